// Skinny matrix products for decode batches of 1 to 16 rows, on the tensor cores:
// y (B, N) float32 = x (B, K) @ W^T, W (N, K) row-major 16-bit, x 16-bit.
//
// mma.sync m16n8k16 with x as the A operand (16 rows, zero beyond B) and W as the B
// operand (8 output features per tile). Each lane loads VEC x 16 contiguous bytes of one
// weight row and of the matching x rows, and feeds each 16 bytes to two MMAs: the k order
// inside a dot product is free, so W and x are permuted the same way. A block of WARPS
// warps shares NTILE x 8 output features and splits K between its warps (chunks of
// 32 x VEC, interleaved); the partial sums are added in a fixed order. Every output
// element is computed the same way whatever B is (batch invariance). K must be a
// multiple of 8. The shape constants are -D options (gemv.py holds the chosen ones;
// bench/kernels.py --gemv-sweep compares others).
#include "common.cuh"

#ifndef WARPS
#define WARPS 8
#endif
#ifndef DEPTH
#define DEPTH 8  // chunks a warp keeps in flight
#endif
#ifndef NTILE
#define NTILE 1  // 8-feature tiles per block
#endif
#ifndef VEC
#define VEC 1  // 16-byte loads per lane per chunk
#endif
#ifndef STAGES
#define STAGES 0  // > 0: weights stream through a cp.async ring of this many chunks per warp
#endif

// One pass of a warp over DEPTH chunks starting at chunk c0: loads first, then MMAs.
// CHECKED: some chunk may reach past K (those loads are skipped and read as zero);
// otherwise the loads are unconditional, so all of them are in flight at once.
template <bool WIDE, bool CHECKED>
__device__ __forceinline__ void skinny_pass(const uint4 *const wrow[NTILE], const uint4 *xrow, const uint4 *xrow2,
                                            float c[NTILE][4], int c0, int q, int groups) {
    const uint4 zero = make_uint4(0, 0, 0, 0);
    uint4 wv[NTILE][DEPTH][VEC], xv[DEPTH][VEC], yv[DEPTH][VEC];
#pragma unroll
    for (int u = 0; u < DEPTH; u++) {
#pragma unroll
        for (int v = 0; v < VEC; v++) {
            const int k8 = (c0 + u * WARPS) * 4 * VEC + q * VEC + v;  // this lane's 16-byte group of k
            const bool ok = !CHECKED || k8 < groups;
#pragma unroll
            for (int t = 0; t < NTILE; t++) wv[t][u][v] = ok ? __ldcs(wrow[t] + k8) : zero;
            xv[u][v] = ok ? __ldg(xrow + k8) : zero;
            yv[u][v] = WIDE && ok ? __ldg(xrow2 + k8) : zero;
        }
    }
#pragma unroll
    for (int u = 0; u < DEPTH; u++) {
#pragma unroll
        for (int v = 0; v < VEC; v++) {
#pragma unroll
            for (int t = 0; t < NTILE; t++) {
                mma_16816(c[t], xv[u][v].x, yv[u][v].x, xv[u][v].y, yv[u][v].y, wv[t][u][v].x, wv[t][u][v].y);
                mma_16816(c[t], xv[u][v].z, yv[u][v].z, xv[u][v].w, yv[u][v].w, wv[t][u][v].z, wv[t][u][v].w);
            }
        }
    }
}

