// Runs the CUDA kernels of src/model/ops/cuda on the CPU, so that their logic is tested on
// machines without a GPU. A block's threads are fibers (ucontext) on one OS thread, switched
// only where a GPU thread may wait: __syncthreads waits for every thread of the block, a warp
// shuffle for the 32 lanes of its warp (so, as on a GPU, every lane must reach it). Blocks run
// one after another, so __shared__ variables can be statics. Deterministic, and a kernel whose
// threads can never all meet at a barrier aborts ("deadlock") instead of hanging. bf16 and f16
// are their bit patterns, converted with round-to-nearest-even as CUDA's intrinsics do. WMMA's
// fragments each hold their whole 16 × 16 tile (every lane the same), loaded, multiplied (in
// double, rounded to f32) and stored whole: the kernels use them only through those calls.
//
// Included before the kernels (g++ -include); the kernels include common.cuh as on the GPU.
#pragma once
#include <ucontext.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <type_traits>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};
// Set by the scheduler before it resumes a fiber, so always the running thread's.
inline dim3 threadIdx, blockIdx, blockDim, gridDim;

namespace emu {
struct Fiber {
    ucontext_t context;
    bool done = false;
};
inline ucontext_t scheduler;
inline std::vector<Fiber> fibers;
inline std::vector<std::vector<char>> stacks;
inline unsigned current = 0;
inline bool progress = false;  // whether anything moved since the scheduler last looked
inline std::function<void()> body;
inline float exchange[1024];

inline void yield() { swapcontext(&fibers[current].context, &scheduler); }

struct Barrier {
    unsigned expected = 0, arrived = 0, generation = 0;
    void wait() {
        const unsigned gen = generation;
        progress = true;
        if (++arrived == expected) {
            arrived = 0;
            ++generation;
            return;
        }
        while (generation == gen) yield();
    }
};
inline Barrier block_barrier;
inline std::vector<Barrier> warp_barriers;

inline void entry() {
    body();
    fibers[current].done = true;
    progress = true;
}  // returns to the scheduler through uc_link

// Runs `body` as `threads` fibers until all have returned.
inline void run_block(unsigned threads) {
    constexpr size_t STACK = 256 * 1024;  // WMMA fragments are 1 KiB each here
    fibers.assign(threads, Fiber{});
    stacks.resize(threads);
    for (unsigned t = 0; t < threads; ++t) {
        stacks[t].resize(STACK);
        getcontext(&fibers[t].context);
        fibers[t].context.uc_stack.ss_sp = stacks[t].data();
        fibers[t].context.uc_stack.ss_size = STACK;
        fibers[t].context.uc_link = &scheduler;
        makecontext(&fibers[t].context, entry, 0);
    }
    block_barrier = Barrier{threads};
    warp_barriers.assign(threads / 32, Barrier{32});
    for (bool alive = true; alive;) {
        alive = false;
        progress = false;
        for (unsigned t = 0; t < threads; ++t) {
            if (fibers[t].done) continue;
            alive = true;
            current = t;
            threadIdx = dim3{t, 0, 0};
            swapcontext(&scheduler, &fibers[t].context);
        }
        if (alive && !progress) {
            std::fprintf(stderr, "deadlock: the block's threads wait at barriers that never complete\n");
            std::abort();
        }
    }
}
}  // namespace emu

inline void __syncthreads() { emu::block_barrier.wait(); }

// Whether any thread of the block passed a non-zero p (a barrier, as __syncthreads).
inline int __syncthreads_or(int p) {
    static int any;
    emu::block_barrier.wait();
    if (threadIdx.x == 0) any = 0;
    emu::block_barrier.wait();
    if (p) any = 1;
    emu::block_barrier.wait();
    return any;  // read before any thread can reach the next call's reset (fibers switch at waits)
}

inline void __syncwarp() { emu::warp_barriers[threadIdx.x / 32].wait(); }

inline unsigned __float_as_uint(float f) {
    unsigned u;
    std::memcpy(&u, &f, 4);
    return u;
}
inline long long min(long long a, long long b) { return a < b ? a : b; }

inline float __shfl_xor_sync(unsigned, float v, int offset) {
    const unsigned tid = threadIdx.x;
    emu::Barrier& warp = emu::warp_barriers[tid / 32];
    emu::exchange[tid] = v;
    warp.wait();
    const float other = emu::exchange[tid ^ (unsigned)offset];
    warp.wait();
    return other;
}

