#!/bin/bash
# Runs benches/tinker_server.py against a release `oxrl serve` on a fresh tiny model (BENCHMARKS.md).
# Needs the SDK venv of .ci/run (.venv-tinker/). Usage: bash benches/tinker_server.sh
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked -q
work=$(mktemp -d)
trap 'kill $server 2>/dev/null || true; rm -rf "$work"' EXIT
./target/release/oxrl init-model --hidden 64 --layers 2 --out "$work/tiny" >/dev/null
port=$((20000 + RANDOM % 20000))
./target/release/oxrl serve --model "$work/tiny" --port $port --data-dir "$work/data" &
server=$!
for _ in $(seq 100); do curl -sf "http://127.0.0.1:$port/api/v1/healthz" >/dev/null && break; sleep 0.1; done
TINKER_BASE_URL=http://127.0.0.1:$port TINKER_API_KEY=tml-bench OXRL_MODEL=tiny OXRL_DATA_DIR="$work/data" \
    .venv-tinker/bin/python benches/tinker_server.py
