#!/usr/bin/env bash
# oxrl's RL with a Python reward function against TRL's GRPOTrainer, side by side on this machine.
# Benchmark-only: CI never runs it, and TRL is never a dependency.
#
#   bash benches/peers/trl_grpo.sh                  # 200 steps; results in benches/results/trl_grpo_<date>/
#   STEPS=30 OUT=runs/trl_grpo/results bash benches/peers/trl_grpo.sh
#   SKIP_BUILD=1 bash benches/peers/trl_grpo.sh     # use target/release/oxrl as it is
#
# Everything runs at nice 19 (the machine is shared) with 1 tensor-math thread per framework
# (THREADS=1: oxrl --threads 1, engine and trainer on one thread each, alternating in the
# synchronous loop; torch.set_num_threads(1), OMP_NUM_THREADS=1). No CPU pinning.
#
# 1. Installs pinned PyTorch (the CPU wheel index when reachable, else PyPI, whose torch wheel pulls
#    in the CUDA libraries), transformers, TRL, datasets and accelerate into .venv-trl/ at the
#    repository root (git-ignored).
# 2. Builds oxrl (release, --features mpi) unless SKIP_BUILD=1.
# 3. Makes the model both start from: `oxrl demo` (the demo's tiny qwen3, SFT'd on one-digit sums
#    until 40 % greedy accuracy; --rl-steps 1, its RL phase is not used) in WORK/demo, kept between
#    runs; the SFT'd model is WORK/demo/sft/final.
# 4. benches/peers/trl_grpo.py bench: writes the prompts (the demo's task in verl's schema,
#    WORK/train.parquet), runs `oxrl rl` with `[reward] custom_function` =
#    tests/fixtures/python/arithmetic_reward.py:compute_score, then TRL's GRPOTrainer with the same
#    compute_score as its reward function and the same settings, and prints the markdown table.
#    The JSON lines go to OUT (default benches/results/trl_grpo_<date>/).
set -euo pipefail
cd "$(dirname "$0")/../.."
renice -n 19 -p $$ >/dev/null
STEPS=${STEPS:-200}
THREADS=${THREADS:-1}
WORK=${WORK:-runs/trl_grpo}
OUT=${OUT:-benches/results/trl_grpo_$(date -u +%F)}
VENV=.venv-trl
TORCH=2.15.0 TRANSFORMERS=5.24.0 TRL=1.16.0 DATASETS=5.2.0 ACCELERATE=1.15.0

if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import torch, transformers, trl, datasets, accelerate" 2>/dev/null; then
    python3.11 -m venv "$VENV" 2>/dev/null || python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
    cpu_index=https://download.pytorch.org/whl/cpu
    if curl -sf --max-time 5 -o /dev/null "$cpu_index/torch/"; then
        "$VENV/bin/pip" install "torch==$TORCH" --index-url "$cpu_index"
    fi
    "$VENV/bin/pip" install "torch==$TORCH" "transformers==$TRANSFORMERS" "trl==$TRL" \
        "datasets==$DATASETS" "accelerate==$ACCELERATE"
fi
PY="$VENV/bin/python"

if [ "${SKIP_BUILD:-0}" != 1 ]; then
    cargo build --release --features mpi --bin oxrl
fi
OXRL=target/release/oxrl

MODEL="$WORK/demo/sft/final"
if [ ! -f "$MODEL/model.safetensors" ]; then
    rm -rf "$WORK/demo"
    mkdir -p "$WORK"
    "$OXRL" --threads "$THREADS" demo --out "$WORK/demo" --rl-steps 1 --seed 0
fi

echo "$(date -u +%F), $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg)" >&2
"$PY" benches/peers/trl_grpo.py bench --oxrl "$OXRL" --model "$MODEL" --work "$WORK" --out "$OUT" \
    --steps "$STEPS" --threads "$THREADS"
