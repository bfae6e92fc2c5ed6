#!/usr/bin/env bash
# Peak memory per process at Qwen2.5-0.5B's shape: `none` in one process against `full` over
# `mpirun -np NP` processes of one rank each, 4 × 256 tokens per rank (one micro-batch: under
# `full` the gradients are summed to their owners during the backward), with and without
# activation checkpointing; one untimed step and one timed, each run a fresh set of processes.
# Usage: benches/sharding_q05.sh MODEL_DIR [NP_CKPT] [NP_KEPT]
# The model: oxrl init-model --arch qwen2 --hidden 896 --layers 24 --heads 14 --kv-heads 2 \
#   --head-dim 64 --intermediate 4864 --vocab 151936 --max-position 32768 --tie --out /tmp/q05
set -euo pipefail
model=$1 np_ckpt=${2:-4} np_kept=${3:-2}
oxrl=${OXRL:-target/release/oxrl}
mpi=(mpirun --oversubscribe --bind-to none --allow-run-as-root)
bench() { "$oxrl" --threads 1 bench memory --model "$model" --batch 4 --seq 256 --reps 1 "$@"; }
across() {
  local np=$1; shift
  OMPI_MCA_btl_vader_single_copy_mechanism=none "${mpi[@]}" -np "$np" \
    "$oxrl" --threads 1 bench memory --model "$model" --batch 4 --seq 256 --reps 1 "$@"
}
bench --sharding none --activation-checkpointing
across "$np_ckpt" --sharding full --activation-checkpointing
bench --sharding none
across "$np_kept" --sharding full
