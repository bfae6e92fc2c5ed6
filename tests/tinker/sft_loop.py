"""End-to-end: the official tinker SDK (pinned 0.38.0) drives `oxrl serve`.

Run by tests/server_sdk.rs with TINKER_BASE_URL, TINKER_API_KEY and OXRL_MODEL set. Checks:
- get_server_capabilities lists the served model;
- an SFT loop (cross_entropy + optim_step) whose loss falls, with `loss:sum` equal to
  sum(-logprob * weight) recomputed here from the returned log-probs;
- importance_sampling: `loss:sum` equal to sum(-exp(lp - q) * A);
- forward (no gradient) returns the same log-probs as the next forward_backward;
- a bad loss name fails with a user error naming it.
Prints one line per check; exits non-zero on the first failure.
"""

import math
import os

import numpy as np
import tinker
from tinker import types

from common import close, rl_datum, text_datum, finish

MODEL = os.environ["OXRL_MODEL"]


def main() -> None:
    service = tinker.ServiceClient()
    caps = tinker.RestClient().get_server_capabilities().result()
    names = [m.model_name for m in caps.supported_models]
    assert MODEL in names, f"capabilities {names} lack {MODEL}"
    print(f"capabilities: {names}")

    client = service.create_lora_training_client(base_model=MODEL, rank=8).result()
    info = client.get_info()
    assert info.model_data.model_name == MODEL, info
    print(f"get_info: {info.model_id} lora_rank={info.lora_rank}")

    batch = [text_datum(b"Q: 2+2? A: four.", 10), text_datum(b"Q: 3+3? A: six!!", 10)]
    weights = [np.asarray(d.loss_fn_inputs["weights"].to_numpy(), dtype=np.float64) for d in batch]
    losses = []
    for step in range(10):
        fb = client.forward_backward(batch, "cross_entropy").result()
        opt = client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        assert len(fb.loss_fn_outputs) == len(batch)
        recomputed = 0.0
        for out, w in zip(fb.loss_fn_outputs, weights):
            lp = np.asarray(out["logprobs"].to_numpy(), dtype=np.float64)
            assert lp.shape == w.shape, (lp.shape, w.shape)
            assert np.all(lp <= 0.0)
            recomputed += float(-(lp * w).sum())
        got = fb.metrics["loss:sum"]
        assert close(got, recomputed), f"step {step}: loss:sum {got} != recomputed {recomputed}"
        assert all(k.count(":") == 1 for k in fb.metrics), fb.metrics
        losses.append(got)
        print(f"sft step {step}: loss:sum={got:.5f} recomputed={recomputed:.5f} optim={opt.metrics}")
    assert losses[-1] < 0.7 * losses[0], f"loss did not fall: {losses}"
    print(f"sft: loss {losses[0]:.4f} -> {losses[-1]:.4f}")

    # forward (no gradient) == the next forward_backward's log-probs (weights unchanged between).
    fwd = client.forward(batch, "cross_entropy").result()
    fb = client.forward_backward(batch, "cross_entropy").result()
    for a, b in zip(fwd.loss_fn_outputs, fb.loss_fn_outputs):
        assert np.allclose(a["logprobs"].to_numpy(), b["logprobs"].to_numpy(), atol=1e-6)
    assert close(fwd.metrics["loss:sum"], fb.metrics["loss:sum"])
    print("forward == forward_backward log-probs")

    # importance_sampling: loss:sum == sum(-exp(lp - q) * A).
    rl = []
    rng = np.random.default_rng(0)
    for d in batch:
        n = len(d.loss_fn_inputs["target_tokens"].to_numpy())
        q = (-3.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)
        adv = rng.standard_normal(n).astype(np.float32)
        rl.append(rl_datum(d, q, adv))
    fb = client.forward_backward(rl, "importance_sampling").result()
    recomputed = 0.0
    for out, d in zip(fb.loss_fn_outputs, rl):
        lp = np.asarray(out["logprobs"].to_numpy(), dtype=np.float64)
        q = np.asarray(d.loss_fn_inputs["logprobs"].to_numpy(), dtype=np.float64)
        adv = np.asarray(d.loss_fn_inputs["advantages"].to_numpy(), dtype=np.float64)
        recomputed += float(-(np.exp(lp - q) * adv).sum())
    got = fb.metrics["loss:sum"]
    assert close(got, recomputed), f"importance_sampling: loss:sum {got} != recomputed {recomputed}"
    print(f"importance_sampling: loss:sum={got:.5f} recomputed={recomputed:.5f}")
    client.optim_step(types.AdamParams(learning_rate=0.0)).result()

    # A bad loss name: a user error that names it (and the client's next seq_id still runs).
    try:
        client.forward_backward(batch, "cross_entropyy").result()
        raise AssertionError("a bad loss name was accepted")
    except tinker.TinkerError as e:  # noqa: PERF203
        assert "cross_entropyy" in str(e), str(e)
        print(f"bad loss name: {type(e).__name__}: {str(e)[:120]}")
    fb = client.forward_backward(batch, "cross_entropy").result()
    assert math.isfinite(fb.metrics["loss:sum"])
    finish()


if __name__ == "__main__":
    main()  # an exception prints its traceback and exits with status 1
