#!/usr/bin/env bash
# Synchronous vs fully asynchronous RL on a long-tail workload (BENCHMARKS.md).
#
#   bash benches/async_longtail.sh [OUT_DIR]        (default runs/async-longtail)
#
# Makes a tiny random model (the demo's shape: hidden 64, 2 layers) and a prompt file of
# one-digit sums whose per-row `max_tokens` is long-tailed: 85 % of rows SHORT tokens, 10 % MID,
# 5 % LONG (= env.max_turn_tokens). A random model rarely samples EOS, so response lengths follow the
# budgets. Then runs `oxrl rl` on one config in three modes, interleaved REPS times:
#   sync | async, max_staleness = 1 | async, max_staleness = 4
# with the same steps × prompts_per_step × n_samples (equal trained samples), and prints per run
# the wall time, samples/s and the mean per-step time split of metrics.jsonl; finally draws the
# reward curves of the first repetition on one plot (OUT_DIR/reward_sync_vs_async.png).
#
# Knobs (environment): REPS (3), STEPS (60), PROMPTS (8 per step), N (4 samples per prompt),
# SHORT / MID / LONG (16 / 64 / 256 tokens), ENGINES (2), ENGINE_THREADS (1), TRAINER_THREADS (1),
# MICRO (8: micro-batch size; micro-batches are packed by length), OXRL (target/release/oxrl).
# REMOTE=1: the ENGINES engines are `oxrl engine` processes pinned to the cores ENGINE_CPUS (1)
# and the trainer is pinned to TRAINER_CPUS (0) (`taskset`), reached through
# `launch.remote_engines`.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/async-longtail}
OXRL=${OXRL:-target/release/oxrl}
REPS=${REPS:-3} STEPS=${STEPS:-60} PROMPTS=${PROMPTS:-8} N=${N:-4}
REMOTE=${REMOTE:-0} ENGINE_CPUS=${ENGINE_CPUS:-1} TRAINER_CPUS=${TRAINER_CPUS:-0}
SHORT=${SHORT:-16} MID=${MID:-64} LONG=${LONG:-256} MICRO=${MICRO:-8}
ENGINES=${ENGINES:-2} ENGINE_THREADS=${ENGINE_THREADS:-1} TRAINER_THREADS=${TRAINER_THREADS:-1}
mkdir -p "$OUT"

# The model: the demo's shape, with room for a LONG reply after the ~50-token prompt.
[ -f "$OUT/model/config.json" ] || "$OXRL" init-model --hidden 64 --layers 2 --heads 4 --kv-heads 2 \
    --head-dim 16 --intermediate 256 --max-position $((LONG + 128)) --seed 0 --out "$OUT/model" 2>/dev/null

# 2000 one-digit sums; row i's budget by i mod 20: 0 → LONG, 1-2 → MID, else SHORT (the loader
# shuffles the rows).
awk -v S="$SHORT" -v M="$MID" -v L="$LONG" 'BEGIN {
    for (i = 0; i < 2000; i++) {
        a = (i * 7) % 10; b = (i * 3 + int(i / 10)) % 10; m = i % 20;
        t = (m == 0) ? L : (m <= 2) ? M : S;
        printf "{\"id\": %d, \"prompt\": \"What is %d + %d?\", \"answer\": %d, \"max_tokens\": %d}\n", i, a, b, a + b, t
    } }' > "$OUT/prompts.jsonl"

cat > "$OUT/rl.toml" <<TOML
[model]
path = "model"
[data]
train_file = "prompts.jsonl"
[env]
max_turn_tokens = $LONG
[rollout]
n_samples = $N
[algorithm]
loss = "rollout_is"
[optimizer]
lr = 0.003
[train]
prompts_per_step = $PROMPTS
max_steps = $STEPS
eval_every = 0
checkpoint_every = 0
[launch]
engines = $ENGINES
engine_threads = $ENGINE_THREADS
trainer_threads = $TRAINER_THREADS
micro_batch_size = $MICRO
TOML

PIN=() REMOTE_SET=()
if [ "$REMOTE" = 1 ]; then
    urls=()
    for e in $(seq 1 "$ENGINES"); do
        port=$((8200 + e))
        taskset -c "$ENGINE_CPUS" "$OXRL" --threads "$ENGINE_THREADS" engine --model "$OUT/model" \
            --listen "127.0.0.1:$port" >"$OUT/engine-$e.log" 2>&1 &
        urls+=("\"http://127.0.0.1:$port\"")
    done
    trap 'kill $(jobs -p) 2>/dev/null' EXIT
    sleep 2
    PIN=(taskset -c "$TRAINER_CPUS")
    REMOTE_SET=(--set "launch.remote_engines=[$(IFS=,; echo "${urls[*]}")]")
fi

declare -A MODE=(
    [sync]='--set mode=sync'
    [async1]='--set mode=async --set async_rl.max_staleness=1'
    [async4]='--set mode=async --set async_rl.max_staleness=4'
)
echo "load before: $(uptime)"
printf '%-8s %3s %7s %9s %8s %8s %8s %8s %8s %6s %6s\n' run rep wall_s samples/s gen_s wait_s train_s sync_s cap_s stale resp
for rep in $(seq 1 "$REPS"); do
    for run in sync async1 async4; do
        dir="$OUT/$run-$rep"
        rm -rf "$dir"
        t0=$(date +%s.%N)
        # shellcheck disable=SC2086
        "${PIN[@]}" "$OXRL" rl --config "$OUT/rl.toml" ${MODE[$run]} "${REMOTE_SET[@]}" --set output.run_dir="$dir" \
            >"$OUT/$run-$rep.log" 2>&1
        wall=$(echo "$(date +%s.%N) - $t0" | bc -l)
        jq -rs --arg run "$run" --arg rep "$rep" --argjson wall "$wall" --argjson samples $((STEPS * PROMPTS * N)) '
            def m(k): (map(.[k] // 0) | add / length);
            [$run, $rep, ($wall * 10 | round / 10), ($samples / $wall * 10 | round / 10),
             (m("time_generate_s") * 1000 | round / 1000), (m("time_wait_data_s") * 1000 | round / 1000),
             ((m("time_reference_s") + m("time_train_s")) * 1000 | round / 1000),
             (m("time_sync_s") * 1000 | round / 1000), (m("time_wait_capacity_s") * 1000 | round / 1000),
             (m("staleness_mean") * 100 | round / 100), (m("response_length_mean") * 10 | round / 10)]
            | "\(.[0]) \(.[1]) \(.[2]) \(.[3]) \(.[4]) \(.[5]) \(.[6]) \(.[7]) \(.[8]) \(.[9]) \(.[10])"' \
            "$dir/metrics.jsonl" | xargs printf '%-8s %3s %7s %9s %8s %8s %8s %8s %8s %6s %6s\n'
    done
done
echo "load after: $(uptime)"
"$OXRL" plot --run "$OUT/sync-1" --run "$OUT/async1-1" --run "$OUT/async4-1" --metric reward_mean \
    --label sync --label "async, max_staleness 1" --label "async, max_staleness 4" \
    --title "reward_mean, long-tail workload" --out "$OUT/reward_sync_vs_async.png"
