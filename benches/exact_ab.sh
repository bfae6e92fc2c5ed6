#!/usr/bin/env bash
# The exactly-on-policy A/B: the fixed-order kernels (this checkout) against a build of OLD_REV (default: the
# commit before them), training step and decoding at 1 and 2 threads, alternating, ROUNDS rounds.
# Prints one JSON line per run; BENCHMARKS.md holds the medians.
#   ROUNDS=3 OLD_REV=5f26a7f bash benches/exact_ab.sh
set -euo pipefail
ROUNDS=${ROUNDS:-3}
OLD_REV=${OLD_REV:-5f26a7f}
OUT=${OUT:-runs/exact_ab}
mkdir -p "$OUT"
cargo build --release --locked --bin oxrl
cp target/release/oxrl "$OUT/oxrl-new"
if [ ! -x "$OUT/oxrl-old" ]; then
    # The old build in a worktree sharing this checkout's target directory (no second copy of
    # the dependencies), then its binary set aside.
    git worktree add --force "$OUT/old-src" "$OLD_REV"
    (cd "$OUT/old-src" && CARGO_TARGET_DIR="$(pwd)/../../../target" cargo build --release --locked --bin oxrl)
    cp target/release/oxrl "$OUT/oxrl-old"
    git worktree remove --force "$OUT/old-src"
    cargo build --release --locked --bin oxrl
fi
for round in $(seq 1 "$ROUNDS"); do
    for n in 1 2; do
        for v in old new; do
            pin=(taskset -c "0-$((n - 1))")
            "${pin[@]}" "$OUT/oxrl-$v" --threads "$n" bench train --reps 5 | sed "s/^{/{\"build\":\"$v\",\"round\":$round,/"
            "${pin[@]}" "$OUT/oxrl-$v" --threads "$n" bench decode --reps 3 | sed "s/^{/{\"build\":\"$v\",\"round\":$round,/"
        done
    done
done | tee "$OUT/results.jsonl"
