// Attention softmax p = softmax(scale · x + bias) (see softmax.rs): x [B, G, T, S] as rows of
// S, bias [B, T, S] shared by the G heads. A warp per row (rows of a few thousand keys are
// short for a block: a block's reductions synchronise its threads twice a row, where a warp's
// shuffles do not synchronise at all, and a block holds as many rows as it has warps): max,
// sum of exponentials, write. Backward from (p, g): ds = scale · p · (g − Σ g·p).
//
// The mixed entry points serve bf16/f16 attention (ops/attention.rs): scores in the inputs'
// dtype X, the bias and p in f32, the backward's g and ds in X. They compute what the f32
// kernels compute on the scores cast to f32, and round ds once: the bits of the casts around
// the f32 kernels, without the casts' passes. The forward also writes p rounded to X (the
// weighted sum's operand), which a cast of the f32 p would make in a pass of its own.
#include "common.cuh"

// The row of this thread's warp (the block's warps take consecutive rows), or -1 past the last.
__device__ __forceinline__ long long warp_row(long long rows) {
    const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    return row < rows ? row : -1;
}

// p (and, where px is not null, p rounded to X) for the warp's row.
template <typename X, typename B, typename P>
__device__ void softmax_rows(const X* x, const B* bias, P* p, X* px, long long rows, long long g, long long t,
                             long long s, float scale) {
    const long long row = warp_row(rows);
    if (row < 0) return;  // the whole warp: its lanes share the row
    const int lane = threadIdx.x & 31;
    const long long bi = row / (g * t), ti = row % t;
    const X* xr = x + row * s;
    const B* br = bias + (bi * t + ti) * s;
    float m = -INFINITY;
    for (long long j = lane; j < s; j += 32) m = fmaxf(m, to_f32(xr[j]) * scale + to_f32(br[j]));
    m = warp_max(m);
    float sum = 0.0f;
    for (long long j = lane; j < s; j += 32) sum += expf(to_f32(xr[j]) * scale + to_f32(br[j]) - m);
    const float inv = 1.0f / warp_sum(sum);
    for (long long j = lane; j < s; j += 32) {
        const float v = expf(to_f32(xr[j]) * scale + to_f32(br[j]) - m) * inv;
        p[row * s + j] = from_f32<P>(v);
        if (px) px[row * s + j] = from_f32<X>(v);
    }
}

template <typename T>
__device__ void masked_softmax_kernel(const T* x, const T* bias, T* p, long long rows, long long g, long long t,
                                      long long s, float scale) {
    softmax_rows<T, T, T>(x, bias, p, (T*)nullptr, rows, g, t, s, scale);
}
#define MASKED_SOFTMAX_PARAMS(T) \
    (const T* x, const T* bias, T* p, long long rows, long long g, long long t, long long s, float scale)
INSTANTIATE(masked_softmax, MASKED_SOFTMAX_PARAMS, (x, bias, p, rows, g, t, s, scale))

template <typename P, typename G>
__device__ void softmax_bwd_rows(const P* p, const G* g, G* ds, long long rows, long long s, float scale) {
    const long long row = warp_row(rows);
    if (row < 0) return;
    const int lane = threadIdx.x & 31;
    float dot = 0.0f;
    for (long long j = lane; j < s; j += 32) dot += to_f32(g[row * s + j]) * to_f32(p[row * s + j]);
    dot = warp_sum(dot);
    for (long long j = lane; j < s; j += 32) {
        const long long i = row * s + j;
        ds[i] = from_f32<G>(scale * to_f32(p[i]) * (to_f32(g[i]) - dot));
    }
}

template <typename T>
__device__ void masked_softmax_bwd_kernel(const T* p, const T* g, T* ds, long long rows, long long s, float scale) {
    softmax_bwd_rows<T, T>(p, g, ds, rows, s, scale);
}
#define MASKED_SOFTMAX_BWD_PARAMS(T) (const T* p, const T* g, T* ds, long long rows, long long s, float scale)
INSTANTIATE(masked_softmax_bwd, MASKED_SOFTMAX_BWD_PARAMS, (p, g, ds, rows, s, scale))

// Mixed: X scores (bf16 or f16), f32 bias and p, p also as X; f32 p with X gradients.
template <typename T>
__device__ void masked_softmax_mixed_kernel(const T* x, const float* bias, float* p, T* px, long long rows,
                                            long long g, long long t, long long s, float scale) {
    softmax_rows<T, float, float>(x, bias, p, px, rows, g, t, s, scale);
}
#define MASKED_SOFTMAX_MIXED_PARAMS(T) \
    (const T* x, const float* bias, float* p, T* px, long long rows, long long g, long long t, long long s, float scale)
INSTANTIATE(masked_softmax_mixed, MASKED_SOFTMAX_MIXED_PARAMS, (x, bias, p, px, rows, g, t, s, scale))

template <typename T>
__device__ void masked_softmax_bwd_mixed_kernel(const float* p, const T* g, T* ds, long long rows, long long s,
                                                float scale) {
    softmax_bwd_rows<float, T>(p, g, ds, rows, s, scale);
}
#define MASKED_SOFTMAX_BWD_MIXED_PARAMS(T) (const float* p, const T* g, T* ds, long long rows, long long s, float scale)
INSTANTIATE(masked_softmax_bwd_mixed, MASKED_SOFTMAX_BWD_MIXED_PARAMS, (p, g, ds, rows, s, scale))
