// The optimizer's kernels (see worker/adamw_fused.rs): the gradient norm's sums and AdamW in
// place, on f32 parameters, moments and gradients.
//
//   sum_squares: Σ x² in f64. Each block sums a grid-stride share of the n elements (each thread
//     in f64), reduces it over the block in a fixed tree and writes partial[block];
//     sum_partials (one block) then adds the partials in the same fixed way. Same bits every run.
//   adamw_step:   in one pass, each element's
//                   m ← β1 m + (1 − β1) (g·clip),  v ← β2 v + (1 − β2) (g·clip)²,
//                   p ← p · decay − m · (lr / bias1) / (sqrt(v · (1 / bias2)) + eps)
//   round_into:   a half-precision parameter ← its f32 master, rounded
//   widen:        a half-precision gradient → f32 (its accumulator's dtype), four at a time
//
// AdamW rounds each operation in f32 in the order written (no fused multiply-add: the _rn
// intrinsics), as the CPU's passes and candle's primitive ops do: the same bits.
#include "common.cuh"

__device__ __forceinline__ double warp_sum_f64(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Sum over the block; thread 0 gets it. Called by every thread of the block.
__device__ __forceinline__ double block_sum_f64(double v) {
    __shared__ double partial[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_sum_f64(v);
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    v = lane < warps ? partial[lane] : 0.0;
    return warp_sum_f64(v);
}

template <typename T>
__device__ void sum_squares_kernel(const T* x, double* partial, long long n) {
    double s = 0.0;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const double v = (double)to_f32(x[i]);
        s += v * v;
    }
    s = block_sum_f64(s);
    if (threadIdx.x == 0) partial[blockIdx.x] = s;
}
#define SUM_SQUARES_PARAMS(T) (const T* x, double* partial, long long n)
INSTANTIATE(sum_squares, SUM_SQUARES_PARAMS, (x, partial, n))

extern "C" __global__ void sum_partials(const double* partial, double* out, long long n) {
    double s = 0.0;
    for (long long i = threadIdx.x; i < n; i += blockDim.x) s += partial[i];
    s = block_sum_f64(s);
    if (threadIdx.x == 0) out[0] = s;
}

extern "C" __global__ void adamw_step(float* p, float* m, float* v, const float* g, float clip, float beta1,
                                      float one_beta1, float beta2, float one_beta2, float decay, float lr_over_bias1,
                                      float inv_bias2, float eps, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const float gj = __fmul_rn(g[i], clip);
        const float mi = __fadd_rn(__fmul_rn(m[i], beta1), __fmul_rn(gj, one_beta1));
        const float vi = __fadd_rn(__fmul_rn(v[i], beta2), __fmul_rn(__fmul_rn(gj, gj), one_beta2));
        m[i] = mi;
        v[i] = vi;
        const float denom = __fadd_rn(__fsqrt_rn(__fmul_rn(vi, inv_bias2)), eps);
        p[i] = __fsub_rn(__fmul_rn(p[i], decay), __fdiv_rn(__fmul_rn(mi, lr_over_bias1), denom));
    }
}

// w ← p rounded to w's type: a half-precision parameter set from its f32 master in one pass
// (what a cast to a new buffer and a copy of it into the parameter do in two).
template <typename T>
__device__ void round_into_kernel(T* w, const float* p, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        w[i] = from_f32<T>(p[i]);
    }
}
#define ROUND_INTO_PARAMS(T) (T* w, const float* p, long long n)
INSTANTIATE(round_into, ROUND_INTO_PARAMS, (w, p, n))

// out = x as f32 (exact), four elements a load where the pointers allow.
template <typename T>
__device__ void widen_kernel(const T* x, float* out, long long n) {
    const long long start = (long long)blockIdx.x * blockDim.x + threadIdx.x, stride = (long long)gridDim.x * blockDim.x;
    if (fours<T>(n, x, x, out, out) && fours<float>(n, out, out, out, out)) {
        const Four<T>* x4 = (const Four<T>*)x;
        Four<float>* out4 = (Four<float>*)out;
        for (long long i = start; i < n / 4; i += stride) {
            const Four<T> a = x4[i];
            Four<float> b;
            for (int e = 0; e < 4; ++e) b.v[e] = to_f32(a.v[e]);
            out4[i] = b;
        }
        return;
    }
    for (long long i = start; i < n; i += stride) out[i] = to_f32(x[i]);
}
#define WIDEN_PARAMS(T) (const T* x, float* out, long long n)
INSTANTIATE(widen, WIDEN_PARAMS, (x, out, n))
