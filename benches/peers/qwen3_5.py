"""The Qwen3.5 peer of `oxrl bench`: transformers' Qwen3_5ForCausalLM (its torch fallbacks for
the Gated DeltaNet kernels: the chunked rule for prompts and training, the recurrent rule for
one-token decode steps) on the same weights and the same workloads as `oxrl bench train` and
`oxrl bench decode`, one JSON line per measurement.

Benchmark-only (run from a virtual environment with torch and transformers >= 5.24, e.g.
.venv-trl/); nothing in the Rust build or tests imports it.

    qwen3_5.py decode --model DIR --threads N [--batch 1,16,64] [--reps R]
    qwen3_5.py train  --model DIR --threads N [--batch 4] [--seq 512] [--reps R]

The workloads are oxrl's (src/bench/workloads.rs): decode prompts of 16 tokens
((r * 977 + i * 131 + 7) % vocab), 32 new tokens greedy (EOS ignored); training inputs
((31 + r * 977 + i * 131) % vocab) and targets (salt 7), token-mean cross-entropy, AdamW (lr 1e-4,
betas 0.9/0.95, eps 1e-12, no weight decay).
"""

import argparse
import json
import statistics
import time


def timed(fn, warmup, reps):
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e3)
    return out


def record(bench, args, ms, tokens, **extra):
    med = statistics.median(ms)
    print(json.dumps({"bench": bench, "framework": "pytorch", "threads": args.threads, "reps": args.reps, **extra,
                      "median_ms": med, "tokens_per_s": tokens / (med / 1e3)}), flush=True)


def model_of(args):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa")
    return torch, model


def decode(args):
    torch, model = model_of(args)
    vocab = model.config.vocab_size
    model.eval()
    for b in args.batch:
        prompts = torch.tensor([[(r * 977 + i * 131 + 7) % vocab for i in range(16)] for r in range(b)])

        def gen():
            with torch.inference_mode():
                out = model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                                     max_new_tokens=32, min_new_tokens=32, use_cache=True, pad_token_id=0)
            assert out.shape == (b, 16 + 32), out.shape

        ms = timed(gen, args.warmup, args.reps)
        record("decode", args, ms, b * 32, batch=b, prompt_len=16, new_tokens=32)


def train(args):
    torch, model = model_of(args)
    import torch.nn.functional as F

    vocab = model.config.vocab_size
    b, s = args.batch[0], args.seq
    ids = torch.tensor([[(31 + r * 977 + i * 131) % vocab for i in range(s)] for r in range(b)])
    tgt = torch.tensor([[(38 + r * 977 + i * 131) % vocab for i in range(s)] for r in range(b)])
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)

    def step():
        opt.zero_grad(set_to_none=True)
        logits = model(input_ids=ids).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tgt.reshape(-1))
        loss.backward()
        opt.step()

    ms = timed(step, args.warmup, args.reps)
    record("train", args, ms, b * s, batch=b, seq=s)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=["decode", "train"])
    p.add_argument("--model", required=True)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=lambda v: [int(x) for x in v.split(",")], default=[1, 16, 64])
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    args = p.parse_args()
    {"decode": decode, "train": train}[args.what](args)


if __name__ == "__main__":
    main()
