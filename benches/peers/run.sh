#!/usr/bin/env bash
# oxrl against PyTorch + transformers and JAX on the same workloads, weights and tokens.
# Benchmark-only: CI never runs it, and the peers are never a dependency.
#
#   bash benches/peers/run.sh [OUT_DIR]        # default runs/peers
#   ROUNDS=3 THREADS="1 2" bash benches/peers/run.sh
#
# 1. Installs pinned PyTorch (CPU wheel index when reachable, else PyPI), transformers, JAX (CPU),
#    numpy and safetensors into .venv-peers/ at the repository root (git-ignored; about 1 GB with
#    the CPU wheel, 3-4 GB from PyPI, whose torch wheel pulls in the CUDA libraries).
# 2. Builds oxrl (release) and writes the benchmark model with its workloads' tokens
#    (`oxrl bench save-model`), which the peers load: the same weights, the same tokens.
# 3. For each round and each thread count, runs, one process each and alternating so that the
#    machine's noise hits all alike: oxrl train f32, oxrl train bf16 (mixed precision), oxrl
#    decode, PyTorch train f32, PyTorch train bf16 (autocast), PyTorch decode, JAX train f32.
#    Every process is confined to the first N CPUs with taskset (XLA has no thread-count flag:
#    it sizes its pools by the CPUs it may use); oxrl gets --threads N, PyTorch
#    torch.set_num_threads(N) and OMP_NUM_THREADS=N, JAX for N = 1 also
#    XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1".
# 4. Prints the markdown tables (medians over rounds, and the best repetition; ratios oxrl / peer
#    in tokens/s, above 1 = oxrl faster) and leaves every JSON line in OUT_DIR/results.jsonl;
#    `peers.py table OUT_DIR/results.jsonl` prints them again.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-runs/peers}
ROUNDS=${ROUNDS:-3}
THREADS=${THREADS:-1 2}
VENV=.venv-peers
TORCH=2.15.0 TRANSFORMERS=5.23.0 JAX=0.10.2 NUMPY=2.4.6 SAFETENSORS=0.8.0

if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import torch, transformers, jax" 2>/dev/null; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
    cpu_index=https://download.pytorch.org/whl/cpu
    if curl -sf --max-time 5 -o /dev/null "$cpu_index/torch/"; then
        "$VENV/bin/pip" install "torch==$TORCH" --index-url "$cpu_index"
    fi
    "$VENV/bin/pip" install "torch==$TORCH" "transformers==$TRANSFORMERS" "jax[cpu]==$JAX" \
        "numpy==$NUMPY" "safetensors==$SAFETENSORS"
fi
PY="$VENV/bin/python"

CARGO_BUILD_JOBS=${CARGO_BUILD_JOBS:-1} cargo build --release --locked --bin oxrl
OXRL=target/release/oxrl
mkdir -p "$OUT"
MODEL="$OUT/model"
"$OXRL" bench save-model --out "$MODEL"
RESULTS="$OUT/results.jsonl"
: > "$RESULTS"

for round in $(seq 1 "$ROUNDS"); do
    for n in $THREADS; do
        cpus="0-$((n - 1))"
        pin=(taskset -c "$cpus")
        echo "round $round, $n thread(s)" >&2
        "${pin[@]}" "$OXRL" --threads "$n" bench train | tee -a "$RESULTS"
        "${pin[@]}" "$OXRL" --threads "$n" bench train --dtype bf16 | tee -a "$RESULTS"
        "${pin[@]}" "$OXRL" --threads "$n" bench decode --reps 3 | tee -a "$RESULTS"
        OMP_NUM_THREADS=$n "${pin[@]}" "$PY" benches/peers/peers.py torch-train --model "$MODEL" --threads "$n" | tee -a "$RESULTS"
        OMP_NUM_THREADS=$n "${pin[@]}" "$PY" benches/peers/peers.py torch-train --model "$MODEL" --threads "$n" --dtype bf16 | tee -a "$RESULTS"
        OMP_NUM_THREADS=$n "${pin[@]}" "$PY" benches/peers/peers.py torch-decode --model "$MODEL" --threads "$n" --reps 3 | tee -a "$RESULTS"
        xla=""
        [ "$n" = 1 ] && xla="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
        JAX_PLATFORMS=cpu XLA_FLAGS="$xla" "${pin[@]}" "$PY" benches/peers/peers.py jax-train --model "$MODEL" --threads "$n" | tee -a "$RESULTS"
    done
done

echo
echo "$(date -u +%F), $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg), $ROUNDS round(s)"
echo "Medians over rounds of each run's median:"
"$PY" benches/peers/peers.py table "$RESULTS"
echo
echo "Best repetition of all rounds (least disturbed by other work on the machine):"
"$PY" benches/peers/peers.py table "$RESULTS" --stat best
