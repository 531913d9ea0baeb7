// Causal flash attention for a ragged batch of prefill chunks on Hopper's wgmma (sm_90a): the
// same arguments and results as flash_prefill.cu, bit for bit (flash_prefill.py picks it on sm_90),
// with the K/V tiles' copies and their widening to 16 bits taken off the MMAs' path.
//
// A work item is 64 queries of HEADS query heads that share a KV head. Warpgroup 0 of a block is
// the producer: it copies K/V tiles of 64 keys from the cache into RAW raw stages (cp.async), then
// writes them as the MMAs read them into STAGES 16-bit stages (K as it is, V transposed; e4m3
// widened on the way) and hands each over on a full mbarrier. Warpgroup 1 + i runs query head
// h0 + i: S = Q K^T (m64n64k16, Q and K from shared memory), the online softmax in registers
// (the scores' accumulators are, element for element, the A fragments of P), then O += P V
// (m64nDk16, P from registers) with the next tile's S issued behind it, and hands the stage back
// on an empty mbarrier. So a tile's copies, widening and barriers run while the tiles before it
// are multiplied, and the tensor cores take P V and the next S back to back. -DPINGPONG (two
// consumers): they take turns to issue their MMAs, so one's softmax runs beside the other's MMAs.
//
// The arithmetic per query row: 16-bit products summed in float32 by the tensor cores, the
// softmax as flash_prefill.cu's (common.cuh's online_softmax), P rounded to 16 bits for P V.
// A row's results do not depend on the other rows or sequences of the launch, nor on HEADS.
//
// Persistent: grid min(work items, the blocks that fit at once), a work item being a tile of 64
// queries (tile_seq / tile_q0 as in flash_prefill.cu) for one group of HEADS heads; block
// 128 * (HEADS + 1). -DHEAD_DIM (64 or 128), -DHEADS, -DKV_FP8, -DRAW, -DSTAGES, -DMIN_BLOCKS,
// -DITEM_CAP;
// dynamic shared memory: flash_prefill.wgmma_smem_bytes().
#include "wgmma.cuh"

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef HEADS
#define HEADS 2
#endif
#ifndef STAGES
#define STAGES 2  // 16-bit K / V^T stages
#endif
#ifndef RAW
#define RAW 2  // stages of K/V rows as cached
#endif
#ifndef MIN_BLOCKS
#define MIN_BLOCKS 1  // blocks an SM (registers capped to fit)
#endif
#ifndef PINGPONG
#define PINGPONG 0  // 1 (HEADS 2): the consumer warpgroups take turns to issue their MMAs
#endif
static_assert(!PINGPONG || HEADS == 2, "turns between two consumer warpgroups");
#define BLOCK_M 64
#define BLOCK_N 64
#define THREADS (128 * (HEADS + 1))
#define ATOMS (HEAD_DIM / 64)                        // 128-byte swizzle columns of a 16-bit row
#define TILE16 (64 * HEAD_DIM * 2)                   // a 16-bit tile: Q (64 x D), K (64 x D), V^T (D x 64)
#define RAW_ROW (HEAD_DIM * (int)sizeof(kv_t))       // bytes of a cached row
#define RAW_TILE (2 * BLOCK_N * RAW_ROW)             // K rows then V rows, as cached

static_assert(HEAD_DIM == 64 || HEAD_DIM == 128, "head_dim 64 or 128");
static_assert(RAW >= 2 && STAGES >= 1, "stages");

// m64n64k16, 16-bit x 16-bit -> float32, A and B from shared memory (K-major); acc: keep d's sums
__device__ __forceinline__ void wgmma_ss64(float (&s)[8][4], unsigned long long da, unsigned long long db,
                                           int acc) {
#if WGMMA_OK
    float(&d)[32] = *reinterpret_cast<float(*)[32]>(&s[0][0]);
    asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %34, 0;\n\twgmma.mma_async.sync.aligned.m64n64k16.f32." MMA_TYPE
                 "." MMA_TYPE " {" WG_P0 ", " WG_P1 ", " WG_P2 ", " WG_P3 "}, %32, %33, p, 1, 1, 0, 0;\n\t}"
                 : WG_F8(0), WG_F8(8), WG_F8(16), WG_F8(24)
                 : "l"(da), "l"(db), "r"(acc));
#endif
}

