// Skinny matrix products for decode batches of 1 to 16 rows, on the tensor cores:
// y (B, N) float32 = x (B, K) @ W^T, W (N, K) row-major 16-bit, x 16-bit.
//
// mma.sync m16n8k16 with x as the A operand (16 rows, zero beyond B) and W as the B
// operand (8 output features). Each lane loads 16 contiguous bytes of one weight row
// (8 k-values) and of the matching x rows, and feeds them to two MMAs: the k order
// inside a dot product is free, so W and x are permuted the same way. A block of WARPS
// warps shares 8 output features and splits K between its warps (chunks of 32,
// interleaved); the partial sums are added in a fixed order. Every output element is
// computed the same way whatever B is (batch invariance). K must be a multiple of 8.
//
// Weights do not depend on the previous kernel: before waiting for it (programmatic
// dependent launch), a block asks the L2 to fetch the first `prefetch` bytes of its rows,
// so the start of the stream overlaps the kernels before this one.
#include "common.cuh"

#ifndef WARPS
#define WARPS 8
#endif
#ifndef DEPTH
#define DEPTH 8  // chunks a warp loads per pass
#endif

// One pass of a warp over DEPTH chunks starting at chunk c0: loads first, then MMAs.
// CHECKED: some chunk may reach past K (those loads are skipped and read as zero).
template <bool WIDE, bool CHECKED>
__device__ __forceinline__ void skinny_pass(const uint4 *wrow, const uint4 *xrow, const uint4 *xrow2, float c[4],
                                            int c0, int q, int groups) {
    const uint4 zero = make_uint4(0, 0, 0, 0);
    uint4 wv[DEPTH], xv[DEPTH], yv[DEPTH];
#pragma unroll
    for (int u = 0; u < DEPTH; u++) {
        const int k8 = (c0 + u * WARPS) * 4 + q;  // this lane's 16-byte group of k
        const bool ok = !CHECKED || k8 < groups;
        wv[u] = ok ? __ldcs(wrow + k8) : zero;
        xv[u] = ok ? __ldg(xrow + k8) : zero;
        yv[u] = WIDE && ok ? __ldg(xrow2 + k8) : zero;
    }
#pragma unroll
    for (int u = 0; u < DEPTH; u++) {
        mma_16816(c, xv[u].x, yv[u].x, xv[u].y, yv[u].y, wv[u].x, wv[u].y);
        mma_16816(c, xv[u].z, yv[u].z, xv[u].w, yv[u].w, wv[u].z, wv[u].w);
    }
}

template <bool WIDE>  // WIDE: rows 8..15 of x exist (B > 8)
__device__ __forceinline__ void skinny(const scalar_t *__restrict__ x, const scalar_t *__restrict__ w,
                                       float *__restrict__ y, int B, int N, int K, int prefetch) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, q = lane & 3;  // mma group (row of x / feature of W) and lane in group
    const long long n = (long long)blockIdx.x * 8 + g;
    // Rows past N or B read row 0 instead: an MMA output row depends only on its own
    // input row, and those outputs are never stored.
    const uint4 *wrow = reinterpret_cast<const uint4 *>(w + (n < N ? n : 0) * K);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (prefetch > 0 && threadIdx.x < 8 && blockIdx.x * 8 + threadIdx.x < N)
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(w + ((long long)blockIdx.x * 8 + threadIdx.x) * K),
                     "r"(prefetch)
                     : "memory");
#endif
    PDL_ENTER();
    const int groups = K >> 3;  // 16-byte groups of k in a row
    const int chunks = (groups + 3) >> 2, whole = groups >> 2;
    const uint4 *xrow = reinterpret_cast<const uint4 *>(x + (long long)(g < B ? g : 0) * K);
    const uint4 *xrow2 = reinterpret_cast<const uint4 *>(x + (long long)(g + 8 < B ? g + 8 : 0) * K);
    float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    int c0 = warp;
    for (; c0 + (DEPTH - 1) * WARPS < whole; c0 += WARPS * DEPTH) skinny_pass<WIDE, false>(wrow, xrow, xrow2, c, c0, q, groups);
    for (; c0 < chunks; c0 += WARPS * DEPTH) skinny_pass<WIDE, true>(wrow, xrow, xrow2, c, c0, q, groups);
    // c: (x row g, features 2q, 2q+1) and (x row g + 8, same features); sum the warps in order
    __shared__ float part[WARPS][4][32];
#pragma unroll
    for (int i = 0; i < 4; i++) part[warp][i][lane] = c[i];
    __syncthreads();
    if (warp == 0) {
        float s[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            s[i] = part[0][i][lane];
#pragma unroll
            for (int v = 1; v < WARPS; v++) s[i] += part[v][i][lane];
        }
        const long long f = (long long)blockIdx.x * 8 + 2 * q;
#pragma unroll
        for (int j = 0; j < 2; j++) {
            if (f + j >= N) continue;
            if (g < B) y[(long long)g * N + f + j] = s[j];
            if (WIDE && g + 8 < B) y[(long long)(g + 8) * N + f + j] = s[2 + j];
        }
    }
}

// grid (ceil(N / 8)), block (32 WARPS); prefetch: bytes of each row to bring into the L2
// up front (a multiple of 16, at most 2 K)
extern "C" __global__ void __launch_bounds__(WARPS * 32) gemv_8(const scalar_t *__restrict__ x,
                                                                const scalar_t *__restrict__ w,
                                                                float *__restrict__ y, int B, int N, int K,
                                                                int prefetch) {
    skinny<false>(x, w, y, B, N, K, prefetch);
}

extern "C" __global__ void __launch_bounds__(WARPS * 32) gemv_16(const scalar_t *__restrict__ x,
                                                                 const scalar_t *__restrict__ w,
                                                                 float *__restrict__ y, int B, int N, int K,
                                                                 int prefetch) {
    skinny<true>(x, w, y, B, N, K, prefetch);
}
