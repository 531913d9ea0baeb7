// Flash decoding (split-KV) for one query token per sequence, GQA-aware, on the tensor cores.
//
// flash_decode_chunk: grid (max_splits, kv_heads, B). Each block takes one split of a
// sequence's keys for the GROUP query heads that share a KV head, and writes an
// unnormalised partial output with its max and sum. A row's keys are cut into splits of
// CHUNK keys, or longer ones (multiples of KEYS) where max_splits of CHUNK do not cover
// them: the grid fixes how many splits a row may have, its length how long they are, so
// a step with many rows (whose blocks already fill the GPU) takes each row in one or two
// long splits, and no context is too long for a grid. The grid is static (graph-safe):
// lengths and pointers come from device arrays, and splits past a sequence's length
// (or a padding row's length 0) exit at once.
//
// The GROUP heads of the token are the rows of a 16-row query tile (rows past GROUP are
// zero), so scores and the P V product run on mma.sync like the prefill kernel: K/V tiles
// of KEYS keys stream through shared memory, double-buffered with cp.async, and each of
// the 4 warps takes 16 keys of a tile with its own running max, sum and output in
// registers; the warps are combined at the end. The last of a row's non-empty split
// blocks of a KV head to finish (a counter per pair, back to 0 after) combines the
// partials into the output: no separate reduce kernel. Maxima are in the log2 domain.
//
// -DHEAD_DIM (multiple of 16; of 32 with KV_FP8), -DGROUP (query heads per KV head, <= 16),
// -DCHUNK (the shortest split, a multiple of KEYS), -DWHOLE (rows of at most that many keys
// take one split: a short row's serial tiles cost less than the partials and the combine),
// -DSHORT (rows of at most that many keys, past WHOLE, take splits of KEYS keys: a short row of a
// small step spreads over more blocks; the host keeps SHORT / KEYS within the grid's splits),
// -DMIN_BLOCKS (launch bounds), -DKV_FP8 (e4m3 cache: the byte tiles stay as they arrive and
// each lane converts its own fragments, with keys and dims permuted inside a tile so that a
// lane reads whole 32-bit words), -DSWAP (KV_FP8 and GROUP <= 8: the keys are the MMA's 16
// rows and the group's heads its 8 columns, S^T = K q^T and O^T += V^T P^T, q in registers;
// a 16-row query tile of <= 8 heads wasted half its MMAs, conversions aside, and its softmax.
// The 16-bit tiles, bound by memory already, gained nothing from it), -DQK_WGMMA (SWAP's q K^T on
// Hopper's wgmma, below).
// Dynamic shared memory: flash_decode.smem_bytes(). KV pool layout: (layers, slots,
// kv_heads, HEAD_DIM); row b's keys start at k_ptrs[b] + layer_offset.
#include "common.cuh"

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef GROUP
#define GROUP 1
#endif
#ifndef CHUNK
#define CHUNK 256
#endif
// -DTG (tile groups; 16-bit K/V, not SWAP): TG groups of 4 warps, group g taking tiles g, g + TG,
// g + 2 TG, ... of the split, each into its own running softmax, so that a split's tiles run side
// by side, not one after another. The live groups' warps are combined in warp order at the end, so
// a row's bits depend on TG, not on BUFS or PDL: the runner (cuda_runner.TILE_GROUPS) launches every
// step of up to 16 rows (the batch-invariant ones) with the same TG. Each group reuses its own
// buffers (BUFS / TG of them), every buffer filled before the wait (AHEAD = BUFS), the later tiles
// by the group's own threads behind a barrier of its own (named barrier 1 + g). H200, SmolLM2 B=1:
// tiles side by side cost 0.86 -> 0.99 us for 1 -> 3 (block 0's timer), and a row of up to 512 keys
// takes one block instead of 64-key splits combined across blocks (docs/performance.md, sixty-first
// session).
#ifndef TG
#define TG 1
#endif
#define THREADS (128 * TG)
#ifndef WHOLE  // a row of at most WHOLE keys takes them in one split, however short CHUNK is
#define WHOLE 0
#endif
#ifndef SHORT  // a row of at most SHORT keys takes splits of KEYS keys, however long CHUNK is (0: none)
#define SHORT 0
#endif
#ifndef MIN_BLOCKS  // blocks an SM to fit (flash_decode.py: 4 for large fp8 grids, 128 registers a thread)
#define MIN_BLOCKS 1
#endif
#ifndef SWAP  // fp8 K/V, <= 8 heads a group: keys as the MMA's rows, heads as its 8 columns
#define SWAP 0
#endif
// -DQK_WGMMA (SWAP, HEAD_DIM 128, at most 4 heads a group; built for sm_90a): q K^T of a 64-key
// tile on warpgroup MMAs (wgmma m64n8k32, e4m3 x e4m3, one a 32-dim step) from shared memory,
// K's bytes as they are stored (no converts; K staged in 128-byte-swizzled rows) and q^T as e4m3
// codes written once a block: each head's q scaled by a power of two into [128, 256), its codes
// in column h (hi) and the codes of 16 (q - hi) in column 4 + h (lo), so hi + lo / 16 keeps ~8
// significant bits, as bfloat16 does. The accumulators of warp w are keys 16w..16w+15 in the
// layout of the mma.sync form; lanes q and q ^ 2 hold the hi and lo scores of the same two heads
// and add them, each scaled back (qmul), after which lanes q >= 2 play the part of the padding
// heads 4..7. P V stays on mma.sync (mma.sync with e4m3 operands compiles to converts and float16
// MMAs on sm_90).
#ifndef QK_WGMMA
#define QK_WGMMA 0
#endif
#if QK_WGMMA
#include "wgmma.cuh"
#endif
#define WARPS (4 * TG)
// -DBUFS (2 to 4): K/V tile buffers in shared memory; a tile is asked for once the buffer it
// takes is free, BUFS - 1 tiles ahead of the one being used, and a tile's wait leaves the tiles
// after it in flight. 4 for a launch of one wave with PDL (flash_decode.py): a short row (up to
// 256 keys, one split) then has every tile asked for before the wait. 3 for whole rows in at most
// two waves of blocks (flash_decode.buffers).
#ifndef BUFS
#define BUFS 2
#endif
// -DAHEAD (1 or BUFS): K/V tiles loaded before the wait for the previous kernel. BUFS where launched
// with programmatic dependent launch (flash_decode.py), whose wait overlaps the kernel before
// it; without it the wait is no wait, and the first tile's arithmetic would then wait for the
// second to land too (H200, 8B fp8 K/V at 32 rows of 576 keys: 23.5 -> 24.7 us).
#ifndef AHEAD
#define AHEAD 1
#endif
static_assert(BUFS >= 2, "BUFS: 2 or more");
static_assert(TG == 1 ? BUFS <= 4 : (TG == 4 && (BUFS == 4 || BUFS == 8)), "BUFS: 2 to 4; with TG 4, 4 or 8");
static_assert(AHEAD == BUFS || (TG == 1 && AHEAD == 1 && BUFS == 2), "AHEAD: BUFS, or 1 with 2 buffers");
static_assert(TG == 1 || !(KV_FP8 || SWAP), "TG: 16-bit K/V only");
// RESIDENT: a row whose tiles all landed before the loop runs them with no barriers between them
// (below), with every buffer filled before the wait (PDL). With two buffers it takes the 16-bit
// form from 158 to 180 registers a thread (sm_90), 2 blocks an SM where 3 fit, yet 8B's 16-bit
// decode at 128 rows of 512 + 128 ran faster with it than without (H200, alternated twice: 16,018.1
// / 16,003.5 against 15,931.2 / 15,898.4 tok/s), so it is built wherever AHEAD = BUFS.
#define RESIDENT (AHEAD == BUFS)
#define KEYS 64                 // keys per tile, 16 per warp
#define LDS (HEAD_DIM + 8)      // shared row stride (elements), as in flash_prefill
#define MAX_SPLITS 64           // flash_decode.py keeps the grid's splits within this