// The weights through a ring of STAGES chunks in shared memory, filled by cp.async:
// STAGES - 1 chunks are in flight whatever the compiler schedules. Each lane copies its
// own 16-byte pieces and reads back only those, so no barrier is needed.
template <bool WIDE>
__device__ __forceinline__ void skinny_async(const uint4 *const wrow[NTILE], const uint4 *xrow, const uint4 *xrow2,
                                             float c[NTILE][4], int warp, int lane, int q, int groups, int chunks) {
    __shared__ __align__(16) uint4 ring[WARPS][STAGES > 0 ? STAGES : 1][NTILE * VEC][32];
    const uint4 zero = make_uint4(0, 0, 0, 0);
    const int mine = warp < chunks ? (chunks - warp + WARPS - 1) / WARPS : 0;  // chunks warp, warp + WARPS, ...
    auto issue = [&](int i) {
        if (i < mine) {
#pragma unroll
            for (int v = 0; v < VEC; v++) {
                const int k8 = (warp + i * WARPS) * 4 * VEC + q * VEC + v;
                const bool ok = k8 < groups;
#pragma unroll
                for (int t = 0; t < NTILE; t++)
                    cp_async16(&ring[warp][i % STAGES][t * VEC + v][lane], wrow[t] + (ok ? k8 : 0), ok);
            }
        }
        cp_async_commit();
    };
#pragma unroll
    for (int i = 0; i < STAGES - 1; i++) issue(i);
    for (int i = 0; i < mine; i++) {
        issue(i + STAGES - 1);
        cp_async_wait<STAGES - 1>();  // chunk i has landed
#pragma unroll
        for (int v = 0; v < VEC; v++) {
            const int k8 = (warp + i * WARPS) * 4 * VEC + q * VEC + v;
            const bool ok = k8 < groups;
            const uint4 xv = ok ? __ldg(xrow + k8) : zero;
            const uint4 yv = WIDE && ok ? __ldg(xrow2 + k8) : zero;
#pragma unroll
            for (int t = 0; t < NTILE; t++) {
                const uint4 wv = ring[warp][i % STAGES][t * VEC + v][lane];
                mma_16816(c[t], xv.x, yv.x, xv.y, yv.y, wv.x, wv.y);
                mma_16816(c[t], xv.z, yv.z, xv.w, yv.w, wv.z, wv.w);
            }
        }
    }
    cp_async_wait<0>();
}

template <bool WIDE>  // WIDE: rows 8..15 of x exist (B > 8)
__device__ __forceinline__ void skinny(const scalar_t *__restrict__ x, const scalar_t *__restrict__ w,
                                       float *__restrict__ y, int B, int N, int K) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, q = lane & 3;  // mma group (row of x / feature of W) and lane in group
    const int groups = K >> 3;              // 16-byte groups of k in a row
    const int chunks = (groups + 4 * VEC - 1) / (4 * VEC), whole = groups / (4 * VEC);
    // Rows past N or B read row 0 instead: an MMA output row depends only on its own input
    // row, and those outputs are never stored.
    const uint4 *wrow[NTILE];
#pragma unroll
    for (int t = 0; t < NTILE; t++) {
        const long long n = ((long long)blockIdx.x * NTILE + t) * 8 + g;
        wrow[t] = reinterpret_cast<const uint4 *>(w + (n < N ? n : 0) * K);
    }
    const uint4 *xrow = reinterpret_cast<const uint4 *>(x + (long long)(g < B ? g : 0) * K);
    const uint4 *xrow2 = reinterpret_cast<const uint4 *>(x + (long long)(g + 8 < B ? g + 8 : 0) * K);
    float c[NTILE][4];
#pragma unroll
    for (int t = 0; t < NTILE; t++) c[t][0] = c[t][1] = c[t][2] = c[t][3] = 0.0f;
    if (STAGES > 0) {
        skinny_async<WIDE>(wrow, xrow, xrow2, c, warp, lane, q, groups, chunks);
    } else {
        int c0 = warp;
        for (; c0 + (DEPTH - 1) * WARPS < whole; c0 += WARPS * DEPTH)
            skinny_pass<WIDE, false>(wrow, xrow, xrow2, c, c0, q, groups);
        for (; c0 < chunks; c0 += WARPS * DEPTH) skinny_pass<WIDE, true>(wrow, xrow, xrow2, c, c0, q, groups);
    }
    // c[t]: (x row g, features 2q, 2q+1 of tile t) and (x row g + 8, same features); sum the warps in order
    __shared__ float part[WARPS][NTILE * 4][32];
#pragma unroll
    for (int t = 0; t < NTILE; t++)
#pragma unroll
        for (int i = 0; i < 4; i++) part[warp][t * 4 + i][lane] = c[t][i];
    __syncthreads();
    for (int e = warp; e < NTILE; e += WARPS) {  // warp e writes tile e
        float s[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            s[i] = part[0][e * 4 + i][lane];
#pragma unroll
            for (int v = 1; v < WARPS; v++) s[i] += part[v][e * 4 + i][lane];
        }
        const long long f = ((long long)blockIdx.x * NTILE + e) * 8 + 2 * q;
#pragma unroll
        for (int j = 0; j < 2; j++) {
            if (f + j >= N) continue;
            if (g < B) y[(long long)g * N + f + j] = s[j];
            if (WIDE && g + 8 < B) y[(long long)(g + 8) * N + f + j] = s[2 + j];
        }
    }
}

// grid (ceil(N / (8 NTILE))), block (32 WARPS)
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
