// Skinny matrix products for decode batches of 1 to 16 rows, on the tensor cores:
// y (B, N) float32 = x (B, K) @ W^T, W (N, K) row-major 16-bit, x 16-bit.
//
// mma.sync m16n8k16 with x as the A operand (16 rows, zero beyond B) and W as the B
// operand (8 output features). Each lane loads 16 contiguous bytes of one weight row
// (8 k-values) and of the matching x rows, and feeds them to two MMAs: the k order
// inside a dot product is free, so W and x are permuted the same way. A block of WARPS
// warps shares 8 output features (16 at 9-16 rows, see TILES) and splits K between its
// warps (chunks of 32, interleaved); the partial sums are added in a fixed order. Every
// output element is computed the same way whatever B is (batch invariance). K must be a
// multiple of 8. With -DSTAGED=1 (gemv.py's `staged`: the large matrices) a warp takes blocks
// of 4 consecutive chunks instead, and they come through shared memory in whole row segments
// (see Stage): another order of the sums, so a matrix is staged at every B or never.
//
// Epilogues: a block's output features ("slots") need not be consecutive weight rows.
// Plain stores y; PlainKeys (an LM head's: gemv_keys) also leaves, for each row, its tile's
// greedy_key (common.cuh): the tile's largest logit with its token. SiluMul gives the first
// half of the slots gate rows and the second half the matching up rows, and stores SiLU(gate)
// * up (16-bit) for the down projection, so no separate activation kernel runs and the float32
// gate/up product is never written.
// RopeKV gives the first half dims j of q/k heads and the second half their partners
// j + HEAD_DIM / 2, adds the bias, rotates, and writes q for attention and k, v into the
// KV cache (the blocks after the q/k pairs take the v rows in order). The arithmetic is
// the one of the separate kernels (common.cuh's helpers), so fused and unfused steps give
// the same bits.
//
// Weights do not depend on the previous kernel: before waiting for it (programmatic
// dependent launch), a block asks the L2 to fetch the first `prefetch` bytes of its rows,
// so the start of the stream overlaps the kernels before this one. With -DPRELOAD=1 (rows
// that fit in one pass of the warps, gemv.py's preload) it loads that first pass into
// registers instead, and then only waits for x.
#include "common.cuh"

#ifndef WARPS
#define WARPS 8
#endif
#ifndef DEPTH
#define DEPTH 8  // chunks a warp loads per pass
#endif
#ifndef MIN_BLOCKS  // __launch_bounds__'s minimum blocks an SM (0: none given)
#define MIN_BLOCKS 0
#endif
#if MIN_BLOCKS
#define SKINNY_BOUNDS __launch_bounds__(WARPS * 32, MIN_BLOCKS)
#else
#define SKINNY_BOUNDS __launch_bounds__(WARPS * 32)
#endif
#ifndef PRELOAD  // load the first pass's weights before waiting for the previous kernel (gemv.py)
#define PRELOAD 0
#endif
#ifndef TILE_LOOP  // a grid that fits the GPU at once, its blocks looping over the tiles gridDim.x apart:
                   // the next tile's weights load while this one's sums are added and stored (same bits)
#define TILE_LOOP 0
#endif
#if TILE_LOOP && (!PRELOAD || STAGED || NORM_IN)
#error "gemv: TILE_LOOP takes rows that fit the first pass (PRELOAD), not staged, with no folded norm"
#endif
#ifndef NORM_IN  // x computed in the block by a residual add + RMSNorm (see NormIn)
#define NORM_IN 0
#endif
#ifndef NORM_THREADS
#define NORM_THREADS 512  // rmsnorm.py's THREADS: the folded norm sums as those blocks do
#endif
#if NORM_IN  // x rows in shared memory: plain loads
#define X_LOAD(p) (*(p))
#else
#define X_LOAD(p) __ldg(p)
#endif

// -DW_FP8=1 (--quantization fp8): W holds e4m3 codes and a float32 scale per row (wscale);
// a lane's 16-byte load then brings 16 k-values, widened exactly to the 16-bit type for the
// same MMAs (x stays 16-bit), and the sums are scaled per feature before the epilogue.
#ifndef W_FP8
#define W_FP8 0
#endif
// -DW_Q8=1 (a GGUF Q8_0 matrix kept as it is, gemv.py's Q8Matrix): W holds int8 codes and
// wscale a float16 scale for each 32 k-values of a row ((N, K / 32)). As for e4m3 weights, a
// lane's 16-byte load brings 16 k-values (half a block, so one scale), which become the values
// the loader dequantizes to (q8x8_to_scalar8) just before their MMAs, in the e4m3 form's order.
#ifndef W_Q8
#define W_Q8 0
#endif
#if W_FP8
typedef unsigned char w_t;
#elif W_Q8
typedef signed char w_t;
#else
typedef scalar_t w_t;
#endif
#if W_Q8
typedef unsigned short wscale_t;  // float16 bits
#else
typedef float wscale_t;
#endif


// TILES: 8-feature tiles a block computes. gemv_8 (B <= 8) takes one; gemv_16 (B > 8)
// takes two, so that each x row it reads from the L2 serves 16 features: at 9-16 rows the
// x reads would otherwise cost as much as the weights. A lane's sum over k runs through
// the same chunks in the same order either way (batch invariance holds across the two).

