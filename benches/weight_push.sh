#!/usr/bin/env bash
# Weight push: in process, HTTP, MPI broadcast, for one model and LoRA rank; same run.
set -u
B=${OXRL:-target/release/oxrl}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl_vader_single_copy_mechanism=none
M=$1; R=$2; REPS=$3
L=(); E=()
[ "$R" -gt 0 ] && L=(--lora-rank $R) && E=(--lora-rank $R)
$B bench weight-push --model $M "${L[@]}" --reps $REPS --warmup 2
$B engine --model $M --listen 127.0.0.1:8117 "${E[@]}" 2>/dev/null & P=$!
sleep 4
$B bench weight-push --model $M "${L[@]}" --engine http://127.0.0.1:8117 --reps $REPS --warmup 2
kill $P; wait $P 2>/dev/null
mpirun -np 1 --oversubscribe --bind-to none $B bench weight-push --model $M "${L[@]}" --reps $REPS --warmup 2 : -np 1 $B engine --model $M --listen 127.0.0.1:0 "${E[@]}" 2>&1 | grep -v "listening"
