// Flash attention for bf16/f16 (see flash_attention.rs): out = softmax(scale · q kᵀ + bias) v
// and its gradients, the scores never in memory. q [B, H, T, D], k and v [B, KV, S, D] (query
// head h reads kv head h / (H / KV)), bias [B, T, S] f32, out [B, T, H, D]. Products on the
// tensor cores (WMMA 16 × 16 × 16 tiles, 16-bit operands, f32 accumulators); the softmax in f32.
//
// Forward, a block of 4 warps per 64 queries of one head, each warp 16 queries, two passes over
// the key tiles (32 keys each): the first finds each row's max m and sum l of exp(x − m) (online,
// two lanes a row), the second computes p = exp(x − m) / l, rounds it to the 16-bit type and
// adds p · v into the accumulators. No accumulator is ever rescaled, and p is the normalised
// probability the unfused path rounds before its weighted sum. (m, 1 / l) per row are kept for
// the backward.
//
// Backward from dO: delta = Σ_d dO ⊙ O per row (= Σ_s p ⊙ dp); then, each p computed again from
// the scores and (m, 1 / l), ds = scale · p · (dp − delta) with dp = dO · vᵀ, and
//   dq = ds · k             a block per 64 queries of one head, looping over key tiles;
//   dv = Σ pᵀ · dO, dk = Σ dsᵀ · q   a block per 64 keys and query head, looping over its query
//                                    tiles into f32 parts; a kv head's parts (one per query head
//                                    sharing it) then summed in head order.
// Each gradient element is summed in a fixed order: no atomics, the same bits each run.
//
// The bias is read through a table of its 32 × 32 tiles (one pass, `tiles_kernel`): a tile masked
// everywhere (≤ MASKED_BELOW: the causal future, left padding) is skipped, its keys weighing
// exp(−1e30 − m) = 0 exactly in a row that sees any key (every row of the model's attention bias
// sees its own position); a tile whose bias is 0 everywhere is not read; only the others (the
// diagonal's, padding's edges) are.
#include "common.cuh"
#ifdef __CUDACC__
#include <mma.h>
#endif

// 16-bit WMMA tiles need compute capability 8.0 (bf16): built for less, the module has no entry
// points, and flash_attention.rs does not serve (it knows the build's CUDA_COMPUTE_CAP).
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800