// One pass of a warp over DEPTH / TILES chunks starting at chunk c0: loads first, then MMAs.
// A chunk is 4 lanes' 16-byte weight groups; x brings the matching k-values (one 16-byte
// load, two for e4m3 weights). CHECKED: some chunk may reach past K (those loads are skipped and
// read as zero). The 16-bit form is kept apart, written as it was before e4m3 weights:
// nvcc unrolls the loops around it more (a common form cost 8B decode graphs ~9 % at 1-16
// rows on the H200). LOADED: wv already holds the pass's weights (load_weights, before the
// wait for the previous kernel: see skinny); else each weight load goes with its x load.
#ifndef STAGED  // weights through shared memory in row segments (see stage_issue); 0: direct loads
#define STAGED 0
#endif
#ifndef STAGES  // STAGED: buffers a warp streams its passes through (1 or 2)
#define STAGES 2
#endif

// The s-th chunk of a warp's sum over k (s = 0, 1, ...). STAGED: blocks of 4 consecutive
// chunks (256 bytes of a row), block j = warp + WARPS m; else chunk warp + WARPS s. Either
// way the sequence depends on the warp alone (not on DEPTH, TILES or B): batch invariance.
__device__ __forceinline__ int chunk_of(int warp, int s) {
    return STAGED ? 4 * (warp + WARPS * (s >> 2)) + (s & 3) : warp + WARPS * s;
}

// STAGED: a warp's pass (DEPTH / TILES chunks of each of its 8 TILES rows) comes to its
// DEPTH x 512 bytes of shared memory through cp.async, each copy instruction taking 512
// bytes made of whole row segments (256 bytes of a row; 128 where a pass holds 2 chunks),
// then each lane reads its MMA fragments from there. A warp loading 64 bytes from each of 8
// rows per instruction (the fragments' own layout) streamed ~8 % slower from HBM (H200, read
// kernels of both patterns: 3.9 against 4.2-4.3 TB/s). Segment sg = b R + r (R = 8 TILES
// rows, b: the pass's block) sits at sg L, its 16-byte units swizzled by the row's parity
// (no bank conflicts when lanes of rows g and g + 1 read the same unit).
template <int TILES>
struct Stage {
    static constexpr int D = DEPTH / TILES, LC = D < 4 ? D : 4, L = LC * 64, LPS = L / 16, R = 8 * TILES;
    __device__ static int swz(int pos, int r) { return pos ^ ((r & 1) << 6); }
};

template <int TILES, bool CHECKED>
__device__ __forceinline__ void stage_issue(const uint4 *const *rowp, unsigned char *buf, int warp, int lane, int s0,
                                            int groups) {
    using S = Stage<TILES>;
#pragma unroll
    for (int i = 0; i < DEPTH; i++) {
        const int sg = i * (32 / S::LPS) + lane / S::LPS, unit = lane % S::LPS;
        const int r = sg % S::R, u = (sg / S::R) * S::LC + unit / 4;  // row, chunk of the pass
        const int k8 = chunk_of(warp, s0 + u) * 4 + (unit & 3);
        const bool ok = !CHECKED || k8 < groups;
        cp_async16(buf + S::swz(i * 512 + lane * 16, r), rowp[r] + (ok ? k8 : 0), ok);
    }
    cp_async_commit();
}

template <int TILES>
__device__ __forceinline__ void stage_read(const unsigned char *buf, uint4 wv[TILES][DEPTH / TILES], int g, int q) {
    using S = Stage<TILES>;
#pragma unroll
    for (int t = 0; t < TILES; t++)
#pragma unroll
        for (int u = 0; u < S::D; u++) {
            const int r = 8 * t + g;
            const int pos = ((u / S::LC) * S::R + r) * S::L + (u % S::LC) * 64 + q * 16;
            wv[t][u] = *reinterpret_cast<const uint4 *>(buf + S::swz(pos, r));
        }
    __syncwarp();  // the buffer is free for the warp's next pass
}

#if W_Q8
// a lane's 16 codes of group k8 (wrow: the row's codes) and their block's scale (srow: the
// row's scales), held as loaded until just before their MMAs (so nothing waits for them sooner)
__device__ __forceinline__ void load_q8(const uint4 *wrow, const wscale_t *srow, int k8, bool ok, uint4 &v,
                                        unsigned short &d) {
    v = ok ? __ldcs(wrow + k8) : make_uint4(0, 0, 0, 0);
    d = ok ? __ldg(srow + (k8 >> 1)) : (unsigned short)0;
}
// those 16 codes -> 8 words of two 16-bit values, lower k first (as fp8x16_to_scalar2x8)
__device__ __forceinline__ void q8x16_to_scalar2x8(const uint4 &v, unsigned short d, unsigned out[8]) {
    const uint4 lo = q8x8_to_scalar8(make_uint2(v.x, v.y), d), hi = q8x8_to_scalar8(make_uint2(v.z, v.w), d);
    out[0] = lo.x, out[1] = lo.y, out[2] = lo.z, out[3] = lo.w;
    out[4] = hi.x, out[5] = hi.y, out[6] = hi.z, out[7] = hi.w;
}
#endif

