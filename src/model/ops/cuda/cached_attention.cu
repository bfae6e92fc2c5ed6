// Attention of a few new queries over the KV cache (see cached_attention.rs), inference only.
// q [B, H, T, D] contiguous; k and v [B, KV, S, D] read in place through their strides (the
// last dimension contiguous); bias [B, T, S]; out [B, T, H·D].
//
// A block per query row (b, h, i). Its warps take the keys in turn (warp w: keys w, w + W, ...)
// and keep an online softmax each: running max m, normaliser l and the weighted sum of value
// rows, the D dims spread over the lanes (lane e holds dims e, e + 32, ...: D ≤ 256). Then the
// W partial results are merged through shared memory:
//   M = max m_w,  out = Σ_w acc_w · exp(m_w − M) / Σ_w l_w · exp(m_w − M).
// Nothing of size S is kept, so any cache length runs in the same few KB.
#include "common.cuh"

#define CA_MAX_D 256
#define CA_MAX_WARPS 8
#define CA_PER_LANE (CA_MAX_D / 32)

template <typename T>
__device__ void cached_attention_kernel(const T* q, const T* k, const T* v, const T* bias, T* out, long long h,
                                        long long kvh, long long t, long long s, long long d, long long k_b,
                                        long long k_g, long long k_j, long long v_b, long long v_g, long long v_j,
                                        float scale) {
    __shared__ float m_w[CA_MAX_WARPS], l_w[CA_MAX_WARPS];
    __shared__ float acc_w[CA_MAX_WARPS][CA_MAX_D];
    const long long row = blockIdx.x;  // (b · H + h) · T + i
    const long long i = row % t, hi = (row / t) % h, bi = row / (t * h);
    const long long gi = hi / (h / kvh);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;

    float qv[CA_PER_LANE], acc[CA_PER_LANE];
    for (int e = 0; e < CA_PER_LANE; ++e) {
        const long long dd = lane + 32 * e;
        qv[e] = dd < d ? to_f32(q[row * d + dd]) : 0.0f;
        acc[e] = 0.0f;
    }
    const T* kb = k + bi * k_b + gi * k_g;
    const T* vb = v + bi * v_b + gi * v_g;
    const T* br = bias + (bi * t + i) * s;
    float m = -INFINITY, l = 0.0f;
    for (long long j = warp; j < s; j += warps) {
        float dot = 0.0f;
        for (int e = 0; e < CA_PER_LANE; ++e) {
            const long long dd = lane + 32 * e;
            if (dd < d) dot += qv[e] * to_f32(kb[j * k_j + dd]);
        }
        const float z = warp_sum(dot) * scale + to_f32(br[j]);
        // A bias of -inf (a masked key in f16, where -1e30 overflows) must give 0, never
        // exp(-inf + inf) = NaN, including while every key so far was masked.
        const float m_new = fmaxf(m, z);
        const float corr = m == -INFINITY ? 0.0f : expf(m - m_new);
        const float p = z == -INFINITY ? 0.0f : expf(z - m_new);
        l = l * corr + p;
        for (int e = 0; e < CA_PER_LANE; ++e) {
            const long long dd = lane + 32 * e;
            acc[e] = acc[e] * corr + (dd < d ? p * to_f32(vb[j * v_j + dd]) : 0.0f);
        }
        m = m_new;
    }
    if (lane == 0) {
        m_w[warp] = m;
        l_w[warp] = l;
    }
    for (int e = 0; e < CA_PER_LANE; ++e) {
        const long long dd = lane + 32 * e;
        if (dd < d) acc_w[warp][dd] = acc[e];
    }
    __syncthreads();
    float big = -INFINITY;
    for (int w = 0; w < warps; ++w) big = fmaxf(big, m_w[w]);
    float norm = 0.0f;
    for (int w = 0; w < warps; ++w) norm += m_w[w] == -INFINITY ? 0.0f : l_w[w] * expf(m_w[w] - big);
    T* o = out + ((bi * t + i) * h + hi) * d;
    for (long long dd = threadIdx.x; dd < d; dd += blockDim.x) {
        float num = 0.0f;
        for (int w = 0; w < warps; ++w) num += m_w[w] == -INFINITY ? 0.0f : acc_w[w][dd] * expf(m_w[w] - big);
        o[dd] = from_f32<T>(num / norm);
    }
}
#define CACHED_ATTENTION_PARAMS(T)                                                                                 \
    (const T* q, const T* k, const T* v, const T* bias, T* out, long long h, long long kvh, long long t, long long s, \
     long long d, long long k_b, long long k_g, long long k_j, long long v_b, long long v_g, long long v_j, float scale)
INSTANTIATE(cached_attention, CACHED_ATTENTION_PARAMS,
            (q, k, v, bias, out, h, kvh, t, s, d, k_b, k_g, k_j, v_b, v_g, v_j, scale))
