#!/usr/bin/env bash
# Peak memory per process, each rank's optimizer state and step time under each sharding mode,
# over `mpirun -np NP` processes of one rank each, the modes alternated PAIRS times (each run a
# fresh set of processes: the peak is the process's); `-np 1` unsharded is the baseline, run in
# the same loop. One JSON line per run from `oxrl bench memory`.
# Usage: benches/sharding_ab.sh MODEL_DIR BATCH SEQ [PAIRS] [NP]
# The model (Qwen2.5's proportions, 8 layers of width 512, 60 M parameters):
#   oxrl init-model --arch qwen2 --hidden 512 --layers 8 --heads 8 --kv-heads 2 --head-dim 64 \
#     --intermediate 2816 --vocab 32000 --max-position 4096 --tie --out /tmp/q60m
set -euo pipefail
model=$1 batch=$2 seq=$3 pairs=${4:-2} np=${5:-2}
oxrl=${OXRL:-target/release/oxrl}
mpi=(mpirun --oversubscribe --bind-to none --allow-run-as-root)
run() { "$oxrl" --threads 1 bench memory --model "$model" --batch "$batch" --seq "$seq" --reps 2 "$@"; }
for _ in $(seq "$pairs"); do
  run --sharding none
  for mode in none optimizer gradients; do
    OMPI_MCA_btl_vader_single_copy_mechanism=none "${mpi[@]}" -np "$np" \
      "$oxrl" --threads 1 bench memory --model "$model" --batch "$batch" --seq "$seq" --reps 2 --sharding "$mode"
  done
done