template <int TILES, bool CHECKED>
__device__ __forceinline__ void load_weights(const uint4 *const wrow[TILES], uint4 wv[TILES][DEPTH / TILES], int warp,
                                             int s0, int q, int groups, const wscale_t *const *srow,
                                             unsigned short *dv) {
#if W_Q8  // held as loaded (load_q8)
#pragma unroll
    for (int u = 0; u < DEPTH / TILES; u++) {
        const int k8 = chunk_of(warp, s0 + u) * 4 + q;
#pragma unroll
        for (int t = 0; t < TILES; t++)
            load_q8(wrow[t], srow[t], k8, !CHECKED || k8 < groups, wv[t][u], dv[t * (DEPTH / TILES) + u]);
    }
#else
#pragma unroll
    for (int u = 0; u < DEPTH / TILES; u++) {
        const int k8 = chunk_of(warp, s0 + u) * 4 + q;  // this lane's 16-byte group of weights
        const bool ok = !CHECKED || k8 < groups;
#pragma unroll
        for (int t = 0; t < TILES; t++) wv[t][u] = ok ? __ldcs(wrow[t] + k8) : make_uint4(0, 0, 0, 0);
    }
#endif
}

template <bool WIDE, int TILES, bool CHECKED, bool LOADED>
__device__ __forceinline__ void skinny_pass(const uint4 *const wrow[TILES], const uint4 *xrow, const uint4 *xrow2,
                                            float c[TILES][4], int warp, int s0, int q, int groups,
                                            uint4 wv[TILES][DEPTH / TILES], const wscale_t *const *srow,
                                            unsigned short *dv) {
    constexpr int D = DEPTH / TILES;
    const uint4 zero = make_uint4(0, 0, 0, 0);
#if W_FP8 || W_Q8  // 16 k-values a lane's load
    uint4 xv[D][2], yv[D][2];
#pragma unroll
    for (int u = 0; u < D; u++) {
        const int k8 = chunk_of(warp, s0 + u) * 4 + q;  // this lane's 16-byte group of weights
        const bool ok = !CHECKED || k8 < groups;
        if (!LOADED)
#pragma unroll
            for (int t = 0; t < TILES; t++)
#if W_Q8
                load_q8(wrow[t], srow[t], k8, ok, wv[t][u], dv[t * D + u]);
#else
                wv[t][u] = ok ? __ldcs(wrow[t] + k8) : zero;
#endif
#pragma unroll
        for (int h = 0; h < 2; h++) {
            xv[u][h] = ok ? X_LOAD(xrow + 2 * k8 + h) : zero;
            yv[u][h] = WIDE && ok ? X_LOAD(xrow2 + 2 * k8 + h) : zero;
        }
    }
#pragma unroll
    for (int u = 0; u < D; u++) {
        const unsigned xw[8] = {xv[u][0].x, xv[u][0].y, xv[u][0].z, xv[u][0].w,
                                xv[u][1].x, xv[u][1].y, xv[u][1].z, xv[u][1].w};
        const unsigned yw[8] = {yv[u][0].x, yv[u][0].y, yv[u][0].z, yv[u][0].w,
                                yv[u][1].x, yv[u][1].y, yv[u][1].z, yv[u][1].w};
#pragma unroll
        for (int t = 0; t < TILES; t++) {
            unsigned ww[8];  // the 16 k-values as 16-bit pairs, lower k first
#if W_Q8
            q8x16_to_scalar2x8(wv[t][u], dv[t * D + u], ww);
#else
            fp8x16_to_scalar2x8(wv[t][u], ww);
#endif
#pragma unroll
            for (int j = 0; j < 4; j++)
                mma_16816(c[t], xw[2 * j], yw[2 * j], xw[2 * j + 1], yw[2 * j + 1], ww[2 * j], ww[2 * j + 1]);
        }
    }
#else
    uint4 xv[D], yv[D];
#pragma unroll
    for (int u = 0; u < D; u++) {
        const int k8 = chunk_of(warp, s0 + u) * 4 + q;  // this lane's 16-byte group of k
        const bool ok = !CHECKED || k8 < groups;
        if (!LOADED)
#pragma unroll
            for (int t = 0; t < TILES; t++) wv[t][u] = ok ? __ldcs(wrow[t] + k8) : zero;
        xv[u] = ok ? X_LOAD(xrow + k8) : zero;
        yv[u] = WIDE && ok ? X_LOAD(xrow2 + k8) : zero;
    }
#pragma unroll
    for (int u = 0; u < D; u++) {
#pragma unroll
        for (int t = 0; t < TILES; t++) {
            mma_16816(c[t], xv[u].x, yv[u].x, xv[u].y, yv[u].y, wv[t][u].x, wv[t][u].y);
            mma_16816(c[t], xv[u].z, yv[u].z, xv[u].w, yv[u].w, wv[t][u].z, wv[t][u].w);
        }
    }
#endif
}

// A lane's block sums: v[4 t + i] of tile t, i = 0, 1 (row g, slots 8 t + 2q + i) and
// i = 2, 3 (row g + 8, same slots). Epilogues that pair the first half of a block's slots
// with the second get both halves here: lo (slot 2q + i of the first half) and hi (the same
// slot of the second); with one tile the partner lives in lane ^ 2. Returns whether this
// lane owns a pair.
template <int TILES>
__device__ __forceinline__ bool halves(const float *v, int q, float lo[4], float hi[4]) {
#pragma unroll
    for (int i = 0; i < 4; i++) {
        lo[i] = v[i];
        hi[i] = TILES == 2 ? v[4 + i] : __shfl_xor_sync(0xffffffffu, v[i], 2);
    }
    return TILES == 2 || q < 2;
}

