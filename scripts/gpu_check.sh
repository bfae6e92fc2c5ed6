#!/usr/bin/env bash
# The whole GPU check in one command, for a GPU machine without Rust: run from the repository
# root with .gpu/ (scripts/gpu_bundle.sh) beside it. In about 5-8 minutes:
#   1. the card's bf16 matrix rate (PyTorch, 8192^3 on random data): the MFU's denominator;
#   2. the GPU suite (tests/gpu.rs) with oxrl's CUDA kernels off, then on; the fused-op test
#      (every kernel against its reference graph, values and gradients, f32/bf16/f16) first and
#      alone, then flash attention's tests alone, so that a kernel that faults cannot take the
#      other tests' context with it (flash attention failing its tests turns it off for the
#      benchmarks that follow, in this run and later ones on the machine);
#   3. the training step of Qwen2.5-0.5B's shape (`oxrl init-model`) in bf16 on 8 x 1024 tokens,
#      kernels off / on / on with the unfused attention node (no flash attention) / on with
#      upstream candle's backward / PyTorch eager with autocast,
#      alternated for ROUNDS rounds;
#   4. decoding at 1 / 16 / 64 / 256 concurrent requests, kernels off / on / transformers'
#      generate, alternated for ROUNDS rounds;
#   (cli) `oxrl sft`, `generate` and `bench train` run to their exit, timed (cli.txt);
#   5. kernel launches per decode step, counted by the kernel trace (scripts/kernel_trace.c),
#      and their device time;
#   6. (profile) one training step's kernels by device time, against its wall time;
# then prints the table (the last lines of stdout). Every step has its own time limit, so one
# that hangs costs its limit and not the lease.
#
#   OUT=dir ROUNDS=2 bash scripts/gpu_check.sh     # OUT: where the logs go (default runs/gpu_check)
#   STEPS="launches profile" bash scripts/gpu_check.sh   # only some steps (default: all)
#   KERNELS=1 bash scripts/gpu_check.sh   # oxrl's kernels on only (default "0 1": off, then on)
#
# STEPS names: tests, train, decode, cli, launches, profile.
#
# Files in OUT: summary.md (the table), results.jsonl (every measurement), tests_off.log,
# tests_on.log, bench.log (the benchmarks' stderr), launches.txt, profile.txt (and the traced step's
# kernels, train_2.tsv.xz), setup.log, hangs.log (where a process that would not exit waited).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_check}
ROUNDS=${ROUNDS:-2}
STEPS=" ${STEPS:-tests train decode cli launches profile} "
KERNELS=${KERNELS:-0 1}
want() { [[ $STEPS == *" $1 "* ]]; }
mkdir -p "$OUT"
RESULTS="$OUT/results.jsonl"
: >"$RESULTS"
T0=$(date +%s)
since() { echo "$(($(date +%s) - T0)) s"; }

# The test binary finds the fixtures through the path it was built in.
build_root=$(cat .gpu/build_root 2>/dev/null || echo /work/main)
if [ ! -e "$build_root" ]; then mkdir -p "$(dirname "$build_root")" && ln -s "$PWD" "$build_root"; fi
export LD_LIBRARY_PATH="${LIBS:-$(python3 -c 'import nvidia,os;print(os.path.join(list(nvidia.__path__)[0],"cu13","lib"))')}"
{
    python3 -c 'import tarfile; tarfile.open(".gpu/bundle.tar.xz").extractall(".gpu")'
    chmod +x .gpu/gpu-tests .gpu/oxrl
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
    echo "build root $build_root -> $(readlink -f "$build_root")"
} >"$OUT/setup.log" 2>&1
OXRL=.gpu/oxrl
[ -x $OXRL ] && [ -x .gpu/gpu-tests ] || { cat "$OUT/setup.log"; echo "no binaries in .gpu: run scripts/gpu_bundle.sh"; exit 1; }
# Nothing outside the machine is reachable: transformers must not look for a Hub.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# Every oxrl command says when it has returned and starts to exit (bench.log): a process that
# then does not exit hangs in the exit itself.
export OXRL_TRACE_EXIT=1
# Flash attention that failed its GPU tests (in this or an earlier run on the machine) stays off
# for the benchmarks: they measure nothing wrong.
FLASH_OFF=/tmp/oxrl_flash_attention_failed
[ -e $FLASH_OFF ] && export OXRL_FLASH_ATTENTION=0
PEERS="python3 benches/peers/gpu_peers.py"
echo "[$(since)] setup done: $(head -2 "$OUT/setup.log" | tail -1)"

# 1. The card's matrix rate.
if want train; then
    timeout -k 5 60 $PEERS matmul >>"$RESULTS" 2>>"$OUT/bench.log" || echo "matmul rate failed"
    echo "[$(since)] matmul rate: $(grep -o '"tflops": [0-9.]*' "$RESULTS" | tail -1)"
