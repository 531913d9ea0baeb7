// Hopper's warpgroup MMA (wgmma, sm_90a), shared by the kernels built for it (gemm_fp8.cu,
// flash_prefill_wgmma.cu): shared-memory descriptors of 128-byte-swizzled K-major tiles, the
// fence / commit / wait instructions, and operand lists for the accumulators. Built for
// another target the instructions compile to nothing (those kernels are never launched there).
#pragma once
#include "cluster.cuh"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define WGMMA_OK 1
#else
#define WGMMA_OK 0
#endif

// shared-memory matrix descriptor of a K-major tile of 128-byte rows, 128-byte swizzle: 8-row
// groups 1,024 bytes apart; the tile starts on a 1,024-byte boundary, and a step of 32 bytes of K
// within the row (k32 in e4m3, k16 in 16 bits) advances the start by 32 bytes. Element (r, c) of
// such a tile, c counted in 16-byte chunks: common.cuh's smem_swizzle(r, c). Shared memory ends below 256 KB,
// so the address field (bits 0-13, address / 16) never carries: the descriptor of p + n (n a
// multiple of 16) is smem_desc(p) + n / 16.
__device__ __forceinline__ unsigned long long smem_desc(const void *p) {
    const unsigned long long addr = smem_addr(p);
    return ((addr & 0x3FFFF) >> 4) | (1ull << 16) | ((1024ull >> 4) << 32) | (1ull << 62);
}

// orders this thread's plain shared-memory writes before the MMAs' (async proxy) reads of them;
// then an mbarrier arrival hands them over
__device__ __forceinline__ void fence_proxy_async() {
#if WGMMA_OK
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

__device__ __forceinline__ void wgmma_fence() {
#if WGMMA_OK
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#if WGMMA_OK
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
#if WGMMA_OK
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
#endif
}
// keeps the compiler from moving accumulator reads/writes across the asynchronous MMAs
template <int R>
__device__ __forceinline__ void fence_acc(float (&d)[R]) {
#pragma unroll
    for (int i = 0; i < R; i++) asm volatile("" : "+f"(d[i])::"memory");
}

// An asm statement's operands are literals: the accumulators go in 8 at a time, WG_P<k> naming
// operands 8k..8k+7 and WG_F8(8k) binding d[8k..8k+7].
#define WG_P0 "%0, %1, %2, %3, %4, %5, %6, %7"
#define WG_P1 "%8, %9, %10, %11, %12, %13, %14, %15"
#define WG_P2 "%16, %17, %18, %19, %20, %21, %22, %23"
#define WG_P3 "%24, %25, %26, %27, %28, %29, %30, %31"
#define WG_P4 "%32, %33, %34, %35, %36, %37, %38, %39"
#define WG_P5 "%40, %41, %42, %43, %44, %45, %46, %47"
#define WG_P6 "%48, %49, %50, %51, %52, %53, %54, %55"
#define WG_P7 "%56, %57, %58, %59, %60, %61, %62, %63"
#define WG_P8 "%64, %65, %66, %67, %68, %69, %70, %71"
#define WG_P9 "%72, %73, %74, %75, %76, %77, %78, %79"
#define WG_P10 "%80, %81, %82, %83, %84, %85, %86, %87"
#define WG_P11 "%88, %89, %90, %91, %92, %93, %94, %95"
#define WG_P12 "%96, %97, %98, %99, %100, %101, %102, %103"
#define WG_P13 "%104, %105, %106, %107, %108, %109, %110, %111"
#define WG_P14 "%112, %113, %114, %115, %116, %117, %118, %119"
#define WG_P15 "%120, %121, %122, %123, %124, %125, %126, %127"
#define WG_F8(i)                                                                                    \
    "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
        "+f"(d[i + 6]), "+f"(d[i + 7])
