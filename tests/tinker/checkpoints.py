"""save_state / load_state through the official SDK (run by tests/server_sdk.rs).

- save_state returns tinker://{model_id}/weights/{name};
- create_training_client_from_state (weights only) reproduces the saved log-probs;
- create_training_client_from_state_with_optimizer: its next step equals the step the original
  client takes (log-probs after the step agree), while the weights-only client, with a fresh
  optimizer, takes a different step;
- bad checkpoint paths are user errors.
Writes $OXRL_OUT/checkpoint.json for tests/tinker/restart.py.
"""

import json
import os

import numpy as np
import tinker
from tinker import types

from common import text_datum, finish

MODEL = os.environ["OXRL_MODEL"]


BATCH = [text_datum(b"the cat sat on the mat"), text_datum(b"a dog ran in the park!")]
ADAM = types.AdamParams(learning_rate=5e-3)


def logprobs(client) -> np.ndarray:
    out = client.forward(BATCH, "cross_entropy").result()
    return np.concatenate([np.asarray(o["logprobs"].to_numpy()) for o in out.loss_fn_outputs])


def step(client) -> None:
    client.forward_backward(BATCH, "cross_entropy").result()
    client.optim_step(ADAM).result()


def main() -> None:
    service = tinker.ServiceClient()
    original = service.create_lora_training_client(base_model=MODEL, rank=4).result()
    for _ in range(3):
        step(original)
    saved = original.save_state("after-3").result()
    assert saved.path == f"tinker://{original.model_id}/weights/after-3", saved.path
    print(f"save_state: {saved.path}")
    at_save = logprobs(original)

    weights_only = service.create_training_client_from_state(saved.path).result()
    assert np.allclose(logprobs(weights_only), at_save, atol=1e-6)
    print("create_training_client_from_state: log-probs equal")

    with_opt = service.create_training_client_from_state_with_optimizer(saved.path).result()
    assert np.allclose(logprobs(with_opt), at_save, atol=1e-6)
    for c in (original, with_opt, weights_only):
        step(c)
    after_original, after_opt, after_fresh = logprobs(original), logprobs(with_opt), logprobs(weights_only)
    diff = float(np.abs(after_original - after_opt).max())
    assert diff < 1e-5, f"the restored client's step differs by {diff}"
    fresh_diff = float(np.abs(after_original - after_fresh).max())
    assert fresh_diff > 1e-4, f"a fresh optimizer took the same step ({fresh_diff})"
    print(f"with optimizer: next step equal (max diff {diff:.2e}); weights only: differs by {fresh_diff:.2e}")

    # load_state onto an existing client (weights only) brings back the saved log-probs.
    original.load_state(saved.path).result()
    assert np.allclose(logprobs(original), at_save, atol=1e-6)
    print("load_state: log-probs back to the saved ones")

    for bad in ["tinker://nope/weights/x", f"tinker://{original.model_id}/weights/..", "/etc/passwd"]:
        try:
            service.create_training_client_from_state(bad).result()
            raise AssertionError(f"{bad} was accepted")
        except tinker.TinkerError as e:
            print(f"bad path {bad!r}: {type(e).__name__}")
    # For the restart check (tests/tinker/restart.py): the path and the saved log-probs.
    with open(os.path.join(os.environ["OXRL_OUT"], "checkpoint.json"), "w") as f:
        json.dump({"path": saved.path, "logprobs": at_save.tolist()}, f)
    finish()


if __name__ == "__main__":
    main()  # an exception prints its traceback and exits with status 1