constexpr int KSTEPS = HEAD_DIM / 16;  // k steps of q K^T
constexpr int OTILES = HEAD_DIM / 8;   // 8-wide column tiles of the output
#if !SWAP
constexpr int VEC = HEAD_DIM / 8;  // 16-byte groups per row (of the query tile, which SWAP does without)
#endif
static_assert(GROUP <= 16, "a query tile holds 16 heads");
static_assert(CHUNK % KEYS == 0, "CHUNK must be a multiple of KEYS");
static_assert(!SWAP || (KV_FP8 && GROUP <= 8), "SWAP: fp8 K/V and at most 8 heads a group");
static_assert(!QK_WGMMA || (SWAP && GROUP <= 4 && HEAD_DIM == 128), "QK_WGMMA: SWAP, head dim 128, <= 4 heads");

#if KV_FP8
#define SROW (HEAD_DIM + 16)  // bytes from one staged K/V row to the next (16-byte aligned, spreads banks)
static_assert(HEAD_DIM % 32 == 0, "the fp8 path takes the output 32 dims at a time");
// Score tile j, column c <-> key 4 (c / 2) + 2 j + c % 2 of the warp's 16, so that a lane's
// P slots (columns 2q, 2q+1 of both tiles) are keys 4q..4q+3 (the k order of an MMA is free).
__device__ __forceinline__ int key_of(int j, int c) { return 4 * (c >> 1) + 2 * j + (c & 1); }
// Output tile j, column c <-> head dim 32 (j / 4) + 4 c + j % 4 (one V word of 4 dims a lane).
__device__ __forceinline__ int out_dim(int j, int c) { return 32 * (j >> 2) + 4 * c + (j & 3); }
#else
__device__ __forceinline__ int key_of(int j, int c) { return 8 * j + c; }
__device__ __forceinline__ int out_dim(int j, int c) { return 8 * j + c; }
#endif

__device__ __forceinline__ unsigned movmatrix_trans(unsigned x) {  // an 8x8 16-bit matrix, transposed
    unsigned y;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
    return y;
}

__device__ __forceinline__ int window_start(int kv_len, int window) {
    return window > 0 && kv_len > window ? kv_len - window : 0;
}

