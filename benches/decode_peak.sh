#!/usr/bin/env bash
# The decoding targets in one run: `oxrl bench decode` against PyTorch `generate`
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
# The table: per thread count and concurrency, medians over the rounds of oxrl's and generate's
# tokens/s, their ratio per round, and oxrl's FLOP rates as fractions of the GEMM reference (the
# faster library's best size in the same round and thread count).
"$PYTHON" - "$OUT/results.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
med = statistics.median
def gemm(rnd, th):
    return max(r["gflops"] for r in rows if r["bench"] == "gemm" and r["round"] == rnd and r["threads"] == th)
print("threads requests oxrl_tok/s generate_tok/s ratio(per round) gemm_GFLOP/s gflops% computed% later_steps%")
for th in sorted({r["threads"] for r in rows}):
    for b in sorted({r["batch"] for r in rows if r["bench"] == "decode"}):
        ox = [r for r in rows if r["bench"] == "decode" and r["framework"] == "oxrl" and r["threads"] == th and r["batch"] == b]
        pt = {r["round"]: r for r in rows if r["bench"] == "decode" and r["framework"] == "pytorch" and r["threads"] == th and r["batch"] == b}
        ratios = [r["tokens_per_s"] / pt[r["round"]]["tokens_per_s"] for r in ox if r["round"] in pt]
        share = lambda key: med([r[key] / gemm(r["round"], th) for r in ox if key in r] or [float("nan")]) * 100
        print(th, b, round(med([r["tokens_per_s"] for r in ox])), round(med([r["tokens_per_s"] for r in pt.values()])),
              f"{med(ratios):.2f} ({', '.join(f'{x:.2f}' for x in ratios)})", round(med([gemm(r['round'], th) for r in ox]), 1),
              f"{share('gflops'):.0f}", f"{share('computed_gflops'):.0f}", f"{share('later_steps_gflops'):.0f}")
PY
