// Matrix-vector products for small batches (decode): y (B, N) float32 = x (B, K) @ W^T,
// W (N, K) row-major 16-bit, x 16-bit. One warp per output row; 16-byte loads of W,
// unrolled so several are in flight; each weight load serves all B rows of x.
// K must be a multiple of 8. gemv_<B> for B = 1..8.
#include "common.cuh"

#define DEPTH 8  // 16-byte weight loads each lane keeps in flight before using them

template <int B>
__device__ __forceinline__ void gemv_body(const scalar_t *__restrict__ x, const scalar_t *__restrict__ w,
                                          float *__restrict__ y, int N, int K) {
    const int warps = blockDim.x >> 5, lane = threadIdx.x & 31;
    const long long n = (long long)blockIdx.x * warps + (threadIdx.x >> 5);
    if (n >= N) return;
    const uint4 *wr = reinterpret_cast<const uint4 *>(w + n * K);
    const int chunks = K >> 3;
    float acc[B];
#pragma unroll
    for (int b = 0; b < B; b++) acc[b] = 0.0f;
    // lane l sums chunks l, l + 32, l + 64, ... in that order (the same for every B)
    for (int c0 = lane; c0 < chunks; c0 += 32 * DEPTH) {
        uint4 wv[DEPTH];
#pragma unroll
        for (int u = 0; u < DEPTH; u++) {
            const int c = c0 + u * 32;
            wv[u] = c < chunks ? __ldcs(wr + c) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < DEPTH; u++) {
            const int c = c0 + u * 32;
            if (c >= chunks) break;
            float wf[8];
            vec8_to_float(*reinterpret_cast<const vec8 *>(&wv[u]), wf);
#pragma unroll
            for (int b = 0; b < B; b++) {
                const uint4 xraw = __ldg(reinterpret_cast<const uint4 *>(x + (long long)b * K) + c);
                float xf[8];
                vec8_to_float(*reinterpret_cast<const vec8 *>(&xraw), xf);
#pragma unroll
                for (int i = 0; i < 8; i++) acc[b] += wf[i] * xf[i];
            }
        }
    }
#pragma unroll
    for (int b = 0; b < B; b++) {
        const float v = warp_sum(acc[b]);
        if (lane == 0) y[(long long)b * N + n] = v;
    }
}

#define GEMV(BB)                                                                                              \
    extern "C" __global__ void gemv_##BB(const scalar_t *__restrict__ x, const scalar_t *__restrict__ w,     \
                                         float *__restrict__ y, int N, int K) {                               \
        gemv_body<BB>(x, w, y, N, K);                                                                   \
    }
GEMV(1) GEMV(2) GEMV(3) GEMV(4) GEMV(5) GEMV(6) GEMV(7) GEMV(8)
