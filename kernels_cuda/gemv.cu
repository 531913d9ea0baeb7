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
// Epilogues: a block's 8 output features ("slots") need not be 8 consecutive weight rows.
// Plain stores y. SiluMul gives slots 0-3 gate rows and slots 4-7 the matching up rows, and
// stores SiLU(gate) * up (16-bit) for the down projection, so no separate activation
// kernel runs and the float32 gate/up product is never written. RopeKV gives slots 0-3
// four dims j of q/k heads and slots 4-7 their partners j + HEAD_DIM / 2, adds the bias,
// rotates, and writes q for attention and k, v into the KV cache (the blocks after the
// q/k pairs take the v rows in order). The arithmetic is the one of the separate kernels
// (common.cuh's helpers), so fused and unfused steps give the same bits.
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

struct Plain {
    float *y;
    int N;
    __device__ long long row(int bx, int s) const { return (long long)bx * 8 + s; }
    template <bool WIDE>
    __device__ void store(int bx, int g, int q, const float v[4], int B) const {
        const long long f = (long long)bx * 8 + 2 * q;
#pragma unroll
        for (int j = 0; j < 2; j++) {
            if (f + j >= N) continue;
            if (g < B) y[(long long)g * N + f + j] = v[j];
            if (WIDE && g + 8 < B) y[(long long)(g + 8) * N + f + j] = v[2 + j];
        }
    }
};

struct SiluMul {  // weight rows [gate (inter) | up (inter)], inter % 4 == 0; grid inter / 4
    scalar_t *act;  // (B, inter)
    int inter;
    __device__ long long row(int bx, int s) const { return (s < 4 ? 0 : inter) + (long long)bx * 4 + (s & 3); }
    template <bool WIDE>
    __device__ void store(int bx, int g, int q, const float v[4], int B) const {
        float up[4];
#pragma unroll
        for (int i = 0; i < 4; i++) up[i] = __shfl_xor_sync(0xffffffffu, v[i], 2);  // lane of slot + 4
        if (q >= 2) return;
#pragma unroll
        for (int j = 0; j < 2; j++) {
            const long long f = (long long)bx * 4 + 2 * q + j;
            if (g < B) act[(long long)g * inter + f] = from_float(silu_times(v[j], up[j]));
            if (WIDE && g + 8 < B) act[(long long)(g + 8) * inter + f] = from_float(silu_times(v[2 + j], up[2 + j]));
        }
    }
};

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#define HALF (HEAD_DIM / 2)

struct RopeKV {  // weight rows [q (H heads) | k (KVH) | v (KVH)] of HEAD_DIM; HALF % 4 == 0
    const float *bias;  // or null
    const int *positions;
    const float *cos_table, *sin_table;  // (max_len, HALF)
    scalar_t *q_out;                     // (B, H, HEAD_DIM)
    const long long *k_ptrs, *v_ptrs;
    long long layer_offset;
    int heads, kv_heads, pair_blocks;  // pair_blocks = (heads + kv_heads) * HALF / 4
    __device__ long long row(int bx, int s) const {
        if (bx >= pair_blocks) return (long long)(heads + kv_heads) * HEAD_DIM + (long long)(bx - pair_blocks) * 8 + s;
        const int p = bx * 4 + (s & 3);
        return (long long)(p / HALF) * HEAD_DIM + p % HALF + (s < 4 ? 0 : HALF);
    }
    __device__ float biased(float x, long long n) const { return bias != nullptr ? x + bias[n] : x; }
    __device__ void rotate_store(int t, int p, float x1, float x2) const {
        const int head = p / HALF, j = p % HALF;
        const long long n1 = (long long)head * HEAD_DIM + j;
        x1 = biased(x1, n1);
        x2 = biased(x2, n1 + HALF);
        const int pos = positions[t];
        float o1, o2;
        rope_rotate(x1, x2, cos_table[(long long)pos * HALF + j], sin_table[(long long)pos * HALF + j], o1, o2);
        scalar_t *dst = head < heads ? q_out + ((long long)t * heads + head) * HEAD_DIM
                                     : kv_row(k_ptrs, t, layer_offset, pos, kv_heads * HEAD_DIM) +
                                           (head - heads) * HEAD_DIM;
        dst[j] = from_float(o1);
        dst[j + HALF] = from_float(o2);
    }
    template <bool WIDE>
    __device__ void store(int bx, int g, int q, const float v[4], int B) const {
        float partner[4];
#pragma unroll
        for (int i = 0; i < 4; i++) partner[i] = __shfl_xor_sync(0xffffffffu, v[i], 2);
        if (bx < pair_blocks) {
            if (q >= 2) return;
#pragma unroll
            for (int j = 0; j < 2; j++) {
                const int p = bx * 4 + 2 * q + j;
                if (g < B) rotate_store(g, p, v[j], partner[j]);
                if (WIDE && g + 8 < B) rotate_store(g + 8, p, v[2 + j], partner[2 + j]);
            }
            return;
        }
        const int v_off = (heads + kv_heads) * HEAD_DIM;
#pragma unroll
        for (int j = 0; j < 2; j++) {
            const int f = (bx - pair_blocks) * 8 + 2 * q + j;  // dim within the v rows
#pragma unroll
            for (int half = 0; half < (WIDE ? 2 : 1); half++) {
                const int t = g + 8 * half;
                if (t < B)
                    kv_row(v_ptrs, t, layer_offset, positions[t], kv_heads * HEAD_DIM)[f] =
                        from_float(biased(v[2 * half + j], v_off + f));
            }
        }
    }
};

