// Adds with candle's bits (see add.rs): two tensors elementwise, out[i] = a[i] + b[i], and a bias
// added to every row, out[i] = x[i] + b[i mod n] for x [rows, n], b [n]. In f32 and rounded once
// (a bf16 or f16 sum rounded once from f32 is its correctly rounded sum, what candle's add
// gives). Grid-stride loops over the elements, the elementwise add four elements a load where
// the sizes and pointers allow.
#include "common.cuh"

template <typename T> __device__ void add_kernel(const T* a, const T* b, T* out, long long total) {
    const long long start = (long long)blockIdx.x * blockDim.x + threadIdx.x, stride = (long long)gridDim.x * blockDim.x;
    if (fours<T>(total, a, b, out, out)) {
        const Four<T>* a4 = (const Four<T>*)a;
        const Four<T>* b4 = (const Four<T>*)b;
        Four<T>* out4 = (Four<T>*)out;
        for (long long i = start; i < total / 4; i += stride) {
            const Four<T> x = a4[i], y = b4[i];
            Four<T> z;
            for (int j = 0; j < 4; ++j) z.v[j] = from_f32<T>(to_f32(x.v[j]) + to_f32(y.v[j]));
            out4[i] = z;
        }
        return;
    }
    for (long long i = start; i < total; i += stride) out[i] = from_f32<T>(to_f32(a[i]) + to_f32(b[i]));
}
#define ADD_PARAMS(T) (const T* a, const T* b, T* out, long long total)
INSTANTIATE(add, ADD_PARAMS, (a, b, out, total))

template <typename T>
__device__ void bias_add_kernel(const T* x, const T* b, T* out, long long total, long long n) {
    const long long start = (long long)blockIdx.x * blockDim.x + threadIdx.x, stride = (long long)gridDim.x * blockDim.x;
    for (long long i = start; i < total; i += stride) out[i] = from_f32<T>(to_f32(x[i]) + to_f32(b[i % n]));
}
#define BIAS_ADD_PARAMS(T) (const T* x, const T* b, T* out, long long total, long long n)
INSTANTIATE(bias_add, BIAS_ADD_PARAMS, (x, b, out, total, n))
