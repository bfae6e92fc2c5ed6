#!/usr/bin/env bash
# Peak memory per process, each rank's optimizer state and parameters, and step time under each
# sharding mode, over `mpirun -np NP` processes of one rank each, the modes alternated PAIRS times
# (each run a fresh set of processes: the peak is the process's); `-np 1` unsharded is the
# baseline, run in the same loop. One JSON line per run from `oxrl bench memory`.
# Usage: benches/sharding_ab.sh MODEL_DIR BATCH SEQ [PAIRS] [NP] [MODES]
# MODES: space-separated (default "none optimizer gradients full"); CKPT=1 adds
# --activation-checkpointing to every run.
# The model (Qwen2.5's proportions, 8 layers of width 512, 60 M parameters):
#   oxrl init-model --arch qwen2 --hidden 512 --layers 8 --heads 8 --kv-heads 2 --head-dim 64 \
#     --intermediate 2816 --vocab 32000 --max-position 4096 --tie --out /tmp/q60m
set -euo pipefail
model=$1 batch=$2 seq=$3 pairs=${4:-2} np=${5:-2} modes=${6:-none optimizer gradients full}
oxrl=${OXRL:-target/release/oxrl}
mpi=(mpirun --oversubscribe --bind-to none --allow-run-as-root)
extra=()
if [ "${CKPT:-0}" = 1 ]; then extra=(--activation-checkpointing); fi
run() { "$oxrl" --threads 1 bench memory --model "$model" --batch "$batch" --seq "$seq" --reps 2 "${extra[@]}" "$@"; }
for _ in $(seq "$pairs"); do
  run --sharding none
  for mode in $modes; do
    OMPI_MCA_btl_vader_single_copy_mechanism=none "${mpi[@]}" -np "$np" \
      "$oxrl" --threads 1 bench memory --model "$model" --batch "$batch" --seq "$seq" --reps 2 \
      "${extra[@]}" --sharding "$mode"
  done
done
