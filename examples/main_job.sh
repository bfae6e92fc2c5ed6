#!/usr/bin/env bash
# The main job, end to end on CPU: build oxrl; score and generate with the reference fixtures
# (a base model and a LoRA adapter); make a tiny model and fine-tune it (SFT) on a small chat
# task, with a falling eval loss; chat with the result; and last the RL demo: a tiny model
# learns one-digit sums with a short SFT and then GRPO (oxrl demo).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked
OXRL=target/release/oxrl
RUN=runs/main-job
rm -rf "$RUN"
mkdir -p "$RUN"

echo "== score: per-token log-probs with the llama fixture (base, then with its LoRA adapter)"
printf '%s\n' '{"text":"the quick brown fox jumps over"}' '{"tokens":[1,275,262,201,89,74]}' > "$RUN/score.jsonl"
$OXRL score --model tests/fixtures/hf/llama --input "$RUN/score.jsonl"
$OXRL score --model tests/fixtures/hf/llama --lora tests/fixtures/hf/llama/lora --input "$RUN/score.jsonl"

echo "== generate: greedy, then 3 seeded samples"
$OXRL generate --model tests/fixtures/hf/qwen3 --prompt "what is 12 plus 30?" --max-tokens 12 --temperature 0 --ignore-eos
$OXRL generate --model tests/fixtures/hf/qwen3 --prompt "def add(a, b):" --max-tokens 12 --temperature 0.8 --top-p 0.9 --seed 7 --n 3

echo "== init-model: a random qwen3 model with a byte-level tokenizer"
$OXRL init-model --arch qwen3 --hidden 128 --layers 2 --heads 4 --kv-heads 2 --out "$RUN/tiny-model"

echo "== sft: uppercase / reverse / add on examples/data/tiny_chat.jsonl (about 20 seconds)"
$OXRL sft --config examples/sft_tiny.toml --set "model.path=\"$RUN/tiny-model\"" --set "output.run_dir=\"$RUN/sft\""
grep '"eval_loss"' "$RUN/sft/metrics.jsonl" | sed -E 's/.*"step":([0-9]+).*"eval_loss":([0-9.]{6}).*/  step \1: eval loss \2/'
echo "plot: $RUN/sft/loss.png"

echo "== chat with the fine-tuned model"
for q in "Uppercase: cat" "Reverse: stone" "What is 3 plus 4?" "What is 5 plus 2?"; do
  printf '%s -> ' "$q"
  $OXRL generate --model "$RUN/sft/final" --chat --prompt "$q" --temperature 0 --max-tokens 16 | grep -o '"text":"[^"]*"'
done

echo "== rl demo: a tiny model learns one-digit sums, short SFT then GRPO (a few minutes on 2 cores)"
rm -rf "$RUN/demo"
$OXRL demo --out "$RUN/demo" --seed 0
echo "summary: $(cat "$RUN/demo/summary.json")"
echo "curves: $RUN/demo/reward.png $RUN/demo/eval_accuracy.png"
