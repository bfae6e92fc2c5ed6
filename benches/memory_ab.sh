#!/usr/bin/env bash
# Peak memory and step time with and without activation checkpointing, alternating the two
# settings PAIRS times (each run a fresh process: the peak is the process's), one JSON line per
# run from `oxrl bench memory`. Usage: benches/memory_ab.sh MODEL_DIR BATCH SEQ [PAIRS] [RANKS]
# A model at Qwen2.5-0.5B's shape:
#   oxrl init-model --arch qwen2 --hidden 896 --layers 24 --heads 14 --kv-heads 2 --head-dim 64 \
#     --intermediate 4864 --vocab 151936 --max-position 32768 --tie --out /tmp/q05
set -euo pipefail
model=$1 batch=$2 seq=$3 pairs=${4:-2} ranks=${5:-1}
oxrl=${OXRL:-target/release/oxrl}
for _ in $(seq "$pairs"); do
  for ck in "" --activation-checkpointing; do
    "$oxrl" bench memory --model "$model" --batch "$batch" --seq "$seq" --ranks "$ranks" --reps 1 $ck
  done
done