namespace flash {
using namespace nvcuda;

constexpr int BQ = 64;        // queries a block of the forward and dq (16 a warp)
constexpr int BK = 32;        // keys a tile of the forward and dq
constexpr int BKV = 64;       // keys a block of dk, dv (16 a warp)
constexpr int BQ2 = 32;       // queries a tile of dk, dv
constexpr int LF = 32 + 4;    // row stride of the f32 tiles (32 columns; the padding spreads banks)
constexpr int LH = 32 + 8;    // row stride of the 16-bit probability tiles
constexpr float MASKED_BELOW = -1e29f;
constexpr int G = 32;  // the bias table's tiles: G queries × G keys
enum : int { DEAD = 0, MIXED = 1, CLEAR = 2 };

template <typename T> using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major>;
template <typename T> using FragB = wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major>;
// A row-major tile of rows read as the columns of the product's right operand (its transpose).
template <typename T> using FragBT = wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major>;
using Acc = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

// e^x by the hardware's approximate exponential (__expf: within 2 + 1.2·|x| ulp, a few 1e-6
// relative for any probability that is not negligible, far below the 16-bit rounding each gets):
// four exponentials a score across the kernels, which would otherwise cost more than the tile
// products. The same function everywhere, so the backward's p is the forward's.
__device__ __forceinline__ float exp_fast(float x) { return __expf(x); }

// The softmax's argument, its product rounded before the sum as softmax.cu's.
__device__ __forceinline__ float logit(float x, float b, float scale) { return __fadd_rn(__fmul_rn(x, scale), b); }

template <typename T> __device__ __forceinline__ void copy8(T* to, const T* from) {
#ifdef __CUDACC__
    *reinterpret_cast<uint4*>(to) = *reinterpret_cast<const uint4*>(from);
#else
    std::memcpy(to, from, 8 * sizeof(T));
#endif
}

// Rows r0 … r0 + ROWS of an [n, D] matrix whose rows are `stride` elements apart → `tile` (row
// stride D + 8), zeros past row n. Eight elements a load where alignment allows.
template <typename T, int D, int ROWS>
__device__ void stage(T* tile, const T* src, long long stride, long long r0, long long n) {
    constexpr int CHUNKS = D / 8;
    const bool wide = (uintptr_t)src % 16 == 0 && stride % 8 == 0;
    for (int i = threadIdx.x; i < ROWS * CHUNKS; i += blockDim.x) {
        const int r = i / CHUNKS, c = i % CHUNKS * 8;
        T* to = tile + r * (D + 8) + c;
        if (r0 + r >= n) {
            for (int j = 0; j < 8; ++j) to[j] = from_f32<T>(0.0f);
        } else if (wide) {
            copy8(to, src + (r0 + r) * stride + c);
        } else {
            for (int j = 0; j < 8; ++j) to[j] = src[(r0 + r) * stride + c + j];
        }
    }
}

// The bias table [B, ⌈T / G⌉, ⌈S / G⌉]: DEAD where no (query, key) of a tile is unmasked, CLEAR
// where the bias is 0 throughout, MIXED otherwise. A warp per tile, a lane per key; grid
// (⌈S / G⌉, ⌈T / G⌉, B).
__device__ void tiles_kernel(const float* bias, unsigned char* table, long long t, long long s) {
    const long long b = blockIdx.z, tq = blockIdx.y, tk = blockIdx.x;
    const long long key = tk * G + (threadIdx.x & 31);
    float live = 0.0f, unclear = 0.0f;
    for (int r = 0; r < G && key < s; ++r) {
        const long long q = tq * G + r;
        if (q >= t) break;
        const float x = bias[(b * t + q) * s + key];
        live += x > MASKED_BELOW ? 1.0f : 0.0f;
        unclear += x != 0.0f ? 1.0f : 0.0f;
    }
    live = warp_sum(live);
    unclear = warp_sum(unclear);
    if ((threadIdx.x & 31) == 0)
        table[(b * gridDim.y + tq) * gridDim.x + tk] = live == 0.0f ? DEAD : unclear == 0.0f ? CLEAR : MIXED;
}

// A batch row's bias [T, S] and its table, and the table's size.
struct BiasRows {
    const float* bias;
    const unsigned char* table;
    long long rows, cols;
};

__device__ BiasRows bias_rows(const float* bias, const unsigned char* tiles, long long b, long long t, long long s) {
    const long long rows = (t + G - 1) / G, cols = (s + G - 1) / G;
    return {bias + b * t * s, tiles + b * rows * cols, rows, cols};
}

// The class of the kernel tile spanning table rows r0 … r0 + rn and columns c0 … c0 + cn
// (clipped to the table's `rows` × `cols`): the same for every thread.
__device__ int tile_class(const unsigned char* table, long long rows, long long cols, long long r0, int rn,
                          long long c0, int cn) {
    bool live = false, clear = true;
    for (long long r = r0; r < r0 + rn && r < rows; ++r)
        for (long long c = c0; c < c0 + cn && c < cols; ++c) {
            const int v = table[r * cols + c];
            live |= v != DEAD;
            clear &= v == CLEAR;
        }
    return !live ? DEAD : clear ? CLEAR : MIXED;
}

// out (16 × COLS f32, row stride LF) = a (the warp's 16 rows × D) · bᵀ, b the tile's COLS rows
// of D (row stride D + 8).
template <typename T, int D, int COLS>
__device__ void product_t(float* out, const FragA<T>* a, const T* b) {
    for (int n = 0; n < COLS / 16; ++n) {
        Acc acc;
        wmma::fill_fragment(acc, 0.0f);
        for (int j = 0; j < D / 16; ++j) {
            FragBT<T> bf;
            wmma::load_matrix_sync(bf, b + n * 16 * (D + 8) + j * 16, D + 8);
            wmma::mma_sync(acc, a[j], bf, acc);
        }
        wmma::store_matrix_sync(out + n * 16, acc, LF, wmma::mem_row_major);
    }
}

// acc (16 × D) += p (16 × K, row stride LH) · b (K rows of D, row stride D + 8).
template <typename T, int D, int K>
__device__ void accumulate(Acc* acc, const T* p, const T* b) {
    for (int kk = 0; kk < K / 16; ++kk) {
        FragA<T> pf;
        wmma::load_matrix_sync(pf, p + kk * 16, LH);
        for (int j = 0; j < D / 16; ++j) {
            FragB<T> bf;
            wmma::load_matrix_sync(bf, b + kk * 16 * (D + 8) + j * 16, D + 8);
            wmma::mma_sync(acc[j], pf, bf, acc[j]);
        }
    }
}

// The warp's 16 rows × D of accumulators, rounded, to rows `stride` apart from dst (the first
// `valid` rows), through `scratch` (16 × LF floats of the warp's own).
template <typename T, int D>
__device__ void write_rows(T* dst, long long stride, int valid, const Acc* acc, float* scratch) {
    const int lane = threadIdx.x & 31;
    for (int j = 0; j < D / 16; ++j) {
        wmma::store_matrix_sync(scratch, acc[j], LF, wmma::mem_row_major);
        __syncwarp();
        for (int i = lane; i < 256; i += 32) {
            const int r = i / 16, c = i % 16;
            if (r < valid) dst[r * stride + j * 16 + c] = from_f32<T>(scratch[r * LF + c]);
        }
        __syncwarp();
    }
}

// The warp's 16 rows of a [16 × D] tile (row stride D + 8) as left operands.
template <typename T, int D> __device__ void load_rows(FragA<T>* frags, const T* tile) {
    for (int j = 0; j < D / 16; ++j) wmma::load_matrix_sync(frags[j], tile + j * 16, D + 8);
}

template <typename T, int D>
__device__ void forward_kernel(const T* q, const T* k, const T* v, const float* bias, const unsigned char* tiles,
                               T* out, float* stats,
                               long long heads, long long kv_heads, long long t, long long s, float scale) {
    constexpr int LD = D + 8;
    __shared__ __align__(32) T staged[BQ * LD];  // the queries; then a key tile and its values
    __shared__ __align__(32) float scores[BQ * LF];
    __shared__ __align__(32) T probs[BQ * LH];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const long long b = blockIdx.z, h = blockIdx.y, q0 = (long long)blockIdx.x * BQ;
    const long long g = h / (heads / kv_heads);
    const T* kh = k + (b * kv_heads + g) * s * D;
    const T* vh = v + (b * kv_heads + g) * s * D;
    const BiasRows br = bias_rows(bias, tiles, b, t, s);
    stage<T, D, BQ>(staged, q + (b * heads + h) * t * D, D, q0, t);
    __syncthreads();
    FragA<T> qf[D / 16];
    load_rows<T, D>(qf, staged + warp * 16 * LD);
    // Lane → row of the warp's 16 and half of a tile's 32 keys.
    const int row = lane >> 1, half = lane & 1;
    const long long query = q0 + warp * 16 + row;
    const float* brow = br.bias + query * s;
    float* ws = scores + warp * 16 * LF;
    T* wp = probs + warp * 16 * LH;

    float m = -INFINITY, l = 0.0f;
    for (long long k0 = 0; k0 < s; k0 += BK) {
        const int cls = tile_class(br.table, br.rows, br.cols, q0 / G, BQ / G, k0 / G, BK / G);
        if (cls == DEAD) continue;
        __syncthreads();  // the block is done with the previous tile
        stage<T, D, BK>(staged, kh, D, k0, s);
        __syncthreads();
        product_t<T, D, BK>(ws, qf, staged);
        __syncwarp();
        for (int c = half * 16; c < half * 16 + 16 && query < t && k0 + c < s; ++c) {
            const float x = logit(ws[row * LF + c], cls == CLEAR ? 0.0f : brow[k0 + c], scale);
            if (x > m) {
                l = l * exp_fast(m - x) + 1.0f;
                m = x;
            } else {
                l += exp_fast(x - m);
            }
        }
    }
    const float m2 = __shfl_xor_sync(0xffffffffu, m, 1), l2 = __shfl_xor_sync(0xffffffffu, l, 1);
    const float mx = fmaxf(m, m2);
    const float sum =
        (m == -INFINITY ? 0.0f : l * exp_fast(m - mx)) + (m2 == -INFINITY ? 0.0f : l2 * exp_fast(m2 - mx));
    const float inv = 1.0f / sum;
    m = mx;

    Acc acc[D / 16];
    for (int j = 0; j < D / 16; ++j) wmma::fill_fragment(acc[j], 0.0f);
    for (long long k0 = 0; k0 < s; k0 += BK) {
        const int cls = tile_class(br.table, br.rows, br.cols, q0 / G, BQ / G, k0 / G, BK / G);
        if (cls == DEAD) continue;
        __syncthreads();  // the block is done with the previous tile
        stage<T, D, BK>(staged, kh, D, k0, s);
        stage<T, D, BK>(staged + BK * LD, vh, D, k0, s);
        __syncthreads();
        product_t<T, D, BK>(ws, qf, staged);
        __syncwarp();
        for (int c = half * 16; c < half * 16 + 16; ++c) {
            const bool in = query < t && k0 + c < s;
            const float x = in ? logit(ws[row * LF + c], cls == CLEAR ? 0.0f : brow[k0 + c], scale) : 0.0f;
            const float p = in ? exp_fast(x - m) * inv : 0.0f;
            wp[row * LH + c] = from_f32<T>(p);
        }
        __syncwarp();
        accumulate<T, D, BK>(acc, wp, staged + BK * LD);
    }
    const long long first = q0 + warp * 16;
    if (first < t)
        write_rows<T, D>(out + ((b * t + first) * heads + h) * D, heads * D, (int)min(16LL, t - first), acc, ws);
    if (half == 0 && query < t) {
        stats[2 * ((b * heads + h) * t + query)] = m;
        stats[2 * ((b * heads + h) * t + query) + 1] = inv;
    }
}

// delta = Σ_d dO ⊙ O for each of `rows` rows of D (a warp a row), f32.
template <typename T>
__device__ void delta_kernel(const T* d_out, const T* out, float* delta, long long rows, long long d) {
    const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;  // the whole warp
    const int lane = threadIdx.x & 31;
    float acc = 0.0f;
    for (long long j = lane; j < d; j += 32) acc += to_f32(d_out[row * d + j]) * to_f32(out[row * d + j]);
    acc = warp_sum(acc);
    if (lane == 0) delta[row] = acc;
}

template <typename T, int D>
__device__ void dq_kernel(const T* q, const T* k, const T* v, const float* bias, const unsigned char* tiles,
                          const float* stats, const T* d_out,
                          const float* delta, T* dq, long long heads, long long kv_heads, long long t, long long s,
                          float scale) {
    constexpr int LD = D + 8;
    __shared__ __align__(32) T staged[BQ * LD];  // the queries, then dO; then a key tile and its values
    __shared__ __align__(32) float scores[BQ * LF];
    __shared__ __align__(32) float d_probs[BQ * LF];
    __shared__ __align__(32) T d_scores[BQ * LH];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const long long b = blockIdx.z, h = blockIdx.y, q0 = (long long)blockIdx.x * BQ;
    const long long g = h / (heads / kv_heads);
    const T* kh = k + (b * kv_heads + g) * s * D;
    const T* vh = v + (b * kv_heads + g) * s * D;
    const BiasRows br = bias_rows(bias, tiles, b, t, s);
    FragA<T> qf[D / 16], dof[D / 16];
    stage<T, D, BQ>(staged, q + (b * heads + h) * t * D, D, q0, t);
    __syncthreads();
    load_rows<T, D>(qf, staged + warp * 16 * LD);
    __syncthreads();
    stage<T, D, BQ>(staged, d_out + (b * t * heads + h) * D, heads * D, q0, t);
    __syncthreads();
    load_rows<T, D>(dof, staged + warp * 16 * LD);
    const int row = lane >> 1, half = lane & 1;
    const long long query = q0 + warp * 16 + row;
    const float* brow = br.bias + query * s;
    float m = 0.0f, inv = 0.0f, dl = 0.0f;
    if (query < t) {
        m = stats[2 * ((b * heads + h) * t + query)];
        inv = stats[2 * ((b * heads + h) * t + query) + 1];
        dl = delta[(b * t + query) * heads + h];
    }
    float* ws = scores + warp * 16 * LF;
    float* wdp = d_probs + warp * 16 * LF;
    T* wds = d_scores + warp * 16 * LH;

    Acc acc[D / 16];
    for (int j = 0; j < D / 16; ++j) wmma::fill_fragment(acc[j], 0.0f);
    for (long long k0 = 0; k0 < s; k0 += BK) {
        const int cls = tile_class(br.table, br.rows, br.cols, q0 / G, BQ / G, k0 / G, BK / G);
        if (cls == DEAD) continue;
        __syncthreads();  // the block is done with the previous tile
        stage<T, D, BK>(staged, kh, D, k0, s);
        stage<T, D, BK>(staged + BK * LD, vh, D, k0, s);
        __syncthreads();
        product_t<T, D, BK>(ws, qf, staged);
        product_t<T, D, BK>(wdp, dof, staged + BK * LD);
        __syncwarp();
        for (int c = half * 16; c < half * 16 + 16; ++c) {
            float ds = 0.0f;
            if (query < t && k0 + c < s) {
                const float p = exp_fast(logit(ws[row * LF + c], cls == CLEAR ? 0.0f : brow[k0 + c], scale) - m) * inv;
                ds = scale * p * (wdp[row * LF + c] - dl);
            }
            wds[row * LH + c] = from_f32<T>(ds);
        }
        __syncwarp();
        accumulate<T, D, BK>(acc, wds, staged);
    }
    const long long first = q0 + warp * 16;
    if (first < t) write_rows<T, D>(dq + ((b * heads + h) * t + first) * D, D, (int)min(16LL, t - first), acc, ws);
}

template <typename T, int D>
__device__ void dkv_kernel(const T* q, const T* k, const T* v, const float* bias, const unsigned char* tiles,
                           const float* stats, const T* d_out,
                           const float* delta, float* dk_part, float* dv_part, long long heads, long long kv_heads,
                           long long t, long long s, float scale) {
    constexpr int LD = D + 8;
    __shared__ __align__(32) T staged[BKV * LD];  // the keys, then the values; then a query tile and its dO
    __shared__ __align__(32) float scores[BKV * LF];
    __shared__ __align__(32) float d_probs[BKV * LF];
    __shared__ __align__(32) T probs[BKV * LH];
    __shared__ __align__(32) T d_scores[BKV * LH];
    __shared__ float row_max[BQ2], row_inv[BQ2], row_delta[BQ2];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const long long b = blockIdx.z, h = blockIdx.y, k0 = (long long)blockIdx.x * BKV;
    const long long g = h / (heads / kv_heads);
    const BiasRows br = bias_rows(bias, tiles, b, t, s);
    FragA<T> kf[D / 16], vf[D / 16];
    stage<T, D, BKV>(staged, k + (b * kv_heads + g) * s * D, D, k0, s);
    __syncthreads();
    load_rows<T, D>(kf, staged + warp * 16 * LD);
    __syncthreads();
    stage<T, D, BKV>(staged, v + (b * kv_heads + g) * s * D, D, k0, s);
    __syncthreads();
    load_rows<T, D>(vf, staged + warp * 16 * LD);
    // Lane → key of the warp's 16 and half of a tile's 32 queries.
    const int row = lane >> 1, half = lane & 1;
    const long long key = k0 + warp * 16 + row;
    float* ws = scores + warp * 16 * LF;
    float* wdp = d_probs + warp * 16 * LF;
    T* wp = probs + warp * 16 * LH;
    T* wds = d_scores + warp * 16 * LH;

    Acc dk_acc[D / 16], dv_acc[D / 16];
    for (int j = 0; j < D / 16; ++j) {
        wmma::fill_fragment(dk_acc[j], 0.0f);
        wmma::fill_fragment(dv_acc[j], 0.0f);
    }
    for (long long q0 = 0; q0 < t; q0 += BQ2) {
        const int cls = tile_class(br.table, br.rows, br.cols, q0 / G, BQ2 / G, k0 / G, BKV / G);
        if (cls == DEAD) continue;
        __syncthreads();  // the block is done with the previous tile
        stage<T, D, BQ2>(staged, q + (b * heads + h) * t * D, D, q0, t);
        stage<T, D, BQ2>(staged + BQ2 * LD, d_out + (b * t * heads + h) * D, heads * D, q0, t);
        if (threadIdx.x < BQ2) {
            const long long qi = q0 + threadIdx.x;
            const bool in = qi < t;
            row_max[threadIdx.x] = in ? stats[2 * ((b * heads + h) * t + qi)] : 0.0f;
            row_inv[threadIdx.x] = in ? stats[2 * ((b * heads + h) * t + qi) + 1] : 0.0f;
            row_delta[threadIdx.x] = in ? delta[(b * t + qi) * heads + h] : 0.0f;
        }
        __syncthreads();
        product_t<T, D, BQ2>(ws, kf, staged);               // scoresᵀ: the warp's keys × the queries
        product_t<T, D, BQ2>(wdp, vf, staged + BQ2 * LD);   // dpᵀ = v · dOᵀ
        __syncwarp();
        for (int c = half * 16; c < half * 16 + 16; ++c) {
            const long long qi = q0 + c;
            float p = 0.0f, ds = 0.0f;
            if (key < s && qi < t) {
                const float x = logit(ws[row * LF + c], cls == CLEAR ? 0.0f : br.bias[qi * s + key], scale);
                p = exp_fast(x - row_max[c]) * row_inv[c];
                ds = scale * p * (wdp[row * LF + c] - row_delta[c]);
            }
            wp[row * LH + c] = from_f32<T>(p);
            wds[row * LH + c] = from_f32<T>(ds);
        }
        __syncwarp();
        accumulate<T, D, BQ2>(dv_acc, wp, staged + BQ2 * LD);  // dv += pᵀ · dO
        accumulate<T, D, BQ2>(dk_acc, wds, staged);           // dk += dsᵀ · q
    }
    const long long first = k0 + warp * 16;
    if (first < s) {
        const int valid = (int)min(16LL, s - first);
        write_rows<float, D>(dk_part + ((b * heads + h) * s + first) * D, D, valid, dk_acc, ws);
        write_rows<float, D>(dv_part + ((b * heads + h) * s + first) * D, D, valid, dv_acc, ws);
    }
}

// dk and dv [B, KV, S, D] from the query heads' parts [B, H, S, D] (f32): each kv head's `rep`
// parts summed in head order, rounded once. A grid-stride loop over the elements.
template <typename T>
__device__ void dkv_sum_kernel(const float* dk_part, const float* dv_part, T* dk, T* dv, long long rep,
                               long long per_head, long long total) {
    const long long start = (long long)blockIdx.x * blockDim.x + threadIdx.x, stride = (long long)gridDim.x * blockDim.x;
    for (long long i = start; i < total; i += stride) {
        const long long bg = i / per_head, e = i % per_head;  // (batch row, kv head), element
        float k_sum = 0.0f, v_sum = 0.0f;
        for (long long r = 0; r < rep; ++r) {
            k_sum += dk_part[(bg * rep + r) * per_head + e];
            v_sum += dv_part[(bg * rep + r) * per_head + e];
        }
        dk[i] = from_f32<T>(k_sum);
        dv[i] = from_f32<T>(v_sum);
    }
}
}  // namespace flash