// An epilogue also has a Pre: what its store reads besides the sums that nothing in this step writes
// after the kernel before the previous one (staged positions and pointers, tables, biases), which
// pre() loads before the wait for the previous kernel, so that the store waits on no load of its own.
// Where skinny() keeps warp 0's Pre: in registers where the rows fit the first pass (PRELOAD: no k
// loop to hold them across, and a store from shared memory would first wait for the loads to land:
// SmolLM2 B=1 2,934 -> 2,865 tok/s), else in shared memory, a slot a lane. As registers across the k
// loop they took gemv_rope_8 from 40 to 54 a thread (sm_90): 6 -> 4 blocks an SM, and Llama-3-8B's
// 16-bit QKV product (768 blocks) from one wave to two, 14.7 -> 20.6 us a layer (H200, B=1 240.7 ->
// 230.6 tok/s). Moved to shared memory: 16-bit B=1 230.2 -> 241.0, e4m3 weights 343.0 -> 345.1.
struct NoPre {};

template <int TILES>
struct Plain {
    float *y;
    int N;
    using Pre = NoPre;
    __device__ long long row(int bx, int s) const { return (long long)bx * 8 * TILES + s; }
    template <bool WIDE>
    __device__ Pre pre(int, int, int, int) const { return {}; }
    template <bool WIDE>
    __device__ void store(int bx, int g, int q, const float *v, int B, const Pre &) const {
#pragma unroll
        for (int t = 0; t < TILES; t++)
#pragma unroll
            for (int j = 0; j < 2; j++) {
                const long long f = (long long)bx * 8 * TILES + 8 * t + 2 * q + j;
                if (f >= N) continue;
                if (g < B) y[(long long)g * N + f] = v[4 * t + j];
                if (WIDE && g + 8 < B) y[(long long)(g + 8) * N + f] = v[4 * t + 2 + j];
            }
    }
};

template <int TILES>
struct PlainKeys : Plain<TILES> {
    unsigned long long *keys;  // (B, key_stride): row r's key of tile bx at keys[r * key_stride + bx]
    int key_stride;
    template <bool WIDE>
    __device__ void store(int bx, int g, int q, const float *v, int B, const NoPre &pre) const {
        Plain<TILES>::template store<WIDE>(bx, g, q, v, B, pre);
        unsigned long long k[2] = {0ull, 0ull};  // rows g, g + 8: the lane's features, then its group's
#pragma unroll
        for (int t = 0; t < TILES; t++)
#pragma unroll
            for (int j = 0; j < 2; j++) {
                const int f = bx * 8 * TILES + 8 * t + 2 * q + j;
                if (f >= this->N) continue;
                k[0] = max(k[0], greedy_key(v[4 * t + j], f));
                if (WIDE) k[1] = max(k[1], greedy_key(v[4 * t + 2 + j], f));
            }
#pragma unroll
        for (int h = 0; h < (WIDE ? 2 : 1); h++) {
#pragma unroll
            for (int m = 1; m < 4; m *= 2) k[h] = max(k[h], __shfl_xor_sync(0xffffffffu, k[h], m));
            if (q == 0 && g + 8 * h < B) keys[(long long)(g + 8 * h) * key_stride + bx] = k[h];
        }
    }
};

template <int TILES>
struct SiluMul {  // weight rows [gate (inter) | up (inter)], inter % (4 TILES) == 0; grid inter / (4 TILES)
    scalar_t *act;  // (B, inter)
    int inter;
    static constexpr int PER = 4 * TILES;  // gate (and up) rows of a block
    using Pre = NoPre;
    __device__ long long row(int bx, int s) const { return (s < PER ? 0 : inter) + (long long)bx * PER + s % PER; }
    template <bool WIDE>
    __device__ Pre pre(int, int, int, int) const { return {}; }
    template <bool WIDE>
    __device__ void store(int bx, int g, int q, const float *v, int B, const Pre &) const {
        float gate[4], up[4];
        if (!halves<TILES>(v, q, gate, up)) return;
#pragma unroll
        for (int j = 0; j < 2; j++) {
            const long long f = (long long)bx * PER + 2 * q + j;
            if (g < B) act[(long long)g * inter + f] = from_float(silu_times(gate[j], up[j]));
            if (WIDE && g + 8 < B) act[(long long)(g + 8) * inter + f] = from_float(silu_times(gate[2 + j], up[2 + j]));
        }
    }
};

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#define HALF (HEAD_DIM / 2)

