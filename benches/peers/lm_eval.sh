#!/usr/bin/env bash
# lm-evaluation-harness through `oxrl engine` (local-completions) against the same evaluation with
# lm-eval's own `hf` model (transformers + PyTorch), side by side on this machine: the same model,
# the same tasks, wall time of each. Benchmark-only: CI never runs it.
#
#   bash benches/peers/lm_eval.sh                 # results as JSON lines on stdout
#   MC=400 GEN=40 THREADS=2 bash benches/peers/lm_eval.sh
#   SKIP_BUILD=1 bash benches/peers/lm_eval.sh    # use target/release/oxrl as it is
#
# 1. Needs .venv-trl/ (PyTorch, transformers, accelerate: benches/peers/trl_grpo.sh installs it);
#    adds lm-eval (pinned) to it.
# 2. Builds oxrl (release) unless SKIP_BUILD=1; makes the model both evaluate with `oxrl
#    init-model` (qwen3, byte-level tokenizer: hidden 256, 4 layers) in WORK/model.
# 3. Writes two tasks from local files: MC multiple-choice questions of 4 choices (loglikelihood
#    requests: echo + logprobs through the engine) and GEN prompts greedy-decoded for 32 tokens.
# 4. Runs lm-eval with `--model hf` (float32, CPU, batch 16), then with `--model local-completions`
#    against `oxrl --threads THREADS engine` (batches of 16 prompts a request), and prints one JSON
#    line each: wall seconds of the lm-eval process and its metrics.
set -euo pipefail
cd "$(dirname "$0")/../.."
MC=${MC:-200}
GEN=${GEN:-40}
THREADS=${THREADS:-2}
WORK=${WORK:-runs/lm_eval_bench}
VENV=.venv-trl
LM_EVAL=0.4.13

[ -x "$VENV/bin/python" ] || { echo "no $VENV: run benches/peers/trl_grpo.sh once" >&2; exit 1; }
"$VENV/bin/python" -c "import lm_eval, tenacity, tiktoken" 2>/dev/null || "$VENV/bin/pip" install -q "lm-eval[api]==$LM_EVAL"
[ "${SKIP_BUILD:-0}" = 1 ] || cargo build --release -q
OXRL=target/release/oxrl
mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)
[ -f "$WORK/model/config.json" ] || $OXRL init-model --arch qwen3 --hidden 256 --layers 4 --heads 4 --kv-heads 2 \
    --max-position 2048 --seed 1 --out "$WORK/model" >/dev/null

"$VENV/bin/python" - "$WORK" "$MC" "$GEN" <<'EOF'
import json, random, sys
work, mc, gen = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rng = random.Random(0)
words = "the a cat dog sky water blue green red runs jumps is was under over near far big small".split()
def phrase(n):
    return " ".join(rng.choice(words) for _ in range(n))
with open(f"{work}/mc.jsonl", "w") as f:
    for _ in range(mc):
        f.write(json.dumps({"question": phrase(rng.randint(6, 20)), "choices": [phrase(rng.randint(1, 5)) for _ in range(4)],
                            "answer": rng.randint(0, 3)}) + "\n")
with open(f"{work}/gen.jsonl", "w") as f:
    for _ in range(gen):
        f.write(json.dumps({"question": phrase(rng.randint(4, 12)), "answer": phrase(3)}) + "\n")
with open(f"{work}/bench_mc.yaml", "w") as f:
    f.write(f"task: bench_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {work}/mc.jsonl\n"
            "test_split: test\noutput_type: multiple_choice\ndoc_to_text: \"{{question}}\"\n"
            "doc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{answer}}\"\nmetric_list:\n  - metric: acc\n")
with open(f"{work}/bench_gen.yaml", "w") as f:
    f.write(f"task: bench_gen\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {work}/gen.jsonl\n"
            "test_split: test\noutput_type: generate_until\ndoc_to_text: \"{{question}}\"\ndoc_to_target: \"{{answer}}\"\n"
            "generation_kwargs:\n  until: [\"\\n\\n\"]\n  max_gen_toks: 32\n  do_sample: false\n"
            "metric_list:\n  - metric: exact_match\n")
EOF

export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HOME="$WORK/hf"
run_lm_eval() { # NAME MODEL MODEL_ARGS [lm-eval options]
    local start end
    start=$(date +%s.%N)
    "$VENV/bin/python" -m lm_eval run --model "$2" --model_args "$3" --batch_size 16 --tasks bench_mc,bench_gen \
        --include_path "$WORK" --output_path "$WORK/out_$1" "${@:4}" >"$WORK/$1.log" 2>&1
    end=$(date +%s.%N)
    local results
    results=$(ls -t "$WORK"/out_"$1"/*/results_*.json | head -1)
    "$VENV/bin/python" -c "import json,sys; r=json.load(open(sys.argv[1]))['results']; print(json.dumps({'framework': sys.argv[2], 'wall_s': round(float(sys.argv[3]), 2), 'acc': r['bench_mc']['acc,none'], 'exact_match': r['bench_gen']['exact_match,none'], 'mc_docs': $MC, 'gen_docs': $GEN, 'threads': $THREADS}))" \
        "$results" "$1" "$(echo "$end - $start" | bc)"
}
OMP_NUM_THREADS=$THREADS run_lm_eval hf hf "pretrained=$WORK/model,dtype=float32" --device cpu
$OXRL --threads "$THREADS" engine --model "$WORK/model" --listen 127.0.0.1:0 2>"$WORK/engine.log" &
ENGINE=$!
trap 'kill $ENGINE 2>/dev/null' EXIT
until grep -q "listening on" "$WORK/engine.log"; do sleep 0.2; done
URL=$(grep -o "http://[^ ]*" "$WORK/engine.log" | head -1)
run_lm_eval oxrl_engine local-completions \
    "base_url=$URL/v1/completions,model=model,tokenizer=$WORK/model,tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,max_retries=1"
