// The attention block of a decode step, for small models, in one kernel: the input RMSNorm,
// the QKV product, RoPE and the K/V write, split-KV attention, and the o product. A decode
// step's layer is then three dependent kernels (this one, gate/up + SiLU, down) instead of
// five: at one row a small model's step is a chain of short kernels, each ~1 us of launch
// boundary plus its loads after the wait (docs/performance.md), so stages, not bytes, set
// its time.
//
// grid (CLUSTER x kv_heads, B), clusters of CLUSTER blocks: cluster g takes KV head g of row
// b and its GROUP query heads. Before the wait for the previous kernel (programmatic
// dependent launch) a block copies into shared memory what nothing in the step writes: its
// CLUSTER-th of the cluster's QKV weight rows (q of the group's heads, then k, then v), the
// o weights of its HIDDEN / CLUSTER output features over the group's heads' columns, and
// its first two tiles of cached keys and values (earlier steps' rows). After the wait each
// block norms the row, takes its QKV rows' dot products, and the cluster gathers them
// through distributed shared memory; every block rotates q and k (the same bits in each),
// block 0 writes the token's K/V row to the cache. Block c then runs the c-th CLUSTER-th of
// the row's keys (online softmax, log2 domain) for the GROUP heads, the cluster combines the
// partials (each block all of them, in rank order), and each block writes its output
// features' sums over the group's heads to out_parts[g]: o = the kv_heads parts added, which
// the next kernel's folded norm does (gemv.cu's NormIn with parts).
//
// The arithmetic: float32 sums of 16-bit operands, the normed row, q and the attention output
// rounded to the 16-bit type as the separate kernels store them, K/V rounded to the cache's
// type. Each row is computed the same way whatever B is (batch invariance), but not with the
// same bits as the separate kernels (their sums run in other orders).
//
// -DHEAD_DIM, -DGROUP (query heads per KV head), -DHIDDEN, -DKV_FP8, -DUSE_BF16; dynamic shared
// memory: attn_block.py's smem_bytes (the kernel checks it). KV pool layout as flash_decode's.

#include "small_shape.cuh"
#define CLUSTER 8
#define THREADS 256
#define TILE 64  // keys a shared-memory tile holds; two tiles, double-buffered
#define KSTR (HEAD_DIM + 16 / (int)sizeof(kv_t))  // a staged K/V row: 16 bytes of padding
#include "cluster.cuh"
#include "small_attn.cuh"

constexpr int D = HEAD_DIM, HALF_D = HEAD_DIM / 2, QW = GROUP * HEAD_DIM, RW = (GROUP + 2) * HEAD_DIM;
constexpr int RC = RW / CLUSTER, OC = HIDDEN / CLUSTER;
static_assert(RW % CLUSTER == 0, "(GROUP + 2) x HEAD_DIM must be a multiple of CLUSTER");
static_assert(HIDDEN % CLUSTER == 0 && HIDDEN % 8 == 0, "HIDDEN must be a multiple of 8");
static_assert(HEAD_DIM % 8 == 0 && HEAD_DIM * sizeof(kv_t) % 16 == 0, "K/V rows of whole 16-byte pieces");

constexpr int align16(int n) { return (n + 15) / 16 * 16; }
constexpr int OFF_W = 0;                                                   // RC x HIDDEN 16-bit
constexpr int OFF_O = OFF_W + align16(RC * HIDDEN * 2);                    // OC x QW 16-bit
constexpr int OFF_X = OFF_O + align16(OC * QW * 2);                        // HIDDEN 16-bit
constexpr int TILE_BYTES = align16(TILE * KSTR * (int)sizeof(kv_t));
constexpr int OFF_T = OFF_X + align16(HIDDEN * 2);                         // [2][K, V] tiles
constexpr int OFF_NEW = OFF_T + 4 * TILE_BYTES;                            // the token's K, V (cache type)
constexpr int OFF_F = OFF_NEW + align16(2 * D * (int)sizeof(kv_t));        // floats from here
// float arrays, in this order (F_ATTN first: read as float4)
constexpr int F_ATTN = 0, F_ACC = F_ATTN + QW, F_QKV = F_ACC + QW, F_ALL = F_QKV + RC, F_Q = F_ALL + RW,
              F_S = F_Q + QW, F_M = F_S + GROUP * TILE, F_L = F_M + GROUP, F_ALPHA = F_L + GROUP,
              F_RM = F_ALPHA + GROUP, F_RL = F_RM + CLUSTER * GROUP, F_COS = F_RL + CLUSTER * GROUP,
              F_SIN = F_COS + HALF_D, F_SCRATCH = F_SIN + HALF_D, F_END = F_SCRATCH + 32;
