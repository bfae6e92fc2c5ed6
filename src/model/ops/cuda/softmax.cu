// Attention softmax p = softmax(scale · x + bias) (see softmax.rs): x [B, G, T, S] as rows of
// S, bias [B, T, S] shared by the G heads. A block per row: max, sum of exponentials, write.
// Backward from (p, g): ds = scale · p · (g − Σ g·p).
#include "common.cuh"

template <typename T>
__device__ void masked_softmax_kernel(const T* x, const T* bias, T* p, long long g, long long t, long long s,
                                      float scale) {
    const long long row = blockIdx.x;
    const long long bi = row / (g * t), ti = row % t;
    const T* xr = x + row * s;
    const T* br = bias + (bi * t + ti) * s;
    float m = -INFINITY;
    for (long long j = threadIdx.x; j < s; j += blockDim.x) m = fmaxf(m, to_f32(xr[j]) * scale + to_f32(br[j]));
    m = block_max(m);
    float sum = 0.0f;
    for (long long j = threadIdx.x; j < s; j += blockDim.x) sum += expf(to_f32(xr[j]) * scale + to_f32(br[j]) - m);
    const float inv = 1.0f / block_sum(sum);
    for (long long j = threadIdx.x; j < s; j += blockDim.x) {
        p[row * s + j] = from_f32<T>(expf(to_f32(xr[j]) * scale + to_f32(br[j]) - m) * inv);
    }
}
#define MASKED_SOFTMAX_PARAMS(T) (const T* x, const T* bias, T* p, long long g, long long t, long long s, float scale)
INSTANTIATE(masked_softmax, MASKED_SOFTMAX_PARAMS, (x, bias, p, g, t, s, scale))

template <typename T>
__device__ void masked_softmax_bwd_kernel(const T* p, const T* g, T* ds, long long s, float scale) {
    const long long row = blockIdx.x;
    float dot = 0.0f;
    for (long long j = threadIdx.x; j < s; j += blockDim.x) dot += to_f32(g[row * s + j]) * to_f32(p[row * s + j]);
    dot = block_sum(dot);
    for (long long j = threadIdx.x; j < s; j += blockDim.x) {
        const long long i = row * s + j;
        ds[i] = from_f32<T>(scale * to_f32(p[i]) * (to_f32(g[i]) - dot));
    }
}
#define MASKED_SOFTMAX_BWD_PARAMS(T) (const T* p, const T* g, T* ds, long long s, float scale)
INSTANTIATE(masked_softmax_bwd, MASKED_SOFTMAX_BWD_PARAMS, (p, g, ds, s, scale))
