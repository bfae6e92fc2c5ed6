// What every fused op's CUDA kernels share: the element types (f32, bf16, f16; every kernel
// computes in f32 and rounds once when it writes), block-wide reductions, and the macro that
// instantiates a kernel once per type under the names the Rust side loads (`<name>_f32`, ...).
//
// Kernels are written for any block of 32·k threads (k ≤ 32): the host picks the block size,
// and the CPU emulation in tests/cuda_emulation runs them with several.
#pragma once

#ifdef __CUDACC__
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>
#endif

typedef __nv_bfloat16 bf16;
typedef __half f16;

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f32(f16 x) { return __half2float(x); }

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16 from_f32<bf16>(float x) { return __float2bfloat16(x); }
template <> __device__ __forceinline__ f16 from_f32<f16>(float x) { return __float2half(x); }

// Sum over the 32 lanes of a warp; every lane gets it.
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum (is_max false) or max over the block; every thread gets it. Called by every thread of
// the block (it synchronises).
__device__ __forceinline__ float block_reduce(float v, bool is_max) {
    __shared__ float partial[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = is_max ? warp_max(v) : warp_sum(v);
    __syncthreads();  // a previous call's readers are done with `partial`
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    const float none = is_max ? -INFINITY : 0.0f;
    v = lane < warps ? partial[lane] : none;
    return is_max ? warp_max(v) : warp_sum(v);
}

__device__ __forceinline__ float block_sum(float v) { return block_reduce(v, false); }
__device__ __forceinline__ float block_max(float v) { return block_reduce(v, true); }

// Four elements moved by one load or store (8 bytes of bf16, 16 of f32): elementwise kernels
// bound by memory transactions take them four at a time where `fours` allows.
template <typename T> struct alignas(4 * sizeof(T)) Four {
    T v[4];
};

// Whether n is a multiple of 4 and every pointer is aligned for Four<T>.
template <typename T>
__device__ __forceinline__ bool fours(long long n, const void* a, const void* b, const void* c, const void* d) {
    const uintptr_t any = (uintptr_t)a | (uintptr_t)b | (uintptr_t)c | (uintptr_t)d;
    return n % 4 == 0 && any % sizeof(Four<T>) == 0;
}

// extern "C" entry points <name>_f32, <name>_bf16, <name>_f16 of a kernel template
// `name##_kernel<T>` whose parameters are PARAMS (with T standing for the element type) and
// whose arguments are ARGS.
#define INSTANTIATE(name, PARAMS, ARGS)                                                            \
    extern "C" __global__ void name##_f32 PARAMS(float) { name##_kernel<float> ARGS; }           \
    extern "C" __global__ void name##_bf16 PARAMS(bf16) { name##_kernel<bf16> ARGS; }            \
    extern "C" __global__ void name##_f16 PARAMS(f16) { name##_kernel<f16> ARGS; }
