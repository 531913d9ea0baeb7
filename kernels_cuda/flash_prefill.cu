// Causal flash attention for a ragged batch of prefill chunks, reading K/V from the
// cache: a chunk attends to its sequence's cached prefix and to itself.
//
// FlashAttention-2 layout on mma.sync (m16n8k16, 16-bit in, float32 accumulate): a block
// of 4 * HEADS warps takes 64 queries of HEADS query heads that share a KV head, each warp
// 16 queries of one head, so each K/V tile is loaded (and widened) once for the HEADS
// heads. A warp keeps its Q
// fragments, its 16 x 64 score tile, the running max / sum and its 16 x HEAD_DIM output in
// registers; K/V tiles of 64 keys stream through shared memory, double-buffered with
// cp.async so the next tile loads while this one is used. Scores never leave registers:
// the score accumulators of two 8-key tiles are exactly the A fragment of P for the P V
// product. Tiles fully visible to a warp skip the mask; tiles it cannot see are skipped.
//
// grid (num_heads / HEADS, num_tiles), block 128 * HEADS. A tile is 64 queries of one
// sequence: tile_seq / tile_q0 map tiles to (sequence, first query), in the order the host
// gives them (flash_prefill.tiles: the most keys first), and the heads of a tile run next to
// each other, so the longest blocks of the whole launch start first and share K/V in L2.
// -DHEAD_DIM (multiple of 16), -DHEADS (query heads a block: a divisor of the heads per KV
// head), -DKV_FP8 (e4m3 cache: tiles are widened to 16 bits in shared memory before the
// MMAs); dynamic shared memory: flash_prefill.smem_bytes().
#include "common.cuh"

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef HEADS
#define HEADS 1
#endif
#define BLOCK_M 64
#define BLOCK_N 64
#define THREADS (128 * HEADS)
#define LDS (HEAD_DIM + 8)  // shared row stride (elements): 16-byte rows land on distinct banks for ldmatrix

constexpr int KSTEPS = HEAD_DIM / 16;  // k steps of Q K^T
constexpr int STILES = BLOCK_N / 8;    // 8-key tiles of a warp's scores
constexpr int OTILES = HEAD_DIM / 8;   // 8-wide column tiles of a warp's output
constexpr int VEC = HEAD_DIM / 8;      // 16-byte groups per row

