// The second half of a small model's decoder layer in one kernel, for decode steps of up to
// 16 rows: the o product, the residual add and post-attention RMSNorm, gate/up, SiLU * up and
// the down product. A one-row step of a small model is a chain of short kernels whose time
// follows the number of dependent stages, not bytes (docs/performance.md): this is one stage
// where the separate kernels take three (o, gate/up + SiLU with the norm folded in, down).
//
// grid (INTER / FEAT), clusters of CLUSTER blocks. Block j of the grid owns intermediate
// features [j FEAT, (j + 1) FEAT); block c of a cluster owns o features [c OC, (c + 1) OC).
// Before the wait for the previous kernel (programmatic dependent launch) a block brings into
// shared memory what nothing in the step writes: its o weight rows (OC rows of QW), its gate
// and up rows (FEAT each, of HIDDEN) and its down columns (HIDDEN rows of FEAT, stored as one
// contiguous block: mlp_block.py's down_blocks). After it:
//  1. o: the block's OC features of every row from the attention output, brought into shared
//     memory first (tensor cores, the k-steps spread over the warps, their sums added in warp
//     order).
//  2. The cluster now holds the whole o product (each cluster computes it: its weights are
//     small and come from the L2). A warp a row: res + o (+ bias), its RMSNorm, the normed
//     row to shared memory (16-bit, as the separate kernels store it); block 0 of the grid
//     writes res + o (+ bias) to res_out, the residual stream after the attention.
//  3. gate/up of the block's features, SiLU(gate) * up rounded to the 16-bit type.
//  4. down: the block's features' share of every output, a float32 row of HIDDEN.
//  5. The cluster adds its blocks' shares in rank order; block c writes the sums of its o
//     features' columns to out_parts[cluster]. down = the parts added in order, which the next
//     kernel does (the folded norm of the next QKV product, add_rms_norm, gemv.cu's NormIn).
//
// The arithmetic: float32 sums of 16-bit operands; o, the normed row and SiLU * up are rounded
// as the separate kernels store them, but the sums run in other orders than the skinny GEMM's,
// so the bits differ from the separate kernels': the runner uses this kernel for every step
// of up to 16 rows or none. A row's arithmetic does not depend on the other rows (an MMA row
// is its own), so decoding stays batch-invariant.
//
// -DHIDDEN, -DQW (heads x head_dim), -DINTER, -DUSE_BF16; dynamic shared memory: mlp_block.py's
// smem_bytes (the kernel checks it).
#include "cluster.cuh"

#ifndef HIDDEN
#define HIDDEN 576
#endif
#ifndef QW
#define QW 576
#endif
#ifndef INTER
#define INTER 1536
#endif
#define CLUSTER 8
#define FEAT 16  // intermediate features a block owns: one k-step of the down product
#define THREADS 256
#define WARPS (THREADS / 32)
#define MAX_ROWS 16

constexpr int OC = HIDDEN / CLUSTER;  // o features a block owns
constexpr int PAD = 8;                // 16-bit values of padding after each shared row (no bank conflicts)
constexpr int OS = QW + PAD, XS = HIDDEN + PAD, AS = FEAT + PAD;
constexpr int XW = (QW > HIDDEN ? QW : HIDDEN) + PAD;  // sX's rows: the attention rows, then the normed rows
static_assert(HIDDEN % (8 * CLUSTER) == 0 && OC % 8 == 0, "HIDDEN / CLUSTER must be a multiple of 8");
static_assert(QW % 16 == 0 && HIDDEN % 16 == 0, "o and gate/up take k-steps of 16");
static_assert(INTER % (FEAT * CLUSTER) == 0, "INTER must be a multiple of FEAT x CLUSTER");

#ifndef PHASES  // exploration: block 0's global timer at each phase to phase_t
#define PHASES 0
#endif
#if PHASES
__device__ unsigned long long phase_t[16];
#define PHASE(i)                                                                                         \
    do {                                                                                                 \
        if (blockIdx.x == 0 && threadIdx.x == 0) {                                                       \
            unsigned long long t;                                                                        \
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));                                        \
            phase_t[i] = t;                                                                              \
        }                                                                                                \
    } while (0)
#else
#define PHASE(i)
#endif