// m64nDk16 with A (P) from registers, B (V^T, K-major) from shared memory; the sums kept
__device__ __forceinline__ void wgmma_rs(float (&o)[HEAD_DIM / 8][4], const unsigned (&a)[4], unsigned long long db) {
#if WGMMA_OK
    float(&d)[HEAD_DIM / 2] = *reinterpret_cast<float(*)[HEAD_DIM / 2]>(&o[0][0]);
#if HEAD_DIM == 64
    asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, 1, 0;\n\twgmma.mma_async.sync.aligned.m64n64k16.f32." MMA_TYPE
                 "." MMA_TYPE " {" WG_P0 ", " WG_P1 ", " WG_P2 ", " WG_P3 "}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n\t}"
                 : WG_F8(0), WG_F8(8), WG_F8(16), WG_F8(24)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
#else
    asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, 1, 0;\n\twgmma.mma_async.sync.aligned.m64n128k16.f32." MMA_TYPE
                 "." MMA_TYPE " {" WG_P0 ", " WG_P1 ", " WG_P2 ", " WG_P3 ", " WG_P4 ", " WG_P5 ", " WG_P6 ", " WG_P7
                 "}, {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n\t}"
                 : WG_F8(0), WG_F8(8), WG_F8(16), WG_F8(24), WG_F8(32), WG_F8(40), WG_F8(48), WG_F8(56)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
#endif
#endif
}

template <int A, int B>
__device__ __forceinline__ void fence_acc2(float (&d)[A][B]) {
    fence_acc(*reinterpret_cast<float(*)[A * B]>(&d[0][0]));
}

__device__ __forceinline__ void producers_sync() { asm volatile("bar.sync 1, 128;" ::: "memory"); }

// A K row's 16-byte chunk (8 values) of the 16-bit tile: from 8 cached values at src
__device__ __forceinline__ uint4 widen8(const unsigned char *src) {
#if KV_FP8
    const uint2 v = *reinterpret_cast<const uint2 *>(src);
    uint4 out;
    fp8x4_to_scalar2x2(v.x, out.x, out.y);
    fp8x4_to_scalar2x2(v.y, out.z, out.w);
    return out;
#else
    return *reinterpret_cast<const uint4 *>(src);
#endif
}

// A work item: one tile (64 queries of a sequence) for one group of HEADS query heads, as the
// block's table in shared memory holds it (filled once at the start, all items' loads at once)
struct __align__(16) Item {
    const kv_t *kb, *vb;  // the item's KV head in the sequence's K and V rows of this layer
    int rows, q_first, n_begin, n_tiles, h0, qbase;
};  // 48 bytes (flash_prefill.WGMMA_ITEM_BYTES)
#ifndef ITEM_CAP
#define ITEM_CAP 160  // items a block at most (flash_prefill.WGMMA_ITEM_CAP)
#endif

// The r-th item of block b (gridDim.x blocks) in a persistent launch: rounds of gridDim.x items,
// every other round in reverse block order, so that a block taking one of a round's longest items
// (flash_prefill.tiles: most keys first) takes one of the next round's shortest. -1: none left.
__device__ __forceinline__ int item_index(int r, int items) {
    const int w = r * gridDim.x + ((r & 1) ? gridDim.x - 1 - blockIdx.x : blockIdx.x);
    return w < items ? w : -1;
}

