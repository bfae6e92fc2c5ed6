#!/usr/bin/env bash
# The proof that `full` sharding trains what does not fit: every process of `mpirun -np NP` runs
# in a memory cgroup of its own capped at CAP_MB (cgroup v1, as root); unsharded, the kernel kills
# the processes for memory (the run fails), while `full` with activation checkpointing trains
# (`oxrl bench memory`: REPS steps, its JSON line with the measured peaks).
# Usage: benches/sharding_fit.sh MODEL_DIR BATCH SEQ CAP_MB [NP]
set -uo pipefail
model=$1 batch=$2 seq=$3 cap=$4 np=${5:-4}
oxrl=${OXRL:-target/release/oxrl}
root=/sys/fs/cgroup/memory
[ -w "$root" ] || { echo "needs a writable cgroup v1 memory hierarchy at $root (run as root)" >&2; exit 2; }
# Each rank puts itself into its own capped cgroup, then becomes oxrl.
wrapper=$(mktemp)
cat > "$wrapper" <<WRAP
#!/usr/bin/env bash
g=$root/oxrl-fit-\$OMPI_COMM_WORLD_RANK
mkdir -p "\$g" && echo $((cap * 1024 * 1024)) > "\$g/memory.limit_in_bytes" && echo 0 > "\$g/memory.swappiness" 2>/dev/null
echo \$\$ > "\$g/cgroup.procs"
exec "$oxrl" --threads 1 bench memory --model "$model" --batch "$batch" --seq "$seq" --reps 2 "\$@"
WRAP
chmod +x "$wrapper"
for args in "--sharding none" "--sharding full --activation-checkpointing"; do
  echo "== np $np, cap ${cap} MB per process: $args"
  OMPI_MCA_btl_vader_single_copy_mechanism=none mpirun --oversubscribe --bind-to none --allow-run-as-root \
    -np "$np" "$wrapper" $args
  echo "exit status $?"
  for r in $(seq 0 $((np - 1))); do
    g=$root/oxrl-fit-$r
    echo "rank $r: peak $(( $(cat $g/memory.max_usage_in_bytes) / 1048576 )) MB, limit hit $(cat $g/memory.failcnt) times"
    rmdir "$g" 2>/dev/null
  done
done
rm -f "$wrapper"
