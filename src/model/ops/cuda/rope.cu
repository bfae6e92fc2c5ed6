// Rotary embedding with the head transpose (see rope.rs). One thread per (b, h, t, k < D/2):
//   forward  x [B, T, H, D] → out [B, H, T, D]:  o1 = x1·c − x2·s,  o2 = x2·c + x1·s
//   backward g [B, H, T, D] → dx [B, T, H, D]:   d1 = g1·c + g2·s,  d2 = g2·c − g1·s
// with (c, s) = tables [B, T, D/2] at (b, t, k), x1/x2 the halves of a head vector.
#include "common.cuh"

template <typename T>
__device__ void rope_kernel(const T* in, const T* cos_t, const T* sin_t, T* out, long long b, long long t, long long h,
                            long long d, int backward) {
    const long long half = d / 2, n = b * h * t * half;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const long long k = i % half, ti = (i / half) % t, hi = (i / (half * t)) % h, bi = i / (half * t * h);
        const long long heads_major = ((bi * h + hi) * t + ti) * d;  // [B, H, T, D]
        const long long time_major = ((bi * t + ti) * h + hi) * d;   // [B, T, H, D]
        const long long tab = (bi * t + ti) * half + k;
        const float c = to_f32(cos_t[tab]), s = to_f32(sin_t[tab]);
        if (!backward) {
            const float x1 = to_f32(in[time_major + k]), x2 = to_f32(in[time_major + half + k]);
            out[heads_major + k] = from_f32<T>(x1 * c - x2 * s);
            out[heads_major + half + k] = from_f32<T>(x2 * c + x1 * s);
        } else {
            const float g1 = to_f32(in[heads_major + k]), g2 = to_f32(in[heads_major + half + k]);
            out[time_major + k] = from_f32<T>(g1 * c + g2 * s);
            out[time_major + half + k] = from_f32<T>(g2 * c - g1 * s);
        }
    }
}
#define ROPE_PARAMS(T)                                                                                    \
    (const T* in, const T* cos_t, const T* sin_t, T* out, long long b, long long t, long long h, long long d, \
     int backward)
INSTANTIATE(rope, ROPE_PARAMS, (in, cos_t, sin_t, out, b, t, h, d, backward))
