// Helpers shared by the kernel families: the 16-bit storage type, conversions,
// warp and block reductions. Compiled through NVRTC (CuPy RawModule) or nvcc.
//
// -DUSE_BF16=1 selects bfloat16 for weights, activations and the KV cache;
// otherwise float16. Arithmetic and accumulation are always float32.
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>

#ifndef USE_BF16
#define USE_BF16 0
#endif

#if USE_BF16
typedef __nv_bfloat16 scalar_t;
typedef __nv_bfloat162 scalar2_t;
__device__ __forceinline__ float to_float(scalar_t x) { return __bfloat162float(x); }
__device__ __forceinline__ scalar_t from_float(float x) { return __float2bfloat16(x); }
__device__ __forceinline__ float2 to_float2(scalar2_t x) { return __bfloat1622float2(x); }
#else
typedef __half scalar_t;
typedef __half2 scalar2_t;
__device__ __forceinline__ float to_float(scalar_t x) { return __half2float(x); }
__device__ __forceinline__ scalar_t from_float(float x) { return __float2half(x); }
__device__ __forceinline__ float2 to_float2(scalar2_t x) { return __half22float2(x); }
#endif

// Programmatic dependent launch (Hopper): a kernel launched with the programmatic
// stream-serialization attribute may start while the previous one finishes; it must
// wait for that one's results before touching memory, and lets the next kernel start
// at once. Every kernel opens with PDL_ENTER(). Without the attribute (or before
// sm_90) both are no-ops.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define PDL_ENTER()                                            \
    do {                                                       \
        asm volatile("griddepcontrol.wait;" ::: "memory");     \
        asm volatile("griddepcontrol.launch_dependents;" :::); \
    } while (0)
#else
#define PDL_ENTER() \
    do {            \
    } while (0)
#endif

#define NEG_INF (__int_as_float(0xff800000))
#define POS_INF (__int_as_float(0x7f800000))

// 8 x 16-bit values moved as one 16-byte access
struct __align__(16) vec8 {
    scalar2_t v[4];
};

__device__ __forceinline__ void vec8_to_float(const vec8 &in, float out[8]) {
#pragma unroll
    for (int i = 0; i < 4; i++) {
        float2 f = to_float2(in.v[i]);
        out[2 * i] = f.x;
        out[2 * i + 1] = f.y;
    }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// block-wide sum / max; every thread gets the result. `scratch` holds >= 32 floats.
__device__ __forceinline__ float block_sum(float v, float *scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();  // scratch may still be read from a previous reduction
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : 0.0f;
    return warp_sum(v);
}

__device__ __forceinline__ float block_max(float v, float *scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : NEG_INF;
    return warp_max(v);
}
