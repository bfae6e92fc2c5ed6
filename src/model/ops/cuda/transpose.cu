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

// x [A, B, C, D] contiguous → out [A, C, B, D] (the heads' transpose, x.transpose(1, 2) written
// out): a thread moves 16 bytes of a D-row at a time where rows and pointers allow (D of 64 bf16
// is eight such chunks: a warp reads and writes whole 128-byte lines), one element otherwise.
struct alignas(16) Chunk16 {
    unsigned int v[4];
};

template <typename T>
__device__ void swap_heads_kernel(const T* x, T* out, long long b, long long c, long long d, long long total) {
    const long long start = (long long)blockIdx.x * blockDim.x + threadIdx.x, stride = (long long)gridDim.x * blockDim.x;
    const long long per = 16 / sizeof(T);
    const bool chunks = d % per == 0 && ((uintptr_t)x | (uintptr_t)out) % 16 == 0;
    const long long w = chunks ? d / per : d;  // units a D-row holds
    for (long long i = start; i < total / (chunks ? per : 1); i += stride) {
        const long long e = i % w, r = i / w;  // r = (a · B + j) · C + k
        const long long k = r % c, j = (r / c) % b, a = r / c / b;
        const long long to = ((a * c + k) * b + j) * w + e;
        if (chunks) {
            ((Chunk16*)out)[to] = ((const Chunk16*)x)[i];
        } else {
            out[to] = x[i];
        }
    }
}
#define SWAP_HEADS_PARAMS(T) (const T* x, T* out, long long b, long long c, long long d, long long total)
INSTANTIATE(swap_heads, SWAP_HEADS_PARAMS, (x, out, b, c, d, total))