template <int TILES>
struct RopeKV {  // weight rows [q (H heads) | k (KVH) | v (KVH)] of HEAD_DIM; HALF % (4 TILES) == 0
    const float *bias;  // or null
    const int *positions;
    const float *cos_table, *sin_table;  // (max_len, HALF)
    scalar_t *q_out;                     // (B, H, HEAD_DIM)
    const long long *k_ptrs, *v_ptrs;
    long long layer_offset;
    int heads, kv_heads;
    static constexpr int PER = 4 * TILES;  // (j, j + HALF) pairs of a block
    // A lane's rows g and g + 8 (h = 0, 1): where their values go, and for a pair block the
    // cos / sin of the lane's pairs j = 0, 1 at the row's position; the biases of its slots.
    // The positions and pointers are staged inputs (written by a copy or stage_in, at least two
    // kernels before any product of a step): with its loads before the wait, the store after
    // the sums waits on none (H200, SmolLM2 B=1: two L2 round trips a QKV product fewer).
    struct Pre {
        scalar_t *q[2];  // pair blocks of q heads: the head's row in q_out
        kv_t *kv[2];     // pair blocks of k heads: the head's K row; v blocks: the V row
        float c[2][2], s[2][2];
        float b1[2 * TILES], b2[2 * TILES];  // pair blocks: biases of x1, x2 (pair j); v blocks: of slot 2 t + j
    };
    __device__ int pair_blocks() const { return (heads + kv_heads) * HALF / PER; }
    __device__ long long row(int bx, int s) const {
        if (bx >= pair_blocks())
            return (long long)(heads + kv_heads) * HEAD_DIM + (long long)(bx - pair_blocks()) * 8 * TILES + s;
        const int p = bx * PER + s % PER;
        return (long long)(p / HALF) * HEAD_DIM + p % HALF + (s < PER ? 0 : HALF);
    }
    __device__ float bias_of(long long n) const { return bias != nullptr ? bias[n] : 0.0f; }
    __device__ float biased(float x, float b) const { return bias != nullptr ? x + b : x; }  // as rope.cu adds it
    template <bool WIDE>
    __device__ Pre pre(int bx, int g, int q, int B) const {
        Pre r;
        const int kv_width = kv_heads * HEAD_DIM;
        if (bx < pair_blocks()) {
            const int head = bx * PER / HALF;  // HALF % PER == 0: one head a block
#pragma unroll
            for (int j = 0; j < 2; j++) {
                const long long n1 = (long long)head * HEAD_DIM + (bx * PER + 2 * q + j) % HALF;
                r.b1[j] = bias_of(n1);
                r.b2[j] = bias_of(n1 + HALF);
            }
#pragma unroll
            for (int h = 0; h < (WIDE ? 2 : 1); h++) {
                const int t = g + 8 * h;
                if (t >= B) continue;
                const int pos = positions[t];
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    const long long at = (long long)pos * HALF + (bx * PER + 2 * q + j) % HALF;
                    r.c[h][j] = cos_table[at];
                    r.s[h][j] = sin_table[at];
                }
                if (head < heads)
                    r.q[h] = q_out + ((long long)t * heads + head) * HEAD_DIM;
                else
                    r.kv[h] = kv_row(k_ptrs, t, layer_offset, pos, kv_width) + (head - heads) * HEAD_DIM;
            }
            return r;
        }
        const int v_off = (heads + kv_heads) * HEAD_DIM;
#pragma unroll
        for (int t = 0; t < TILES; t++)
#pragma unroll
            for (int j = 0; j < 2; j++) r.b1[2 * t + j] = bias_of(v_off + (bx - pair_blocks()) * 8 * TILES + 8 * t + 2 * q + j);
#pragma unroll
        for (int h = 0; h < (WIDE ? 2 : 1); h++) {
            const int t = g + 8 * h;
            if (t < B) r.kv[h] = kv_row(v_ptrs, t, layer_offset, positions[t], kv_width);
        }
        return r;
    }
    template <bool WIDE>
    __device__ void store(int bx, int g, int q, const float *v, int B, const Pre &r) const {
        if (bx < pair_blocks()) {
            float x1[4], x2[4];
            if (!halves<TILES>(v, q, x1, x2)) return;
            const bool is_q = bx * PER / HALF < heads;
#pragma unroll
            for (int h = 0; h < (WIDE ? 2 : 1); h++) {
                if (g + 8 * h >= B) continue;
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    const int d = (bx * PER + 2 * q + j) % HALF;
                    float o1, o2;
                    rope_rotate(biased(x1[2 * h + j], r.b1[j]), biased(x2[2 * h + j], r.b2[j]), r.c[h][j], r.s[h][j],
                                o1, o2);
                    if (is_q) {
                        r.q[h][d] = from_float(o1);
                        r.q[h][d + HALF] = from_float(o2);
                    } else {
                        r.kv[h][d] = to_kv(o1);
                        r.kv[h][d + HALF] = to_kv(o2);
                    }
                }
            }
            return;
        }
#pragma unroll
        for (int t = 0; t < TILES; t++)
#pragma unroll
            for (int j = 0; j < 2; j++) {
                const int f = (bx - pair_blocks()) * 8 * TILES + 8 * t + 2 * q + j;  // dim within the v rows
#pragma unroll
                for (int h = 0; h < (WIDE ? 2 : 1); h++)
                    if (g + 8 * h < B) r.kv[h][f] = to_kv(biased(v[4 * t + 2 * h + j], r.b1[2 * t + j]));
            }
    }
};

// -DNORM_IN=1: the product's input rows are not read from x but made by each block, as
// rmsnorm.cu's add_rms_norm makes them (the same bits): res (+ delta + bias, where delta is
// not null) normed with weights w, into shared memory; block 0 writes res + delta (+ bias) to
// res_out where that is not null. delta may come in `parts` parts delta_stride floats apart
// (attn_block.cu's o product, a part per KV head), added in order before the residual (one
// part: the bits of add_rms_norm). The block takes the rows one at a time and sums their
// float4s in the order of an add_rms_norm block of NORM_THREADS threads: K / 4 <= NORM_THREADS,
// K % 4 == 0, NORM_THREADS a multiple of 32 WARPS.
struct NormIn {
    const float *res, *delta, *bias, *w;
    float eps;
    float *res_out;
    long long delta_stride;
    int parts;
};

