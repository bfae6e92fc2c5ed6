// RMSNorm over rows of d: y = x · r · w, r = 1 / sqrt(mean(x²) + eps) (see rms_norm.rs).
// Forward: a block per row. Backward, with x̂ = x · r:
//   dx = r · (w·gy − x̂ · mean(w·gy·x̂))   a block per row, which also writes r;
//   dw = Σ_rows gy · x̂                     partial sums over chunks of rows (one thread per
//                                           column and chunk), then a sum over the chunks:
//                                           no atomics, so the result does not depend on timing.
#include "common.cuh"

template <typename T>
__device__ void rms_norm_kernel(const T* x, const T* w, T* y, long long d, float eps) {
    const long long row = blockIdx.x;
    const T* xr = x + row * d;
    float ss = 0.0f;
    for (long long j = threadIdx.x; j < d; j += blockDim.x) {
        const float v = to_f32(xr[j]);
        ss += v * v;
    }
    const float r = 1.0f / sqrtf(block_sum(ss) / (float)d + eps);
    for (long long j = threadIdx.x; j < d; j += blockDim.x) {
        y[row * d + j] = from_f32<T>(to_f32(xr[j]) * r * to_f32(w[j]));
    }
}
#define RMS_NORM_PARAMS(T) (const T* x, const T* w, T* y, long long d, float eps)
INSTANTIATE(rms_norm, RMS_NORM_PARAMS, (x, w, y, d, eps))

// The residual sum and its norm in one pass (a step that differentiates nothing): s = h + a,
// rounded to T as a bf16 / f16 add writes it, then rms_norm_kernel's operations on s, each
// thread reading back the elements it wrote: the bits of the add and the norm kernel.
template <typename T>
__device__ void add_rms_norm_kernel(const T* h, const T* a, const T* w, T* s, T* y, long long d, float eps) {
    const long long row = blockIdx.x;
    float ss = 0.0f;
    for (long long j = threadIdx.x; j < d; j += blockDim.x) {
        const T sum = from_f32<T>(to_f32(h[row * d + j]) + to_f32(a[row * d + j]));
        s[row * d + j] = sum;
        const float v = to_f32(sum);
        ss += v * v;
    }
    const float r = 1.0f / sqrtf(block_sum(ss) / (float)d + eps);
    for (long long j = threadIdx.x; j < d; j += blockDim.x) {
        y[row * d + j] = from_f32<T>(to_f32(s[row * d + j]) * r * to_f32(w[j]));
    }
}
#define ADD_RMS_NORM_PARAMS(T) (const T* h, const T* a, const T* w, T* s, T* y, long long d, float eps)
INSTANTIATE(add_rms_norm, ADD_RMS_NORM_PARAMS, (h, a, w, s, y, d, eps))

template <typename T>
__device__ void rms_norm_bwd_rows_kernel(const T* x, const T* gy, const T* w, T* dx, float* r_out, long long d,
                                         float eps) {
    const long long row = blockIdx.x;
    const T* xr = x + row * d;
    const T* gr = gy + row * d;
    float ss = 0.0f, wgx = 0.0f;
    for (long long j = threadIdx.x; j < d; j += blockDim.x) {
        const float v = to_f32(xr[j]);
        ss += v * v;
        wgx += to_f32(w[j]) * to_f32(gr[j]) * v;
    }
    ss = block_sum(ss);
    wgx = block_sum(wgx);
    const float r = 1.0f / sqrtf(ss / (float)d + eps);
    const float mean = wgx * r / (float)d;  // mean(w·gy·x̂)
    for (long long j = threadIdx.x; j < d; j += blockDim.x) {
        const float v = to_f32(xr[j]);
        dx[row * d + j] = from_f32<T>(r * (to_f32(w[j]) * to_f32(gr[j]) - v * r * mean));
    }
    if (threadIdx.x == 0) r_out[row] = r;
}
#define RMS_NORM_BWD_ROWS_PARAMS(T) (const T* x, const T* gy, const T* w, T* dx, float* r_out, long long d, float eps)
INSTANTIATE(rms_norm_bwd_rows, RMS_NORM_BWD_ROWS_PARAMS, (x, gy, w, dx, r_out, d, eps))

// partial[c, j] = Σ_{rows i of chunk c} gy[i, j] · x[i, j] · r[i]; grid (column blocks, chunks).
template <typename T>
__device__ void rms_norm_bwd_dw_partial_kernel(const T* x, const T* gy, const float* r, float* partial, long long n,
                                               long long d, long long rows_per_chunk) {
    const long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long c = blockIdx.y;
    if (j >= d) return;
    const long long end = (c + 1) * rows_per_chunk < n ? (c + 1) * rows_per_chunk : n;
    float acc = 0.0f;
    for (long long i = c * rows_per_chunk; i < end; ++i) {
        acc += to_f32(gy[i * d + j]) * to_f32(x[i * d + j]) * r[i];
    }
    partial[c * d + j] = acc;
}
#define RMS_NORM_BWD_DW_PARTIAL_PARAMS(T)                                                                   \
    (const T* x, const T* gy, const float* r, float* partial, long long n, long long d, long long rows_per_chunk)
INSTANTIATE(rms_norm_bwd_dw_partial, RMS_NORM_BWD_DW_PARTIAL_PARAMS, (x, gy, r, partial, n, d, rows_per_chunk))

// dw[j] = Σ_c partial[c, j], chunks in order.
template <typename T>
__device__ void rms_norm_bwd_dw_sum_kernel(const float* partial, T* dw, long long chunks, long long d) {
    const long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= d) return;
    float acc = 0.0f;
    for (long long c = 0; c < chunks; ++c) acc += partial[c * d + j];
    dw[j] = from_f32<T>(acc);
}
#define RMS_NORM_BWD_DW_SUM_PARAMS(T) (const float* partial, T* dw, long long chunks, long long d)
INSTANTIATE(rms_norm_bwd_dw_sum, RMS_NORM_BWD_DW_SUM_PARAMS, (partial, dw, chunks, d))
