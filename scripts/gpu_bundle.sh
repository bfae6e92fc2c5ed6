#!/usr/bin/env bash
# Builds, on a machine without a GPU, what a GPU machine with no Rust toolchain needs to run
# oxrl's GPU tests and benchmarks, into .gpu/ (git-ignored): the `gpu` test binary and the
# `oxrl` binary, built with `--features cuda` in release, stripped and packed into one
# .gpu/bundle.tar.xz (candle's PTX makes each about 65 MB; the `device` tool carries 64 MiB in
# all), the CUPTI kernel trace (scripts/kernel_trace.c), and the path they were built in (the
# test binary finds the fixtures through it). About 15 minutes on 2 cores from cold, a few after
# a change to oxrl alone.
#
#   scripts/install_cuda.sh && scripts/gpu_bundle.sh
#
# Then, on the GPU machine, from the repository root with .gpu carried, the whole check (the GPU
# suite with oxrl's kernels off and on, the fused ops against their references, the training and
# decoding benchmarks beside PyTorch; a table at the end):
#
#   OUT=<folder> bash scripts/gpu_check.sh
#
# The GPU machine supplies the driver and the CUDA 13 libraries (cuBLAS, cuRAND, NVRTC, the
# runtime): its PyTorch environment's nvidia/cu13/lib, or LIBS=... .
set -euo pipefail
cd "$(dirname "$0")/.."
eval "$(scripts/install_cuda.sh --env)"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target/cuda}"
cargo build --locked --release --features cuda --bin oxrl
test_bin=$(cargo test --locked --release --features cuda --test gpu --no-run --message-format=json \
    | python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "gpu" and m.get("executable"):
        print(m["executable"])')
rm -rf .gpu && mkdir -p .gpu
cp "$test_bin" .gpu/gpu-tests
cp "$CARGO_TARGET_DIR/release/oxrl" .gpu/oxrl
strip .gpu/gpu-tests .gpu/oxrl
# One xz stream: its 64 MiB window holds candle's PTX once for both binaries (37 MB gzipped
# apart, 15 MB together).
tar -C .gpu -cf - gpu-tests oxrl | xz -9e >.gpu/bundle.tar.xz
rm .gpu/gpu-tests .gpu/oxrl
# The kernel trace the GPU check counts and times kernels with (a CUPTI injection library).
cc -shared -fPIC -O2 -I"$CUDA_HOME/include" scripts/kernel_trace.c -L"$CUDA_HOME/lib" -l:libcupti.so.13 \
    -o .gpu/libkernel_trace.so
echo "$PWD" >.gpu/build_root
ls -la .gpu
echo "# On the GPU machine, from the repository root (carry .gpu): OUT=<folder> bash scripts/gpu_check.sh"
