#!/usr/bin/env bash
# The demo's task scored by the built-in `arithmetic` env against the same reward as a Python
# compute_score (tests/fixtures/python/arithmetic_reward.py) through the worker pool: per-step
# time and whether the two runs are the same bits, in alternating pairs.
#
#   bash benches/python_reward_ab.sh CONFIG [ROUNDS]   # CONFIG: an RL config with [reward] custom_function
#
# CONFIG's model and data: e.g. benches/results/python_reward_2026-11-26/rl.toml (the demo's SFT'd
# model and a verl parquet of its task, as benches/peers/trl_grpo.sh writes them). Prints, per
# round, the median step (steps 2..), the median time_generate_s (generation + rewards: the
# difference between the two runs is the wait on the pool) and whether metrics (timing keys
# aside) and final weights are bit-identical.
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG=${1:?an RL config}
ROUNDS=${2:-3}
OUT=${OUT:-runs/python_reward_ab}
for r in $(seq "$ROUNDS"); do
    for kind in builtin python; do
        extra=()
        [ "$kind" = builtin ] && extra=(--set 'reward.custom_function.path=""' --set 'data.env="arithmetic"')
        rm -rf "$OUT/$kind$r"
        target/release/oxrl --threads 1 rl --config "$CONFIG" --set "output.run_dir=\"$OUT/$kind$r\"" "${extra[@]}" 2>/dev/null
    done
done
python3 - "$OUT" "$ROUNDS" <<'PY'
import json, statistics as st, sys
out, rounds = sys.argv[1], int(sys.argv[2])
timing = lambda k: k.startswith("time_") or k in ("samples_per_s", "elapsed_s")
load = lambda d: [json.loads(l) for l in open(f"{out}/{d}/metrics.jsonl")]
step = lambda l: l["time_generate_s"] + l["time_reference_s"] + l["time_train_s"] + l["time_sync_s"]
print("| round | step, built-in | step, Python | Python / built-in | generate + reward, built-in | Python | reward wait / step | same bits |")
print("|---|---|---|---|---|---|---|---|")
for r in range(1, rounds + 1):
    a, b = load(f"builtin{r}"), load(f"python{r}")
    same = all({k: v for k, v in x.items() if not timing(k)} == {k: v for k, v in y.items() if not timing(k)} for x, y in zip(a, b))
    same &= open(f"{out}/builtin{r}/final/model.safetensors", "rb").read() == open(f"{out}/python{r}/final/model.safetensors", "rb").read()
    sa, sb = st.median(map(step, a[1:])), st.median(map(step, b[1:]))
    ga, gb = st.median(l["time_generate_s"] for l in a[1:]), st.median(l["time_generate_s"] for l in b[1:])
    print(f"| {r} | {sa*1e3:.1f} ms | {sb*1e3:.1f} ms | {sb/sa:.3f} | {ga*1e3:.2f} ms | {gb*1e3:.2f} ms | {(gb-ga)/sb*100:.1f} % | {same} |")
PY