inline double __shfl_xor_sync(unsigned, double v, int offset) {
    static double exchange[1024];
    const unsigned tid = threadIdx.x;
    emu::Barrier& warp = emu::warp_barriers[tid / 32];
    exchange[tid] = v;
    warp.wait();
    const double other = exchange[tid ^ (unsigned)offset];
    warp.wait();
    return other;
}

// IEEE operations rounded to nearest (C++ without -ffp-contract rounds each one as written).
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline float __expf(float a) { return std::exp(a); }  // the GPU's is approximate: tolerances cover it

struct __nv_bfloat16 {
    uint16_t bits;
};
struct __half {
    _Float16 value;
};
inline float __bfloat162float(__nv_bfloat16 x) {
    uint32_t u = (uint32_t)x.bits << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline __nv_bfloat16 __float2bfloat16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if (std::isnan(f)) return {0x7fc0};
    u += 0x7fff + ((u >> 16) & 1);
    return {(uint16_t)(u >> 16)};
}
inline float __half2float(__half x) { return (float)x.value; }
inline __half __float2half(float f) { return {(_Float16)f}; }
// a += b rounded to the type, as cuda_bf16.h's and cuda_fp16.h's operators.
inline __nv_bfloat16& operator+=(__nv_bfloat16& a, __nv_bfloat16 b) {
    a = __float2bfloat16(__bfloat162float(a) + __bfloat162float(b));
    return a;
}
inline __half& operator+=(__half& a, __half b) {
    a = __float2half(__half2float(a) + __half2float(b));
    return a;
}

namespace nvcuda::wmma {
struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

template <typename Use, int M, int N, int K, typename T, typename Layout = void> struct fragment {
    static_assert(M == 16 && N == 16 && K == 16, "16 x 16 x 16 tiles only");
    float x[16 * 16];  // row-major
};

inline float widen(float x) { return x; }
inline float widen(__nv_bfloat16 x) { return __bfloat162float(x); }
inline float widen(__half x) { return __half2float(x); }

template <typename Use, typename T, typename Layout>
void load_matrix_sync(fragment<Use, 16, 16, 16, T, Layout>& f, const T* p, unsigned ldm) {
    constexpr bool rows = std::is_same<Layout, row_major>::value;
    for (int r = 0; r < 16; ++r)
        for (int c = 0; c < 16; ++c) f.x[r * 16 + c] = widen(rows ? p[r * ldm + c] : p[c * ldm + r]);
}

inline void fill_fragment(fragment<accumulator, 16, 16, 16, float>& f, float v) {
    for (float& x : f.x) x = v;
}

template <typename T, typename LA, typename LB>
void mma_sync(fragment<accumulator, 16, 16, 16, float>& d, const fragment<matrix_a, 16, 16, 16, T, LA>& a,
              const fragment<matrix_b, 16, 16, 16, T, LB>& b, const fragment<accumulator, 16, 16, 16, float>& c) {
    float out[16 * 16];
    for (int r = 0; r < 16; ++r)
        for (int j = 0; j < 16; ++j) {
            double s = c.x[r * 16 + j];
            for (int k = 0; k < 16; ++k) s += (double)a.x[r * 16 + k] * (double)b.x[k * 16 + j];
            out[r * 16 + j] = (float)s;
        }
    std::memcpy(d.x, out, sizeof out);
}

inline void store_matrix_sync(float* p, const fragment<accumulator, 16, 16, 16, float>& f, unsigned ldm, layout_t layout) {
    for (int r = 0; r < 16; ++r)
        for (int c = 0; c < 16; ++c) (layout == mem_row_major ? p[r * ldm + c] : p[c * ldm + r]) = f.x[r * 16 + c];
}
}  // namespace nvcuda::wmma

// kernel<<<grid, block>>>(args...), for 1-D blocks of 32·k threads.
template <typename... P, typename... A>
void launch(dim3 grid, dim3 block, void (*kernel)(P...), A... args) {
    if (block.x % 32 != 0 || block.x > 1024 || block.y != 1 || block.z != 1) {
        std::fprintf(stderr, "launch: blocks are 1-D, of 32·k threads up to 1024\n");
        std::abort();
    }
    gridDim = grid;
    blockDim = block;
    emu::body = [=] { kernel(args...); };
    for (unsigned bz = 0; bz < grid.z; ++bz)
        for (unsigned by = 0; by < grid.y; ++by)
            for (unsigned bx = 0; bx < grid.x; ++bx) {
                blockIdx = dim3{bx, by, bz};
                emu::run_block(block.x);
            }
}
