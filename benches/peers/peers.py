"""The peers of `oxrl bench`: the same workloads on the same weights in PyTorch + transformers and in
JAX, one JSON line per measurement (the fields of `oxrl bench`), and the table of ratios.

Benchmark-only: run by benches/peers/run.sh from its own virtual environment; nothing in the Rust
build or tests imports this.

    peers.py torch-train  --model DIR --threads N [--dtype f32|bf16] [--reps R]
    peers.py torch-decode --model DIR --threads N [--batch 1,16,64] [--reps R]
    peers.py torch-gemm   --threads N [--batch 1024,2048] [--reps R]   (square f32 matmul sizes)
    peers.py jax-train    --model DIR --threads N [--reps R]
    peers.py table RESULTS.jsonl [--stat median|best]

DIR is written by `oxrl bench save-model`: the benchmark model in the HF layout plus
bench_workloads.json, the training batch's input/target tokens and the decoding prompts exactly as
oxrl builds them. The workloads:
- training step = forward + backward of the token-mean cross-entropy + AdamW (lr 1e-4, betas
  0.9/0.95, eps 1e-12, no weight decay) on 8 x 128 tokens; PyTorch: Qwen3ForCausalLM with
  attn_implementation="sdpa" and torch.optim.AdamW (bf16 = torch.autocast over f32 parameters, the
  usual mixed precision); JAX: a hand-written qwen3 forward, jax.value_and_grad and a hand-written
  AdamW, the whole step one jitted function (parameters and moments donated);
- decoding = greedy, prompt 16, 32 new tokens (EOS ignored: min_new_tokens), transformers'
  model.generate with its KV cache at batch 1 / 16 / 64.

Threads: torch.set_num_threads(N) (run.sh also sets OMP_NUM_THREADS); JAX/XLA has no thread-count
setting of its own, so run.sh confines the process with `taskset -c 0-(N-1)` (XLA sizes its pools
by the CPUs it may run on) and, for one thread, adds XLA_FLAGS="--xla_cpu_multi_thread_eigen=false
intra_op_parallelism_threads=1".
"""

import argparse
import json
import os
import statistics
import sys
import time


def workloads(model_dir):
    with open(os.path.join(model_dir, "bench_workloads.json")) as f:
        return json.load(f)


def timed(fn, warmup, reps):
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e3)
    return out


def record(bench, framework, args, ms, tokens, **extra):
    med = statistics.median(ms)
    r = {"bench": bench, "framework": framework, "dtype": args.dtype, "threads": args.threads,
         "reps": args.reps, **extra, "median_ms": med, "min_ms": min(ms), "tokens_per_s": tokens / (med / 1e3)}
    print(json.dumps(r), flush=True)


def torch_model(args):
    import torch
    from transformers import Qwen3ForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa")
    return torch, model


def torch_train(args):
    torch, model = torch_model(args)
    import torch.nn.functional as F

    w = workloads(args.model)["train"]
    ids = torch.tensor(w["input_tokens"])
    tgt = torch.tensor(w["target_tokens"])
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
    losses = []

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.dtype == "bf16"):
            logits = model(input_ids=ids, use_cache=False).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tgt.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())

    ms = timed(step, args.warmup, args.reps)
    record("train", "pytorch", args, ms, ids.numel(), batch=ids.shape[0], seq_len=ids.shape[1],
           master_weights=args.dtype != "f32", first_loss=losses[0], last_loss=losses[-1])


def torch_decode(args):
    torch, model = torch_model(args)
    w = workloads(args.model)["decode"]
    new = w["new_tokens"]
    model.eval()
    for b in args.batch:
        prompts = torch.tensor(w["prompts"][:b])

        def gen():
            with torch.inference_mode():
                out = model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                                     max_new_tokens=new, min_new_tokens=new, use_cache=True, pad_token_id=0)
            assert out.shape == (b, prompts.shape[1] + new), out.shape

        ms = timed(gen, args.warmup, args.reps)
        record("decode", "pytorch", args, ms, b * new, batch=b, prompt_len=prompts.shape[1], new_tokens=new)


