#!/usr/bin/env bash
# Installs what `cargo build --features cuda` needs, from PyPI, into .cuda/ (git-ignored), and
# prints the environment variables to export. No GPU and no system CUDA toolkit are needed to
# build; the machine that runs the binary needs an NVIDIA driver and the CUDA 13 libraries.
#
#   scripts/install_cuda.sh            # then: eval "$(scripts/install_cuda.sh --env)"
#   cargo build --release --features cuda
#
# What it installs (CUDA 13.0, pinned: the PTX that nvcc writes must not be newer than what the
# driver can JIT; driver 580 is CUDA 13.0):
#   nvidia-cuda-nvcc, nvidia-nvvm (cicc), nvidia-cuda-crt, nvidia-cuda-runtime, nvidia-cuda-cccl:
#     nvcc and the headers, for candle-kernels' .cu files;
#   nvidia-cublas, nvidia-curand, nvidia-cuda-nvrtc: the libraries candle links (cudarc is built
#     with `dynamic-linking` by candle-core, so they must be present at link time);
#   nvidia-cuda-cupti: CUPTI, for the kernel trace of the GPU check (scripts/kernel_trace.c).
# libcuda.so comes with the driver, not with a wheel: a stub of it (no code, the symbols only,
# SONAME libcuda.so.1) is compiled into lib/stubs so that linking works on a machine without a
# driver; at run time the driver's libcuda.so.1 is the one loaded (every entry point of the stub
# returns CUDA_ERROR_NO_DEVICE).
#
# Environment: CUDA_COMPUTE_CAP (default 90, the H100/H200) is the architecture the kernels are
# compiled for; PYTHON (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"
ROOT_DIR="$REPO/.cuda"
PKGS="$ROOT_DIR/pkgs"
CUDA="$PKGS/nvidia/cu13"
CAP="${CUDA_COMPUTE_CAP:-90}"

print_env() {
    echo "export CUDA_HOME=\"$CUDA\""
    echo "export CUDA_ROOT=\"$CUDA\""
    echo "export CUDA_PATH=\"$CUDA\""
    echo "export NVCC=\"$CUDA/bin/nvcc\""
    echo "export PATH=\"$CUDA/bin:\$PATH\""
    echo "export CUDA_COMPUTE_CAP=\"$CAP\""
    echo "# to run here (a machine with a driver), the libraries:"
    echo "export LD_LIBRARY_PATH=\"$CUDA/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}\""
}

if [[ "${1:-}" == "--env" ]]; then
    print_env
    exit 0
fi

PY="${PYTHON:-python3}"
mkdir -p "$ROOT_DIR"
if [[ ! -x "$CUDA/bin/nvcc" || ! -e "$CUDA/lib/libcublasLt.so.13" || ! -e "$CUDA/lib/libcupti.so.13" ]]; then
    "$PY" -m pip install --quiet --no-deps --only-binary=:all: --upgrade --target "$PKGS" \
        "nvidia-cuda-nvcc==13.0.*" "nvidia-nvvm==13.0.*" "nvidia-cuda-crt==13.0.*" \
        "nvidia-cuda-runtime==13.0.*" "nvidia-cuda-cccl==13.0.*" "nvidia-cuda-nvrtc==13.0.*" \
        "nvidia-cublas==13.0.*" "nvidia-curand==10.4.*" "nvidia-cuda-cupti==13.0.*"
fi

# The layout of a toolkit: unversioned names for the linker, targets/<arch> for nvcc.profile.
cd "$CUDA/lib"
for l in libcublas.so.13 libcublasLt.so.13 libnvrtc.so.13 libcurand.so.10 libcudart.so.13; do
    ln -sf "$l" "${l%%.so.*}.so"
done
mkdir -p "$CUDA/targets"
ln -sfn .. "$CUDA/targets/x86_64-linux"

# The libcuda stub: every driver entry point that cudarc declares, as an empty function.
mkdir -p "$CUDA/lib/stubs"
if [[ ! -e "$CUDA/lib/stubs/libcuda.so" ]]; then
    CUDARC_SYS=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cudarc-0.19.*/src/driver/sys/mod.rs 2>/dev/null | tail -1 || true)
    if [[ -z "$CUDARC_SYS" ]]; then
        (cd "$REPO" && cargo fetch --locked >/dev/null)
        CUDARC_SYS=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cudarc-0.19.*/src/driver/sys/mod.rs | tail -1)
    fi
    stub_c="$ROOT_DIR/libcuda_stub.c"
    {
        grep -oE '^\s+fn cu[A-Za-z0-9_]+\(' "$CUDARC_SYS" | sed -E 's/^\s+fn (cu[A-Za-z0-9_]+)\(/\1/'
    } | sort -u | sed -E 's/(.*)/int \1(void) { return 100; }/' >"$stub_c"
    cc -shared -fPIC -o "$CUDA/lib/stubs/libcuda.so" -Wl,-soname,libcuda.so.1 "$stub_c"
    # Only for running a CUDA build where no driver is installed (every call fails with
    # CUDA_ERROR_NO_DEVICE, so the GPU tests skip): LD_LIBRARY_PATH=$CUDA/lib/stubs.
    ln -sf libcuda.so "$CUDA/lib/stubs/libcuda.so.1"
fi

"$CUDA/bin/nvcc" --version | tail -2 >&2
echo "# CUDA 13.0 is installed in $CUDA. Export:" >&2
print_env
