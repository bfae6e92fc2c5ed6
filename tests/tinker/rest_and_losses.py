"""RestClient listings, checkpoint deletion, the RL losses and concurrent clients through the
official SDK (run by tests/server_sdk.rs).

- list_training_runs / get_training_run / list_checkpoints / list_user_checkpoints (with cursor) /
  get_weights_info_by_tinker_path / delete_checkpoint / list_sessions / get_session;
- ppo, cispo, dro (with and without `beta`): `loss:sum` equal to the client-side recomputation (docs/specs/algorithms.md);
- four SDK training clients training concurrently, each loss falling.
"""

import os
import threading

import numpy as np
import tinker
from tinker import types

from common import close, rl_datum, text_datum, finish

MODEL = os.environ["OXRL_MODEL"]


def check_rl_losses(client) -> None:
    texts = [b"seven eight nine", b"red green blue!!"]
    base = [text_datum(t) for t in texts]
    fwd = client.forward(base, "cross_entropy").result()
    rng = np.random.default_rng(1)
    data, inputs = [], []
    for d, out in zip(base, fwd.loss_fn_outputs):
        lp = np.asarray(out["logprobs"].to_numpy(), dtype=np.float32)
        q = (lp + 0.3 * rng.standard_normal(lp.shape)).astype(np.float32)  # ratios around 1, some clipped
        adv = rng.standard_normal(lp.shape).astype(np.float32)
        inputs.append((q.astype(np.float64), adv.astype(np.float64)))
        data.append(rl_datum(d, q, adv))
    lo, hi, beta = 0.8, 1.2, 0.5
    cases = {
        "ppo": ({"clip_low_threshold": lo, "clip_high_threshold": hi},
                lambda lp, q, a: -np.minimum(np.exp(lp - q) * a, np.clip(np.exp(lp - q), lo, hi) * a)),
        "cispo": ({"clip_low_threshold": lo, "clip_high_threshold": hi},
                  lambda lp, q, a: -np.clip(np.exp(lp - q), lo, hi) * lp * a),
        "dro": ({"beta": beta}, lambda lp, q, a: -(lp * a - 0.5 * beta * (lp - q) ** 2)),
        # No config, as the cookbook calls it: beta 0.05 (the value of Tinker's documentation).
        "dro_default": (None, lambda lp, q, a: -(lp * a - 0.5 * 0.05 * (lp - q) ** 2)),
    }
    for name, (config, formula) in cases.items():
        out = client.forward_backward(data, name.removesuffix("_default"), loss_fn_config=config).result()
        recomputed = 0.0
        for o, (q, adv) in zip(out.loss_fn_outputs, inputs):
            lp = np.asarray(o["logprobs"].to_numpy(), dtype=np.float64)
            recomputed += float(formula(lp, q, adv).sum())
        got = out.metrics["loss:sum"]
        assert close(got, recomputed), f"{name}: loss:sum {got} != recomputed {recomputed}"
        print(f"{name}: loss:sum={got:.5f} recomputed={recomputed:.5f}")
    client.optim_step(types.AdamParams(learning_rate=0.0)).result()


def train_alone(service, index: int, results: dict) -> None:
    try:
        client = service.create_lora_training_client(base_model=MODEL, rank=2 + index).result()
        batch = [text_datum(f"client {index} says hi {index}".encode())]
        losses = []
        for _ in range(4):
            out = client.forward_backward(batch, "cross_entropy").result()
            client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            losses.append(out.metrics["loss:sum"])
        results[index] = losses
    except Exception as e:  # reported below
        results[index] = e


def main() -> None:
    service = tinker.ServiceClient()
    rest = service.create_rest_client()
    client = service.create_lora_training_client(base_model=MODEL, rank=4).result()
    client.forward_backward([text_datum(b"listing test")], "cross_entropy").result()
    client.optim_step(types.AdamParams()).result()
    a = client.save_state("a").result().path
    client.save_state("b").result()
    s = client.save_weights_for_sampler("s").result().path

    runs = rest.list_training_runs(limit=100).result()
    ids = [r.training_run_id for r in runs.training_runs]
    assert client.model_id in ids and runs.cursor.total_count >= 1, runs
    run = rest.get_training_run(client.model_id).result()
    assert run.base_model == MODEL and run.lora_rank == 4 and run.last_checkpoint is not None, run
    assert run.last_sampler_checkpoint.tinker_path == s, run
    cks = rest.list_checkpoints(client.model_id).result().checkpoints
    kinds = sorted((c.checkpoint_type, c.checkpoint_id) for c in cks)
    assert kinds == [("sampler", "sampler_weights/s"), ("training", "weights/a"), ("training", "weights/b")], kinds
    assert all(c.size_bytes and c.size_bytes > 0 for c in cks), cks
    mine = rest.list_user_checkpoints(limit=2, offset=0).result()
    assert len(mine.checkpoints) == 2 and mine.cursor.total_count == 3, mine
    info = rest.get_weights_info_by_tinker_path(a).result()
    assert info.base_model == MODEL and info.lora_rank == 4, info
    rest.delete_checkpoint(client.model_id, "weights/a").result()
    left = sorted(c.checkpoint_id for c in rest.list_checkpoints(client.model_id).result().checkpoints)
    assert left == ["sampler_weights/s", "weights/b"], left
    try:
        service.create_training_client_from_state(a).result()
        raise AssertionError("a deleted checkpoint loaded")
    except tinker.TinkerError:
        pass
    session_id = client.model_id.split(":train:")[0]  # model ids are "{session_id}:train:{n}"
    assert session_id in rest.list_sessions(limit=100).result().sessions
    got = rest.get_session(session_id).result()
    assert client.model_id in got.training_run_ids, got
    print(f"listings: runs={len(ids)} checkpoints={kinds}; deleted weights/a -> {left}; session {got}")

    check_rl_losses(client)

    results: dict = {}
    threads = [threading.Thread(target=train_alone, args=(service, i, results)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(4):
        r = results.get(i)
        assert isinstance(r, list), f"client {i}: {r!r}"
        assert r[-1] < r[0], f"client {i}: loss did not fall {r}"
    print("four concurrent clients: " + ", ".join(f"{r[0]:.2f}->{r[-1]:.2f}" for r in results.values()))
    finish()


if __name__ == "__main__":
    main()  # an exception prints its traceback and exits with status 1