def torch_gemm(args):
    """f32 GEMM GFLOP/s of torch.matmul on square matrices (--batch: the sizes), the reference
    `oxrl bench gemm` is set against."""
    import torch

    torch.set_num_threads(args.threads)
    for n in args.batch:
        a, b = torch.randn(n, n), torch.randn(n, n)
        ms = timed(lambda: torch.matmul(a, b), args.warmup, args.reps)
        med = statistics.median(ms)
        print(json.dumps({"bench": "gemm", "framework": "pytorch", "dtype": "f32", "threads": args.threads,
                          "reps": args.reps, "size": n, "median_ms": med,
                          "gflops": 2 * n ** 3 / (med / 1e3) / 1e9}), flush=True)


def jax_train(args):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from safetensors.numpy import load_file

    with open(os.path.join(args.model, "config.json")) as f:
        cfg = json.load(f)
    n_layers, n_heads, n_kv = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd, eps, theta = cfg["head_dim"], cfg["rms_norm_eps"], cfg["rope_theta"]
    params = {k: jnp.asarray(v, dtype=jnp.float32) for k, v in load_file(os.path.join(args.model, "model.safetensors")).items()}
    w = workloads(args.model)["train"]
    ids = jnp.asarray(np.array(w["input_tokens"], dtype=np.int32))
    tgt = jnp.asarray(np.array(w["target_tokens"], dtype=np.int32))
    B, T = ids.shape

    inv_freq = 1.0 / (theta ** (np.arange(0, hd, 2, dtype=np.float32) / hd))
    freqs = np.arange(T, dtype=np.float32)[:, None] * inv_freq[None]
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos, sin = jnp.asarray(np.cos(emb)), jnp.asarray(np.sin(emb))  # [T, hd]
    causal = jnp.asarray(np.tril(np.ones((T, T), dtype=bool)))

    def rms(x, weight):
        return weight * (x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps))

    def rope(x):  # [B, H, T, hd], HF's rotate_half convention
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin

    def forward(p, ids):
        x = p["model.embed_tokens.weight"][ids]
        for l in range(n_layers):
            pre = f"model.layers.{l}."
            h = rms(x, p[pre + "input_layernorm.weight"])
            q = (h @ p[pre + "self_attn.q_proj.weight"].T).reshape(B, T, n_heads, hd)
            k = (h @ p[pre + "self_attn.k_proj.weight"].T).reshape(B, T, n_kv, hd)
            v = (h @ p[pre + "self_attn.v_proj.weight"].T).reshape(B, T, n_kv, hd)
            q = rope(rms(q, p[pre + "self_attn.q_norm.weight"]).transpose(0, 2, 1, 3))
            k = rope(rms(k, p[pre + "self_attn.k_norm.weight"]).transpose(0, 2, 1, 3))
            v = v.transpose(0, 2, 1, 3)
            k = jnp.repeat(k, n_heads // n_kv, axis=1)
            v = jnp.repeat(v, n_heads // n_kv, axis=1)
            s = jnp.einsum("bhqd,bhkd->bhqk", q, k) / np.sqrt(hd)
            s = jnp.where(causal, s, -jnp.inf)
            a = jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v)
            x = x + a.transpose(0, 2, 1, 3).reshape(B, T, n_heads * hd) @ p[pre + "self_attn.o_proj.weight"].T
            h = rms(x, p[pre + "post_attention_layernorm.weight"])
            g = jax.nn.silu(h @ p[pre + "mlp.gate_proj.weight"].T) * (h @ p[pre + "mlp.up_proj.weight"].T)
            x = x + g @ p[pre + "mlp.down_proj.weight"].T
        return rms(x, p["model.norm.weight"]) @ p["lm_head.weight"].T

    def loss_fn(p, ids, tgt):
        logits = forward(p, ids)
        lse = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, tgt[..., None], axis=-1)[..., 0]
        return jnp.mean(lse - picked)

    lr, b1, b2, adam_eps = 1e-4, 0.9, 0.95, 1e-12

    def train_step(p, m, v, t, ids, tgt):
        loss, g = jax.value_and_grad(loss_fn)(p, ids, tgt)
        t = t + 1
        m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, m, g)
        v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, v, g)
        c1, c2 = 1 - b1 ** t, 1 - b2 ** t
        p = jax.tree.map(lambda p, m, v: p - lr * (m / c1) / (jnp.sqrt(v / c2) + adam_eps), p, m, v)
        return p, m, v, t, loss

    step_fn = jax.jit(train_step, donate_argnums=(0, 1, 2))
    state = [params, jax.tree.map(jnp.zeros_like, params), jax.tree.map(jnp.zeros_like, params), jnp.float32(0)]
    losses = []

    def step():
        state[0], state[1], state[2], state[3], loss = step_fn(*state, ids, tgt)
        losses.append(float(loss))  # blocks until the step is done

    ms = timed(step, args.warmup, args.reps)
    record("train", "jax", args, ms, B * T, batch=B, seq_len=T, master_weights=False,
           first_loss=losses[0], last_loss=losses[-1], jax_devices=str(jax.devices()))