#if SWAP
// One warp's 16 keys of a tile with the keys as the MMA's rows: S^T (16 keys x 8 heads) =
// K q^T, then O^T (dims x heads) += V^T P^T, so a group of <= 8 heads fills the MMA's 8
// columns instead of a 16-row query tile (half the MMAs and half the softmax of the other
// form). Lane (g, q) holds keys g, g + 8 of heads 2q, 2q + 1; each head's max runs over the
// 8 lanes of its q. P^T reaches the B operand by transposing its two 8x8 halves in
// registers. cK / cV: the warp's 16 staged K / V rows; live: keys of the 16 that are in the
// split (the rest are masked). O^T tile j, rows g and g + 8: dims swap_dim(j, g) and
// swap_dim(j, g) + 2 (tile 2u + e: dims 32u + 4g + e and + 2, so that a lane reads whole V words).
__device__ __forceinline__ int swap_dim(int j, int g) { return 32 * (j >> 1) + 4 * g + (j & 1); }
// The swapped form's MMAs take float16 operands whatever the model's 16-bit type: e4m3 K and V widen
// to float16 in one convert a pair (to bfloat16 through float16 and float32: four converts), and a
// bfloat16 model's q (rounded to float16, held to its range) and probabilities (<= 1) keep more bits
// in float16 than in bfloat16. The scores, the softmax, the output and the partials are float32 as
// before. For a float16 model nothing changes.
__device__ __forceinline__ unsigned q_to_f16x2(unsigned w) {  // two q values of the model's type
#if USE_BF16
    const float2 f = to_float2(*reinterpret_cast<const scalar2_t *>(&w));
    return pack2_f16(fminf(fmaxf(f.x, -65504.0f), 65504.0f), fminf(fmaxf(f.y, -65504.0f), 65504.0f));
#else
    return w;
#endif
}
// s (zero on entry): the warp's scores, (key g, heads 2q, 2q + 1), (key g + 8, the same heads)
__device__ __forceinline__ void swapped_scores(const kv_t *cK, const unsigned (&qf)[KSTEPS][2], float (&s)[4]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, qd = lane & 3;
#pragma unroll
    for (int kk = 0; kk < KSTEPS; kk++) {  // K word of dims 4q..4q+3 -> k slots 2q, 2q+1 and 2q+8, 2q+9
        unsigned a0, a1, a2, a3;
        fp8x4_to_f16x2x2(*reinterpret_cast<const unsigned *>(cK + g * SROW + kk * 16 + 4 * qd), a0, a2);
        fp8x4_to_f16x2x2(*reinterpret_cast<const unsigned *>(cK + (g + 8) * SROW + kk * 16 + 4 * qd), a1, a3);
        mma_16816<true>(s, a0, a1, a2, a3, qf[kk][0], qf[kk][1]);
    }
}
// the scores s of the warp's keys (live of its 16 in the split) into its running softmax, and P V
__device__ __forceinline__ void swapped_tile(const kv_t *cV, float (&s)[4], float (&o)[HEAD_DIM / 16][4],
                                             float m_run[2], float l_run[2], int live, float scale2) {
    const int lane = threadIdx.x & 31, g = lane >> 2, qd = lane & 3;
    if (live < 16) {
        if (g >= live) s[0] = s[1] = NEG_INF;
        if (g + 8 >= live) s[2] = s[3] = NEG_INF;
    }
    float corr[2];
#pragma unroll
    for (int c = 0; c < 2; c++) {
        float mx = fmaxf(s[c], s[2 + c]);
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
        const float m_new = fmaxf(m_run[c], mx * scale2);
        const float base = m_new == NEG_INF ? 0.0f : m_new;
        corr[c] = exp2f(m_run[c] - base);
        m_run[c] = m_new;
        s[c] = exp2f(fmaf(s[c], scale2, -base));
        s[2 + c] = exp2f(fmaf(s[2 + c], scale2, -base));
        l_run[c] = l_run[c] * corr[c] + s[c] + s[2 + c];
    }
    if (__any_sync(0xffffffffu, corr[0] != 1.0f || corr[1] != 1.0f)) {
#pragma unroll
        for (int j = 0; j < HEAD_DIM / 16; j++) {
            o[j][0] *= corr[0];
            o[j][1] *= corr[1];
            o[j][2] *= corr[0];
            o[j][3] *= corr[1];
        }
    }
    // P^T: k slots 2q, 2q + 1 (keys 2q, 2q + 1) and 2q + 8, 2q + 9 of column g (head g)
    const unsigned p0 = movmatrix_trans(pack2_f16(s[0], s[1])), p1 = movmatrix_trans(pack2_f16(s[2], s[3]));
    // V^T tile 2u + e from the lane's V words of keys 2q, 2q + 1, 2q + 8, 2q + 9 (one byte
    // permute gives a key pair at both of the lane's dims)
#pragma unroll
    for (int u = 0; u < HEAD_DIM / 32; u++) {
        unsigned w[4];
#pragma unroll
        for (int i = 0; i < 4; i++)
            w[i] = *reinterpret_cast<const unsigned *>(cV + (2 * qd + (i & 1) + 8 * (i >> 1)) * SROW + 32 * u + 4 * g);
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const unsigned sel = e == 0 ? 0x6240u : 0x7351u;
            unsigned a0, a1, a2, a3;
            fp8x4_to_f16x2x2(__byte_perm(w[0], w[1], sel), a0, a1);
            fp8x4_to_f16x2x2(__byte_perm(w[2], w[3], sel), a2, a3);
            mma_16816<true>(o[2 * u + e], a0, a1, a2, a3, p0, p1);
        }
    }
}

#if QK_WGMMA
// s (zero on entry) += the 64-key K tile kt (128-byte-swizzled rows) times q^T qt (8 x 128
// codes, swizzled alike), by the whole warpgroup; warp w's accumulators are keys 16w..16w+15.
// Each 32-dim step has accumulators of its own, added in float32 after: fp8 wgmma keeps fewer
// bits than float32 as it adds into its accumulators, and chained over the 128 dims that lost up
// to 4x the other forms' error where scores are large (H200, rows of 576-640 keys of e4m3 codes
// up to 448: 1.6e-2 of the largest output against 3.6e-3; apart, 5.3e-3; K of N(0, 4), q of
// N(0, 1): 3.65e-3, the other forms' own; chained, 4.4e-3), at the same speed.
__device__ __forceinline__ void qk_wgmma(float (&s)[4], const unsigned char *kt, const unsigned char *qt) {
    const unsigned long long da0 = smem_desc(kt), db0 = smem_desc(qt);
    float part[HEAD_DIM / 32][4];
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 32; kk++) {
        const unsigned long long da = da0 + 2 * kk, db = db0 + 2 * kk;  // 32 bytes of K further on
#if WGMMA_OK  // scale-d 0: the step's sums alone
        asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, 0, 0;\n\t"
                     "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0, %1, %2, %3}, %4, %5, p, 1, 1;\n\t}"
                     : "=f"(part[kk][0]), "=f"(part[kk][1]), "=f"(part[kk][2]), "=f"(part[kk][3])
                     : "l"(da), "l"(db));
