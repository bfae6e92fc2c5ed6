#!/bin/bash
# Runs benches/tinker_fairness.py against `oxrl serve` on a fresh tiny model (BENCHMARKS.md).
# Usage: bash benches/tinker_fairness.sh [OXRL_BINARY] (default: a release build of this tree).
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-}
if [ -z "$bin" ]; then cargo build --release --locked -q; bin=./target/release/oxrl; fi
work=$(mktemp -d)
trap 'kill $server 2>/dev/null || true; rm -rf "$work"' EXIT
"$bin" init-model --hidden 64 --layers 2 --max-position 2048 --out "$work/tiny" >/dev/null
printf 'k1\nk2\n' > "$work/keys"
port=$((20000 + RANDOM % 20000))
"$bin" --threads 1 serve --model "$work/tiny" --port $port --data-dir "$work/data" --api-keys "$work/keys" 2>/dev/null &
server=$!
for _ in $(seq 100); do curl -sf "http://127.0.0.1:$port/api/v1/healthz" >/dev/null && break; sleep 0.1; done
python3 benches/tinker_fairness.py "http://127.0.0.1:$port" "${N:-30}"
