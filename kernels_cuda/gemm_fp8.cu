// out (M, N) = xq (M, K) @ w (N, K)^T over e4m3 codes, on Hopper's wgmma (sm_90a): the float8
// product of steps of 17-256 rows (gemm.py). The sums only, as cuBLASLt's gemm_fp8 gives them:
// the readers apply the scales.
//
// The weights are the MMA's A operand and the tokens its B (out^T = w xq^T), so a step's few
// tokens are the MMA's N: m64nNTk32 with NT = BT / TSPLIT (16-256) wastes nothing at small
// steps. A block takes BMW = 64 * RM * CW / TSPLIT weight rows (features), BT tokens and
// 1/SPLITS of K. Both operands come in through the bulk tensor copy engine (2-D tensor maps,
// 128-byte swizzle, KBOX 128-byte slices of K a stage; weights in boxes of 64 rows) on
// full/empty mbarrier pairs, STAGES deep. Warp 0 of warpgroup 0 issues them; the CW warpgroups
// after it each multiply RM x 64 weight rows by NT tokens (TSPLIT 2: two warpgroups share the
// weight rows, half the tokens each), the accumulators in registers. The weights' first stages
// are asked for before the wait for the previous kernel (PDL): nothing writes them.
// The sums go through shared memory, transposed to out's rows. SPLITS > 1: the SPLITS blocks of
// a tile form a cluster along z, and each adds its share of the tile's tokens over the cluster
// (rank order: the same bits every time) before writing them.
// -DOUT_F32=1: float32 out; else bfloat16 (the runner's fp8 products).
#include "wgmma.cuh"

#ifndef BT
#define BT 64
#endif
#ifndef RM
#define RM 1
#endif
#ifndef CW
#define CW 2
#endif
#ifndef STAGES
#define STAGES 4
#endif
#ifndef SPLITS
#define SPLITS 1
#endif
#ifndef KBOX
#define KBOX 1  // 128-byte slices of K a stage (a tile of each operand per slice)
#endif
#ifndef MIN_BLOCKS
#define MIN_BLOCKS 1  // blocks an SM (registers capped to fit; the shared memory must fit too)
#endif
#ifndef OUT_F32
#define OUT_F32 0
#endif
#ifndef TSPLIT
#define TSPLIT 1  // 2: the consumer warpgroups in pairs over the same weight rows, half the tokens each
#endif
#define NT (BT / TSPLIT)              // tokens a warpgroup: the MMA's N
#define BMW (64 * RM * (CW / TSPLIT)) // weight rows (out's columns) a block
#define BOX 128                      // bytes (e4m3 values) of K a tile: one swizzle row
#define BK (BOX * KBOX)              // K a stage
#define W_TILE (BMW * BOX)
#define X_TILE (BT * BOX)
#define W_BYTES (W_TILE * KBOX)
#define STAGE_BYTES ((W_TILE + X_TILE) * KBOX)
#define THREADS (128 * (CW + 1))
#define RED_STRIDE (BMW + 4)         // floats a token's row of the sums in shared memory (padded)

// the 128-byte CUtensorMap, passed by value (__grid_constant__): its address is the copy's
struct __align__(64) tensor_map {
    unsigned long long raw[16];
};

__device__ __forceinline__ void tma_load_2d(void *dst, const tensor_map *map, int c0, int c1,
                                            unsigned long long *bar) {
#if WGMMA_OK
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
        ::"r"(smem_addr(dst)), "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1),
        "r"(smem_addr(bar))
        : "memory");
#endif
}


// named barrier over the consumer warpgroups
__device__ __forceinline__ void consumers_sync() {
    asm volatile("bar.sync 1, %0;" ::"n"(128 * CW) : "memory");
}

// m64nNk32, e4m3 x e4m3 -> float32, both operands from shared memory (K-major), the sums kept
// (scale-d 1); operands through wgmma.cuh's WG_P / WG_F8.
#if WGMMA_OK
#define WGMMA_ASM(N, REGS, DA, DB, ...)                                                              \
    asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, 1, 0;\n\twgmma.mma_async.sync.aligned.m64n" #N   \
                 "k32.f32.e4m3.e4m3 {" REGS "}, " DA ", " DB ", p, 1, 1;\n\t}"                           \
                 : __VA_ARGS__                                                                      \
                 : "l"(da), "l"(db))
#else
#define WGMMA_ASM(N, REGS, DA, DB, ...)
#endif