#else
        part[kk][0] = part[kk][1] = part[kk][2] = part[kk][3] = 0.0f;
#endif
    }
    wgmma_commit();
    wgmma_wait<0>();
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 32; kk++) {
        fence_acc(part[kk]);
#pragma unroll
        for (int i = 0; i < 4; i++) s[i] += part[kk][i];
    }
}
#endif
#endif

// The dynamic shared memory of a block (flash_decode.smem_bytes): the 16-row query tile (none
// in the SWAP form) and BUFS buffers of K/V tiles. QK_WGMMA: up to 1,024 bytes to align, q^T
// (8 x 128 codes), BUFS K tiles of 128-byte rows, BUFS V tiles as staged, q's 4 shifts.
#if QK_WGMMA
constexpr int KT_BYTES = KEYS * HEAD_DIM, VT_BYTES = KEYS * SROW;
constexpr int SMEM_BYTES = 1024 + 8 * HEAD_DIM + BUFS * (KT_BYTES + VT_BYTES) + 16;
#elif KV_FP8
constexpr int SMEM_BYTES = (SWAP ? 0 : 2 * 16 * LDS) + 2 * BUFS * KEYS * SROW;
#else
constexpr int SMEM_BYTES = 2 * (16 + 2 * BUFS * KEYS) * LDS;
static_assert((2 + HEAD_DIM) * WARPS * GROUP * 4 <= 2 * BUFS * KEYS * LDS * 2, "the warps' partials fit the tiles");
#endif

