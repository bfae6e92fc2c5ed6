// A matrix's transpose written out (see transpose.rs): x [A, M, N] contiguous → out [A, N, M].
// A block moves one 32 × 32 tile through shared memory: its warps read the tile's rows (32
// consecutive elements each) and write the transposed tile's rows, so that both sides are
// whole memory transactions where an element-wise strided copy reads one row per element.
// Grid: x over N's tiles, y over M's tiles, z over A. The padding column keeps a warp's
// column reads of the tile on 32 different shared-memory banks.
#include "common.cuh"

template <typename T>
__device__ void transpose_kernel(const T* x, T* out, long long m, long long n) {
    __shared__ T tile[32][33];
    const long long base = (long long)blockIdx.z * m * n;
    const long long i0 = (long long)blockIdx.y * 32, j0 = (long long)blockIdx.x * 32;
    const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    for (int r = threadIdx.x >> 5; r < 32; r += warps) {
        const long long i = i0 + r, j = j0 + lane;
        if (i < m && j < n) tile[r][lane] = x[base + i * n + j];
    }
    __syncthreads();
    for (int r = threadIdx.x >> 5; r < 32; r += warps) {
        const long long j = j0 + r, i = i0 + lane;
        if (j < n && i < m) out[base + j * m + i] = tile[lane][r];
    }
}
#define TRANSPOSE_PARAMS(T) (const T* x, T* out, long long m, long long n)
INSTANTIATE(transpose, TRANSPOSE_PARAMS, (x, out, m, n))