extern "C" __global__ void __launch_bounds__(THREADS) flash_prefill(
    PREFILL_ATTENTION_ARGS) {
    PDL_ENTER();
    extern __shared__ __align__(128) unsigned char smem[];
    scalar_t *sQ = reinterpret_cast<scalar_t *>(smem);  // HEADS x BLOCK_M x LDS
#if KV_FP8  // tiles arrive as bytes (double-buffered) and are widened into one 16-bit K and V tile
    unsigned char *st = reinterpret_cast<unsigned char *>(sQ + HEADS * BLOCK_M * LDS);  // [2][K, V][BLOCK_N][HEAD_DIM]
    scalar_t *sK = reinterpret_cast<scalar_t *>(st + 4 * BLOCK_N * HEAD_DIM);   // BLOCK_N x LDS
    scalar_t *sV = sK + BLOCK_N * LDS;                                           // BLOCK_N x LDS
#else
    scalar_t *sK = sQ + HEADS * BLOCK_M * LDS;  // 2 x BLOCK_N x LDS
    scalar_t *sV = sK + 2 * BLOCK_N * LDS;  // 2 x BLOCK_N x LDS
#endif

    const int tile = blockIdx.y, h0 = blockIdx.x * HEADS;
    const int kvh = h0 / (num_heads / num_kv_heads);
    const int s = tile_seq[tile], q0 = tile_q0[tile];
    const int q_len = seq_q_len[s], kv_len = seq_kv_len[s];
    const int start_pos = kv_len - q_len;
    const int rows = min(BLOCK_M, q_len - q0);
    const long long qbase = (long long)seq_q_start[s] + q0;
    const int tid = threadIdx.x, lane = tid & 31;
    const int h = h0 + (tid >> 7), warp = (tid >> 5) & 3;  // this warp's head and its 16 queries of the 64
    const int g = lane >> 2, qd = lane & 3;

    const int q_first = start_pos + q0, q_last = q_first + rows - 1;
    const int k_hi = q_last + 1;  // causal: no key past the last query
    const int k_lo = window > 0 ? max(0, q_first - window + 1) : 0;
    const int n_begin = (k_lo / BLOCK_N) * BLOCK_N;
    const int n_tiles = (k_hi - n_begin + BLOCK_N - 1) / BLOCK_N;
    const long long kv_stride = (long long)num_kv_heads * HEAD_DIM;
    const kv_t *kb = reinterpret_cast<const kv_t *>(k_ptrs[s]) + layer_offset + kvh * HEAD_DIM;
    const kv_t *vb = reinterpret_cast<const kv_t *>(v_ptrs[s]) + layer_offset + kvh * HEAD_DIM;

    for (int i = tid; i < HEADS * BLOCK_M * VEC; i += THREADS) {
        const int hr = i / VEC, r = hr % BLOCK_M, c = (i % VEC) * 8;  // hr: head hr / BLOCK_M of the block, row r
        const bool ok = r < rows;
        cp_async16(sQ + hr * LDS + c, q + ((qbase + (ok ? r : 0)) * num_heads + h0 + hr / BLOCK_M) * HEAD_DIM + c, ok);
    }
    cp_async_commit();
    // (written out rather than through common.cuh's load_kv_tile, which the decode kernel
    // uses: with it this kernel compiled to 25 % slower code, 173 vs 224 TFLOP/s at 8,192
    // tokens on the H200)
    constexpr int PIECES = HEAD_DIM * (int)sizeof(kv_t) / 16;  // 16-byte pieces of a cached row
    auto load_kv = [&](int t) {
        const int n0 = n_begin + t * BLOCK_N;
        for (int i = tid; i < BLOCK_N * PIECES; i += THREADS) {
            const int r = i / PIECES, c = (i % PIECES) * (16 / (int)sizeof(kv_t)), key = n0 + r;
            const bool ok = key < k_hi;  // keys past the chunk are zeros (never NaN times 0 in P V)
            const long long off = (long long)(ok ? key : 0) * kv_stride + c;
#if KV_FP8
            unsigned char *dk = st + (t & 1) * 2 * BLOCK_N * HEAD_DIM, *dv = dk + BLOCK_N * HEAD_DIM;
            cp_async16(dk + r * HEAD_DIM + c, kb + off, ok);
            cp_async16(dv + r * HEAD_DIM + c, vb + off, ok);
#else
            cp_async16(sK + ((t & 1) * BLOCK_N + r) * LDS + c, kb + off, ok);
            cp_async16(sV + ((t & 1) * BLOCK_N + r) * LDS + c, vb + off, ok);
#endif
        }
    };
    load_kv(0);
    cp_async_commit();
    cp_async_wait<1>();  // Q has landed
    __syncthreads();

    unsigned qf[KSTEPS][4];
#pragma unroll
    for (int kk = 0; kk < KSTEPS; kk++)
        ldsm_x4(qf[kk], sQ + ((h - h0) * BLOCK_M + warp * 16 + (lane & 15)) * LDS + kk * 16 + (lane >> 4) * 8);

    float o[OTILES][4];
#pragma unroll
    for (int j = 0; j < OTILES; j++) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
    float m_run[2] = {NEG_INF, NEG_INF}, l_run[2] = {0.0f, 0.0f};  // rows g and g + 8, log2 domain
    const float scale2 = scale * 1.4426950408889634f;
    const int pos0 = q_first + warp * 16 + g;  // query positions of this lane's two rows
    const int wq_lo = q_first + warp * 16, wq_hi = wq_lo + 15;

    for (int t = 0; t < n_tiles; t++) {
        if (t + 1 < n_tiles) load_kv(t + 1);
        cp_async_commit();
        cp_async_wait<1>();  // tile t has landed
        __syncthreads();
        const int n0 = n_begin + t * BLOCK_N;
#if KV_FP8
        kv_tile_to_scalar(st + (t & 1) * 2 * BLOCK_N * HEAD_DIM, sK, BLOCK_N, HEAD_DIM, LDS);
        kv_tile_to_scalar(st + (t & 1) * 2 * BLOCK_N * HEAD_DIM + BLOCK_N * HEAD_DIM, sV, BLOCK_N, HEAD_DIM, LDS);
        __syncthreads();
        const scalar_t *cK = sK, *cV = sV;
#else
        const scalar_t *cK = sK + (t & 1) * BLOCK_N * LDS, *cV = sV + (t & 1) * BLOCK_N * LDS;
#endif
        const bool visible = n0 <= wq_hi && (window <= 0 || n0 + BLOCK_N - 1 > wq_lo - window);
        if (visible && wq_lo <= q_last) {
            float sc[STILES][4];
#pragma unroll
            for (int j = 0; j < STILES; j++) sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < KSTEPS; kk++) {
#pragma unroll
                for (int j = 0; j < STILES; j += 2) {
                    unsigned b[4];
                    ldsm_x4(b, cK + (j * 8 + (lane & 7) + ((lane >> 4) << 3)) * LDS + kk * 16 + ((lane >> 3) & 1) * 8);
                    mma_16816(sc[j], qf[kk][0], qf[kk][1], qf[kk][2], qf[kk][3], b[0], b[1]);
                    mma_16816(sc[j + 1], qf[kk][0], qf[kk][1], qf[kk][2], qf[kk][3], b[2], b[3]);
                }
            }
            if (n0 + BLOCK_N - 1 > wq_lo || n0 + BLOCK_N > k_hi || (window > 0 && n0 <= wq_hi - window))
                {  // not wholly visible to the warp's rows
                CAUSAL_MASK(sc, BLOCK_N / 8, n0, pos0, k_hi, window, qd);
            }
            online_softmax(sc, m_run, l_run, o, scale2);
#pragma unroll
            for (int kk = 0; kk < BLOCK_N / 16; kk++) {  // P's fragments packed as the MMAs take them (p_fragments)
                const unsigned a0 = pack2(sc[2 * kk][0], sc[2 * kk][1]), a1 = pack2(sc[2 * kk][2], sc[2 * kk][3]);
                const unsigned a2 = pack2(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);
                const unsigned a3 = pack2(sc[2 * kk + 1][2], sc[2 * kk + 1][3]);
#pragma unroll
                for (int j = 0; j < OTILES; j += 2) {
                    unsigned b[4];
                    ldsm_x4_trans(b, cV + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LDS + j * 8 + (lane >> 4) * 8);
                    mma_16816(o[j], a0, a1, a2, a3, b[0], b[1]);
                    mma_16816(o[j + 1], a0, a1, a2, a3, b[2], b[3]);
                }
            }
        }
        __syncthreads();  // everyone is done with buffer t & 1 before tile t + 2 overwrites it
    }

    const int r0 = warp * 16 + g;
    store_rows(o, l_run, out + ((qbase + r0) * num_heads + h) * HEAD_DIM + 2 * qd, 8LL * num_heads * HEAD_DIM, r0,
               rows);
}
