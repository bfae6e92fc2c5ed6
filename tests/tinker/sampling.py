"""Sampling through the official SDK (run by tests/server_sdk.rs).

- save_weights_and_get_sampling_client (ephemeral): sample with num_samples 2 returns 2 sequences
  of max_tokens tokens with stop reason "length" (stop=[] never stops), and each sampled token's
  log-prob equals the training client's forward log-prob of that token (same weights, T = 1);
- compute_logprobs: None first, then the forward log-probs of the prompt;
- a seeded request is reproducible;
- named sampler weights: save_weights_for_sampler(name) -> tinker://.../sampler_weights/name, and a
  sampling client from that path computes the same log-probs;
- stop token ids: generation ends at the first stop token, which is included;
- top-k log-probs of prompt positions and of sampled tokens, consistent with the trainer's
  log-probs; prompt_logprobs_last_n scores only the last n prompt tokens;
- two LoRA clients' samplers (one engine batch on the server): requests of both in flight at once
  give exactly what each gives alone, and the two adapters sample differently.
"""

import os

import numpy as np
import tinker
from tinker import types
from common import finish

MODEL = os.environ["OXRL_MODEL"]


def forward_logprobs(client, tokens: list[int]) -> np.ndarray:
    d = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
    out = client.forward([d], "cross_entropy").result()
    return np.asarray(out.loss_fn_outputs[0]["logprobs"].to_numpy(), dtype=np.float64)


