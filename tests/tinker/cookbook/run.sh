#!/usr/bin/env bash
# Manual check: the real tinker-cookbook 0.6.1 trains against `oxrl serve`.
#
# Runs the cookbook's own math_rl recipe (tinker_cookbook.recipes.math_rl.train, default loss
# stable_reinforce) on the tiny Qwen3 fixture: plain, bigger batch, async off-policy, resume,
# streaming minibatches, and load_checkpoint_path without renderer_name from a checkpoint saved
# after a resume (the cookbook then reads the renderer from the run's user_metadata). Then the
# cookbook's weights.download (weights_download.py), the training-run metadata of resumed and
# loaded runs, and the server's stderr.
#
# Manual, not run by .ci/run: the cookbook imports torch, so the first run installs it (~1 min
# more); after that a run takes about a minute. Offline once the venv exists.
#
#   OXRL=target/release/oxrl bash tests/tinker/cookbook/run.sh
#
# Env: OXRL (binary), VENV (default .venv-cookbook, created if missing), WORK (default mktemp -d),
# PORT (default 8231). Exits non-zero if any check fails; logs stay in WORK.
set -uo pipefail   # not -e: every check runs and reports
REPO=$(cd "$(dirname "$0")/../../.." && pwd); cd "$REPO"
OXRL=${OXRL:-target/release/oxrl}; VENV=${VENV:-.venv-cookbook}; WORK=${WORK:-$(mktemp -d)}; PORT=${PORT:-8231}
PY=$VENV/bin/python; BASE=http://127.0.0.1:$PORT; MODEL=$WORK/models/qwen3
mkdir -p "$WORK/logs" "$WORK/runs" "$MODEL"
FAILED=0
report() {  # NAME STATUS [DETAIL]
  if [ "$2" = 0 ]; then echo "PASS  $1"; else echo "FAIL  $1${3:+: $3}"; FAILED=1; fi
}

# --- venv. torch comes from PyPI (CUDA build; works on CPU). The [math-rl] extra is listed by
# hand because the cookbook goes in with --no-deps: its tml-renderers>=0.4.1 dependency is not
# on PyPI, and is only used for models this check does not touch.
if [ ! -x "$PY" ]; then
  python3 -m venv "$VENV" &&
  "$PY" -m pip install -q "torch>=2.10" &&
  "$PY" -m pip install -q "tinker==0.38.0" aiohttp anyio blobfile chz cloudpickle datasets huggingface-hub \
      numpy pillow pydantic pyrage rich safetensors termcolor tiktoken tqdm \
      "transformers!=5.3.0,!=5.4.*,!=5.5.0,!=5.5.1,!=5.5.2,!=5.5.3,!=5.6.*,>=4.57.6" \
      "math-verify>=0.5.0" "pylatexenc>=2.0" "sympy>=1.12.0" &&
  "$PY" -m pip install -q --no-deps "tinker-cookbook==0.6.1" || { echo "FAIL  venv setup"; exit 1; }
fi

# --- model: a copy of the fixture; the cookbook's model_name is this directory (its tokenizer
# loads offline from there, and the server accepts the path as base_model).
(cd tests/fixtures/hf/qwen3 && cp config.json model.safetensors tokenizer.json tokenizer_config.json \
    special_tokens_map.json generation_config.json chat_template.jinja "$MODEL/")

# --- server
"$OXRL" serve --model "$MODEL" --data-dir "$WORK/data" --port "$PORT" > "$WORK/logs/server.out" 2> "$WORK/logs/server.err" &
SERVER=$!; trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null' EXIT
for _ in $(seq 100); do curl -sf "$BASE/api/v1/healthz" >/dev/null && break; sleep 0.2; done
curl -sf "$BASE/api/v1/healthz" >/dev/null || { echo "FAIL  server did not come up (see $WORK/logs/server.err)"; exit 1; }

export TINKER_API_KEY=tml-dummy TINKER_BASE_URL=$BASE WANDB_MODE=disabled \
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1