__device__ __forceinline__ void norm_into(const NormIn &n, scalar_t *xs, int B, int K) {
    constexpr int PER = (NORM_THREADS + WARPS * 32 - 1) / (WARPS * 32);  // norm threads a thread stands for
    __shared__ float sums[NORM_THREADS / 32];  // the norm block's warp sums
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, n4 = K / 4;
    const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int r = 0; r < B; r++) {  // the block on one row at a time: its loads all at once
        const float4 *res = reinterpret_cast<const float4 *>(n.res + (long long)r * K);
        const float4 *del = n.delta != nullptr ? reinterpret_cast<const float4 *>(n.delta + (long long)r * K) : nullptr;
        const float4 *bias = reinterpret_cast<const float4 *>(n.bias);
        float4 v[PER], g[PER];
#pragma unroll
        for (int j = 0; j < PER; j++) {  // norm thread i = threadIdx.x + j * blockDim.x holds float4 i
            const int i = threadIdx.x + j * WARPS * 32;
            if (i < n4) {
                if (del != nullptr) {
                    const float4 e = add_parts(del[i], n.delta + (long long)r * K, n.delta_stride, n.parts, i);
                    v[j] = add_delta(res[i], e, bias != nullptr ? bias[i] : zero);
                } else {
                    v[j] = res[i];
                }
                g[j] = reinterpret_cast<const float4 *>(n.w)[i];
            }
        }
#pragma unroll
        for (int j = 0; j < PER; j++) {
            const int i = threadIdx.x + j * WARPS * 32;
            const float s = warp_sum(i < n4 ? sq4(v[j]) : 0.0f);
            if (lane == 0 && warp + j * WARPS < NORM_THREADS / 32) sums[warp + j * WARPS] = s;
        }
        __syncthreads();
        const float inv = rsqrtf(warp_sum(lane < NORM_THREADS / 32 ? sums[lane] : 0.0f) / K + n.eps);
#pragma unroll
        for (int j = 0; j < PER; j++) {
            const int i = threadIdx.x + j * WARPS * 32;
            if (i >= n4) continue;
            scalar2_t *o = reinterpret_cast<scalar2_t *>(xs + (long long)r * K) + 2 * i;
            o[0] = from_float2(v[j].x * inv * g[j].x, v[j].y * inv * g[j].y);
            o[1] = from_float2(v[j].z * inv * g[j].z, v[j].w * inv * g[j].w);
            if (blockIdx.x == 0 && n.res_out != nullptr)
                reinterpret_cast<float4 *>(n.res_out + (long long)r * K)[i] = v[j];
        }
        __syncthreads();  // sums: the next row's
    }
}

template <bool WIDE, int TILES, class Epilogue>  // WIDE: rows 8..15 of x exist (B > 8)
__device__ __forceinline__ void skinny(const scalar_t *__restrict__ x, const w_t *__restrict__ w, int B, int N,
                                       int K, int prefetch, const wscale_t *__restrict__ wscale, const NormIn &nin,
                                       const Epilogue &epi) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, q = lane & 3;  // mma group (row of x / slot of W) and lane in group
    int bx = blockIdx.x;  // the block's tile (TILE_LOOP: its first; then every gridDim.x-th)
    // Rows past N or B read row 0 instead: an MMA output row depends only on its own
    // input row, and those outputs are never stored.
    const uint4 *wrow[TILES];
    const wscale_t *srow[TILES];  // W_Q8: the rows' scales (else unused)
    auto tile_rows = [&](int tile) {
#pragma unroll
        for (int t = 0; t < TILES; t++) {
            const long long n = epi.row(tile, 8 * t + g);
            wrow[t] = reinterpret_cast<const uint4 *>(w + (n < N ? n : 0) * K);
            srow[t] = W_Q8 ? wscale + (n < N ? n : 0) * (K >> 5) : nullptr;
        }
    };
    tile_rows(bx);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    // With PRELOAD, or staged, the first pass (WARPS * DEPTH / TILES chunks of 64 bytes a row:
    // the row's first bytes, unless staged passes hold half blocks) comes in below, so the L2
    // is asked for the bytes after it.
    const bool first_prefix = STAGED ? DEPTH / TILES >= 4 : PRELOAD;  // the first pass: the rows' first bytes
    const int skip = first_prefix ? min(WARPS * (DEPTH / TILES) * 64, K * (int)sizeof(w_t)) : 0;
    const int ask = min(prefetch, K * (int)sizeof(w_t) - skip);
    if (ask > 0 && threadIdx.x < 8 * TILES) {
        const long long pn = epi.row(blockIdx.x, threadIdx.x);
        if (pn < N)
            asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(
                             reinterpret_cast<const char *>(w + pn * K) + skip), "r"(ask) : "memory");
    }
