// Rotary embedding with the head transpose (see rope.rs). One thread per (b, h, t, k < D/2):
//   forward  x [B, T, H, D] → out [B, H, T, D]:  o1 = x1·c − x2·s,  o2 = x2·c + x1·s
//   backward g [B, H, T, D] → dx [B, T, H, D]:   d1 = g1·c + g2·s,  d2 = g2·c − g1·s
// with (c, s) = tables [B, T, D/2] at (b, t, k), x1/x2 the halves of a head vector.
#include "common.cuh"

// The forward rotation of one pair, each product rounded before the sum (no fused multiply-add,
// as the CPU's kernel computes it), so that every kernel here gives the same bits.
__device__ __forceinline__ void rotated(float x1, float x2, float c, float s, float& o1, float& o2) {
    o1 = __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s));
    o2 = __fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s));
}

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
            float o1, o2;
            rotated(to_f32(in[time_major + k]), to_f32(in[time_major + half + k]), c, s, o1, o2);
            out[heads_major + k] = from_f32<T>(o1);
            out[heads_major + half + k] = from_f32<T>(o2);
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

// q [B, T, HQ, D] and k [B, T, HK, D] of a step that differentiates nothing, in one launch: each
// projection's bias [H·D] added first where its flag is set (rounded to T, as the bias add writes
// it), then rotated as rope_kernel does, into qo [B, HQ, T, D] and ko [B, HK, T, D].
template <typename T>
__device__ void rope_pair_kernel(const T* q, const T* qb, const T* k, const T* kb, const T* cos_t, const T* sin_t, T* qo,
                                 T* ko, long long b, long long t, long long hq, long long hk, long long d, int q_biased,
                                 int k_biased) {
    const long long half = d / 2, nq = b * hq * t * half, n = nq + b * hk * t * half;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const bool is_q = i < nq;
        const long long j = is_q ? i : i - nq, h = is_q ? hq : hk;
        const T* in = is_q ? q : k;
        const T* bias = is_q ? qb : kb;
        T* out = is_q ? qo : ko;
        const long long kk = j % half, ti = (j / half) % t, hi = (j / (half * t)) % h, bi = j / (half * t * h);
        const long long heads_major = ((bi * h + hi) * t + ti) * d, time_major = ((bi * t + ti) * h + hi) * d;
        const long long tab = (bi * t + ti) * half + kk;
        float x1 = to_f32(in[time_major + kk]), x2 = to_f32(in[time_major + half + kk]);
        if (is_q ? q_biased : k_biased) {
            x1 = to_f32(from_f32<T>(x1 + to_f32(bias[hi * d + kk])));
            x2 = to_f32(from_f32<T>(x2 + to_f32(bias[hi * d + half + kk])));
        }
        float o1, o2;
        rotated(x1, x2, to_f32(cos_t[tab]), to_f32(sin_t[tab]), o1, o2);
        out[heads_major + kk] = from_f32<T>(o1);
        out[heads_major + half + kk] = from_f32<T>(o2);
    }
}
#define ROPE_PAIR_PARAMS(T)                                                                                          \
    (const T* q, const T* qb, const T* k, const T* kb, const T* cos_t, const T* sin_t, T* qo, T* ko, long long b,    \
     long long t, long long hq, long long hk, long long d, int q_biased, int k_biased)
INSTANTIATE(rope_pair, ROPE_PAIR_PARAMS, (q, qb, k, kb, cos_t, sin_t, qo, ko, b, t, hq, hk, d, q_biased, k_biased))