template <bool WIDE, class Epilogue>  // WIDE: rows 8..15 of x exist (B > 8)
__device__ __forceinline__ void skinny(const scalar_t *__restrict__ x, const scalar_t *__restrict__ w, int B, int N,
                                       int K, int prefetch, const Epilogue &epi) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, q = lane & 3;  // mma group (row of x / slot of W) and lane in group
    const long long n = epi.row(blockIdx.x, g);
    // Rows past N or B read row 0 instead: an MMA output row depends only on its own
    // input row, and those outputs are never stored.
    const uint4 *wrow = reinterpret_cast<const uint4 *>(w + (n < N ? n : 0) * K);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (prefetch > 0 && threadIdx.x < 8) {
        const long long pn = epi.row(blockIdx.x, threadIdx.x);
        if (pn < N)
            asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(w + pn * K), "r"(prefetch) : "memory");
    }
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
    // c: (x row g, slots 2q, 2q+1) and (x row g + 8, same slots); sum the warps in order
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
        epi.template store<WIDE>(blockIdx.x, g, q, s, B);
    }
}

// Kernels: grid (blocks the epilogue asks for), block (32 WARPS); prefetch: bytes of each
// weight row to bring into the L2 up front (a multiple of 16, at most 2 K). EPI: the
// epilogue built from the kernel's own parameters (the ones after `prefetch`).
#define SKINNY_KERNELS(NAME, EPI, ...)                                                                           \
    extern "C" __global__ void __launch_bounds__(WARPS * 32)                                                     \
        NAME##_8(const scalar_t *__restrict__ x, const scalar_t *__restrict__ w, int B, int N, int K, int prefetch, \
                 __VA_ARGS__) {                                                                                  \
        skinny<false>(x, w, B, N, K, prefetch, EPI);                                                             \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(WARPS * 32)                                                     \
        NAME##_16(const scalar_t *__restrict__ x, const scalar_t *__restrict__ w, int B, int N, int K,            \
                  int prefetch, __VA_ARGS__) {                                                                   \
        skinny<true>(x, w, B, N, K, prefetch, EPI);                                                              \
    }

// y (B, N) float32
SKINNY_KERNELS(gemv, (Plain{y, N}), float *__restrict__ y)
// act (B, N / 2) 16-bit = SiLU(gate) * up
SKINNY_KERNELS(gemv_silu, (SiluMul{act, N / 2}), scalar_t *__restrict__ act)
// q_out (B, H, HEAD_DIM) and the token's K/V rows; N = (heads + 2 kv_heads) * HEAD_DIM
SKINNY_KERNELS(gemv_rope,
               (RopeKV{bias, positions, cos_table, sin_table, q_out, k_ptrs, v_ptrs, layer_offset, heads, kv_heads,
                       (heads + kv_heads) * HALF / 4}),
               const float *__restrict__ bias, const int *__restrict__ positions, const float *__restrict__ cos_table,
               const float *__restrict__ sin_table, scalar_t *__restrict__ q_out,
               const long long *__restrict__ k_ptrs, const long long *__restrict__ v_ptrs, long long layer_offset,
               int heads, int kv_heads)