#endif
    const int groups = W_FP8 || W_Q8 ? K >> 4 : K >> 3;  // 16-byte groups of weights in a row
    const int chunks = (groups + 3) >> 2, whole = groups >> 2;
    constexpr int D = DEPTH / TILES;
    uint4 wv[TILES][D];
    unsigned short dv[TILES * D];  // W_Q8: the scales of wv's codes (else unused)
#if STAGED
    static_assert(!W_Q8, "gemv: the staged form takes 16-bit weights");
    // Each warp streams its passes through STAGES buffers: with two, the copies of pass p + 1
    // are in flight while pass p multiplies; with one, they are asked for once pass p is in
    // registers (see stage_issue).
    static_assert(STAGES * DEPTH * 512 * WARPS <= 32768, "gemv: staged passes take STAGES x DEPTH <= 8 at 8 warps");
    __shared__ const uint4 *rowp[8 * TILES];
    __shared__ __align__(128) unsigned char wstage[WARPS][STAGES][DEPTH * 512];
    if (threadIdx.x < 8 * TILES) {
        const long long n = epi.row(blockIdx.x, threadIdx.x);
        rowp[threadIdx.x] = reinterpret_cast<const uint4 *>(w + (n < N ? n : 0) * K);
    }
    __syncthreads();
    auto issue = [&](int s, int b) {
        if (chunk_of(warp, s + D - 1) < whole)
            stage_issue<TILES, false>(rowp, wstage[warp][b], warp, lane, s, groups);
        else
            stage_issue<TILES, true>(rowp, wstage[warp][b], warp, lane, s, groups);
    };
    issue(0, 0);  // nothing writes the weights: their fetch overlaps the kernel before this one
#else
    int s0 = 0;  // the warp's next chunk in its sequence (chunk_of)
#if PRELOAD
    // The first pass's weights go to registers before the wait: nothing writes them, so
    // their fetch overlaps the end of the kernel before this one.
    const bool first_whole = chunk_of(warp, D - 1) < whole;
    if (first_whole)
        load_weights<TILES, false>(wrow, wv, warp, 0, q, groups, srow, dv);
    else
        load_weights<TILES, true>(wrow, wv, warp, 0, q, groups, srow, dv);
#endif
#endif
#if PRELOAD  // warp 0 stores: its lanes' Pre (see there)
    typename Epilogue::Pre pre_reg, &pre = pre_reg;
#else
    __shared__ typename Epilogue::Pre pre_smem[32];
    typename Epilogue::Pre &pre = pre_smem[lane];
#endif
    if (warp == 0) pre = epi.template pre<WIDE>(bx, g, q, B);
    PDL_ENTER();
#if NORM_IN
    extern __shared__ __align__(16) unsigned char x_smem[];  // (B, K) 16-bit
    scalar_t *xs = reinterpret_cast<scalar_t *>(x_smem);
    norm_into(nin, xs, B, K);
    __syncthreads();
    x = xs;
#endif
    const uint4 *xrow = reinterpret_cast<const uint4 *>(x + (long long)(g < B ? g : 0) * K);
    const uint4 *xrow2 = reinterpret_cast<const uint4 *>(x + (long long)(g + 8 < B ? g + 8 : 0) * K);
#if TILE_LOOP
    const int tiles = (N + 8 * TILES - 1) / (8 * TILES);  // every epilogue's grid
    for (;; s0 = 0) {
#endif
    float c[TILES][4];
#pragma unroll
    for (int t = 0; t < TILES; t++) c[t][0] = c[t][1] = c[t][2] = c[t][3] = 0.0f;
#if STAGED
    for (int s = 0, b = 0; chunk_of(warp, s) < chunks; s += D, b ^= STAGES - 1) {
        const bool next = chunk_of(warp, s + D) < chunks;
        if (STAGES == 2) {
            if (next)
                issue(s + D, b ^ 1);
            else
                cp_async_commit();  // an empty group: the wait below still leaves pass s's copies done
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncwarp();
        stage_read<TILES>(wstage[warp][b], wv, g, q);
        if (STAGES == 1 && next) issue(s + D, 0);
        if (chunk_of(warp, s + D - 1) < whole)
            skinny_pass<WIDE, TILES, false, true>(wrow, xrow, xrow2, c, warp, s, q, groups, wv, srow, dv);
        else
            skinny_pass<WIDE, TILES, true, true>(wrow, xrow, xrow2, c, warp, s, q, groups, wv, srow, dv);
    }
    cp_async_wait<0>();  // a warp with no chunk still had pass 0 asked for
#else
#if PRELOAD
    if (first_whole)
        skinny_pass<WIDE, TILES, false, true>(wrow, xrow, xrow2, c, warp, s0, q, groups, wv, srow, dv);
    else if (chunk_of(warp, 0) < chunks)
        skinny_pass<WIDE, TILES, true, true>(wrow, xrow, xrow2, c, warp, s0, q, groups, wv, srow, dv);
    s0 += D;
#endif
    for (; chunk_of(warp, s0 + D - 1) < whole; s0 += D)
        skinny_pass<WIDE, TILES, false, false>(wrow, xrow, xrow2, c, warp, s0, q, groups, wv, srow, dv);
    for (; chunk_of(warp, s0) < chunks; s0 += D)
        skinny_pass<WIDE, TILES, true, false>(wrow, xrow, xrow2, c, warp, s0, q, groups, wv, srow, dv);
#endif
#if TILE_LOOP
    // the next tile's weights come in while this one's sums are added and stored
    const int next = bx + gridDim.x;
    if (next < tiles) {
        tile_rows(next);
        if (first_whole)
            load_weights<TILES, false>(wrow, wv, warp, 0, q, groups, srow, dv);
        else
            load_weights<TILES, true>(wrow, wv, warp, 0, q, groups, srow, dv);
    }
#endif
    // sum the warps in order
    __shared__ float part[WARPS][4 * TILES][32];
#pragma unroll
    for (int t = 0; t < TILES; t++)
#pragma unroll
        for (int i = 0; i < 4; i++) part[warp][4 * t + i][lane] = c[t][i];
    __syncthreads();
    if (warp == 0) {
        float s[4 * TILES];
#pragma unroll
        for (int i = 0; i < 4 * TILES; i++) {
            s[i] = part[0][i][lane];
#pragma unroll
            for (int v = 1; v < WARPS; v++) s[i] += part[v][i][lane];
        }
#if W_FP8
#pragma unroll
        for (int i = 0; i < 4 * TILES; i++) {  // s[4 t + i] is slot 8 t + 2 q + (i & 1)
            const long long n = epi.row(bx, 8 * (i / 4) + 2 * q + (i & 1));
            s[i] *= wscale[n < N ? n : 0];
        }
#endif
        epi.template store<WIDE>(bx, g, q, s, B, pre);
    }
#if TILE_LOOP
    if (next >= tiles) break;
    bx = next;
    if (warp == 0) pre = epi.template pre<WIDE>(bx, g, q, B);
    __syncthreads();  // part: warp 0 has read this tile's
    }
#endif
}