constexpr int align16(int n) { return (n + 15) / 16 * 16; }
constexpr int OFF_O = 0;                                           // OC x OS 16-bit: o rows
constexpr int OFF_GU = OFF_O + align16(OC * OS * 2);               // 2 FEAT x XS 16-bit: gate, then up rows
constexpr int OFF_D = OFF_GU + align16(2 * FEAT * XS * 2);         // HIDDEN x FEAT 16-bit: down columns
constexpr int OFF_X = OFF_D + align16(HIDDEN * FEAT * 2);          // MAX_ROWS x XW 16-bit: attention / normed rows
constexpr int OFF_A = OFF_X + align16(MAX_ROWS * XW * 2);          // MAX_ROWS x AS 16-bit: SiLU * up
constexpr int OFF_OUT = OFF_A + align16(MAX_ROWS * AS * 2);        // MAX_ROWS x OC float: this block's o
constexpr int NT_O = OC / 8, NT_GU = 2 * FEAT / 8;                 // 8-feature tiles of o and gate/up
constexpr int RED = WARPS * (NT_O > NT_GU ? NT_O : NT_GU) * 128;   // floats of the warps' partial sums
constexpr int OFF_G = OFF_OUT + align16(MAX_ROWS * OC * 4);        // MAX_ROWS x 2 FEAT float: gate, up
constexpr int OFF_Y = OFF_G + align16(MAX_ROWS * 2 * FEAT * 4);    // MAX_ROWS x HIDDEN float: down share
constexpr int Y_FLOATS = MAX_ROWS * HIDDEN > RED ? MAX_ROWS * HIDDEN : RED;  // (the partial sums before)
constexpr int SMEM_BYTES = OFF_Y + Y_FLOATS * 4;

// A (16 rows x 16 k) fragments of rows g and g + 8 at k-step ks from 16-bit rows `stride`
// values apart (rows past B read row 0: an MMA row depends only on its own input row)
__device__ __forceinline__ void a_frag(const scalar_t *x, int stride, int B, int g, int q, int ks, unsigned a[4]) {
    const scalar_t *r0 = x + (g < B ? g : 0) * stride + ks * 16 + 2 * q;
    const scalar_t *r1 = x + (g + 8 < B ? g + 8 : 0) * stride + ks * 16 + 2 * q;
    a[0] = *reinterpret_cast<const unsigned *>(r0);
    a[1] = *reinterpret_cast<const unsigned *>(r1);
    a[2] = *reinterpret_cast<const unsigned *>(r0 + 8);
    a[3] = *reinterpret_cast<const unsigned *>(r1 + 8);
}

// NT 8-feature tiles of y (B x 8 NT) = x (B x 16 KSTEPS) . w^T, x in shared memory, w (8 NT
// rows, `ws` apart) in shared or global memory: warp v takes k-steps v, v + WARPS, ..., all NT
// tiles (NT independent accumulators; the loop unrolled, so that a warp's loads are in flight
// together), and the warps' sums are added in warp order (red: WARPS x NT x 128 floats).
// out(row, feature, value) for rows < B; every thread may call it.
template <int NT, int KSTEPS, class Out>
__device__ __forceinline__ void ksplit_product(const scalar_t *x, int xs, int B, const scalar_t *w, int ws,
                                               float *red, Out out) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    float c[NT][4];
#pragma unroll
    for (int t = 0; t < NT; t++) c[t][0] = c[t][1] = c[t][2] = c[t][3] = 0.0f;
#pragma unroll
    for (int i = 0; i < (KSTEPS + WARPS - 1) / WARPS; i++) {
        const int ks = warp + i * WARPS;
        if (ks >= KSTEPS) break;
        unsigned a[4];
        a_frag(x, xs, B, g, q, ks, a);
#pragma unroll
        for (int t = 0; t < NT; t++) {
            const scalar_t *wr = w + (8 * t + g) * ws + ks * 16 + 2 * q;
            mma_16816(c[t], a[0], a[1], a[2], a[3], *reinterpret_cast<const unsigned *>(wr),
                      *reinterpret_cast<const unsigned *>(wr + 8));
        }
    }
#pragma unroll
    for (int t = 0; t < NT; t++)
#pragma unroll
        for (int i = 0; i < 4; i++) red[((warp * NT + t) * 4 + i) * 32 + lane] = c[t][i];
    __syncthreads();
    for (int e = threadIdx.x; e < NT * 128; e += THREADS) {  // e = (t * 4 + i) * 32 + lane
        float s = red[e];
#pragma unroll
        for (int v = 1; v < WARPS; v++) s += red[v * NT * 128 + e];
        const int t = e / 128, i = (e / 32) % 4, l = e % 32;
        const int row = (l >> 2) + (i >= 2 ? 8 : 0), f = 8 * t + 2 * (l & 3) + (i & 1);
        if (row < B) out(row, f, s);
    }
    __syncthreads();  // red is free again
}