// Entry points `<kernel>_d<D>_<type>` for D of 64 and 128, bf16 and f16 (WMMA has no f32 tiles).
#define FLASH_ENTRIES(D, T, SUFFIX)                                                                                    \
    extern "C" __global__ void flash_attention_fwd_d##D##_##SUFFIX(                                                    \
        const T* q, const T* k, const T* v, const float* bias, const unsigned char* tiles, T* out, float* stats,      \
        long long heads, long long kv_heads, long long t, long long s, float scale) {                                  \
        flash::forward_kernel<T, D>(q, k, v, bias, tiles, out, stats, heads, kv_heads, t, s, scale);                   \
    }                                                                                                                  \
    extern "C" __global__ void flash_attention_dq_d##D##_##SUFFIX(                                                     \
        const T* q, const T* k, const T* v, const float* bias, const unsigned char* tiles, const float* stats,        \
        const T* d_out, const float* delta, T* dq, long long heads, long long kv_heads, long long t, long long s,       \
        float scale) {                                                                                                 \
        flash::dq_kernel<T, D>(q, k, v, bias, tiles, stats, d_out, delta, dq, heads, kv_heads, t, s, scale);           \
    }                                                                                                                  \
    extern "C" __global__ void flash_attention_dkv_d##D##_##SUFFIX(                                                    \
        const T* q, const T* k, const T* v, const float* bias, const unsigned char* tiles, const float* stats,        \
        const T* d_out, const float* delta, float* dk_part, float* dv_part, long long heads, long long kv_heads,      \
        long long t, long long s, float scale) {                                                                       \
        flash::dkv_kernel<T, D>(q, k, v, bias, tiles, stats, d_out, delta, dk_part, dv_part, heads, kv_heads, t, s,    \
                                scale);                                                                                \
    }
