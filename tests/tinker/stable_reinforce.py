"""The cookbook's default RL loss through the official SDK (run by tests/server_sdk.rs), built
as tinker-cookbook's `recipes/rl_loop.py` builds it: sample with `record_stability_info=True`,
datums with provenance (the prompt and sampled spans of each sequence), `stable_reinforce` with a
`kl_coeff`, then optim_step. Toy task of rl_loop.py (the fraction of lowercase bytes); the mean
reward must rise, and every step's `loss:sum` must equal a client-side recomputation of oxrl's
documented objective from the trainer's log-probs and the sampler's:
    Σ_sampled −min(exp(lp − q), 2)·A·lp + ½·kl_coeff·(lp − q)²
Also: a datum naming an unknown sequence, and one without provenance, are refused. As in
rl_loop.py, groups without signal are skipped (no optim_step on a zero gradient: Adam's momentum
alone would move the weights).
"""

import os

import numpy as np
import tinker
from tinker import types
from tinker.types import PromptProvenanceSpan as Prompt
from tinker.types import SampledProvenanceSpan as Sampled
from common import finish

MODEL = os.environ["OXRL_MODEL"]
PROMPTS = [list(b"write: "), list(b"speak: ")]
GROUP, MAX_TOKENS, ITERATIONS, KL = 8, 8, 40, 0.01


def reward(tokens) -> float:
    return float(np.mean([97 <= t <= 122 for t in tokens])) if len(tokens) else 0.0


def datum(prompt, seq, advantage, sequence_id=None):
    """rl_loop.py's datum: prompt + sampled[:-1] in, zeros under the prompt's targets."""
    sid = sequence_id or seq.sequence_id
    p, s = len(prompt), len(seq.tokens)
    d = types.Datum(
        model_input=types.ModelInput.from_ints(prompt + list(seq.tokens[:-1])),
        loss_fn_inputs={
            "target_tokens": [0] * (p - 1) + list(seq.tokens),
            "logprobs": types.TensorData.from_numpy(np.array([0.0] * (p - 1) + list(seq.logprobs), dtype=np.float32)),
            "advantages": types.TensorData.from_numpy(np.array([0.0] * (p - 1) + [advantage] * s, dtype=np.float32)),
        },
    )
    return d.with_provenance(
        model_input=[Prompt(sequence_id=sid, length=p), Sampled(sequence_id=sid, length=s - 1)],
        loss_fn_inputs=[Prompt(sequence_id=sid, offset=1, length=p - 1), Sampled(sequence_id=sid, length=s)],
    )


def expected_loss(out, batch):
    """The objective from the trainer's log-probs (`loss_fn_outputs`) and the sampler's."""
    total = 0.0
    for o, (prompt, seq, a) in zip(out.loss_fn_outputs, batch):
        lp = np.asarray(o["logprobs"].data, dtype=np.float64)[len(prompt) - 1:]
        q = np.asarray(seq.logprobs, dtype=np.float64)
        r = np.minimum(np.exp(lp - q), 2.0)
        total += float(np.sum(-r * a * lp + 0.5 * KL * (lp - q) ** 2))
    return total


def refused(trainer, data, want):
    try:
        trainer.forward_backward(data, "stable_reinforce").result()
    except Exception as e:  # the SDK raises the server's user error
        assert want in str(e), f"{want!r} not in {e}"
        return
    raise AssertionError(f"accepted a datum that should be refused ({want})")


def main() -> None:
    service = tinker.ServiceClient()
    trainer = service.create_lora_training_client(base_model=MODEL, rank=8, seed=1).result()
    history, worst, refusals_checked = [], 0.0, False
    for it in range(ITERATIONS):
        sampler = trainer.save_weights_and_get_sampling_client(record_stability_info=True).result()
        futures = [
            (p, sampler.sample(types.ModelInput.from_ints(p), GROUP, types.SamplingParams(
                max_tokens=MAX_TOKENS, temperature=1.0, stop=[], seed=1000 * it + k)))
            for k, p in enumerate(PROMPTS)
        ]
        batch, rewards = [], []
        for prompt, fut in futures:
            seqs = fut.result().sequences
            rs = np.array([reward(s.tokens) for s in seqs])
            rewards.extend(rs)
            for s in seqs:
                assert s.sequence_id, "no sequence_id with record_stability_info=True"
            if rs.std() == 0:
                continue  # as rl_loop.py: a group without signal is not trained on
            for s, a in zip(seqs, rs - rs.mean()):
                batch.append((prompt, s, float(a)))
        history.append(float(np.mean(rewards)))
        if not batch:
            print(f"iteration {it}: mean reward {history[-1]:.3f} (no group with signal)")
            continue
        if not refusals_checked:
            refusals_checked = True
            prompt, seq, a = batch[0]
            refused(trainer, [datum(prompt, seq, a, sequence_id="no-such-sequence")], "unknown")
            plain = datum(prompt, seq, a)
            plain = types.Datum(model_input=plain.model_input, loss_fn_inputs=plain.loss_fn_inputs)
            refused(trainer, [plain], "needs provenance")
        data = [datum(p, s, a) for p, s, a in batch]
        out = trainer.forward_backward(data, "stable_reinforce", {"kl_coeff": KL}).result()
        trainer.optim_step(types.AdamParams(learning_rate=2e-2, beta1=0.9, beta2=0.95, eps=1e-8)).result()
        got, want = out.metrics["loss:sum"], expected_loss(out, batch)
        worst = max(worst, abs(got - want) / (1.0 + abs(want)))
        assert abs(got - want) <= 1e-4 * (1.0 + abs(want)), f"iteration {it}: loss:sum {got} vs recomputed {want}"
        print(f"iteration {it}: mean reward {history[-1]:.3f} loss:sum {got:.5f} (recomputed {want:.5f})")
    assert refusals_checked, "no iteration had a group with signal"
    first, last = np.mean(history[:3]), np.mean(history[-3:])
    assert last > first + 0.2, f"reward did not rise: {history}"
    print(f"reward {first:.3f} -> {last:.3f}; loss:sum vs recomputation: worst relative {worst:.2e}")
    finish()


if __name__ == "__main__":
    main()  # an exception prints its traceback and exits with status 1
