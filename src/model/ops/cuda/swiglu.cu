// SwiGLU elementwise (see swiglu.rs): y = g · σ(g) · u; backward, into [dg | du]:
//   dg = dy · u · σ(g) · (1 + g · (1 − σ(g))),   du = dy · g · σ(g).
// Grid-stride loops over the n elements, four at a time where every pointer allows it (one
// 8-byte load of four bf16 instead of four 2-byte ones: common.cuh's Four), one at a time
// otherwise. The same arithmetic either way.
#include "common.cuh"

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

template <typename T> __device__ __forceinline__ T swiglu_one(T g, T u) {
    const float a = to_f32(g);
    return from_f32<T>(a * sigmoid(a) * to_f32(u));
}

template <typename T>
__device__ void swiglu_kernel(const T* g, const T* u, T* y, long long n) {
    const long long start = (long long)blockIdx.x * blockDim.x + threadIdx.x, stride = (long long)gridDim.x * blockDim.x;
    if (fours<T>(n, g, u, y, y)) {
        const Four<T>* g4 = (const Four<T>*)g;
        const Four<T>* u4 = (const Four<T>*)u;
        Four<T>* y4 = (Four<T>*)y;
        for (long long i = start; i < n / 4; i += stride) {
            const Four<T> a = g4[i], b = u4[i];
            Four<T> out;
            for (int e = 0; e < 4; ++e) out.v[e] = swiglu_one(a.v[e], b.v[e]);
            y4[i] = out;
        }
        return;
    }
    for (long long i = start; i < n; i += stride) y[i] = swiglu_one(g[i], u[i]);
}
#define SWIGLU_PARAMS(T) (const T* g, const T* u, T* y, long long n)
INSTANTIATE(swiglu, SWIGLU_PARAMS, (g, u, y, n))

// (dg, du) of one element.
template <typename T> __device__ __forceinline__ void swiglu_bwd_one(T g, T u, T dy, T& dg, T& du) {
    const float a = to_f32(g), b = to_f32(u), dd = to_f32(dy);
    const float s = sigmoid(a);
    dg = from_f32<T>(dd * b * s * (1.0f + a * (1.0f - s)));
    du = from_f32<T>(dd * a * s);
}

template <typename T>
__device__ void swiglu_bwd_kernel(const T* g, const T* u, const T* dy, T* out, long long n) {
    const long long start = (long long)blockIdx.x * blockDim.x + threadIdx.x, stride = (long long)gridDim.x * blockDim.x;
    if (fours<T>(n, g, u, dy, out)) {
        const Four<T>* g4 = (const Four<T>*)g;
        const Four<T>* u4 = (const Four<T>*)u;
        const Four<T>* dy4 = (const Four<T>*)dy;
        Four<T>* dg4 = (Four<T>*)out;
        Four<T>* du4 = (Four<T>*)(out + n);
        for (long long i = start; i < n / 4; i += stride) {
            const Four<T> a = g4[i], b = u4[i], d = dy4[i];
            Four<T> dg, du;
            for (int e = 0; e < 4; ++e) swiglu_bwd_one(a.v[e], b.v[e], d.v[e], dg.v[e], du.v[e]);
            dg4[i] = dg;
            du4[i] = du;
        }
        return;
    }
    for (long long i = start; i < n; i += stride) swiglu_bwd_one(g[i], u[i], dy[i], out[i], out[n + i]);
}
#define SWIGLU_BWD_PARAMS(T) (const T* g, const T* u, const T* dy, T* out, long long n)
INSTANTIATE(swiglu_bwd, SWIGLU_BWD_PARAMS, (g, u, dy, out, n))