// Kernels: NAME_8 (up to 8 rows, one tile), NAME_8x2 (up to 8 rows, two tiles: e4m3 weights,
// whose rows are half as long, so a block still streams as many bytes), NAME_16 (9-16 rows,
// two tiles). Grid (blocks the epilogue asks for), block (32 WARPS); prefetch: bytes of each
// weight row to bring into the L2 up front (a multiple of 16, at most a row); wscale: the
// rows' scales with W_FP8, their chunks' float16 scales with W_Q8 (else unused, may be null);
// nres .. nres_out: NormIn's fields with NORM_IN (else unused; dynamic shared memory B * K
// 16-bit values); ndelta_stride, nparts: delta's parts (see NormIn). EPI: the epilogue
// template, built from the kernel's own parameters (the ones after `nres_out`).
#define SKINNY_PARAMS                                                                                            \
    const scalar_t *__restrict__ x, const w_t *__restrict__ w, int B, int N, int K, int prefetch,                \
        const wscale_t *__restrict__ wscale, const float *nres, const float *ndelta, const float *nbias,            \
        const float *nw, float neps, float *nres_out, long long ndelta_stride, int nparts
#define SKINNY_KERNELS(NAME, EPI, INIT, ...)                                                                     \
    extern "C" __global__ void SKINNY_BOUNDS NAME##_8(SKINNY_PARAMS, __VA_ARGS__) {                                 \
        skinny<false, 1>(x, w, B, N, K, prefetch, wscale, NormIn{nres, ndelta, nbias, nw, neps, nres_out, ndelta_stride, nparts},       \
                         EPI<1> INIT);                                                                           \
    }                                                                                                            \
    extern "C" __global__ void SKINNY_BOUNDS NAME##_8x2(SKINNY_PARAMS, __VA_ARGS__) {                               \
        skinny<false, 2>(x, w, B, N, K, prefetch, wscale, NormIn{nres, ndelta, nbias, nw, neps, nres_out, ndelta_stride, nparts},       \
                         EPI<2> INIT);                                                                           \
    }                                                                                                            \
    extern "C" __global__ void SKINNY_BOUNDS NAME##_16(SKINNY_PARAMS, __VA_ARGS__) {                                \
        skinny<true, 2>(x, w, B, N, K, prefetch, wscale, NormIn{nres, ndelta, nbias, nw, neps, nres_out, ndelta_stride, nparts},        \
                        EPI<2> INIT);                                                                            \
    }

// y (B, N) float32
SKINNY_KERNELS(gemv, Plain, ({y, N}), float *__restrict__ y)
// y (B, N) float32 and each tile's greedy key a row
SKINNY_KERNELS(gemv_keys, PlainKeys, ({{y, N}, keys, key_stride}), float *__restrict__ y,
               unsigned long long *__restrict__ keys, int key_stride)
// act (B, N / 2) 16-bit = SiLU(gate) * up
SKINNY_KERNELS(gemv_silu, SiluMul, ({act, N / 2}), scalar_t *__restrict__ act)
// q_out (B, H, HEAD_DIM) and the token's K/V rows; N = (heads + 2 kv_heads) * HEAD_DIM
SKINNY_KERNELS(gemv_rope, RopeKV,
               ({bias, positions, cos_table, sin_table, q_out, k_ptrs, v_ptrs, layer_offset, heads, kv_heads}),
               const float *__restrict__ bias, const int *__restrict__ positions, const float *__restrict__ cos_table,
               const float *__restrict__ sin_table, scalar_t *__restrict__ q_out,
               const long long *__restrict__ k_ptrs, const long long *__restrict__ v_ptrs, long long layer_offset,
               int heads, int kv_heads)
