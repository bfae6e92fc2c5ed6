#!/usr/bin/env bash
# Builds, on a machine without a GPU, what a GPU machine with no Rust toolchain needs to run
# oxrl's GPU tests and benchmarks, into .gpu/ (git-ignored): the `gpu` test binary and the
# `oxrl` binary, built with `--features cuda` in release, stripped and gzipped (candle's PTX
# makes each about 65 MB, 17-19 MB gzipped: the `device` tool carries 64 MiB in all). Then
# prints the command that runs the tests there from the repository root (`run`, `.gpu` carried),
# on candle's primitive graphs and then with OXRL_CUDA_KERNELS=1 on oxrl's kernels.
#
#   scripts/install_cuda.sh && scripts/gpu_bundle.sh
#
# The GPU machine supplies the driver and the CUDA 13 libraries (cuBLAS, cuRAND, NVRTC, the
# runtime): its PyTorch environment's nvidia/cu13/lib, or LIBS=... . The test binary finds the
# fixtures through the path it was built in, so the command links that path to the checkout.
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
gzip -9 .gpu/gpu-tests .gpu/oxrl
ls -la .gpu
cat <<CMD
# On the GPU machine, from the repository root (carry .gpu):
mkdir -p "$(dirname "$PWD")" && { [ -e "$PWD" ] || ln -s "\$PWD" "$PWD"; } && \\
export LD_LIBRARY_PATH="\${LIBS:-\$(python3 -c 'import nvidia,os;print(os.path.join(list(nvidia.__path__)[0],"cu13","lib"))')}" && \\
gunzip -kf .gpu/gpu-tests.gz .gpu/oxrl.gz && nvidia-smi -L && .gpu/gpu-tests --nocapture --test-threads 1 && \\
OXRL_CUDA_KERNELS=1 .gpu/gpu-tests --nocapture --test-threads 1
# Then the benchmarks, each on candle's graphs (0) and on oxrl's kernels (1), alternated:
for r in 1 2; do for k in 0 1; do for dt in f32 bf16; do echo "kernels=\$k dtype=\$dt"; \\
OXRL_CUDA_KERNELS=\$k .gpu/oxrl bench train --device cuda --dtype \$dt --reps 20 && \\
OXRL_CUDA_KERNELS=\$k .gpu/oxrl bench decode --device cuda --dtype \$dt --batch 1,16,64,256; done; done; done
CMD
