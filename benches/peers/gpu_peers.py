"""The GPU peers of `oxrl bench`: the card's bf16 matrix rate, PyTorch eager training and transformers'
`generate` on the same card, weights and tokens as `oxrl bench train|decode --device cuda`, and the
table that sets them side by side. One JSON line per measurement (the fields of `oxrl bench`).

Benchmark-only: scripts/gpu_check.sh runs it with the GPU machine's own python3 (torch,
transformers); nothing in the Rust build or tests imports it.

    gpu_peers.py matmul                                  bf16 GEMM rate, 8192^3, random operands
    gpu_peers.py train  --model DIR [--batch 8] [--seq 1024] [--reps 5]
    gpu_peers.py decode --model DIR [--batch 1,16,64,256] [--prompt 16] [--new-tokens 32]
    gpu_peers.py table RESULTS.jsonl

Workloads, as src/bench/workloads.rs builds them for any vocabulary:
- training step = forward + backward of the token-mean cross-entropy + AdamW (lr 1e-4, betas
  0.9/0.95, eps 1e-12, no weight decay) on BATCH x SEQ tokens, row r's input token i
  (31 + 977 r + 131 i) mod V and its target (38 + 977 r + 131 i) mod V; f32 parameters under
  torch.autocast(bf16) (the usual mixed precision), SDPA attention, torch.optim.AdamW's default
  (foreach) implementation: PyTorch eager as its users run it;
- decoding = greedy, request r's prompt (7 + 977 r + 131 i) mod V, NEW tokens each (EOS ignored:
  min_new_tokens), transformers' generate with its KV cache, the model in bf16.
Every timing synchronises the device before reading the clock.
"""

import argparse
import json
import statistics
import sys
import time


def timed(fn, warmup, reps, sync):
    for _ in range(warmup):
        fn()
    sync()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync()
        out.append((time.perf_counter() - t) * 1e3)
    return out


def emit(r):
    print(json.dumps(r), flush=True)


def tokens(row, n, salt, vocab):
    return [(31 + salt + row * 977 + i * 131) % vocab for i in range(n)]


def prompt(row, n, vocab):
    return [(row * 977 + i * 131 + 7) % vocab for i in range(n)]


def load(model_dir, dtype):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
    return model.to("cuda")


def matmul(args):
    import torch

    n = 8192
    sets = [(torch.randn(n, n, device="cuda", dtype=torch.bfloat16),
             torch.randn(n, n, device="cuda", dtype=torch.bfloat16)) for _ in range(2)]
    i = [0]

    def mm():
        a, b = sets[i[0] % 2]
        i[0] += 1
        torch.matmul(a, b)

    ms = timed(mm, 5, 30, torch.cuda.synchronize)
    med = statistics.median(ms)
    emit({"bench": "matmul", "framework": "pytorch", "dtype": "bf16", "size": n, "median_ms": med,
          "tflops": 2 * n ** 3 / (med / 1e3) / 1e12, "device": torch.cuda.get_device_name()})


def train(args):
    import torch
    import torch.nn.functional as F

    model = load(args.model, torch.float32)
    vocab = model.config.vocab_size
    ids = torch.tensor([tokens(r, args.seq, 0, vocab) for r in range(args.batch)], device="cuda")
    tgt = torch.tensor([tokens(r, args.seq, 7, vocab) for r in range(args.batch)], device="cuda")
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
    losses = []

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=ids, use_cache=False).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tgt.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())

    ms = timed(step, args.warmup, args.reps, torch.cuda.synchronize)
    med = statistics.median(ms)
    emit({"bench": "train", "framework": "pytorch", "model": args.model, "dtype": "bf16", "device": "cuda",
          "batch": args.batch, "seq_len": args.seq, "reps": args.reps, "median_ms": med, "min_ms": min(ms),
          "tokens_per_s": ids.numel() / (med / 1e3), "first_loss": losses[0], "last_loss": losses[-1],
          "peak_gib": torch.cuda.max_memory_allocated() / 2 ** 30})