def table(path, stat="median"):
    """Markdown: per workload and thread count, the median over rounds of each run's median (or, with
    stat "best", the fastest repetition of all rounds: the figure least disturbed by other work on a
    shared machine), and the speed ratios oxrl / peer (tokens/s over tokens/s: above 1, oxrl is
    faster)."""
    rows = [json.loads(line) for line in open(path) if line.strip().startswith("{")]
    groups = {}
    for r in rows:
        if r["bench"] == "train":
            label = "train 8x128" if r["dtype"] == "f32" else "train 8x128 bf16" + (" mixed" if r.get("master_weights") else " pure")
            key = (0, 0, label, r["threads"])
        else:
            key = (1, r["batch"], f"decode, {r['batch']} concurrent", r["threads"])
        groups.setdefault(key, {}).setdefault(r["framework"], []).append(r)
    print("| workload | threads | oxrl | PyTorch | JAX | oxrl / PyTorch | oxrl / JAX |")
    print("|---|---|---|---|---|---|---|")
    for key in sorted(groups):
        label, threads = key[2], key[3]
        fw = groups[key]
        if stat == "best":
            ms = {f: min(r["min_ms"] for r in rs) for f, rs in fw.items()}
            tps = {f: max(r["tokens_per_s"] * r["median_ms"] / r["min_ms"] for r in rs) for f, rs in fw.items()}
        else:
            ms = {f: statistics.median(r["median_ms"] for r in rs) for f, rs in fw.items()}
            tps = {f: statistics.median(r["tokens_per_s"] for r in rs) for f, rs in fw.items()}

        def cell(f):
            if f not in tps:
                return "—"
            return f"{ms[f]:,.0f} ms ({tps[f]:,.0f} tok/s)" if key[0] == 0 else f"{tps[f]:,.0f} tok/s"

        def ratio(f):
            return f"{tps['oxrl'] / tps[f]:.2f}×" if "oxrl" in tps and f in tps else "—"

        print(f"| {label} | {threads} | {cell('oxrl')} | {cell('pytorch')} | {cell('jax')} | {ratio('pytorch')} | {ratio('jax')} |")
    losses = [(r["framework"], r["dtype"], r.get("master_weights"), r["first_loss"]) for r in rows if r["bench"] == "train"]
    seen = {}
    for f, d, m, l in losses:
        seen.setdefault((f, d, m), l)
    print()
    print("First-step loss (same weights and tokens): " + ", ".join(f"{f} {d}{' mixed' if m and d != 'f32' else ''} {l:.4f}" for (f, d, m), l in sorted(seen.items(), key=str)))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["torch-train", "torch-decode", "torch-gemm", "jax-train", "table"])
    ap.add_argument("--stat", default="median", choices=["median", "best"], help="table: which figure")
    ap.add_argument("path", nargs="?", help="table: the results file")
    ap.add_argument("--model")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="f32", choices=["f32", "bf16"])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--batch", default="1,16,64")
    args = ap.parse_args()
    args.batch = [int(b) for b in args.batch.split(",")]
    if args.what == "table":
        return table(args.path, args.stat)
    if args.what == "torch-gemm":
        return torch_gemm(args)
    if not args.model:
        sys.exit("--model DIR is required (write it with `oxrl bench save-model --out DIR`)")
    {"torch-train": torch_train, "torch-decode": torch_decode, "jax-train": jax_train}[args.what](args)


if __name__ == "__main__":
    main()