// Split `split` of row b's keys for KV head kvh (the kernel below, one block each; attn_o.cu
// runs a whole row as one split: max_splits 1).
__device__ __forceinline__ void decode_split(
    int split, int kvh, int b,
    const scalar_t *__restrict__ q,         // (B, H, HEAD_DIM)
    const long long *__restrict__ k_ptrs,   // (B)
    const long long *__restrict__ v_ptrs,   // (B)
    const int *__restrict__ kv_lens,        // (B)
    long long layer_offset,
    float *__restrict__ part_o,             // (B, H, max_splits, HEAD_DIM)
    float *__restrict__ part_ml,            // (B, H, max_splits, 2): max (log2 domain), sum
    int *__restrict__ counters,             // (B, kv_heads), zero between launches
    scalar_t *__restrict__ out,             // (B, H, HEAD_DIM)
    int num_heads, int num_kv_heads, int max_splits, int window, float scale) {
    // Before the wait for the previous kernel (the QKV product, which writes q and this
    // step's K/V row) only the step's inputs and K/V rows of earlier steps are read.
    const int kv_len = kv_lens[b];
    const int first = window_start(kv_len, window);
    const int span = kv_len - first;
    int chunk = max(CHUNK, (span + max_splits * KEYS - 1) / (max_splits * KEYS) * KEYS);
    if (span <= SHORT) chunk = KEYS;
    if (span <= WHOLE) chunk = max(chunk, (span + KEYS - 1) / KEYS * KEYS);  // one split: no partials
    const int start = first + split * chunk;
    const int end = min(kv_len, start + chunk);
    if (start >= end) return;  // past this row's keys (a padding row has none); nothing written
    const int splits = (span + chunk - 1) / chunk;  // <= max_splits
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, qd = lane & 3;
    const int h0 = kvh * GROUP;
    const long long head_stride = (long long)max_splits * HEAD_DIM;
    const long long row0 = (long long)b * num_heads + h0;  // (row, head) of the group's first head

    extern __shared__ __align__(128) unsigned char smem[];
    scalar_t *sQ = reinterpret_cast<scalar_t *>(smem);  // 16 x LDS (SWAP: none, q goes to registers)
#if QK_WGMMA
    unsigned char *sQT = smem + ((1024 - (smem_addr(smem) & 1023)) & 1023);  // q^T codes, 1,024-byte aligned
    unsigned char *sKT = sQT + 8 * HEAD_DIM, *sVT = sKT + BUFS * KT_BYTES;
    int *q_shift = reinterpret_cast<int *>(sVT + BUFS * VT_BYTES);  // [4]: each head's q scaled by 2^q_shift
    float *scratch_a = reinterpret_cast<float *>(sKT), *scratch_b = reinterpret_cast<float *>(sVT);
    (void)sQ;
#elif KV_FP8  // byte tiles, BUFS buffers; the MMA fragments are converted from them directly
    unsigned char *st = reinterpret_cast<unsigned char *>(sQ + (SWAP ? 0 : 16 * LDS));  // [BUFS][K, V][KEYS][SROW]
    float *scratch_a = reinterpret_cast<float *>(st), *scratch_b = reinterpret_cast<float *>(st + 2 * KEYS * SROW);
#else
    scalar_t *sK = sQ + 16 * LDS;           // BUFS x KEYS x LDS
    scalar_t *sV = sK + BUFS * KEYS * LDS;  // BUFS x KEYS x LDS
    float *scratch_a = reinterpret_cast<float *>(sK), *scratch_b = reinterpret_cast<float *>(sV);
#endif

    const long long kv_stride = (long long)num_kv_heads * HEAD_DIM;
    const kv_t *kb = reinterpret_cast<const kv_t *>(k_ptrs[b]) + layer_offset + kvh * HEAD_DIM;
    const kv_t *vb = reinterpret_cast<const kv_t *>(v_ptrs[b]) + layer_offset + kvh * HEAD_DIM;
    const int n_tiles = (end - start + KEYS - 1) / KEYS;
#if QK_WGMMA
    auto k_tile = [&](int t) { return sKT + (t % BUFS) * KT_BYTES; };
    auto v_tile = [&](int t) { return sVT + (t % BUFS) * VT_BYTES; };
    constexpr int STRIDE = SROW;  // V's (K's rows are 128-byte swizzled: load_kv_tile's SWIZZLED_K)
#elif KV_FP8
    auto k_tile = [&](int t) { return st + (t % BUFS) * 2 * KEYS * SROW; };
    auto v_tile = [&](int t) { return st + ((t % BUFS) * 2 + 1) * KEYS * SROW; };
    constexpr int STRIDE = SROW;
#else
    auto k_tile = [&](int t) { return sK + (t % BUFS) * KEYS * LDS; };
    auto v_tile = [&](int t) { return sV + (t % BUFS) * KEYS * LDS; };
    constexpr int STRIDE = LDS;
#endif
    auto load_kv = [&](int t, int skip) {  // tile t: keys start + t * KEYS .., but key `skip`
        load_kv_tile<KEYS, HEAD_DIM, THREADS, QK_WGMMA>(k_tile(t), v_tile(t), STRIDE, kb, vb, kv_stride,
                                                        start + t * KEYS, end, start, skip);
    };
    // The first AHEAD tiles but this step's own key (kv_len - 1) before the wait: earlier steps
    // wrote them. With AHEAD = BUFS a row of up to BUFS tiles (SmolLM2 at up to 128 or 256 keys) has
    // nothing but q and its own key to load after the wait.
    const int own = kv_len - 1;
    const int own_tile = own < end ? (own - start) / KEYS : n_tiles;  // the tile holding it, if this split's
    const int ahead = min(n_tiles, AHEAD);
    for (int t = 0; t < ahead; t++) load_kv(t, own_tile == t ? own : -1);
    cp_async_commit();
    PDL_ENTER();
#if !SWAP
    for (int i = tid; i < 16 * VEC; i += THREADS) {
        const int r = i / VEC, c = (i % VEC) * 8;
        const bool ok = r < GROUP;
        cp_async16(sQ + r * LDS + c, q + (row0 + (ok ? r : 0)) * HEAD_DIM + c, ok);
    }
#endif
    if (own_tile < ahead) {  // the own key's row, where the tiles above left it out
#if QK_WGMMA
        load_kv_tile<1, HEAD_DIM, THREADS, true>(k_tile(own_tile), v_tile(own_tile), STRIDE, kb, vb, kv_stride, own,
                                                 own + 1, start, -1, own - start - own_tile * KEYS);
#else
        const int at = (own - start - own_tile * KEYS) * STRIDE;
        load_kv_tile<1, HEAD_DIM, THREADS>(k_tile(own_tile) + at, v_tile(own_tile) + at, STRIDE, kb, vb, kv_stride, own,
                                           own + 1, start);
#endif
    }
    cp_async_commit();

#if SWAP  // q^T as the B operand, straight from global memory: k slots 2q, 2q+1 / 2q+8, 2q+9
          // hold dims 4q, 4q+1 / 4q+2, 4q+3 (as K's words); column g is head g (zero past the group)
#if QK_WGMMA
    {  // q^T's codes: thread i takes dims 8 (i % 16) .. + 7 of column i / 16 (head (i / 16) & 3, hi or lo)
        const int n = tid >> 4, d0 = (tid & 15) * 8, hh = n & 3;
        const uint4 w = hh < GROUP ? *reinterpret_cast<const uint4 *>(q + (row0 + hh) * HEAD_DIM + d0)
                                   : make_uint4(0u, 0u, 0u, 0u);
        const unsigned ws[4] = {w.x, w.y, w.z, w.w};
        float x[8], amax = 0.0f;
#pragma unroll
        for (int p = 0; p < 4; p++) {
            const float2 f = to_float2(*reinterpret_cast<const scalar2_t *>(&ws[p]));
            x[2 * p] = f.x, x[2 * p + 1] = f.y;
            amax = fmaxf(amax, fmaxf(fabsf(f.x), fabsf(f.y)));
        }
#pragma unroll
        for (int m = 1; m < 16; m *= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));  // the head's
        int e = 0;
        frexpf(amax, &e);  // amax = m 2^e, m in [0.5, 1)
        const int sh = amax > 0.0f ? min(max(8 - e, -120), 120) : 0;  // amax 2^sh in [128, 256)
        const float up = ldexpf(1.0f, sh);
        unsigned codes[2] = {0u, 0u};
#pragma unroll
        for (int p = 0; p < 4; p++) {
            const float v0 = x[2 * p] * up, v1 = x[2 * p + 1] * up;
            unsigned short c = fp8x2_from_floats(v0, v1);
            if (n >= 4) {  // lo: 16 times what hi left
                const float2 h = fp8x2_to_float2(c);
                c = fp8x2_from_floats((v0 - h.x) * 16.0f, (v1 - h.y) * 16.0f);
            }
            codes[p >> 1] |= (unsigned)c << (16 * (p & 1));
        }
        *reinterpret_cast<uint2 *>(sQT + smem_swizzle(n, d0 >> 4) + (d0 & 15)) = make_uint2(codes[0], codes[1]);
        if ((tid & 15) == 0 && n < 4) q_shift[n] = sh;
    }
    cp_async_wait<0>();  // the tiles ahead have landed
    fence_proxy_async();  // this thread's copies and codes, before the MMAs read them
    __syncthreads();
    STAMP_POINT();  // landed
    float qmul[2][2];  // lane (g, q) ends with heads 2 (q & 1) + c: [c][0] its own column's factor, [c][1] q ^ 2's