recipe() {  # NAME [key=value...]: one math_rl run into WORK/runs/NAME; later keys override earlier ones
  local name=$1 t=$SECONDS; shift
  "$PY" -m tinker_cookbook.recipes.math_rl.train env=arithmetic model_name="$MODEL" base_url="$BASE" \
      lora_rank=16 group_size=8 groups_per_batch=8 max_tokens=16 learning_rate=3e-4 \
      log_path="$WORK/runs/$name" behavior_if_log_dir_exists=delete "$@" > "$WORK/logs/$name.log" 2>&1
  grep -q "Training completed successfully" "$WORK/logs/$name.log"
  report "recipe $name ($((SECONDS - t))s)" $? "see $WORK/logs/$name.log"
}
last_state() {  # NAME: the tinker:// state path of the run's last checkpoint (empty if none)
  tail -1 "$WORK/runs/$1/checkpoints.jsonl" 2>/dev/null |
    "$PY" -c 'import json,sys; print(json.load(sys.stdin)["state_path"])' 2>/dev/null
}
run_of() { echo "$1" | cut -d/ -f3; }  # tinker://RUN/weights/NAME -> RUN

# model_info does not know a directory as model name, so renderer_name is explicit (except load).
recipe default renderer_name=qwen3 lora_rank=8 group_size=4 groups_per_batch=4 max_tokens=8 \
    learning_rate=1e-4 max_steps=8 save_every=3 eval_every=4
recipe big renderer_name=qwen3 max_steps=10 save_every=5 eval_every=5
recipe async renderer_name=qwen3 max_steps=8 save_every=4 eval_every=4 max_steps_off_policy=2
FIRST=$(last_state big)
# Resume `big` to 13 steps: a new run made by load_weights (create_training_client_from_state_with_optimizer).
recipe resume renderer_name=qwen3 max_steps=13 save_every=5 eval_every=5 \
    log_path="$WORK/runs/big" behavior_if_log_dir_exists=resume
recipe stream renderer_name=qwen3 max_steps=5 save_every=5 eval_every=0 \
    stream_minibatch_config.groups_per_batch=8 stream_minibatch_config.num_minibatches=2
# Load the resumed run's final checkpoint without renderer_name: the cookbook reads it from
# that run's user_metadata, which runs made by load_weights used to lose.
RESUMED=$(last_state big)
[ "$(run_of "$RESUMED")" != "$(run_of "$FIRST")" ]; report "resume wrote its checkpoint under a new run" $?
recipe load load_checkpoint_path="$RESUMED" max_steps=4 save_every=2 eval_every=0

# --- training runs made by load_weights keep their metadata and the client's base model name
for name in big load; do
  run=$(run_of "$(last_state $name)")
  got=$(curl -sf -H "X-API-Key: $TINKER_API_KEY" "$BASE/api/v1/training_runs/$run")
  echo "$got" | MODEL=$MODEL "$PY" -c '
import json, os, sys
r = json.load(sys.stdin)
assert (r.get("user_metadata") or {}).get("renderer_name") == "qwen3", r
assert r.get("base_model") == os.environ["MODEL"], r' 2>/dev/null
  report "GET training_runs of the $name run: renderer_name, base_model" $? "$got"
done

# --- weights.download
"$PY" tests/tinker/cookbook/weights_download.py "$(last_state default)" "$WORK/downloads" > "$WORK/logs/weights.log" 2>&1
rc=$?; grep -E '^(PASS|FAIL)' "$WORK/logs/weights.log"
report "weights_download.py" $rc "see $WORK/logs/weights.log"

# --- server: still up, and nothing went wrong on its side
curl -sf "$BASE/api/v1/healthz" >/dev/null; report "server still healthy" $?
! grep -iE "panic|error" "$WORK/logs/server.err"; report "server stderr has no panic/error" $?

[ $FAILED = 0 ] && echo "all passed (${SECONDS}s; logs in $WORK)" || echo "FAILED (${SECONDS}s; logs in $WORK)"
exit $FAILED