constexpr int SMEM_BYTES = OFF_F + 4 * F_END;

// the weight row of entry t of cluster g's QKV rows: q of heads g GROUP .., then k, then v
__device__ __forceinline__ long long qkv_row(int t, int g, int heads, int kv_heads) {
    if (t < QW) return (long long)g * QW + t;
    if (t < QW + D) return (long long)heads * D + (long long)g * D + (t - QW);
    return (long long)(heads + kv_heads) * D + (long long)g * D + (t - QW - D);
}

extern "C" __global__ void CLUSTER_DIMS __launch_bounds__(THREADS, 1) attn_block(
    const float *__restrict__ res,        // (B, HIDDEN) the residual stream
    const float *__restrict__ delta,      // (B, HIDDEN) added to it first, or null
    const float *__restrict__ norm_w,     // (HIDDEN,)
    float eps,
    float *__restrict__ res_out,          // (B, HIDDEN) res + delta (where delta), or null
    const scalar_t *__restrict__ w_qkv,   // (heads + 2 kv_heads) HEAD_DIM x HIDDEN
    const float *__restrict__ qkv_bias,   // or null
    const scalar_t *__restrict__ w_o,     // HIDDEN x heads HEAD_DIM
    const int *__restrict__ positions,    // (B)
    const float *__restrict__ cos_table,  // (max_len, HEAD_DIM / 2)
    const float *__restrict__ sin_table,
    const long long *__restrict__ k_ptrs, const long long *__restrict__ v_ptrs,  // (B)
    const int *__restrict__ kv_lens,      // (B), the token's key included; 0: a padding row
    long long layer_offset,
    float *__restrict__ out_parts,        // (kv_heads, B, HIDDEN) with parts part_stride apart
    long long part_stride, int heads, int kv_heads, int window, float scale) {
    const int g = blockIdx.x / CLUSTER, b = blockIdx.y;
    const int c = (int)cluster_rank();
    const int tid = threadIdx.x;
    const int kv_len = kv_lens[b];
    if (kv_len <= 0) return;  // a padding row: every block of its clusters leaves here
    extern __shared__ __align__(128) unsigned char smem[];
    if (tid == 0 && dynamic_smem_bytes() < SMEM_BYTES) __trap();  // attn_block.py's smem_bytes disagrees with this file
    scalar_t *sW = reinterpret_cast<scalar_t *>(smem + OFF_W);
    scalar_t *sO = reinterpret_cast<scalar_t *>(smem + OFF_O);
    scalar_t *sX = reinterpret_cast<scalar_t *>(smem + OFF_X);
    kv_t *sNew = reinterpret_cast<kv_t *>(smem + OFF_NEW);  // K then V of the token
    float *F = reinterpret_cast<float *>(smem + OFF_F);
    auto tileK = [&](int buf) { return reinterpret_cast<kv_t *>(smem + OFF_T + (2 * buf) * TILE_BYTES); };
    auto tileV = [&](int buf) { return reinterpret_cast<kv_t *>(smem + OFF_T + (2 * buf + 1) * TILE_BYTES); };

    const int pos = positions[b];
    const int first = window > 0 && kv_len > window ? kv_len - window : 0;
    const int per = (kv_len - first + CLUSTER - 1) / CLUSTER;
    const int s0 = first + c * per, s1 = min(kv_len, s0 + per);  // this block's keys
    const int ntiles = s1 > s0 ? (s1 - s0 + TILE - 1) / TILE : 0;
    const int kv_width = kv_heads * HEAD_DIM;
    const kv_t *kb = reinterpret_cast<const kv_t *>(k_ptrs[b]) + layer_offset + (long long)g * HEAD_DIM;
    const kv_t *vb = reinterpret_cast<const kv_t *>(v_ptrs[b]) + layer_offset + (long long)g * HEAD_DIM;
    // a tile of cached keys (the token's own slot is left for sNew: it is not in the cache yet)
    auto issue_tile = [&](int t) {
        if (t < ntiles)
            load_kv_tile<TILE, HEAD_DIM, THREADS>(tileK(t & 1), tileV(t & 1), KSTR, kb, vb, kv_width, s0 + t * TILE,
                                                  s1, first, pos);
    };
    auto place_new = [&](int t) {  // the token's K/V into tile t's slot, where the tile holds it
        const int j = pos - (s0 + t * TILE);
        if (t < ntiles && j >= 0 && j < TILE)
            for (int d = tid; d < D; d += THREADS) {
                tileK(t & 1)[j * KSTR + d] = sNew[d];
                tileV(t & 1)[j * KSTR + d] = sNew[D + d];
            }
    };

    // ---- before the wait: weights and earlier steps' keys (nothing in this step writes them)
    __shared__ __align__(8) unsigned long long wbar;
    if (tid == 0) mbar_init(&wbar);
    __syncthreads();
    if (tid == 0) mbar_expect(&wbar, (RC * HIDDEN + OC * QW) * 2);
    if (tid < RC)  // a row each
        bulk_copy(sW + tid * HIDDEN, w_qkv + qkv_row(c * RC + tid, g, heads, kv_heads) * HIDDEN, HIDDEN * 2, &wbar);
    for (int r = tid; r < OC; r += THREADS)
        bulk_copy(sO + r * QW, w_o + (long long)(c * OC + r) * heads * HEAD_DIM + g * QW, QW * 2, &wbar);
    cp_async_commit();  // (an empty group: the tiles' groups keep their places)
    issue_tile(0);
    cp_async_commit();
    issue_tile(1);
    cp_async_commit();
    for (int j = tid; j < HALF_D; j += THREADS) {  // the token's rotation (an input of the step)
        F[F_COS + j] = cos_table[(long long)pos * HALF_D + j];
        F[F_SIN + j] = sin_table[(long long)pos * HALF_D + j];
    }
    const float4 *w4 = reinterpret_cast<const float4 *>(norm_w);
    constexpr int PER = (HIDDEN / 4 + THREADS - 1) / THREADS;
    float4 nw[PER];
#pragma unroll
    for (int j = 0; j < PER; j++) nw[j] = tid + j * THREADS < HIDDEN / 4 ? w4[tid + j * THREADS] : make_float4(0, 0, 0, 0);

    PDL_ENTER();
    // ---- the input norm (rmsnorm.cu's sums: residual + delta, then the float4s' squares)
    {
        const float4 *r4 = reinterpret_cast<const float4 *>(res + (long long)b * HIDDEN);
        const float4 *d4 = delta != nullptr ? reinterpret_cast<const float4 *>(delta + (long long)b * HIDDEN) : nullptr;
        const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        float4 v[PER];
        float ss = 0.0f;
#pragma unroll
        for (int j = 0; j < PER; j++) {
            const int i = tid + j * THREADS;
            v[j] = zero;
            if (i < HIDDEN / 4) v[j] = d4 != nullptr ? add_delta(r4[i], d4[i], zero) : r4[i];
            ss += sq4(v[j]);
        }
        const float inv = rsqrtf(block_sum(ss, F + F_SCRATCH) / HIDDEN + eps);
#pragma unroll
        for (int j = 0; j < PER; j++) {
            const int i = tid + j * THREADS;
            if (i >= HIDDEN / 4) continue;
            const float4 w = nw[j];
            scalar2_t *o = reinterpret_cast<scalar2_t *>(sX) + 2 * i;
            o[0] = from_float2(v[j].x * inv * w.x, v[j].y * inv * w.y);
            o[1] = from_float2(v[j].z * inv * w.z, v[j].w * inv * w.w);
            if (blockIdx.x == 0 && d4 != nullptr && res_out != nullptr)
                reinterpret_cast<float4 *>(res_out + (long long)b * HIDDEN)[i] = v[j];
        }
    }
    mbar_wait(&wbar, 0);  // the weights; the two tiles may still be on their way
    __syncthreads();

    // ---- this block's QKV rows (warp_rows)
    warp_rows<RC, HIDDEN>(
        sW, [&](int u, float f[8]) { vec8_to_float(*reinterpret_cast<const vec8 *>(sX + u * 8), f); },
        [&](int r, float v) { F[F_QKV + r] = v; });
    cluster_sync();  // every block's rows are in its shared memory
    for (int t = tid; t < RW; t += THREADS) {
        float v = *peer(F + F_QKV + t % RC, t / RC);
        if (qkv_bias != nullptr) v += qkv_bias[qkv_row(t, g, heads, kv_heads)];
        F[F_ALL + t] = v;
    }
    __syncthreads();

    // ---- RoPE (rotate-half pairs) of q and k; the token's K/V row to the cache (block 0)
    {
        const float *cs = F + F_COS, *sn = F + F_SIN;
        kv_t *kdst = kv_row(k_ptrs, b, layer_offset, pos, kv_width) + g * HEAD_DIM;
        kv_t *vdst = kv_row(v_ptrs, b, layer_offset, pos, kv_width) + g * HEAD_DIM;
        for (int p = tid; p < (GROUP + 1) * HALF_D; p += THREADS) {
            const int hh = p / HALF_D, j = p % HALF_D;
            float o1, o2;
            rope_rotate(F[F_ALL + hh * D + j], F[F_ALL + hh * D + j + HALF_D], cs[j], sn[j], o1, o2);
            if (hh < GROUP) {  // q as the separate kernels store it: 16-bit
                F[F_Q + hh * D + j] = to_float(from_float(o1));
                F[F_Q + hh * D + j + HALF_D] = to_float(from_float(o2));
            } else {
                const kv_t k1 = to_kv(o1), k2 = to_kv(o2);
                sNew[j] = k1;
                sNew[j + HALF_D] = k2;
                if (c == 0) kdst[j] = k1, kdst[j + HALF_D] = k2;
            }
        }
        for (int d = tid; d < D; d += THREADS) {
            const kv_t v = to_kv(F[F_ALL + QW + D + d]);
            sNew[D + d] = v;
            if (c == 0) vdst[d] = v;
        }
    }
    for (int i = tid; i < QW; i += THREADS) F[F_ACC + i] = 0.0f;
    if (tid < GROUP) F[F_M + tid] = NEG_INF, F[F_L + tid] = 0.0f;
    __syncthreads();
    place_new(0);
    place_new(1);

    // ---- this block's keys, TILE at a time
    const float scale2 = scale * 1.4426950408889634f;  // log2 domain
    for (int t = 0; t < ntiles; t++) {
        cp_async_wait<1>();  // tile t (one group a tile is always committed, empty or not)
        __syncthreads();
        const int valid = min(TILE, s1 - (s0 + t * TILE));
        attend_tile(tileK(t & 1), tileV(t & 1), valid, F + F_Q, F + F_S, F + F_M, F + F_L, F + F_ALPHA, F + F_ACC,
                    scale2);  // buffer t & 1 is free after it
        issue_tile(t + 2);
        place_new(t + 2);
        cp_async_commit();
    }
    cp_async_wait<0>();

    // ---- the cluster's partials combined (every block, in rank order)
    cluster_sync();  // every block's max, sum and output are final
    if (tid < CLUSTER * GROUP) {
        const int r = tid / GROUP, h = tid % GROUP;
        F[F_RM + tid] = *peer(F + F_M + h, r);
        F[F_RL + tid] = *peer(F + F_L + h, r);
    }
    __syncthreads();
    for (int i = tid; i < QW; i += THREADS) {
        const int h = i / D;
        float m = NEG_INF;
#pragma unroll
        for (int r = 0; r < CLUSTER; r++) m = fmaxf(m, F[F_RM + r * GROUP + h]);
        float acc[CLUSTER];
#pragma unroll
        for (int r = 0; r < CLUSTER; r++) acc[r] = *peer(F + F_ACC + i, r);  // all in flight at once
        float num = 0.0f, den = 0.0f;
#pragma unroll
        for (int r = 0; r < CLUSTER; r++) {
            const float mr = F[F_RM + r * GROUP + h];
            if (mr == NEG_INF) continue;  // a block without keys (its sums are zeros)
            const float w = exp2f(mr - m);
            den = fmaf(F[F_RL + r * GROUP + h], w, den);
            num = fmaf(acc[r], w, num);
        }
        F[F_ATTN + i] = to_float(from_float(num / den));  // as the separate kernels store it: 16-bit
    }
    __syncthreads();

    // ---- this block's output features over the group's heads (warp_rows)
    float *op = out_parts + g * part_stride + (long long)b * HIDDEN + c * OC;
    warp_rows<OC, QW>(
        sO,
        [&](int u, float f[8]) {
            const float4 a0 = *reinterpret_cast<const float4 *>(F + F_ATTN + u * 8);
            const float4 a1 = *reinterpret_cast<const float4 *>(F + F_ATTN + u * 8 + 4);
            f[0] = a0.x, f[1] = a0.y, f[2] = a0.z, f[3] = a0.w, f[4] = a1.x, f[5] = a1.y, f[6] = a1.z, f[7] = a1.w;
        },
        [&](int r, float v) { op[r] = v; });
    cluster_sync();  // no block leaves while another may still read its shared memory
}