def main() -> None:
    service = tinker.ServiceClient()
    trainer = service.create_lora_training_client(base_model=MODEL, rank=4).result()
    text = list(b"one two three four")
    d = types.Datum(
        model_input=types.ModelInput.from_ints(text[:-1]),
        loss_fn_inputs={"target_tokens": text[1:], "weights": [1.0] * (len(text) - 1)},
    )
    for _ in range(2):  # move the adapter away from zero, so the LoRA path matters
        trainer.forward_backward([d], "cross_entropy").result()
        trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()

    sampler = trainer.save_weights_and_get_sampling_client().result()
    prompt = list(b"one two")
    params = types.SamplingParams(max_tokens=6, temperature=1.0, stop=[], seed=123)
    res = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=2, sampling_params=params).result()
    assert len(res.sequences) == 2, res
    for seq in res.sequences:
        assert len(seq.tokens) == 6 and seq.stop_reason == "length", seq
        assert seq.logprobs is not None and len(seq.logprobs) == 6
        want = forward_logprobs(trainer, prompt + list(seq.tokens))[len(prompt) - 1 :]
        assert np.allclose(seq.logprobs, want, atol=1e-4), (seq.logprobs, want)
    print(f"sample: 2 x 6 tokens, log-probs equal the trainer's: {[list(s.tokens) for s in res.sequences]}")

    again = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=2, sampling_params=params).result()
    assert [list(s.tokens) for s in again.sequences] == [list(s.tokens) for s in res.sequences]
    print("seeded sampling is reproducible")

    scored = list(b"one two three")
    lps = sampler.compute_logprobs(types.ModelInput.from_ints(scored)).result()
    assert lps[0] is None and len(lps) == len(scored), lps
    want = forward_logprobs(trainer, scored)
    assert np.allclose(np.asarray(lps[1:], dtype=np.float64), want, atol=1e-4), (lps, want)
    print("compute_logprobs: None, then the trainer's log-probs")

    named = trainer.save_weights_for_sampler("s1").result()
    assert named.path == f"tinker://{trainer.model_id}/sampler_weights/s1", named.path
    from_path = service.create_sampling_client(model_path=named.path)
    lps2 = from_path.compute_logprobs(types.ModelInput.from_ints(scored)).result()
    assert np.allclose(np.asarray(lps2[1:], dtype=np.float64), want, atol=1e-4)
    print(f"named sampler weights: {named.path}, same log-probs")

    # Stop at a token id: the first one generated ends the sample and is included.
    # (Seeded sampling: the same draws up to the stop.)
    free_params = types.SamplingParams(max_tokens=8, temperature=1.0, stop=[], seed=7)
    free = sampler.sample(types.ModelInput.from_ints(prompt), 1, free_params).result().sequences[0]
    toks = list(free.tokens)
    # A token first generated at a position > 0, so that the stop truncates a real prefix.
    first = next((i for i in range(1, len(toks)) if toks[i] not in toks[:i]), 0)
    stop_id = toks[first]
    stopped = sampler.sample(
        types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=8, temperature=1.0, stop=[stop_id], seed=7)
    ).result().sequences[0]
    assert list(stopped.tokens) == list(free.tokens[: first + 1]) and stopped.stop_reason == "stop", (stopped, free)
    assert first > 0, toks
    print(f"stop token {stop_id}: {list(stopped.tokens)} (free run {toks})")

    # Top-k log-probs: most likely first; the prompt token's own log-prob (the trainer's) appears
    # among them with that value, or lies below the k-th.
    k = 5
    topk_params = types.SamplingParams(max_tokens=4, temperature=1.0, stop=[], seed=3)
    res = sampler.sample(
        types.ModelInput.from_ints(text), 1, topk_params,
        include_prompt_logprobs=True, topk_prompt_logprobs=k, topk_sample_logprobs=3,
    ).result()
    rows = res.topk_prompt_logprobs
    assert rows is not None and rows[0] is None and len(rows) == len(text), rows
    want = forward_logprobs(trainer, text)
    for i in range(1, len(text)):
        ids, lps = [t for t, _ in rows[i]], [lp for _, lp in rows[i]]
        assert len(ids) == k and lps == sorted(lps, reverse=True) and np.exp(lps).sum() <= 1 + 1e-5, rows[i]
        if text[i] in ids:
            assert abs(lps[ids.index(text[i])] - want[i - 1]) < 1e-4, (i, rows[i], want[i - 1])
        else:
            assert want[i - 1] <= lps[-1] + 1e-5, (i, rows[i], want[i - 1])
    seq = res.sequences[0]
    assert seq.topk_logprobs is not None and len(seq.topk_logprobs) == len(seq.tokens), seq
    for tok, lp, row in zip(seq.tokens, seq.logprobs, seq.topk_logprobs):
        assert len(row) == 3
        if tok in [t for t, _ in row]:
            assert abs(dict(row)[tok] - lp) < 1e-5, (tok, lp, row)
    last = sampler.sample(
        types.ModelInput.from_ints(text), 1, topk_params,
        include_prompt_logprobs=True, prompt_logprobs_last_n=3, topk_prompt_logprobs=2,
    ).result()
    assert all(x is None for x in last.prompt_logprobs[:-3]), last.prompt_logprobs
    assert np.allclose(last.prompt_logprobs[-3:], want[-3:], atol=1e-4), (last.prompt_logprobs, want)
    assert all(r is None for r in last.topk_prompt_logprobs[:-3]) and all(len(r) == 2 for r in last.topk_prompt_logprobs[-3:])
    print("top-k log-probs of prompt and samples; prompt_logprobs_last_n")

    # A second LoRA client with another adapter; both samplers decode in one engine batch.
    other = service.create_lora_training_client(base_model=MODEL, rank=8).result()
    text2 = list(b"zebra yak xylophone")
    d2 = types.Datum(
        model_input=types.ModelInput.from_ints(text2[:-1]),
        loss_fn_inputs={"target_tokens": text2[1:], "weights": [1.0] * (len(text2) - 1)},
    )
    for _ in range(3):
        other.forward_backward([d2], "cross_entropy").result()
        other.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    sampler2 = other.save_weights_and_get_sampling_client().result()
    p = types.SamplingParams(max_tokens=12, temperature=1.0, stop=[], seed=5)
    prompt_in = types.ModelInput.from_ints(prompt)
    alone = [s.sample(prompt_in, 2, p).result() for s in (sampler, sampler2)]
    futures = [s.sample(prompt_in, 2, p) for s in (sampler, sampler2, sampler, sampler2)]
    together = [f.result() for f in futures]
    for i, got in enumerate(together):
        want = alone[i % 2]
        for a, b in zip(got.sequences, want.sequences):
            assert list(a.tokens) == list(b.tokens), (i, a, b)
            assert np.allclose(a.logprobs, b.logprobs, atol=1e-5), (i, a.logprobs, b.logprobs)
    first_lps = [np.asarray(r.sequences[0].logprobs) for r in alone]
    assert [list(r.sequences[0].tokens) for r in alone][0] != [list(r.sequences[0].tokens) for r in alone][1] or (
        not np.allclose(first_lps[0], first_lps[1], atol=1e-3)
    ), "the two adapters sampled identically"
    print("two LoRA samplers together: each equals its run alone")
    finish()


if __name__ == "__main__":
    main()  # an exception prints its traceback and exits with status 1