#pragma unroll
    for (int c = 0; c < 2; c++) {
        const int sh_c = q_shift[2 * (qd & 1) + c];
        const float hi = ldexpf(1.0f, -sh_c), lo = ldexpf(1.0f, -sh_c - 4);
        qmul[c][0] = qd < 2 ? hi : lo;
        qmul[c][1] = qd < 2 ? lo : hi;
    }
#else
    unsigned qf[KSTEPS][2];
#pragma unroll
    for (int kk = 0; kk < KSTEPS; kk++) {
        const uint2 w = g < GROUP ? *reinterpret_cast<const uint2 *>(q + (row0 + g) * HEAD_DIM + kk * 16 + 4 * qd)
                                  : make_uint2(0u, 0u);
        qf[kk][0] = q_to_f16x2(w.x);
        qf[kk][1] = q_to_f16x2(w.y);
    }
    cp_async_wait<0>();  // the tiles ahead have landed
    __syncthreads();
    STAMP_POINT();  // landed
#endif
#else
    cp_async_wait<0>();  // Q and the tiles ahead have landed
    __syncthreads();
    STAMP_POINT();  // landed
    unsigned qf[KSTEPS][4];
#pragma unroll
    for (int kk = 0; kk < KSTEPS; kk++) {
#if KV_FP8  // k slots 2q, 2q+1, 2q+8, 2q+9 of a step hold dims 4q..4q+3 (K is permuted alike)
        const uint2 lo = *reinterpret_cast<const uint2 *>(sQ + g * LDS + kk * 16 + 4 * qd);
        const uint2 hi = *reinterpret_cast<const uint2 *>(sQ + (g + 8) * LDS + kk * 16 + 4 * qd);
        qf[kk][0] = lo.x;
        qf[kk][1] = hi.x;
        qf[kk][2] = lo.y;
        qf[kk][3] = hi.y;
#else
        ldsm_x4(qf[kk], sQ + (lane & 15) * LDS + kk * 16 + (lane >> 4) * 8);
#endif
    }
#endif

    float o[SWAP ? HEAD_DIM / 16 : OTILES][4];  // SWAP: O^T tiles, 16 dims x 8 heads
#pragma unroll
    for (int j = 0; j < (SWAP ? HEAD_DIM / 16 : OTILES); j++) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
    // rows g and g + 8 (SWAP: heads 2q and 2q + 1), log2 domain
    float m_run[2] = {NEG_INF, NEG_INF}, l_run[2] = {0.0f, 0.0f};
    const float scale2 = scale * 1.4426950408889634f;

#if !SWAP
    const int wk = TG > 1 ? warp & 3 : warp;  // the warp's 16 keys of a tile: keys 16 wk .. 16 wk + 15
    // A warp's 16 keys of tile t: scores (sc, zero on entry; keys past the split masked), then
    // their softmax step and P V. Only the running max, sum and output link one tile to the next.
    auto tile_scores = [&](int t, float (&sc)[2][4]) {
        const int n0 = start + t * KEYS + wk * 16;  // this warp's 16 keys
        if (n0 >= end) return;
#if KV_FP8
        const unsigned char *cK = st + ((t % BUFS) * 2 * KEYS + wk * 16) * SROW;
#pragma unroll
        for (int kk = 0; kk < KSTEPS; kk++)
#pragma unroll
            for (int j = 0; j < 2; j++) {  // the key of column g of score tile j: see key_of
                unsigned b0, b1;
                fp8x4_to_scalar2x2(*reinterpret_cast<const unsigned *>(cK + key_of(j, g) * SROW + kk * 16 + 4 * qd),
                                   b0, b1);
                mma_16816(sc[j], qf[kk][0], qf[kk][1], qf[kk][2], qf[kk][3], b0, b1);
            }
#else
        const scalar_t *cK = sK + ((t % BUFS) * KEYS + wk * 16) * LDS;
#pragma unroll
        for (int kk = 0; kk < KSTEPS; kk++) {
            unsigned kf[4];
            ldsm_x4(kf, cK + ((lane & 7) + ((lane >> 4) << 3)) * LDS + kk * 16 + ((lane >> 3) & 1) * 8);
            mma_16816(sc[0], qf[kk][0], qf[kk][1], qf[kk][2], qf[kk][3], kf[0], kf[1]);
            mma_16816(sc[1], qf[kk][0], qf[kk][1], qf[kk][2], qf[kk][3], kf[2], kf[3]);
        }
#endif
        if (n0 + 16 > end) {
#pragma unroll
            for (int j = 0; j < 2; j++)
#pragma unroll
                for (int i = 0; i < 4; i++)
                    if (n0 + key_of(j, 2 * qd + (i & 1)) >= end) sc[j][i] = NEG_INF;
        }
    };
    auto tile_output = [&](int t, float (&sc)[2][4]) {
        if (start + t * KEYS + wk * 16 >= end) return;
        online_softmax<2, OTILES, GROUP <= 8 ? 1 : 2>(sc, m_run, l_run, o, scale2);
        const unsigned a0 = pack2(sc[0][0], sc[0][1]), a1 = pack2(sc[0][2], sc[0][3]);
        const unsigned a2 = pack2(sc[1][0], sc[1][1]), a3 = pack2(sc[1][2], sc[1][3]);
#if KV_FP8
        // k slots 2q, 2q+1, 2q+8, 2q+9 of P are keys 4q..4q+3 (key_of); output tiles 4u..4u+3
        // take dims 32u + 4n + (0..3) at column n (out_dim). A lane's four V words (keys
        // 4q..4q+3, dims 32u + 4g..+3) interleaved bytewise, two dims per permute, feed four MMAs
        const unsigned char *cV = st + ((t % BUFS) * 2 * KEYS + KEYS + wk * 16) * SROW;
#pragma unroll
        for (int u = 0; u < OTILES / 4; u++) {
            unsigned w[4];
#pragma unroll
            for (int i = 0; i < 4; i++)
                w[i] = *reinterpret_cast<const unsigned *>(cV + (4 * qd + i) * SROW + 32 * u + 4 * g);
#pragma unroll
            for (int e = 0; e < 4; e += 2) {
                const unsigned sel = e == 0 ? 0x5140u : 0x7362u;  // dims e, e + 1 of keys (0, 1) / (2, 3)
                unsigned k01[2], k23[2];
                fp8x4_to_scalar2x2(__byte_perm(w[0], w[1], sel), k01[0], k01[1]);
                fp8x4_to_scalar2x2(__byte_perm(w[2], w[3], sel), k23[0], k23[1]);
                mma_16816(o[4 * u + e], a0, a1, a2, a3, k01[0], k23[0]);
                mma_16816(o[4 * u + e + 1], a0, a1, a2, a3, k01[1], k23[1]);
            }
        }
#else
        const scalar_t *cV = sV + ((t % BUFS) * KEYS + wk * 16) * LDS;
#pragma unroll
        for (int j = 0; j < OTILES; j += 2) {
            unsigned vf[4];
            ldsm_x4_trans(vf, cV + ((lane & 7) + ((lane >> 3) & 1) * 8) * LDS + j * 8 + (lane >> 4) * 8);
            mma_16816(o[j], a0, a1, a2, a3, vf[0], vf[1]);
            mma_16816(o[j + 1], a0, a1, a2, a3, vf[2], vf[3]);
        }
#endif
    };