FLASH_ENTRIES(64, bf16, bf16)
FLASH_ENTRIES(64, f16, f16)
FLASH_ENTRIES(128, bf16, bf16)
FLASH_ENTRIES(128, f16, f16)

extern "C" __global__ void flash_attention_tiles(const float* bias, unsigned char* table, long long t, long long s) {
    flash::tiles_kernel(bias, table, t, s);
}

#define FLASH_DELTA_PARAMS(T) (const T* d_out, const T* out, float* delta, long long rows, long long d)
extern "C" __global__ void flash_attention_delta_bf16 FLASH_DELTA_PARAMS(bf16) {
    flash::delta_kernel<bf16>(d_out, out, delta, rows, d);
}
extern "C" __global__ void flash_attention_delta_f16 FLASH_DELTA_PARAMS(f16) {
    flash::delta_kernel<f16>(d_out, out, delta, rows, d);
}

#define FLASH_DKV_SUM_PARAMS(T) \
    (const float* dk_part, const float* dv_part, T* dk, T* dv, long long rep, long long per_head, long long total)
extern "C" __global__ void flash_attention_dkv_sum_bf16 FLASH_DKV_SUM_PARAMS(bf16) {
    flash::dkv_sum_kernel<bf16>(dk_part, dv_part, dk, dv, rep, per_head, total);
}
extern "C" __global__ void flash_attention_dkv_sum_f16 FLASH_DKV_SUM_PARAMS(f16) {
    flash::dkv_sum_kernel<f16>(dk_part, dv_part, dk, dv, rep, per_head, total);
}
#endif
