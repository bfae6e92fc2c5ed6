"""Manual interop check (not run in CI: it needs torch, transformers and peft, ~5 GB):
models and adapters written by oxrl load in transformers / PEFT and score like `oxrl score`.

    python -m venv /tmp/hf && /tmp/hf/bin/pip install torch transformers peft safetensors
    cargo build --release && /tmp/hf/bin/python scripts/check_hf_interop.py
"""
import json
import os
import subprocess
import tempfile

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

OXRL = os.environ.get("OXRL", "target/release/oxrl")
TOKENS = [1, 75, 120, 201, 89, 74, 200, 150, 223, 87, 2, 201]
torch.set_grad_enabled(False)


def run(*args):
    return subprocess.check_output([OXRL, *args], stderr=subprocess.DEVNULL)


def oxrl_logprobs(tmp, model, lora=None):
    with open(f"{tmp}/s.jsonl", "w") as f:
        f.write(json.dumps({"tokens": TOKENS}))
    extra = ["--lora", lora] if lora else []
    return json.loads(run("score", "--model", model, "--input", f"{tmp}/s.jsonl", *extra))["logprobs"][1:]


def hf_logprobs(model, lora=None):
    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    if lora:
        m = PeftModel.from_pretrained(m, lora)
    x = torch.tensor([TOKENS])
    lp = torch.log_softmax(m.eval()(x).logits[0].float(), -1)
    return lp[:-1].gather(-1, x[0, 1:, None])[:, 0].tolist()


with tempfile.TemporaryDirectory() as tmp:
    run("init-model", "--arch", "llama", "--tie", "--out", f"{tmp}/llama")
    run("init-model", "--arch", "qwen2", "--dtype", "bf16", "--out", f"{tmp}/qwen2")
    run("init-model", "--arch", "qwen3", "--hidden", "128", "--out", f"{tmp}/qwen3")
    run("init-model", "--arch", "qwen3_5", "--hidden", "64", "--layers", "4", "--heads", "4", "--kv-heads", "2",
        "--head-dim", "16", "--linear-key-heads", "2", "--linear-value-heads", "4", "--out", f"{tmp}/qwen3_5")
    # A window of 4 on every other layer: the 12 scored tokens reach past it.
    run("init-model", "--arch", "gemma3", "--hidden", "64", "--layers", "4", "--heads", "4", "--kv-heads", "2",
        "--head-dim", "16", "--sliding-window", "4", "--sliding-window-pattern", "2", "--out", f"{tmp}/gemma3")
    # 8 experts, top-2, renormalised; layer 1 a dense MLP.
    run("init-model", "--arch", "qwen3_moe", "--hidden", "64", "--layers", "3", "--heads", "4", "--kv-heads", "2",
        "--head-dim", "16", "--num-experts", "8", "--experts-per-token", "2", "--moe-intermediate-size", "32",
        "--mlp-only-layers", "1", "--out", f"{tmp}/qwen3_moe")
    with open(f"{tmp}/d.jsonl", "w") as f:
        f.write('{"messages":[{"role":"user","content":"hi"},{"role":"assistant","content":"hello"}]}\n' * 4)
    for base, prefix in [("qwen3", ""), ("qwen3_5", "qwen3_5_"), ("gemma3", "gemma3_"), ("qwen3_moe", "qwen3_moe_")]:
        for name, rank in [("full", "0"), ("lora", "4")]:
            run("sft", "--config", "examples/sft_tiny.toml", "--set", f'model.path="{tmp}/{base}"', "--set", f'data.train_file="{tmp}/d.jsonl"',
                "--set", "data.eval_fraction=0", "--set", "train.max_steps=3", "--set", "train.batch_size=2", "--set", "train.micro_batch_size=1",
                "--set", f"model.lora.rank={rank}", "--set", "model.lora.alpha=8", "--set", f'output.run_dir="{tmp}/{prefix}{name}"')
    cases = [("llama, tied (init-model)", f"{tmp}/llama", None), ("qwen2, bf16 (init-model)", f"{tmp}/qwen2", None),
             ("qwen3 (init-model)", f"{tmp}/qwen3", None), ("qwen3 after SFT (HF export)", f"{tmp}/full/final", None),
             ("qwen3 + LoRA after SFT (PEFT export)", f"{tmp}/qwen3", f"{tmp}/lora/final"),
             ("qwen3_5 (init-model)", f"{tmp}/qwen3_5", None), ("qwen3_5 after SFT (HF export)", f"{tmp}/qwen3_5_full/final", None),
             ("qwen3_5 + LoRA after SFT (PEFT export)", f"{tmp}/qwen3_5", f"{tmp}/qwen3_5_lora/final"),
             ("gemma3 (init-model)", f"{tmp}/gemma3", None), ("gemma3 after SFT (HF export)", f"{tmp}/gemma3_full/final", None),
             ("gemma3 + LoRA after SFT (PEFT export)", f"{tmp}/gemma3", f"{tmp}/gemma3_lora/final"),
             ("qwen3_moe (init-model)", f"{tmp}/qwen3_moe", None), ("qwen3_moe after SFT (HF export)", f"{tmp}/qwen3_moe_full/final", None),
             ("qwen3_moe + LoRA after SFT (PEFT export)", f"{tmp}/qwen3_moe", f"{tmp}/qwen3_moe_lora/final")]
    worst = 0.0
    for name, model, lora in cases:
        err = max(abs(a - b) for a, b in zip(hf_logprobs(model, lora), oxrl_logprobs(tmp, model, lora)))
        worst = max(worst, err)
        print(f"{name}: loads; max |log p (transformers) - log p (oxrl)| = {err:.2e}")
    assert worst < 1e-4, worst
    print("ok")