template <int N>
__device__ __forceinline__ void wgmma(float (&d)[N / 2], unsigned long long da, unsigned long long db) {
    static_assert(N == 16 || N == 32 || N == 64 || N == 128 || N == 256, "the MMA's N: 16, 32, 64, 128 or 256");
    if constexpr (N == 16) {
        WGMMA_ASM(16, WG_P0, "%8", "%9", WG_F8(0));
    } else if constexpr (N == 32) {
        WGMMA_ASM(32, WG_P0 ", " WG_P1, "%16", "%17", WG_F8(0), WG_F8(8));
    } else if constexpr (N == 64) {
        WGMMA_ASM(64, WG_P0 ", " WG_P1 ", " WG_P2 ", " WG_P3, "%32", "%33", WG_F8(0), WG_F8(8), WG_F8(16), WG_F8(24));
    } else if constexpr (N == 128) {
        WGMMA_ASM(128, WG_P0 ", " WG_P1 ", " WG_P2 ", " WG_P3 ", " WG_P4 ", " WG_P5 ", " WG_P6 ", " WG_P7, "%64", "%65",
                  WG_F8(0), WG_F8(8), WG_F8(16), WG_F8(24), WG_F8(32), WG_F8(40), WG_F8(48), WG_F8(56));
    } else {
        WGMMA_ASM(256, WG_P0 ", " WG_P1 ", " WG_P2 ", " WG_P3 ", " WG_P4 ", " WG_P5 ", " WG_P6 ", " WG_P7 ", " WG_P8
                  ", " WG_P9 ", " WG_P10 ", " WG_P11 ", " WG_P12 ", " WG_P13 ", " WG_P14 ", " WG_P15, "%128", "%129",
                  WG_F8(0), WG_F8(8), WG_F8(16), WG_F8(24), WG_F8(32), WG_F8(40), WG_F8(48), WG_F8(56), WG_F8(64),
                  WG_F8(72), WG_F8(80), WG_F8(88), WG_F8(96), WG_F8(104), WG_F8(112), WG_F8(120));
    }
}
#define WGMMA wgmma<NT>
#define ACC (NT / 2)  // accumulators a thread for m64 x NT over a warpgroup's 128 threads

#if SPLITS > 1 && (!defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900)
#define SPLIT_CLUSTER __cluster_dims__(1, 1, SPLITS)
#else
#define SPLIT_CLUSTER
#endif

// the block's whole cluster at a barrier (a plain block barrier when the cluster is one block)
__device__ __forceinline__ void all_sync() {
#if SPLITS > 1
    cluster_sync();
#else
    __syncthreads();
#endif
}