fi

# 2. The GPU suite, kernels off then on.
want tests && for k in $KERNELS; do
    log="$OUT/tests_$([ $k = 1 ] && echo on || echo off).log"
    : >"$log"
    OXRL_CUDA_KERNELS=$k timeout -k 5 90 .gpu/gpu-tests --nocapture --test-threads 1 --exact \
        fused_ops_on_cuda_equal_their_reference_graphs >>"$log" 2>&1
    # Flash attention's tests alone too: a fault there leaves the others' context alone.
    : >/tmp/flash_tests.log
    OXRL_CUDA_KERNELS=$k timeout -k 5 90 .gpu/gpu-tests --nocapture --test-threads 1 flash_attention \
        >/tmp/flash_tests.log 2>&1
    cat /tmp/flash_tests.log >>"$log"
    if ! grep -q '^test result: ok' /tmp/flash_tests.log; then
        touch $FLASH_OFF
        export OXRL_FLASH_ATTENTION=0
        echo "[$(since)] flash attention failed its tests: the benchmarks run without it"
    fi
    OXRL_CUDA_KERNELS=$k timeout -k 5 180 .gpu/gpu-tests --nocapture --test-threads 1 \
        --skip fused_ops_on_cuda_equal_their_reference_graphs --skip flash_attention >>"$log" 2>&1
    echo "[$(since)] tests kernels=$k: $(grep -h '^test result' "$log" | tr '\n' ' ')"
done

# 3-4. The benchmarks on Qwen2.5-0.5B's shape.
MODEL=runs/gpu_q05b
if { want train || want decode || want launches || want profile || want cli; } && [ ! -e "$MODEL/config.json" ]; then
    $OXRL init-model --arch qwen2 --hidden 896 --layers 24 --heads 14 --kv-heads 2 --intermediate 4864 \
        --vocab 151936 --tie --max-position 32768 --rope-theta 1000000 --dtype bf16 --out "$MODEL" \
        >>"$OUT/bench.log" 2>&1 || echo "init-model failed"
