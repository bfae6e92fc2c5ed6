// Log-softmax + gather of the target (see logprob_lse.rs). A block per row of v logits:
//   forward:  m = max z, lse = m + ln Σ exp(z − m), out[row] = (z_y − lse, lse)
//             (a target outside the vocabulary gives NaN: the host checks targets first);
//   backward: dz = p · (g_lse − g_lp) + g_lp · onehot(y), p = exp(z − lse), from
//             rg[row] = (lp, lse, g_lp, g_lse).
#include "common.cuh"

// The rows' logits are z · scale (scale = 1 / temperature; 1 leaves them as they are, exactly),
// rounded before any sum: the chain scales in a pass of its own, so a product fused into the
// next addition (an FMA, which nvcc forms by default) would round once where the chain rounds twice.
__device__ __forceinline__ float scaled(float z, float scale) { return __fmul_rn(z, scale); }

template <typename T, typename O>
__device__ void logprob_lse_rows(const T* z, const unsigned int* y, O* out, long long v, float scale) {
    const long long row = blockIdx.x;
    const T* zr = z + row * v;
    float m = -INFINITY;
    for (long long j = threadIdx.x; j < v; j += blockDim.x) m = fmaxf(m, scaled(to_f32(zr[j]), scale));
    m = block_max(m);
    float s = 0.0f;
    for (long long j = threadIdx.x; j < v; j += blockDim.x) s += expf(scaled(to_f32(zr[j]), scale) - m);
    const float lse = m + logf(block_sum(s));
    if (threadIdx.x == 0) {
        const unsigned int target = y[row];
        out[2 * row] = from_f32<O>(target < v ? scaled(to_f32(zr[target]), scale) - lse : NAN);
        out[2 * row + 1] = from_f32<O>(lse);
    }
}

// dz with respect to the unscaled logits: the scaled logits' gradient times scale.
template <typename T, typename R>
__device__ void logprob_lse_bwd_rows(const T* z, const unsigned int* y, const R* rg, T* dz, long long v, float scale) {
    const long long row = blockIdx.x;
    const float lse = to_f32(rg[4 * row + 1]), g_lp = to_f32(rg[4 * row + 2]), g_lse = to_f32(rg[4 * row + 3]);
    const float c = g_lse - g_lp;
    const long long target = y[row];
    for (long long j = threadIdx.x; j < v; j += blockDim.x) {
        const float p = expf(scaled(to_f32(z[row * v + j]), scale) - lse);
        const float d = p * c + (j == target ? g_lp : 0.0f);
        dz[row * v + j] = from_f32<T>(scale * d);
    }
}

template <typename T>
__device__ void logprob_lse_kernel(const T* z, const unsigned int* y, T* out, long long v) {
    logprob_lse_rows<T, T>(z, y, out, v, 1.0f);
}
#define LOGPROB_LSE_PARAMS(T) (const T* z, const unsigned int* y, T* out, long long v)
INSTANTIATE(logprob_lse, LOGPROB_LSE_PARAMS, (z, y, out, v))

template <typename T>
__device__ void logprob_lse_bwd_kernel(const T* z, const unsigned int* y, const T* rg, T* dz, long long v) {
    logprob_lse_bwd_rows<T, T>(z, y, rg, dz, v, 1.0f);
}
#define LOGPROB_LSE_BWD_PARAMS(T) (const T* z, const unsigned int* y, const T* rg, T* dz, long long v)
INSTANTIATE(logprob_lse_bwd, LOGPROB_LSE_BWD_PARAMS, (z, y, rg, dz, v))

// Mixed (ops/head_logprobs.rs): logits of the model's dtype, (log p, lse) and the output
// gradients in f32; dz in the logits' dtype. The f32 kernels' values on the logits cast to f32
// (and scaled by 1 / temperature in f32), dz rounded once: the bits of the casts (and of the
// scaling's product) around them, without their passes.
template <typename T>
__device__ void logprob_lse_mixed_kernel(const T* z, const unsigned int* y, float* out, long long v, float scale) {
    logprob_lse_rows<T, float>(z, y, out, v, scale);
}
#define LOGPROB_LSE_MIXED_PARAMS(T) (const T* z, const unsigned int* y, float* out, long long v, float scale)
INSTANTIATE(logprob_lse_mixed, LOGPROB_LSE_MIXED_PARAMS, (z, y, out, v, scale))

template <typename T>
__device__ void logprob_lse_bwd_mixed_kernel(const T* z, const unsigned int* y, const float* rg, T* dz, long long v,
                                             float scale) {
    logprob_lse_bwd_rows<T, float>(z, y, rg, dz, v, scale);
}
#define LOGPROB_LSE_BWD_MIXED_PARAMS(T) \
    (const T* z, const unsigned int* y, const float* rg, T* dz, long long v, float scale)
INSTANTIATE(logprob_lse_bwd_mixed, LOGPROB_LSE_BWD_MIXED_PARAMS, (z, y, rg, dz, v, scale))