#endif
#if TG > 1
    {
        const int grp = warp >> 2;
        const bool resident = n_tiles <= BUFS;  // every tile landed before the loop: no barriers
        auto group_sync = [&] { asm volatile("bar.sync %0, 128;" ::"r"(1 + grp) : "memory"); };
#pragma unroll 1
        for (int t = grp; t < n_tiles; t += TG) {
            if (!resident && t >= BUFS) {  // the group asked for it once done with its tile t - BUFS
                cp_async_wait<BUFS / TG - 1>();  // its later tiles (one an iteration) may still be on their way
                group_sync();
            }
            float sc[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
            tile_scores(t, sc);
            tile_output(t, sc);
            if (!resident) {
                if (t + BUFS < n_tiles) {  // tile t + BUFS, the group's too, takes buffer t % BUFS
                    group_sync();
                    load_kv_tile<KEYS, HEAD_DIM, 128>(k_tile(t), v_tile(t), STRIDE, kb, vb, kv_stride,
                                                      start + (t + BUFS) * KEYS, end, start, -1, 0, tid & 127);
                }
                cp_async_commit();
            }
        }
        __syncthreads();  // the tiles' memory takes the warps' partials below
    }
#else
#if !SWAP
    if (RESIDENT && n_tiles <= BUFS) {
        // Every tile landed before the loop (a short row, PDL): no barriers between tiles, the
        // arithmetic and its order the loop's below (so the bits too). H200, SmolLM2 B=1 decode
        // graphs at 40 / 96 / 160 keys: 323.8 / 334.6 / 346.6 -> 320.2 / 329.6 / 341.3 us. Two
        // forms that also took each tile's scores ahead of the last tile's P V ran no faster:
        // rolled, 325.3 / 334.9 / 346.4; unrolled over BUFS tiles, 335.0 / 342.5 / 350.3.
#pragma unroll 1
        for (int t = 0; t < n_tiles; t++) {
            float sc[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
            tile_scores(t, sc);
            tile_output(t, sc);
        }
        __syncthreads();  // the tiles' memory takes the warps' partials below
    } else
#endif
    for (int t = 0; t < n_tiles; t++) {
        // the buffer of tile t - 1 is free (the barrier that ended its pass): tile t + BUFS - 1 takes it
        if (t + BUFS - 1 < n_tiles && t + BUFS - 1 >= ahead) load_kv(t + BUFS - 1, -1);
        cp_async_commit();
        cp_async_wait<BUFS - 1>();  // tile t has landed; the BUFS - 2 tiles after it may still be on their way
#if QK_WGMMA
        fence_proxy_async();  // this thread's copies, before the MMAs read them
#endif
        __syncthreads();
#if SWAP
        const int n0 = start + t * KEYS + warp * 16;  // this warp's 16 keys
        float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#if QK_WGMMA
        qk_wgmma(s, k_tile(t), sQT);  // the whole warpgroup, whether or not the warp has keys in the split
#pragma unroll
        for (int i = 0; i < 4; i++) {  // hi and lo halves of the same head's score, scaled back
            const float other = __shfl_xor_sync(0xffffffffu, s[i], 2);
            s[i] = s[i] * qmul[i & 1][0] + other * qmul[i & 1][1];
        }
#else
        if (n0 < end) swapped_scores(k_tile(t) + warp * 16 * STRIDE, qf, s);
#endif
        if (n0 < end) swapped_tile(v_tile(t) + warp * 16 * STRIDE, s, o, m_run, l_run, end - n0, scale2);
#else
        float sc[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
        tile_scores(t, sc);
        tile_output(t, sc);
#endif
        __syncthreads();  // everyone is done with buffer t % BUFS before tile t + BUFS overwrites it
    }
#endif
    STAMP_POINT();  // tiles done
#pragma unroll
    for (int r = 0; r < 2; r++)  // a row's (SWAP: a head's) sum over the lanes that hold its keys
#pragma unroll
        for (int x = SWAP ? 4 : 1; x < (SWAP ? 32 : 4); x *= 2) l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], x);

    // combine the warps (in the K/V tiles' memory; every load has landed and been used); with tile
    // groups only those of the groups that had tiles (the rest hold nothing): a row of one tile
    // combines 4 warps, not 16 (H200, SmolLM2 B=1 at 40 keys: 16 cost 0.28 us a layer)
    const int live = TG > 1 ? 4 * min(TG, n_tiles) : WARPS;
    float *red_m = scratch_a;                      // [WARPS][GROUP]
    float *red_l = red_m + WARPS * GROUP;          // [WARPS][GROUP]
    float *red_o = red_l + WARPS * GROUP;          // [WARPS][GROUP][HEAD_DIM]
#if SWAP  // lane (g, q) holds heads 2q, 2q + 1 of dims swap_dim(j, g) (+ 2) in O^T tile j
#pragma unroll
    for (int c = 0; c < 2; c++) {
        const int h = 2 * qd + c;
        if (h >= GROUP) continue;
        if (g == 0) {
            red_m[warp * GROUP + h] = m_run[c];
            red_l[warp * GROUP + h] = l_run[c];
        }
#pragma unroll
        for (int j = 0; j < HEAD_DIM / 16; j++) {
            const int d = swap_dim(j, g);
            red_o[(warp * GROUP + h) * HEAD_DIM + d] = o[j][c];
            red_o[(warp * GROUP + h) * HEAD_DIM + d + 2] = o[j][2 + c];
        }
    }
#else
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int row = g + 8 * r;
        if (row >= GROUP || (TG > 1 && warp >= live)) continue;
        if (qd == 0) {
            red_m[warp * GROUP + row] = m_run[r];
            red_l[warp * GROUP + row] = l_run[r];
        }
#pragma unroll
        for (int j = 0; j < OTILES; j++) {
            red_o[(warp * GROUP + row) * HEAD_DIM + out_dim(j, 2 * qd)] = o[j][2 * r];
            red_o[(warp * GROUP + row) * HEAD_DIM + out_dim(j, 2 * qd + 1)] = o[j][2 * r + 1];
        }
    }
