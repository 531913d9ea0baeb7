// Thread-block clusters, distributed shared memory and bulk copies on an mbarrier (sm_90),
// shared by the kernels whose blocks work in clusters (attn_block.cu, mlp_block.cu). Built
// for older GPUs they compile to nothing (those kernels are never launched there).
#pragma once
#include "common.cuh"

// ------------------------------------------------------------------ clusters (sm_90)
__device__ __forceinline__ void cluster_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

__device__ __forceinline__ unsigned cluster_rank() {
    unsigned r = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
#endif
    return r;
}

// block `rank`'s shared memory at the offset of p in this block's, as a generic address: plain
// loads through it, which the compiler may issue together (the cluster barriers order them)
__device__ __forceinline__ const float *peer(const float *p, unsigned rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    unsigned long long a;
    asm("mapa.u64 %0, %1, %2;" : "=l"(a) : "l"(p), "r"(rank));
    return reinterpret_cast<const float *>(a);
#else
    return p;
#endif
}

// ------------------------------------------------------------------ bulk copies (sm_90)
// Weight rows come into shared memory as bulk copies that complete on an mbarrier: a few
// instructions a block, where 16-byte cp.async copies (18 a thread) held the block before its
// wait until most had landed, which made the kernel before it look longer.
// count: the arrivals that complete a phase (1: the thread that expects the bytes)
__device__ __forceinline__ void mbar_init(unsigned long long *bar, unsigned count = 1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.init.shared.b64 [%0], %1;\n\tfence.mbarrier_init.release.cluster;" ::"r"(smem_addr(bar)),
                 "r"(count)
                 : "memory");
#endif
}
__device__ __forceinline__ void mbar_expect(unsigned long long *bar, unsigned bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.arrive.expect_tx.shared.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
#endif
}
__device__ __forceinline__ void bulk_copy(void *dst, const void *src, unsigned bytes, unsigned long long *bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
#endif
}
__device__ __forceinline__ void mbar_arrive(unsigned long long *bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.arrive.shared.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
#endif
}
__device__ __forceinline__ void mbar_wait(unsigned long long *bar, unsigned parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile(
        "{\n\t.reg .pred done;\n"
        "WAIT_%=:\n\t"
        "mbarrier.try_wait.parity.shared.b64 done, [%0], %1;\n\t"
        "@!done bra WAIT_%=;\n\t}" ::"r"(smem_addr(bar)), "r"(parity) : "memory");
#endif
}

// The block's dynamic shared memory, to check it against the layout a kernel file computes
// (the Python side's smem_bytes must agree with it).
__device__ __forceinline__ unsigned dynamic_smem_bytes() {
    unsigned have = 0;
#if defined(__CUDA_ARCH__)
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(have));
#endif
    return have;
}

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
#define CLUSTER_DIMS __cluster_dims__(CLUSTER, 1, 1)
#else
#define CLUSTER_DIMS  // clusters need sm_90: built for older GPUs only to compile (never launched there)
#endif
