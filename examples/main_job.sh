#!/usr/bin/env bash
# The main job, end to end on CPU: build oxrl, make a tiny model, score and generate with the
# reference fixtures (a base model and a LoRA adapter), then with the fresh model.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked
OXRL=target/release/oxrl
RUN=runs/main-job
mkdir -p "$RUN"

echo "== init-model: a random qwen3 model with a byte-level tokenizer"
$OXRL init-model --arch qwen3 --hidden 64 --layers 2 --heads 4 --kv-heads 2 --out "$RUN/tiny-qwen3"

echo "== score: per-token log-probs with the llama fixture (base, then with its LoRA adapter)"
printf '%s\n' '{"text":"the quick brown fox jumps over"}' '{"tokens":[1,275,262,201,89,74]}' > "$RUN/score.jsonl"
$OXRL score --model tests/fixtures/hf/llama --input "$RUN/score.jsonl"
$OXRL score --model tests/fixtures/hf/llama --lora tests/fixtures/hf/llama/lora --input "$RUN/score.jsonl"

echo "== generate: greedy, then 3 seeded samples, then a chat turn"
$OXRL generate --model tests/fixtures/hf/qwen3 --prompt "what is 12 plus 30?" --max-tokens 12 --temperature 0 --ignore-eos
$OXRL generate --model tests/fixtures/hf/qwen3 --prompt "def add(a, b):" --max-tokens 12 --temperature 0.8 --top-p 0.9 --seed 7 --n 3
$OXRL generate --model "$RUN/tiny-qwen3" --chat --prompt "Hello!" --max-tokens 8 --seed 1