#endif
    __syncthreads();
    // a row's only split writes its output, normalised: no partials to combine
    float *po = part_o + row0 * head_stride + (long long)split * HEAD_DIM;
    float *pml = part_ml + (row0 * max_splits + split) * 2;
    for (int i = tid; i < GROUP * HEAD_DIM; i += THREADS) {
        const int h = i / HEAD_DIM, d = i % HEAD_DIM;
        float M = NEG_INF;
#pragma unroll
        for (int w = 0; w < live; w++) M = fmaxf(M, red_m[w * GROUP + h]);
        float O = 0.0f, L = 0.0f;
#pragma unroll
        for (int w = 0; w < live; w++) {
            const float m = red_m[w * GROUP + h];
            const float e = m == NEG_INF ? 0.0f : exp2f(m - M);
            O += red_o[(w * GROUP + h) * HEAD_DIM + d] * e;
            L += red_l[w * GROUP + h] * e;
        }
        if (splits == 1) {
            out[(row0 + h) * HEAD_DIM + d] = from_float(L > 0.0f ? O / L : 0.0f);
            continue;
        }
        po[(long long)h * head_stride + d] = O;
        if (d == 0) {
            pml[(long long)h * max_splits * 2] = M;
            pml[(long long)h * max_splits * 2 + 1] = L;
        }
    }
    if (splits == 1) return;

    // the last of the row's `splits` blocks for this KV head combines their partials
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    if (tid == 0) {
        int *counter = counters + (long long)b * num_kv_heads + kvh;
        last = atomicAdd(counter, 1) == splits - 1;
        if (last) *counter = 0;  // ready for the next launch
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    float *wts = scratch_b;                      // [GROUP][MAX_SPLITS] each split's weight exp2(m_s - M)
    float *inv_l = wts + GROUP * MAX_SPLITS;    // [GROUP]
    for (int h = warp; h < GROUP; h += WARPS) {  // a warp per head: the splits' max, weights and sum
        const float *ml = part_ml + (row0 + h) * max_splits * 2;
        float M = NEG_INF;
        for (int s = lane; s < splits; s += 32) M = fmaxf(M, __ldcg(ml + 2 * s));
        M = warp_max(M);
        float L = 0.0f;
        for (int s = lane; s < splits; s += 32) {
            const float m = __ldcg(ml + 2 * s);
            const float e = m == NEG_INF ? 0.0f : exp2f(m - M);
            wts[h * MAX_SPLITS + s] = e;
            L += __ldcg(ml + 2 * s + 1) * e;
        }
        L = warp_sum(L);
        if (lane == 0) inv_l[h] = L > 0.0f ? 1.0f / L : 0.0f;
    }
    __syncthreads();
    for (int i = tid; i < GROUP * HEAD_DIM; i += THREADS) {
        const int h = i / HEAD_DIM, d = i % HEAD_DIM;
        const float *po_h = part_o + (row0 + h) * head_stride + d;
        float O = 0.0f;
#pragma unroll 4
        for (int s = 0; s < splits; s++) O += __ldcg(po_h + (long long)s * HEAD_DIM) * wts[h * MAX_SPLITS + s];
        out[(row0 + h) * HEAD_DIM + d] = from_float(O * inv_l[h]);
    }
}

extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS) flash_decode_chunk(
    const scalar_t *__restrict__ q, const long long *__restrict__ k_ptrs, const long long *__restrict__ v_ptrs,
    const int *__restrict__ kv_lens, long long layer_offset, float *__restrict__ part_o, float *__restrict__ part_ml,
    int *__restrict__ counters, scalar_t *__restrict__ out, int num_heads, int num_kv_heads, int max_splits,
    int window, float scale) {
    decode_split(blockIdx.x, blockIdx.y, blockIdx.z, q, k_ptrs, v_ptrs, kv_lens, layer_offset, part_o, part_ml,
                 counters, out, num_heads, num_kv_heads, max_splits, window, scale);
}