// Dynamic shared memory (gemm.py's WgmmaConfig.smem must agree): up to 1,024 bytes to align the
// tiles, STAGES x (KBOX weight tiles BMW x 128, KBOX token tiles BT x 128), then STAGES full and
// STAGES empty barriers. After the last stage the tiles hold the sums, float32 [BT][RED_STRIDE].
extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS) SPLIT_CLUSTER
gemm_fp8_wgmma(const __grid_constant__ tensor_map map_x, const __grid_constant__ tensor_map map_w,
               void *__restrict__ out, int M, int N, int K) {
    extern __shared__ unsigned char smem_raw[];
    unsigned char *smem = smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u);
    unsigned long long *full = reinterpret_cast<unsigned long long *>(smem + STAGES * STAGE_BYTES);
    unsigned long long *empty = full + STAGES;
    const int wg = threadIdx.x / 128;
    const int t0 = blockIdx.x * BT, n0 = blockIdx.y * BMW;  // a weight tile's token blocks run together
    const int split = SPLITS > 1 ? (int)blockIdx.z : 0;
    const int chunks = K / BK;
    const int k_first = chunks * split / SPLITS;
    const int nk = chunks * (split + 1) / SPLITS - k_first;
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; s++) {
            mbar_init(&full[s]);
            mbar_init(&empty[s], CW);  // each consumer warpgroup hands a stage back
        }
    }
    __syncthreads();

    if (wg == 0) {
        if (threadIdx.x == 0) {
            // the weight tile, in boxes of 64 rows (a tensor map's box has at most 256)
            auto load_w = [&](int s, int kt) {
                for (int b = 0; b < KBOX; b++)
                    for (int r = 0; r < BMW / 64; r++)
                        tma_load_2d(smem + s * STAGE_BYTES + b * W_TILE + r * 64 * BOX, &map_w,
                                    (k_first + kt) * BK + b * BOX, n0 + r * 64, &full[s]);
            };
            const int ahead = min(nk, STAGES);
            for (int i = 0; i < ahead; i++) {  // the weights (nothing writes them) before the wait
                mbar_expect(&full[i], STAGE_BYTES);
                load_w(i, i);
            }
            auto load_x = [&](int s, int kt) {  // the token tile
                for (int b = 0; b < KBOX; b++)
                    tma_load_2d(smem + s * STAGE_BYTES + W_BYTES + b * X_TILE, &map_x, (k_first + kt) * BK + b * BOX,
                                t0, &full[s]);
            };
            PDL_ENTER();
            for (int i = 0; i < ahead; i++) load_x(i, i);
            for (int kt = STAGES; kt < nk; kt++) {
                const int s = kt % STAGES;
                mbar_wait(&empty[s], ((kt / STAGES) & 1) ^ 1);
                mbar_expect(&full[s], STAGE_BYTES);
                load_w(s, kt);
                load_x(s, kt);
            }
        } else {
            PDL_ENTER();
        }
    } else {
        PDL_ENTER();
        const int wr = (wg - 1) / TSPLIT, wt = (wg - 1) % TSPLIT;  // its weight rows, its tokens
        float acc[RM][ACC];
#pragma unroll
        for (int r = 0; r < RM; r++)
#pragma unroll
            for (int i = 0; i < ACC; i++) acc[r][i] = 0.0f;
        for (int kt = 0; kt < nk; kt++) {
            const int s = kt % STAGES;
            mbar_wait(&full[s], (kt / STAGES) & 1);
            const unsigned char *a = smem + s * STAGE_BYTES + wr * RM * 64 * BOX;
            const unsigned char *b = smem + s * STAGE_BYTES + W_BYTES + wt * NT * BOX;
            wgmma_fence();
#pragma unroll
            for (int r = 0; r < RM; r++) fence_acc(acc[r]);
#pragma unroll
            for (int kb = 0; kb < KBOX; kb++)
#pragma unroll
                for (int kk = 0; kk < BOX / 32; kk++)
#pragma unroll
                    for (int r = 0; r < RM; r++)
                        WGMMA(acc[r], smem_desc(a + kb * W_TILE + r * 64 * BOX + 32 * kk),
                              smem_desc(b + kb * X_TILE + 32 * kk));
            wgmma_commit();
#pragma unroll
            for (int r = 0; r < RM; r++) fence_acc(acc[r]);
            wgmma_wait<1>();  // the stage before this one is read: hand it back
            if (kt > 0 && threadIdx.x % 128 == 0) mbar_arrive(&empty[(kt - 1) % STAGES]);
        }
        wgmma_wait<0>();
#pragma unroll
        for (int r = 0; r < RM; r++) fence_acc(acc[r]);
        consumers_sync();  // every warpgroup is done with the tiles: they take the sums
        float *red = reinterpret_cast<float *>(smem);
        const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
#pragma unroll
        for (int r = 0; r < RM; r++)
#pragma unroll
            for (int i = 0; i < ACC; i++) {  // acc[r][i]: weight row (out's column), token (out's row)
                const int col = (wr * RM + r) * 64 + warp * 16 + lane / 4 + 8 * ((i / 2) % 2);
                const int tok = wt * NT + (i / 4) * 8 + (lane % 4) * 2 + i % 2;
                red[tok * RED_STRIDE + col] = acc[r][i];
            }
    }
    all_sync();
    // this block's share of the tile's tokens, summed over the cluster in rank order
    const float *red = reinterpret_cast<const float *>(smem);
    constexpr int GROUPS = BMW / 4;
    const int tok0 = BT * split / SPLITS, toks = BT * (split + 1) / SPLITS - tok0;
    for (int g = threadIdx.x; g < toks * GROUPS; g += THREADS) {
        const int t = tok0 + g / GROUPS, c = 4 * (g % GROUPS);
        if (t0 + t >= M) continue;
        const float *p = red + t * RED_STRIDE + c;
        float4 v = *reinterpret_cast<const float4 *>(SPLITS > 1 ? peer(p, 0) : p);
#pragma unroll
        for (int q = 1; q < SPLITS; q++) {
            const float4 x = *reinterpret_cast<const float4 *>(peer(p, q));
            v.x += x.x;
            v.y += x.y;
            v.z += x.z;
            v.w += x.w;
        }
        const long long at = (long long)(t0 + t) * N + n0 + c;
#if OUT_F32
        *reinterpret_cast<float4 *>(static_cast<float *>(out) + at) = v;
#else
        __nv_bfloat162 lo = __floats2bfloat162_rn(v.x, v.y), hi = __floats2bfloat162_rn(v.z, v.w);
        uint2 packed;
        packed.x = *reinterpret_cast<unsigned *>(&lo);
        packed.y = *reinterpret_cast<unsigned *>(&hi);
        *reinterpret_cast<uint2 *>(static_cast<__nv_bfloat16 *>(out) + at) = packed;
#endif
    }
#if SPLITS > 1
    cluster_sync();  // no block leaves while its peers read its sums
#endif
}