extern "C" __global__ void CLUSTER_DIMS __launch_bounds__(THREADS, 1) mlp_block(
    const float *__restrict__ res,         // (B, HIDDEN) the residual stream before the attention block
    const scalar_t *__restrict__ attn,     // (B, QW) the attention output
    const scalar_t *__restrict__ w_o,      // (HIDDEN, QW)
    const float *__restrict__ o_bias,      // (HIDDEN,) or null
    const float *__restrict__ norm_w,      // (HIDDEN,) the post-attention norm's weights
    float eps,
    float *__restrict__ res_out,           // (B, HIDDEN) res + o (+ bias); not res
    const scalar_t *__restrict__ w_gu,     // (2 INTER, HIDDEN): gate rows, then up rows
    const scalar_t *__restrict__ w_down,   // (INTER / FEAT, HIDDEN, FEAT): down's columns, a block's together
    float *__restrict__ out_parts,         // (INTER / FEAT / CLUSTER, B, HIDDEN), parts part_stride apart
    long long part_stride, int B) {
    const int j = blockIdx.x, cl = j / CLUSTER;
    const int c = (int)cluster_rank();
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    extern __shared__ __align__(128) unsigned char smem[];
    if (tid == 0 && (dynamic_smem_bytes() < SMEM_BYTES || B > MAX_ROWS)) __trap();  // mlp_block.py disagrees with this file
    scalar_t *sO = reinterpret_cast<scalar_t *>(smem + OFF_O);
    scalar_t *sGU = reinterpret_cast<scalar_t *>(smem + OFF_GU);
    scalar_t *sD = reinterpret_cast<scalar_t *>(smem + OFF_D);
    scalar_t *sX = reinterpret_cast<scalar_t *>(smem + OFF_X);
    scalar_t *sA = reinterpret_cast<scalar_t *>(smem + OFF_A);
    float *sOut = reinterpret_cast<float *>(smem + OFF_OUT);
    float *sG = reinterpret_cast<float *>(smem + OFF_G);
    float *sY = reinterpret_cast<float *>(smem + OFF_Y);

    // ---- before the wait: the weights (nothing in the step writes them)
    PHASE(0);
    __shared__ __align__(8) unsigned long long wbar;
    if (tid == 0) mbar_init(&wbar);
    __syncthreads();
    if (tid == 0) mbar_expect(&wbar, (OC * QW + 2 * FEAT * HIDDEN + HIDDEN * FEAT) * 2);
    for (int r = tid; r < OC + 2 * FEAT; r += THREADS) {
        if (r < OC)
            bulk_copy(sO + r * OS, w_o + (long long)(c * OC + r) * QW, QW * 2, &wbar);
        else {  // gate row f, then up row f, of the block's features
            const int t = r - OC, f = j * FEAT + t % FEAT;
            bulk_copy(sGU + t * XS, w_gu + ((long long)(t < FEAT ? 0 : INTER) + f) * HIDDEN, HIDDEN * 2, &wbar);
        }
    }
    if (tid == THREADS - 1) bulk_copy(sD, w_down + (long long)j * HIDDEN * FEAT, HIDDEN * FEAT * 2, &wbar);

    PDL_ENTER();
    PHASE(1);
    {  // the attention rows into shared memory, every load in flight at once
        constexpr int U = QW / 8, ITER = (MAX_ROWS * U + THREADS - 1) / THREADS;
        uint4 v[ITER];
#pragma unroll
        for (int k = 0; k < ITER; k++) {
            const int e = tid + k * THREADS;
            if (e < B * U) v[k] = reinterpret_cast<const uint4 *>(attn)[e];
        }
#pragma unroll
        for (int k = 0; k < ITER; k++) {
            const int e = tid + k * THREADS;
            if (e < B * U) *reinterpret_cast<uint4 *>(sX + (e / U) * XW + (e % U) * 8) = v[k];
        }
    }
    PHASE(2);
    mbar_wait(&wbar, 0);
    __syncthreads();
    PHASE(3);

    // ---- 1. the block's o features of every row
    ksplit_product<NT_O, QW / 16>(sX, XW, B, sO, OS, sY, [&](int r, int f, float v) { sOut[r * OC + f] = v; });
    PHASE(4);
    cluster_sync();  // the cluster's o features are in its blocks' shared memory
    PHASE(5);

    // ---- 2. res + o (+ bias), its RMSNorm: a warp a row
    for (int r = warp; r < B; r += WARPS) {
        constexpr int PER = (HIDDEN / 4 + 31) / 32;
        const float4 *r4 = reinterpret_cast<const float4 *>(res + (long long)r * HIDDEN);
        const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        float4 v[PER];
        float ss = 0.0f;
#pragma unroll
        for (int k = 0; k < PER; k++) {
            const int i = lane + 32 * k;  // the row's float4 i: o features 4 i .. 4 i + 3
            v[k] = zero;
            if (i < HIDDEN / 4) {
                const int f = 4 * i;
                const float4 o = *reinterpret_cast<const float4 *>(peer(sOut + r * OC + f % OC, f / OC));
                v[k] = add_delta(r4[i], o, o_bias != nullptr ? reinterpret_cast<const float4 *>(o_bias)[i] : zero);
            }
            ss += sq4(v[k]);
        }
        const float inv = rsqrtf(warp_sum(ss) / HIDDEN + eps);
#pragma unroll
        for (int k = 0; k < PER; k++) {
            const int i = lane + 32 * k;
            if (i >= HIDDEN / 4) continue;
            const float4 w = reinterpret_cast<const float4 *>(norm_w)[i];
            scalar2_t *o = reinterpret_cast<scalar2_t *>(sX + r * XW) + 2 * i;
            o[0] = from_float2(v[k].x * inv * w.x, v[k].y * inv * w.y);
            o[1] = from_float2(v[k].z * inv * w.z, v[k].w * inv * w.w);
            if (j == 0) reinterpret_cast<float4 *>(res_out + (long long)r * HIDDEN)[i] = v[k];
        }
    }
    __syncthreads();
    PHASE(6);

    // ---- 3. gate/up of the block's features, SiLU(gate) * up (16-bit)
    ksplit_product<NT_GU, HIDDEN / 16>(sX, XW, B, sGU, XS, sY,
                                       [&](int r, int f, float v) { sG[r * 2 * FEAT + f] = v; });
    for (int e = tid; e < B * FEAT; e += THREADS) {  // (sOut may still be read by the cluster)
        const int r = e / FEAT, f = e % FEAT;
        sA[r * AS + f] = from_float(silu_times(sG[r * 2 * FEAT + f], sG[r * 2 * FEAT + FEAT + f]));
    }
    __syncthreads();
    PHASE(7);

    // ---- 4. down: the block's features' share of every output (one k-step a tile)
    {
        const int g = lane >> 2, q = lane & 3;
        unsigned a[4];
        a_frag(sA, AS, B, g, q, 0, a);
        for (int t = warp; t < HIDDEN / 8; t += WARPS) {
            const scalar_t *wr = sD + (8 * t + g) * FEAT + 2 * q;  // (2-way bank conflicts: 9 loads a warp)
            float y[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            mma_16816(y, a[0], a[1], a[2], a[3], *reinterpret_cast<const unsigned *>(wr),
                      *reinterpret_cast<const unsigned *>(wr + 8));
            const int f = 8 * t + 2 * q;
            if (g < B) sY[g * HIDDEN + f] = y[0], sY[g * HIDDEN + f + 1] = y[1];
            if (g + 8 < B) sY[(g + 8) * HIDDEN + f] = y[2], sY[(g + 8) * HIDDEN + f + 1] = y[3];
        }
    }
    cluster_sync();  // every block's share is in its shared memory
    PHASE(8);

    // ---- 5. the cluster's shares added in rank order: block c's o features' columns
    float *part = out_parts + cl * part_stride;
    for (int e = tid; e < B * (OC / 4); e += THREADS) {
        const int r = e / (OC / 4), f = c * OC + 4 * (e % (OC / 4));
        float4 s[CLUSTER];
#pragma unroll
        for (int k = 0; k < CLUSTER; k++) s[k] = *reinterpret_cast<const float4 *>(peer(sY + r * HIDDEN + f, k));
        float4 acc = s[0];
#pragma unroll
        for (int k = 1; k < CLUSTER; k++) acc = make_float4(acc.x + s[k].x, acc.y + s[k].y, acc.z + s[k].z, acc.w + s[k].w);
        *reinterpret_cast<float4 *>(part + (long long)r * HIDDEN + f) = acc;
    }
    PHASE(9);
    cluster_sync();  // no block leaves while another may still read its shared memory
    PHASE(10);
}
