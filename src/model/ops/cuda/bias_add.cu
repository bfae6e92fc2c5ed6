// A bias added to every row (see bias_add.rs): out[i] = x[i] + b[i mod n] for x [rows, n], b [n],
// in f32 and rounded once (the bits of candle's broadcast add: a bf16 or f16 sum rounded once
// from f32 is its correctly rounded sum). A grid-stride loop over the elements.
#include "common.cuh"

template <typename T>
__device__ void bias_add_kernel(const T* x, const T* b, T* out, long long total, long long n) {
    const long long start = (long long)blockIdx.x * blockDim.x + threadIdx.x, stride = (long long)gridDim.x * blockDim.x;
    for (long long i = start; i < total; i += stride) out[i] = from_f32<T>(to_f32(x[i]) + to_f32(b[i % n]));
}
#define BIAS_ADD_PARAMS(T) (const T* x, const T* b, T* out, long long total, long long n)
INSTANTIATE(bias_add, BIAS_ADD_PARAMS, (x, b, out, total, n))
