// Attention softmax p = softmax(scale · x + bias) (see softmax.rs): x [B, G, T, S] as rows of
// S, bias [B, T, S] shared by the G heads. A warp per row (rows of a few thousand keys are
// short for a block: a block's reductions synchronise its threads twice a row, where a warp's
// shuffles do not synchronise at all, and a block holds as many rows as it has warps): max,
// sum of exponentials, write. Backward from (p, g): ds = scale · p · (g − Σ g·p).
//
// The mixed entry points serve bf16/f16 attention (ops/attention.rs): scores in the inputs'
// dtype X, the bias in f32, the backward's g and ds in X. They compute what the f32 kernels
// compute on the scores cast to f32, and round once: the bits of the casts around the f32
// kernels, without the casts' passes. The forward writes p rounded to X (the weighted sum's
// operand) and each row's max and 1 / sum, not the f32 p: the backward computes p again from
// the scores, the bias and those two numbers, by the same operations, so the same f32 values
// (half the bytes kept for the backward and written by the forward).
#include "common.cuh"

// The row's logit and probability. The product is rounded before the sum (no fused
// multiply-add), so that p is the same number in every kernel that computes it.
__device__ __forceinline__ float logit(float x, float b, float scale) { return __fadd_rn(__fmul_rn(x, scale), b); }
__device__ __forceinline__ float prob(float z, float m, float inv) { return expf(z - m) * inv; }

// The row of this thread's warp (the block's warps take consecutive rows), or -1 past the last.
__device__ __forceinline__ long long warp_row(long long rows) {
    const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    return row < rows ? row : -1;
}

// p for the warp's row, and where `stats` is not null the row's max and 1 / sum there.
template <typename X, typename B, typename P>
__device__ void softmax_rows(const X* x, const B* bias, P* p, float* stats, long long rows, long long g, long long t,
                             long long s, float scale) {
    const long long row = warp_row(rows);
    if (row < 0) return;  // the whole warp: its lanes share the row
    const int lane = threadIdx.x & 31;
    const long long bi = row / (g * t), ti = row % t;
    const X* xr = x + row * s;
    const B* br = bias + (bi * t + ti) * s;
    float m = -INFINITY;
    for (long long j = lane; j < s; j += 32) m = fmaxf(m, logit(to_f32(xr[j]), to_f32(br[j]), scale));
    m = warp_max(m);
    float sum = 0.0f;
    for (long long j = lane; j < s; j += 32) sum += expf(logit(to_f32(xr[j]), to_f32(br[j]), scale) - m);
    const float inv = 1.0f / warp_sum(sum);
    for (long long j = lane; j < s; j += 32) p[row * s + j] = from_f32<P>(prob(logit(to_f32(xr[j]), to_f32(br[j]), scale), m, inv));
    if (stats && lane == 0) {
        stats[2 * row] = m;
        stats[2 * row + 1] = inv;
    }
}

template <typename T>
__device__ void masked_softmax_kernel(const T* x, const T* bias, T* p, long long rows, long long g, long long t,
                                      long long s, float scale) {
    softmax_rows<T, T, T>(x, bias, p, nullptr, rows, g, t, s, scale);
}
#define MASKED_SOFTMAX_PARAMS(T) \
    (const T* x, const T* bias, T* p, long long rows, long long g, long long t, long long s, float scale)
INSTANTIATE(masked_softmax, MASKED_SOFTMAX_PARAMS, (x, bias, p, rows, g, t, s, scale))

// ds for the warp's row `row` from its g and p_at(j), p of key j (read or computed).
template <typename G, typename PAt>
__device__ void softmax_bwd_row(PAt p_at, const G* g, G* ds, long long row, long long s, float scale) {
    const int lane = threadIdx.x & 31;
    float dot = 0.0f;
    for (long long j = lane; j < s; j += 32) dot += to_f32(g[row * s + j]) * p_at(j);
    dot = warp_sum(dot);
    for (long long j = lane; j < s; j += 32) {
        const long long i = row * s + j;
        ds[i] = from_f32<G>(scale * p_at(j) * (to_f32(g[i]) - dot));
    }
}

template <typename P, typename G>
__device__ void softmax_bwd_rows(const P* p, const G* g, G* ds, long long rows, long long s, float scale) {
    const long long row = warp_row(rows);
    if (row < 0) return;
    softmax_bwd_row(
        [&](long long j) { return to_f32(p[row * s + j]); }, g, ds, row, s, scale);
}

template <typename T>
__device__ void masked_softmax_bwd_kernel(const T* p, const T* g, T* ds, long long rows, long long s, float scale) {
    softmax_bwd_rows<T, T>(p, g, ds, rows, s, scale);
}
#define MASKED_SOFTMAX_BWD_PARAMS(T) (const T* p, const T* g, T* ds, long long rows, long long s, float scale)
INSTANTIATE(masked_softmax_bwd, MASKED_SOFTMAX_BWD_PARAMS, (p, g, ds, rows, s, scale))

// Mixed: X scores (bf16 or f16) and f32 bias → p rounded to X and the rows' (max, 1 / sum); the
// backward computes the f32 p again from them, with X gradients.
template <typename T>
__device__ void masked_softmax_mixed_kernel(const T* x, const float* bias, T* px, float* stats, long long rows,
                                            long long g, long long t, long long s, float scale) {
    softmax_rows<T, float, T>(x, bias, px, stats, rows, g, t, s, scale);
}
#define MASKED_SOFTMAX_MIXED_PARAMS(T) \
    (const T* x, const float* bias, T* px, float* stats, long long rows, long long g, long long t, long long s, float scale)
INSTANTIATE(masked_softmax_mixed, MASKED_SOFTMAX_MIXED_PARAMS, (x, bias, px, stats, rows, g, t, s, scale))

template <typename T>
__device__ void masked_softmax_bwd_mixed_kernel(const T* x, const float* bias, const float* stats, const T* g, T* ds,
                                                long long rows, long long heads, long long t, long long s,
                                                float scale) {
    const long long row = warp_row(rows);
    if (row < 0) return;
    const T* xr = x + row * s;
    const float* br = bias + (row / (heads * t) * t + row % t) * s;
    const float m = stats[2 * row], inv = stats[2 * row + 1];
    softmax_bwd_row(
        [&](long long j) { return prob(logit(to_f32(xr[j]), br[j], scale), m, inv); }, g, ds, row, s, scale);
}
#define MASKED_SOFTMAX_BWD_MIXED_PARAMS(T)                                                                     \
    (const T* x, const float* bias, const float* stats, const T* g, T* ds, long long rows, long long heads, \
     long long t, long long s, float scale)
INSTANTIATE(masked_softmax_bwd_mixed, MASKED_SOFTMAX_BWD_MIXED_PARAMS, (x, bias, stats, g, ds, rows, heads, t, s, scale))
