// Skinny matrix products for decode batches of 1 to 16 rows, on the tensor cores:
// y (B, N) float32 = x (B, K) @ W^T, W (N, K) row-major 16-bit, x 16-bit.
//
// mma.sync m16n8k16 with x as the A operand (16 rows, zero beyond B) and W as the B
// operand (8 output features). Each lane loads 16 contiguous bytes of one weight row
// (8 k-values) and of the matching x rows, and feeds them to two MMAs: the k order
// inside a dot product is free, so W and x are permuted the same way. A block of
// 8 warps shares 8 output features and splits K between its warps (chunks of 32,
// interleaved); the partial sums are added in a fixed order. Every output element is
// computed the same way whatever B is (batch invariance). K must be a multiple of 8.
#include "common.cuh"

#define WARPS 8
#define DEPTH 8  // 32-k chunks a warp keeps in flight

#if USE_BF16
#define MMA_TYPE "bf16"
#else
#define MMA_TYPE "f16"
#endif

__device__ __forceinline__ void mma_16816(float c[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                          unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." MMA_TYPE "." MMA_TYPE ".f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

template <bool WIDE>  // WIDE: rows 8..15 of x exist (B > 8)
__device__ __forceinline__ void skinny(const scalar_t *__restrict__ x, const scalar_t *__restrict__ w,
                                       float *__restrict__ y, int B, int N, int K) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, q = lane & 3;  // mma group (row of x / feature of W) and lane in group
    const long long n = (long long)blockIdx.x * 8 + g;
    const int chunks = (K + 31) >> 5;
    const uint4 zero = make_uint4(0, 0, 0, 0);
    const uint4 *wrow = reinterpret_cast<const uint4 *>(w + (n < N ? n : 0) * K);
    const uint4 *xrow = reinterpret_cast<const uint4 *>(x + (long long)(g < B ? g : 0) * K);
    const uint4 *xrow2 = reinterpret_cast<const uint4 *>(x + (long long)(g + 8 < B ? g + 8 : 0) * K);
    float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int c0 = warp; c0 < chunks; c0 += WARPS * DEPTH) {
        uint4 wv[DEPTH], xv[DEPTH], yv[DEPTH];
#pragma unroll
        for (int u = 0; u < DEPTH; u++) {
            const int ch = c0 + u * WARPS;
            const int k8 = ch * 4 + q;  // this lane's 16-byte group of k
            const bool ok = ch < chunks && k8 * 8 < K;
            wv[u] = ok && n < N ? __ldcs(wrow + k8) : zero;
            xv[u] = ok && g < B ? __ldg(xrow + k8) : zero;
            yv[u] = WIDE && ok && g + 8 < B ? __ldg(xrow2 + k8) : zero;
        }
#pragma unroll
        for (int u = 0; u < DEPTH; u++) {
            mma_16816(c, xv[u].x, yv[u].x, xv[u].y, yv[u].y, wv[u].x, wv[u].y);
            mma_16816(c, xv[u].z, yv[u].z, xv[u].w, yv[u].w, wv[u].z, wv[u].w);
        }
    }
    // c: (x row g, features 2q, 2q+1) and (x row g + 8, same features); sum the warps in order
    __shared__ float part[WARPS][32][4];
#pragma unroll
    for (int i = 0; i < 4; i++) part[warp][lane][i] = c[i];
    __syncthreads();
    if (warp == 0) {
        float s[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            s[i] = part[0][lane][i];
#pragma unroll
            for (int v = 1; v < WARPS; v++) s[i] += part[v][lane][i];
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

// grid (ceil(N / 8)), block (256)
extern "C" __global__ void __launch_bounds__(WARPS * 32) gemv_8(const scalar_t *__restrict__ x,
                                                                const scalar_t *__restrict__ w,
                                                                float *__restrict__ y, int B, int N, int K) {
    PDL_ENTER();
    skinny<false>(x, w, y, B, N, K);
}

extern "C" __global__ void __launch_bounds__(WARPS * 32) gemv_16(const scalar_t *__restrict__ x,
                                                                 const scalar_t *__restrict__ w,
                                                                 float *__restrict__ y, int B, int N, int K) {
    PDL_ENTER();
    skinny<true>(x, w, y, B, N, K);
}
