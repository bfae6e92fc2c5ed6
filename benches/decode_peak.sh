#!/usr/bin/env bash
# Issue 26's decoding targets in one session: `oxrl bench decode` against PyTorch `generate`
# (benches/peers/peers.py torch-decode) at 1, 16 and 64 concurrent requests, and both against the
# machine's f32 GEMM speed (`oxrl bench gemm`, PyTorch's matmul), at 1 and 2 threads, ROUNDS
# rounds, alternating, each process pinned with taskset. Needs a Python with torch and
# transformers (PYTHON, default .venv-peers/bin/python as benches/peers/run.sh installs it).
#   ROUNDS=3 PYTHON=.venv-peers/bin/python bash benches/decode_peak.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/decode_peak}
ROUNDS=${ROUNDS:-3}
PYTHON=${PYTHON:-.venv-peers/bin/python}
mkdir -p "$OUT"
cargo build --release --locked --bin oxrl
OXRL=target/release/oxrl
[ -f "$OUT/model/config.json" ] || "$OXRL" bench save-model --out "$OUT/model"
for round in $(seq 1 "$ROUNDS"); do
    for n in 1 2; do
        pin=(taskset -c "0-$((n - 1))")
        tag="s/^{/{\"round\":$round,/"
        "${pin[@]}" "$OXRL" --threads "$n" bench gemm --size 960,2048 | sed "$tag"
        OMP_NUM_THREADS=$n "${pin[@]}" "$PYTHON" benches/peers/peers.py torch-gemm --threads "$n" --batch 960,2048 | sed "$tag"
        "${pin[@]}" "$OXRL" --threads "$n" bench decode --reps 5 | sed "$tag"
        OMP_NUM_THREADS=$n "${pin[@]}" "$PYTHON" benches/peers/peers.py torch-decode --model "$OUT/model" --threads "$n" --reps 3 2>/dev/null | sed "$tag"
    done
done | tee "$OUT/results.jsonl"