fi
# limited LIMIT STDOUT COMMAND...: runs COMMAND for at most LIMIT seconds, its stdout into the
# file STDOUT, its stderr into bench.log. Once it has printed a result it has EXIT_GRACE seconds
# from its last output line to print the next or exit; a teardown that hangs costs that, not
# the limit (and is reported).
EXIT_GRACE=${EXIT_GRACE:-60}
limited() {
    local limit=$1 stdout=$2 ticks=0 size=0
    shift 2
    timeout -k 5 "$limit" "$@" >"$stdout" 2>>"$OUT/bench.log" &
    local pid=$!
    while kill -0 $pid 2>/dev/null; do
        if [ -s "$stdout" ]; then
            local now
            now=$(stat -c %s "$stdout")
            if [ "$now" != "$size" ]; then size=$now ticks=0; fi
            ticks=$((ticks + 1))
            if [ $ticks -gt $((EXIT_GRACE * 5)) ]; then
                echo "[$(since)] $(basename "$1") printed a result but neither another nor its exit in ${EXIT_GRACE} s: killed" \
                    | tee -a "$OUT/bench.log"
                hang_report $pid "$*"
                pkill -KILL -P $pid
                kill -KILL $pid 2>/dev/null
                break
            fi
        fi
        sleep 0.2
    done
    wait $pid
}
# Where a process that will not exit waits (into hangs.log): each thread's name, state and kernel
# wait channel, and, where cuda-gdb is installed, every thread's stack (a stripped binary shows
# the libraries' frames: libc's exit, the CUDA driver).
hang_report() { # pid (of the command or a parent: its deepest first child is reported), what
    local pid=$1 child
    while child=$(pgrep -P "$pid" | head -1) && [ -n "$child" ]; do pid=$child; done
    [ -d "/proc/$pid" ] || return 0
    {
        echo "== $2 (pid $pid), $(date -u +%T)"
        # tid, name, state, wait channel, and the system call it is in ("running": none).
        for t in /proc/$pid/task/*; do
            echo "$(basename "$t") $(cat "$t/comm") $(awk '{print $3}' "$t/stat") $(cat "$t/wchan" 2>/dev/null)" \
                "$(cut -d' ' -f1 "$t/syscall" 2>/dev/null)"
        done
        # Whether the GPU is still busy (a kernel that never ends) or idle (a host-side hang).
        nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
        command -v cuda-gdb >/dev/null && timeout -k 2 30 cuda-gdb -p "$pid" -batch -ex "info threads" \
            -ex "thread apply all bt 12" 2>&1 | grep -v -E '^(\[New|Reading|Loaded|warning)' | head -200
    } >>"$OUT/hangs.log" 2>&1
}
bench() { # what, limit, command...
    local what=$1 limit=$2
    shift 2
    echo "== $what" >>"$OUT/bench.log"
    limited "$limit" /tmp/bench_out "$@" || echo "[$(since)] $what failed (rc $?)"
    cat /tmp/bench_out >>"$RESULTS"
}
want train && for r in $(seq "$ROUNDS"); do
    for k in $KERNELS; do
        OXRL_CUDA_KERNELS=$k bench "oxrl train k=$k" 120 $OXRL bench train --model "$MODEL" --device cuda \
            --dtype bf16 --batch 8 --seq 1024 --warmup 2 --reps 5
    done
    # Kernels on with the unfused attention node instead of flash attention.
    OXRL_FLASH_ATTENTION=0 bench "oxrl train unfused attention" 120 $OXRL bench train --model "$MODEL" \
        --device cuda --dtype bf16 --batch 8 --seq 1024 --warmup 2 --reps 5
    # The same with candle's backward as upstream has it (vendor/candle-core's changes undone).
    OXRL_CANDLE_ZERO_FIRST=1 bench "oxrl train upstream backward" 120 $OXRL bench train --model "$MODEL" \
        --device cuda --dtype bf16 --batch 8 --seq 1024 --warmup 2 --reps 5
    bench "pytorch train" 120 $PEERS train --model "$MODEL" --batch 8 --seq 1024 --warmup 2 --reps 5
    echo "[$(since)] train round $r done"
done
want decode && for r in $(seq "$ROUNDS"); do
    for k in $KERNELS; do
        OXRL_CUDA_KERNELS=$k bench "oxrl decode k=$k" 150 $OXRL bench decode --model "$MODEL" --device cuda \
            --dtype bf16 --batch 1,16,64,256 --prompt 16 --new-tokens 32 --warmup 1 --reps 3
    done
    bench "generate" 150 $PEERS decode --model "$MODEL" --batch 1,16,64,256 --warmup 1 --reps 3
    echo "[$(since)] decode round $r done"
done

# The command line on the GPU, each command timed from its start to its exit (cli.txt): a tiny
# model's SFT run through `oxrl sft`, generation, and `bench train` of one and of two steps
# untraced. A process that does not exit within 20 s of its last output is reported (hangs.log).
: >"$OUT/cli.txt"
if want cli; then
    cli() { # what, limit, command...
        local what=$1 limit=$2 start rc
        shift 2
        start=$(date +%s.%N)
        echo "== $what" >>"$OUT/bench.log"
        EXIT_GRACE=20 limited "$limit" /tmp/cli_out "$@"
        rc=$?
        echo "$what: rc $rc, $(python3 -c "import time; print(f'{time.time() - $start:.1f}')") s from start to exit;" \
            "$(tail -c 300 /tmp/cli_out | tr '\n' ' ' | tail -c 160)" >>"$OUT/cli.txt"
    }
    TINY=runs/gpu_tiny
    [ -e "$TINY/config.json" ] || $OXRL init-model --arch qwen3 --hidden 128 --layers 2 --heads 4 --kv-heads 2 \
        --out "$TINY" >>"$OUT/bench.log" 2>&1
    cli "oxrl sft (tiny, 1 epoch)" 120 $OXRL sft --config examples/sft_tiny.toml --set "model.path=\"$PWD/$TINY\"" \
        --set 'model.device="cuda"' --set train.data_parallel=1 --set train.epochs=1 \
        --set "output.run_dir=\"$PWD/runs/gpu_sft\""
    cli "oxrl generate" 60 $OXRL generate --model tests/fixtures/hf/qwen3 --device cuda --prompt "what is 12 plus 30?" \
        --max-tokens 12 --temperature 0
    for n in 1 2; do
        cli "oxrl bench train, $n steps" 120 $OXRL bench train --model "$MODEL" --device cuda --dtype bf16 --batch 8 \
            --seq 1024 --warmup 0 --reps $n
    done
    echo "[$(since)] command line done"
fi

# 5-6. The kernel trace (scripts/kernel_trace.c: every kernel a process runs, with its device
#    time, at the program's own speed) of one command, into a file.
TRACE="$PWD/.gpu/libkernel_trace.so"
traced() { # trace file, time limit, command...
    local file=$1 limit=$2
    shift 2
    # The trace reaches its file every half second: a traced process that hangs at its exit
    # (CUPTI's teardown) is given 5 s.
    CUDA_INJECTION64_PATH="$TRACE" OXRL_KERNEL_TRACE="$file" EXIT_GRACE=5 limited "$limit" /tmp/traced_out "$@"
    local rc=$?
    cat /tmp/traced_out
    return $rc
}
kernels() { grep -vc '^#' "$1" 2>/dev/null || true; }
device_ms() { awk -F'\t' '!/^#/ { t += $3 - $2 } END { printf "%.3f", t / 1e6 }' "$1" 2>/dev/null || echo 0; }

# 5. Kernel launches per decode step: runs of 2 and 6 new tokens differ by four decode steps.
: >"$OUT/launches.txt"
if want launches && [ -e "$TRACE" ]; then
    for b in 1 64 256; do
        for n in 2 6; do
            traced "/tmp/trace_${b}_$n.tsv" 90 $OXRL bench decode --model "$MODEL" --device cuda --dtype bf16 \
                --batch "$b" --new-tokens "$n" --warmup 0 --reps 1 >/dev/null
        done
        c2=$(kernels "/tmp/trace_${b}_2.tsv") c6=$(kernels "/tmp/trace_${b}_6.tsv")
        d2=$(device_ms "/tmp/trace_${b}_2.tsv") d6=$(device_ms "/tmp/trace_${b}_6.tsv")
        echo "decode, $b requests: ${c2:-?} kernels for 2 new tokens, ${c6:-?} for 6:" \
            "$(((${c6:-0} - ${c2:-0}) / 4)) a decode step, $(python3 -c "print(f'{($d6 - $d2) / 4:.2f}')") ms of device time" \
            >>"$OUT/launches.txt"
    done
    echo "[$(since)] launches counted"
fi

# 6. Where a training step's time goes: traces of 1 and 2 steps (no warm-up); their difference
#    is one step's kernels, each kernel's device time summed by name, against the step's wall time.
: >"$OUT/profile.txt"
if want profile && [ -e "$TRACE" ]; then
    for n in 1 2; do
        start=$(date +%s.%N)
        traced "/tmp/train_$n.tsv" 150 $OXRL bench train --model "$MODEL" --device cuda --dtype bf16 --batch 8 \
            --seq 1024 --warmup 0 --reps "$n" >"/tmp/train_$n.json"
        echo "bench train --reps $n: rc $?, $(python3 -c "import time; print(f'{time.time() - $start:.1f}')") s" \
            "from start to exit; $(grep -o '"median_ms":[0-9.]*' "/tmp/train_$n.json")" >>"$OUT/profile.txt"
    done
    python3 - /tmp/train_1.tsv /tmp/train_2.tsv >>"$OUT/profile.txt" <<'PY'
import collections, sys
def load(path):
    by = collections.defaultdict(lambda: [0, 0.0])
    for line in open(path):
        name, start, end = line.rstrip("\n").split("\t")
        if not name.startswith("#"):
            k = by[name.split("(")[0][:70]]
            k[0] += 1
            k[1] += (int(end) - int(start)) / 1e3
    return by
one, two = load(sys.argv[1]), load(sys.argv[2])
step = {k: [two[k][0] - one.get(k, [0, 0.0])[0], two[k][1] - one.get(k, [0, 0.0])[1]] for k in two}
total = sum(v[1] for v in step.values())
print(f"one training step (8 x 1024, bf16): {sum(v[0] for v in step.values())} kernels, {total / 1e3:.1f} ms of device time; the largest:")
for name, (n, us) in sorted(step.items(), key=lambda x: -x[1][1])[:40]:
    print(f"  {us / 1e3:8.2f} ms {n:6d}x {name}")
PY
    xz -c /tmp/train_2.tsv >"$OUT/train_2.tsv.xz" 2>/dev/null
    echo "[$(since)] profile done"
fi

{
    echo "# GPU check, $(head -2 "$OUT/setup.log" | tail -1), $(date -u +%FT%TZ), $(since)"
    for k in off on; do
        [ -s "$OUT/tests_$k.log" ] || continue
        echo "tests kernels $k: $(grep -h '^test result' "$OUT/tests_$k.log" | tr '\n' ' ')"
        grep -h -E '^test .* FAILED|panicked' "$OUT/tests_$k.log" | head -5
    done
    [ -s "$OUT/tests_on.log" ] && echo "fused ops (kernel vs reference, worst per op and dtype):"
    [ -s "$OUT/tests_on.log" ] && grep -h 'max relative difference' "$OUT/tests_on.log" \
        | sed -E 's/^test [^ ]+ \.\.\. //; s/: (values|gradient [0-9]+) max relative difference/:/; s/ d=[0-9]+: max relative difference/:/' \
        | awk -F': ' '{ if (!($1 in w) || $2 + 0 > w[$1] + 0) w[$1] = $2 } END { for (k in w) printf "  %s %s\n", k, w[k] }' \
        | sort
    cat "$OUT/cli.txt" "$OUT/launches.txt" "$OUT/profile.txt"
    python3 benches/peers/gpu_peers.py table "$RESULTS"
} >"$OUT/summary.md" 2>&1
cat "$OUT/summary.md"
