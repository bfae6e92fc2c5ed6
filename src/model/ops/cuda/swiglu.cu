// SwiGLU elementwise (see swiglu.rs): y = g · σ(g) · u; backward, into [dg | du]:
//   dg = dy · u · σ(g) · (1 + g · (1 − σ(g))),   du = dy · g · σ(g).
// Grid-stride loops over the n elements.
#include "common.cuh"

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

template <typename T>
__device__ void swiglu_kernel(const T* g, const T* u, T* y, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const float a = to_f32(g[i]);
        y[i] = from_f32<T>(a * sigmoid(a) * to_f32(u[i]));
    }
}
#define SWIGLU_PARAMS(T) (const T* g, const T* u, T* y, long long n)
INSTANTIATE(swiglu, SWIGLU_PARAMS, (g, u, y, n))

template <typename T>
__device__ void swiglu_bwd_kernel(const T* g, const T* u, const T* dy, T* out, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const float a = to_f32(g[i]), b = to_f32(u[i]), dd = to_f32(dy[i]);
        const float s = sigmoid(a);
        out[i] = from_f32<T>(dd * b * s * (1.0f + a * (1.0f - s)));
        out[n + i] = from_f32<T>(dd * a * s);
    }
}
#define SWIGLU_BWD_PARAMS(T) (const T* g, const T* u, const T* dy, T* out, long long n)
INSTANTIATE(swiglu_bwd, SWIGLU_BWD_PARAMS, (g, u, dy, out, n))