// Persistent: block b takes items item_index(0), item_index(1), ... of tiles x (num_heads / HEADS)
// (a tile's head groups next to each other). The producer streams K/V tiles across items without
// a pause; each consumer warpgroup brings the next item's Q in (cp.async) while it works on this
// one.
extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS) flash_prefill_wgmma(
    PREFILL_ATTENTION_ARGS, int tiles_given,  // tiles_given: tile_seq's length, or
    const int *__restrict__ tiles_on_device) {  // where not null, that length read here (a graph's step)
    PDL_ENTER();
    const int tiles = tiles_on_device ? *tiles_on_device : tiles_given;
    extern __shared__ unsigned char smem_raw[];
    unsigned char *smem = smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u);
    unsigned char *sQ = smem;                        // HEADS x 2 x [ATOMS][64 rows][128 B]
    unsigned char *sK = sQ + 2 * HEADS * TILE16;     // STAGES x [ATOMS][64 keys][128 B]
    unsigned char *sV = sK + STAGES * TILE16;        // STAGES x [HEAD_DIM dims][64 keys = 128 B]
    unsigned char *sR = sV + STAGES * TILE16;        // RAW x [K, V][64 keys][RAW_ROW]
    Item *table = reinterpret_cast<Item *>(sR + RAW * RAW_TILE);  // the block's items in order
    unsigned long long *full = reinterpret_cast<unsigned long long *>(table + ITEM_CAP);
    unsigned long long *empty = full + STAGES;
    const int groups = num_heads / HEADS, items = tiles * groups;

    for (int r = threadIdx.x; r < ITEM_CAP; r += THREADS) {
        const int w = item_index(r, items);
        if (w < 0) break;
        Item it;
        const int tile = w / groups, s = tile_seq[tile], q0 = tile_q0[tile], q_len = seq_q_len[s];
        it.h0 = (w % groups) * HEADS;
        const long long kv_off = layer_offset + (long long)(it.h0 / (num_heads / num_kv_heads)) * HEAD_DIM;
        it.kb = reinterpret_cast<const kv_t *>(k_ptrs[s]) + kv_off;
        it.vb = reinterpret_cast<const kv_t *>(v_ptrs[s]) + kv_off;
        it.rows = min(BLOCK_M, q_len - q0);
        it.qbase = seq_q_start[s] + q0;
        it.q_first = seq_kv_len[s] - q_len + q0;
        const int k_lo = window > 0 ? max(0, it.q_first - window + 1) : 0;
        it.n_begin = (k_lo / BLOCK_N) * BLOCK_N;
        it.n_tiles = (it.q_first + it.rows - it.n_begin + BLOCK_N - 1) / BLOCK_N;
        table[r] = it;
    }
    if (threadIdx.x == 0) {
        for (int i = 0; i < STAGES; i++) {
            mbar_init(&full[i], 128);            // every producer thread hands its part over
            mbar_init(&empty[i], 128 * HEADS);   // every consumer thread hands it back
        }
    }
    __syncthreads();
    int n_items = 0;  // the block's
    while (n_items < ITEM_CAP && item_index(n_items, items) >= 0) n_items++;
    constexpr int QCH = HEAD_DIM / 8;  // 16-byte chunks of a row

    if (threadIdx.x < 128) {  // ------------------------------------------------ producer
        const int tid = threadIdx.x;
        const long long kv_stride = (long long)num_kv_heads * HEAD_DIM;
        constexpr int PIECES = RAW_ROW / 16;  // 16-byte pieces of a cached row
        int r = 0, t = 0, issued = 0;  // the next tile to copy: tile t of item r
        auto issue = [&]() {  // copies of the next tile into raw stage issued % RAW, if any is left
            if (r < n_items) {
                const Item &it = table[r];
                const int n0 = it.n_begin + t * BLOCK_N, k_hi = it.q_first + it.rows;
                unsigned char *dk = sR + (issued % RAW) * RAW_TILE, *dv = dk + BLOCK_N * RAW_ROW;
#pragma unroll
                for (int u = 0; u < BLOCK_N * PIECES / 128; u++) {  // a static count: the offsets fold
                    const int i = tid + 128 * u, row = i / PIECES, c = i % PIECES, key = n0 + row;
                    const bool ok = key < k_hi;  // keys past the chunk are zeros (never NaN times 0 in P V)
                    const long long off = (long long)(ok ? key : 0) * kv_stride + c * (16 / (int)sizeof(kv_t));
                    cp_async16(dk + row * RAW_ROW + c * 16, it.kb + off, ok);
                    cp_async16(dv + row * RAW_ROW + c * 16, it.vb + off, ok);
                }
                issued++;
                if (++t == it.n_tiles) {
                    t = 0;
                    r++;
                }
            }
            cp_async_commit();  // a group a call, empty or not: the waits below count them
        };
#pragma unroll
        for (int i = 0; i < RAW - 1; i++) issue();
        for (int g = 0; g < issued; g++) {  // g: the block's g-th tile; issued runs RAW - 1 ahead
            cp_async_wait<RAW - 2>();  // this thread's copies of tile g have landed
            producers_sync();          // everyone's have, and everyone is done with tile g - 1's raw stage
            issue();
            const int st = g % STAGES;
            if (g >= STAGES) mbar_wait(&empty[st], ((g / STAGES) - 1) & 1);
            const unsigned char *rk = sR + (g % RAW) * RAW_TILE, *rv = rk + BLOCK_N * RAW_ROW;
            unsigned char *k16 = sK + st * TILE16, *v16 = sV + st * TILE16;
            // K: 8 values of a key a thread, as a 16-byte chunk of its row
#pragma unroll
            for (int u = 0; u < BLOCK_N * QCH / 128; u++) {
                const int i = tid + 128 * u, row = i / QCH, c = i % QCH;
                *reinterpret_cast<uint4 *>(k16 + (c / 8) * (BLOCK_N * 128) + smem_swizzle(row, c % 8)) =
                    widen8(rk + row * RAW_ROW + c * 8 * (int)sizeof(kv_t));
            }
            // V^T: 8 keys of DPU dims a thread (a 4-byte word of each key's row), one 16-byte
            // chunk of V^T's row for each dim: the words' bytes regrouped by dim, two keys a
            // 16-bit pair
#if KV_FP8
            constexpr int DPU = 4;
#else
            constexpr int DPU = 2;
#endif
#pragma unroll
            for (int u = 0; u < (BLOCK_N / 8) * (HEAD_DIM / DPU) / 128; u++) {
                const int i = tid + 128 * u, dc = i % (HEAD_DIM / DPU), kc = i / (HEAD_DIM / DPU);
                unsigned wd[8];
#pragma unroll
                for (int j = 0; j < 8; j++) wd[j] = *reinterpret_cast<const unsigned *>(rv + (kc * 8 + j) * RAW_ROW + dc * 4);
#pragma unroll
                for (int d = 0; d < DPU; d++) {
                    uint4 chunk;
                    unsigned *c4 = reinterpret_cast<unsigned *>(&chunk);
#pragma unroll
                    for (int p = 0; p < 4; p++) {
#if KV_FP8
                        const unsigned pair = __byte_perm(wd[2 * p], wd[2 * p + 1], d | ((4 + d) << 4));
                        c4[p] = fp8x2_to_scalar2((unsigned short)(pair & 0xffff));
#else
                        c4[p] = __byte_perm(wd[2 * p], wd[2 * p + 1], d ? 0x7632 : 0x5410);
#endif
                    }
                    *reinterpret_cast<uint4 *>(v16 + smem_swizzle(dc * DPU + d, kc)) = chunk;
                }
            }
            fence_proxy_async();
            mbar_arrive(&full[st]);
        }
        return;
    }

    // ---------------------------------------------------------------- consumers: one head each
    const int c = threadIdx.x / 128 - 1;
    const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;  // warp: its 16 of the 64 queries
    const int g = lane >> 2, qd = lane & 3;
    const float scale2 = scale * 1.4426950408889634f;
    auto load_q = [&](int r, int buf) {  // this head's 64 x HEAD_DIM queries of item r, if any
        if (r < n_items) {
            const Item &it = table[r];
            unsigned char *dst = sQ + (2 * c + buf) * TILE16;
#pragma unroll
            for (int u = 0; u < BLOCK_M * QCH / 128; u++) {
                const int i = threadIdx.x % 128 + 128 * u, row = i / QCH, ch = i % QCH;
                const bool ok = row < it.rows;
                cp_async16(dst + (ch / 8) * (BLOCK_M * 128) + smem_swizzle(row, ch % 8),
                           q + ((long long)(it.qbase + (ok ? row : 0)) * num_heads + it.h0 + c) * HEAD_DIM + ch * 8, ok);
            }
        }
        cp_async_commit();
    };
    load_q(0, 0);
    load_q(1, 1);
    const unsigned long long dq0 = smem_desc(sQ + 2 * c * TILE16), dk0 = smem_desc(sK), dv0 = smem_desc(sV);
    // PINGPONG (two consumer warpgroups): they take turns to issue their MMAs, on named barriers
    // 4 + c (warpgroup c's turn), so that one's softmax runs while the other's MMAs do
    auto my_turn = [&]() {
        if (PINGPONG) asm volatile("bar.sync %0, 256;" ::"r"(4 + c) : "memory");
    };
    auto their_turn = [&]() {
        if (PINGPONG) asm volatile("bar.arrive %0, 256;" ::"r"(5 - c) : "memory");
    };
    if (PINGPONG && c == 1) asm volatile("bar.arrive 4, 256;" ::: "memory");  // warpgroup 0 goes first
    int gt = 0;  // the block's tiles so far
    for (int r = 0; r < n_items; r++) {
        const int rows = table[r].rows, q_first = table[r].q_first, n_begin = table[r].n_begin;
        const int n_tiles = table[r].n_tiles, qbase = table[r].qbase, h = table[r].h0 + c, k_hi = q_first + rows;
        cp_async_wait<1>();  // this thread's part of the item's Q has landed (the next one's may not)
        fence_proxy_async();
        asm volatile("bar.sync %0, 128;" ::"r"(2 + c) : "memory");  // the warpgroup's parts have
        const unsigned long long dq = dq0 + (r % 2) * (TILE16 >> 4);
        float o[HEAD_DIM / 8][4];
#pragma unroll
        for (int j = 0; j < HEAD_DIM / 8; j++) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
        float m_run[2] = {NEG_INF, NEG_INF}, l_run[2] = {0.0f, 0.0f};  // rows g and g + 8, log2 domain
        const int pos0 = q_first + warp * 16 + g;  // query positions of this lane's two rows
        const int wq_lo = q_first + warp * 16, wq_hi = wq_lo + 15;

        // Tile by tile: the scores' softmax, then O += P V with the next tile's S = Q K^T behind it
        // (the tensor cores take both back to back). No branch holds an MMA (ptxas would serialize
        // them): the last tile runs outside the loop.
        float sc[BLOCK_N / 8][4];
        unsigned a[BLOCK_N / 16][4];
        auto stage_ready = [&](int gtile) { mbar_wait(&full[gtile % STAGES], (gtile / STAGES) & 1); };
        auto scores = [&](int gtile) {  // issued, not waited for
            // the stage's descriptor: a byte offset within shared memory adds offset / 16 (smem_desc)
            const unsigned long long dk = dk0 + (gtile % STAGES) * (TILE16 >> 4);
#pragma unroll
            for (int kk = 0; kk < HEAD_DIM / 16; kk++) {
                const int at = (kk / 4) * (64 * 128) + (kk % 4) * 32;
                wgmma_ss64(sc, dq + (at >> 4), dk + (at >> 4), kk);
            }
        };
        auto softmax = [&](int t) {  // sc -> P in a; o and the running sums rescaled
            const int n0 = n_begin + t * BLOCK_N;
            if (n0 + BLOCK_N - 1 > wq_lo || n0 + BLOCK_N > k_hi || (window > 0 && n0 <= wq_hi - window))
                {  // not wholly visible to the warp's rows
                CAUSAL_MASK(sc, BLOCK_N / 8, n0, pos0, k_hi, window, qd);
            }
            online_softmax(sc, m_run, l_run, o, scale2);
            p_fragments(sc, a);
        };
        auto pv = [&](int gtile) {  // issued, not waited for
            const unsigned long long dv = dv0 + (gtile % STAGES) * (TILE16 >> 4);
#pragma unroll
            for (int kk = 0; kk < BLOCK_N / 16; kk++) wgmma_rs(o, a[kk], dv + kk * 2);
        };
        auto retire = [&](int gtile) {  // the MMAs done: the stage goes back
            wgmma_wait<0>();
            fence_acc2(o);
            fence_acc2(sc);
#pragma unroll
            for (int kk = 0; kk < BLOCK_N / 16; kk++)  // P's registers stay P's until the MMAs have read them
                asm volatile("" ::"r"(a[kk][0]), "r"(a[kk][1]), "r"(a[kk][2]), "r"(a[kk][3]));
            mbar_arrive(&empty[gtile % STAGES]);
        };
        stage_ready(gt);
        my_turn();
        wgmma_fence();
        scores(gt);
        wgmma_commit();
        their_turn();
        wgmma_wait<0>();
        fence_acc2(sc);
        for (int t = 0; t + 1 < n_tiles; t++, gt++) {
            softmax(t);
            stage_ready(gt + 1);
            my_turn();
            wgmma_fence();
            pv(gt);
            scores(gt + 1);
            wgmma_commit();
            their_turn();
            retire(gt);
        }
        softmax(n_tiles - 1);
        my_turn();
        wgmma_fence();
        pv(gt);
        wgmma_commit();
        their_turn();
        retire(gt++);
        load_q(r + 2, r % 2);  // this item's MMAs are done with its Q buffer

        const int r0 = warp * 16 + g;
        store_rows(o, l_run, out + ((long long)(qbase + r0) * num_heads + h) * HEAD_DIM + 2 * qd,
                   8LL * num_heads * HEAD_DIM, r0, rows);
    }
    if (PINGPONG && c == 0) asm volatile("bar.sync 4, 256;" ::: "memory");  // warpgroup 1's last turn handed over
}
