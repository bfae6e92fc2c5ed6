// One token per row of logits, drawn on the device (see sample_rows.rs). A block per row of v
// logits z, with inv_t[row] = 1 / temperature (0: greedy) and u[row] in [0, 1) drawn on the host
// from the row's random stream:
//   m = max z; lse = m + ln Σ exp(z − m) (the trainer's log-prob reduction, logprob_lse.cu);
//   greedy: the first index of m;
//   else: w_j = exp((z_j − m) · inv_t) in f32, summed in f64; the token is the first j whose
//     cumulative weight passes u · Σw (the last one if rounding leaves u past the end), found by
//     chunk: each thread sums a contiguous chunk, then thread 0 scans the chunk sums and the
//     one chunk that holds the point;
//   log-prob: the model's z_y − lse when greedy or at temperature 1, else ln(w_y / Σw).
// out[row] = (token, the log-prob's f32 bits). A row with a NaN logit, or none above −∞, gets
// token 0xffffffff: the host reports it.
#include "common.cuh"

template <typename T>
__device__ void sample_rows_kernel(const T* z, const float* inv_t, const double* u, unsigned int* out, long long v) {
    __shared__ double chunk_sum[1024];
    const long long row = blockIdx.x;
    const T* zr = z + row * v;
    float m = -INFINITY, nans = 0.0f;
    for (long long j = threadIdx.x; j < v; j += blockDim.x) {
        const float x = to_f32(zr[j]);
        if (x != x) nans += 1.0f;
        m = fmaxf(m, x);
    }
    m = block_max(m);
    nans = block_sum(nans);
    if (nans > 0.0f || m == -INFINITY) {
        if (threadIdx.x == 0) out[2 * row] = 0xffffffffu, out[2 * row + 1] = __float_as_uint(NAN);
        return;
    }
    float s = 0.0f;
    for (long long j = threadIdx.x; j < v; j += blockDim.x) s += expf(to_f32(zr[j]) - m);
    const float lse = m + logf(block_sum(s));
    const float it = inv_t[row];
    if (it == 0.0f) {
        // The first index of the maximum: the least index holding it (indices below 2^24 are
        // exact in f32, as block_reduce's min is written through its max of negated values).
        float first = INFINITY;
        for (long long j = threadIdx.x; j < v; j += blockDim.x)
            if (to_f32(zr[j]) == m) first = fminf(first, (float)j);
        first = -block_max(-first);
        if (threadIdx.x == 0) {
            const long long y = (long long)first;
            out[2 * row] = (unsigned int)y;
            out[2 * row + 1] = __float_as_uint(to_f32(zr[y]) - lse);
        }
        return;
    }
    const long long per = (v + blockDim.x - 1) / blockDim.x;
    const long long lo = min((long long)threadIdx.x * per, v), hi = min(lo + per, v);
    double mine = 0.0;
    for (long long j = lo; j < hi; ++j) mine += (double)expf((to_f32(zr[j]) - m) * it);
    chunk_sum[threadIdx.x] = mine;
    __syncthreads();
    if (threadIdx.x == 0) {
        double total = 0.0;
        for (unsigned int t = 0; t < blockDim.x; ++t) total += chunk_sum[t];
        double left = u[row] * total;
        unsigned int t = 0;
        // The chunk holding the point, and the point's offset into it; past the end, the last
        // non-empty chunk's last token.
        while (t + 1 < blockDim.x && left >= chunk_sum[t] && (long long)(t + 1) * per < v) left -= chunk_sum[t++];
        // Thread 0 scans that chunk itself: v / blockDim tokens.
        const long long clo = (long long)t * per, chi = min(clo + per, v);
        long long y = chi - 1;
        for (long long j = clo; j < chi; ++j) {
            const double w = (double)expf((to_f32(zr[j]) - m) * it);
            if (left < w) {
                y = j;
                break;
            }
            left -= w;
        }
        const double wy = (double)expf((to_f32(zr[y]) - m) * it);
        out[2 * row] = (unsigned int)y;
        out[2 * row + 1] = __float_as_uint(it == 1.0f ? to_f32(zr[y]) - lse : (float)log(wy / total));
    }
}
#define SAMPLE_ROWS_PARAMS(T) (const T* z, const float* inv_t, const double* u, unsigned int* out, long long v)
INSTANTIATE(sample_rows, SAMPLE_ROWS_PARAMS, (z, inv_t, u, out, v))