def decode(args):
    import torch

    model = load(args.model, torch.bfloat16)
    model.eval()
    vocab = model.config.vocab_size
    for b in args.batch:
        prompts = torch.tensor([prompt(r, args.prompt, vocab) for r in range(b)], device="cuda")

        def gen():
            with torch.inference_mode():
                out = model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                                     max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                     use_cache=True, pad_token_id=0)
            assert out.shape == (b, args.prompt + args.new_tokens), out.shape

        ms = timed(gen, args.warmup, args.reps, torch.cuda.synchronize)
        med = statistics.median(ms)
        emit({"bench": "decode", "framework": "transformers", "model": args.model, "dtype": "bf16",
              "device": "cuda", "batch": b, "prompt_len": args.prompt, "new_tokens": args.new_tokens,
              "reps": args.reps, "median_ms": med, "min_ms": min(ms),
              "tokens_per_s": b * args.new_tokens / (med / 1e3)})


def train_flops_per_token(cfg, seq):
    """6 x the projections' multiply-adds (forward 2, backward 4) + the causal attention's
    products (QK^T and PV over half the T x T matrix, x 3 for the backward)."""
    h, L, V = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    q, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or h // q
    layer = h * q * hd * 2 + h * kv * hd * 2 + 3 * h * cfg["intermediate_size"]
    return 6 * (L * layer + h * V) + 6 * L * q * hd * seq


def table(args):
    rows = [json.loads(l) for l in open(args.results) if l.startswith("{")]
    med = lambda xs: statistics.median(xs) if xs else float("nan")
    peak = med([r["tflops"] for r in rows if r["bench"] == "matmul"])
    print(f"card bf16 matmul (8192^3, random): {peak:.0f} TFLOP/s")

    def key(r):
        if r.get("framework") == "oxrl":
            upstream = ", upstream candle backward" if r.get("candle_zero_first") else ""
            unfused = ", unfused attention" if r.get("flash_attention") is False else ""
            return "oxrl kernels " + ("on" if r.get("cuda_kernels") else "off") + unfused + upstream
        return r.get("framework")

    train_rows = [r for r in rows if r["bench"] == "train"]
    if train_rows:
        cfg_path = train_rows[0]["model"].rstrip("/") + "/config.json"
        try:
            cfg = json.load(open(cfg_path))
            fpt = train_flops_per_token(cfg, train_rows[0]["seq_len"])
        except OSError:
            fpt = None
        print("\n| training step, bf16, 8 x 1024 | median ms | tokens/s | MFU | vs PyTorch | peak GiB |")
        print("|---|---|---|---|---|---|")
        torch_tps = med([r["tokens_per_s"] for r in train_rows if r["framework"] == "pytorch"])
        for k in sorted({key(r) for r in train_rows}):
            rs = [r for r in train_rows if key(r) == k]
            tps = med([r["tokens_per_s"] for r in rs])
            mfu = f"{tps * fpt / (peak * 1e12) * 100:.1f} %" if fpt and peak == peak else "-"
            peak_gib = med([r["peak_gib"] for r in rs if "peak_gib" in r])
            print(f"| {k} ({len(rs)} runs) | {med([r['median_ms'] for r in rs]):.1f} | {tps:,.0f} | {mfu} "
                  f"| {tps / torch_tps:.2f}x | {peak_gib:.1f} |")
    dec = [r for r in rows if r["bench"] == "decode"]
    if dec:
        batches = sorted({r["batch"] for r in dec})
        print("\n| decode tokens/s, bf16 | " + " | ".join(str(b) for b in batches) + " |")
        print("|---|" + "---|" * len(batches))
        gen = {b: med([r["tokens_per_s"] for r in dec if r["batch"] == b and r["framework"] == "transformers"])
               for b in batches}
        for k in sorted({key(r) for r in dec}):
            cells = []
            for b in batches:
                tps = med([r["tokens_per_s"] for r in dec if r["batch"] == b and key(r) == k])
                cells.append(f"{tps:,.0f} ({tps / gen[b]:.2f}x)" if gen[b] == gen[b] else f"{tps:,.0f}")
            print(f"| {k} | " + " | ".join(cells) + " |")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=["matmul", "train", "decode", "table"])
    p.add_argument("results", nargs="?")
    p.add_argument("--model")
    p.add_argument("--batch", default=None)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args()
    if args.what == "train":
        args.batch = int(args.batch or 8)
    elif args.what == "decode":
        args.batch = [int(b) for b in (args.batch or "1,16,64,256").split(",")]
    {"matmul": matmul, "train": train, "decode": decode, "table": table}[args.what](args)


if __name__ == "__main__":
    sys.exit(main())
