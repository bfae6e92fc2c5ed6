// Attention softmax p = softmax(scale · x + bias) (see softmax.rs): x [B, G, T, S] as rows of
// S, bias [B, T, S] shared by the G heads. A block per row: max, sum of exponentials, write.
// Backward from (p, g): ds = scale · p · (g − Σ g·p).
//
// The mixed entry points serve bf16/f16 attention (ops/attention.rs): scores in the inputs'
// dtype X, the bias and p in f32, the backward's g and ds in X. They compute what the f32
// kernels compute on the scores cast to f32, and round ds once: the bits of the casts around
// the f32 kernels, without the casts' passes.
#include "common.cuh"

template <typename X, typename B, typename P>
__device__ void softmax_rows(const X* x, const B* bias, P* p, long long g, long long t, long long s, float scale) {
    const long long row = blockIdx.x;
    const long long bi = row / (g * t), ti = row % t;
    const X* xr = x + row * s;
    const B* br = bias + (bi * t + ti) * s;
    float m = -INFINITY;
    for (long long j = threadIdx.x; j < s; j += blockDim.x) m = fmaxf(m, to_f32(xr[j]) * scale + to_f32(br[j]));
    m = block_max(m);
    float sum = 0.0f;
    for (long long j = threadIdx.x; j < s; j += blockDim.x) sum += expf(to_f32(xr[j]) * scale + to_f32(br[j]) - m);
    const float inv = 1.0f / block_sum(sum);
    for (long long j = threadIdx.x; j < s; j += blockDim.x) {
        p[row * s + j] = from_f32<P>(expf(to_f32(xr[j]) * scale + to_f32(br[j]) - m) * inv);
    }
}

template <typename T>
__device__ void masked_softmax_kernel(const T* x, const T* bias, T* p, long long g, long long t, long long s,
                                      float scale) {
    softmax_rows<T, T, T>(x, bias, p, g, t, s, scale);
}
#define MASKED_SOFTMAX_PARAMS(T) (const T* x, const T* bias, T* p, long long g, long long t, long long s, float scale)
INSTANTIATE(masked_softmax, MASKED_SOFTMAX_PARAMS, (x, bias, p, g, t, s, scale))

template <typename P, typename G>
__device__ void softmax_bwd_rows(const P* p, const G* g, G* ds, long long s, float scale) {
    const long long row = blockIdx.x;
    float dot = 0.0f;
    for (long long j = threadIdx.x; j < s; j += blockDim.x) dot += to_f32(g[row * s + j]) * to_f32(p[row * s + j]);
    dot = block_sum(dot);
    for (long long j = threadIdx.x; j < s; j += blockDim.x) {
        const long long i = row * s + j;
        ds[i] = from_f32<G>(scale * to_f32(p[i]) * (to_f32(g[i]) - dot));
    }
}

template <typename T>
__device__ void masked_softmax_bwd_kernel(const T* p, const T* g, T* ds, long long s, float scale) {
    softmax_bwd_rows<T, T>(p, g, ds, s, scale);
}
#define MASKED_SOFTMAX_BWD_PARAMS(T) (const T* p, const T* g, T* ds, long long s, float scale)
INSTANTIATE(masked_softmax_bwd, MASKED_SOFTMAX_BWD_PARAMS, (p, g, ds, s, scale))

// Mixed: X scores (bf16 or f16), f32 bias and p; f32 p with X gradients.
template <typename T>
__device__ void masked_softmax_mixed_kernel(const T* x, const float* bias, float* p, long long g, long long t,
                                            long long s, float scale) {
    softmax_rows<T, float, float>(x, bias, p, g, t, s, scale);
}
#define MASKED_SOFTMAX_MIXED_PARAMS(T) \
    (const T* x, const float* bias, float* p, long long g, long long t, long long s, float scale)
INSTANTIATE(masked_softmax_mixed, MASKED_SOFTMAX_MIXED_PARAMS, (x, bias, p, g, t, s, scale))

template <typename T>
__device__ void masked_softmax_bwd_mixed_kernel(const float* p, const T* g, T* ds, long long s, float scale) {
    softmax_bwd_rows<float, T>(p, g, ds, s, scale);
}
#define MASKED_SOFTMAX_BWD_MIXED_PARAMS(T) (const float* p, const T* g, T* ds, long long s, float scale)
INSTANTIATE(masked_softmax_bwd_mixed, MASKED_SOFTMAX_BWD_MIXED_PARAMS, (p, g, ds, s, scale))
