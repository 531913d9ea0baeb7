// Causal flash attention for a ragged batch of prefill chunks (and decode rows,
// which are chunks of one query), reading K/V from the cache: a chunk attends to its
// sequence's cached prefix and to itself. Tensor cores through WMMA (16x16x16, 16-bit
// in, float32 accumulate); online softmax per row in shared memory.
//
// grid (num_tiles, num_heads), block 128 (4 warps x 16 query rows). A tile is 64
// queries of one sequence: tile_seq / tile_q0 map tiles to (sequence, first query).
// -DHEAD_DIM (multiple of 16), dynamic shared memory: flash_prefill_smem_bytes().
#include "common.cuh"
#include <mma.h>
using namespace nvcuda;

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#define BLOCK_M 64
#define BLOCK_N 64
#define THREADS 128
#define LDS (HEAD_DIM + 8)   // Q/K/V shared row stride (elements): 16-byte rows, fewer bank conflicts
#define LDP (BLOCK_N + 8)    // P row stride (elements)
#define LDF (BLOCK_N + 4)    // S row stride (floats)
#define LDO (HEAD_DIM + 4)   // O row stride (floats)

typedef wmma::fragment<wmma::matrix_a, 16, 16, 16, scalar_t, wmma::row_major> frag_a;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, scalar_t, wmma::col_major> frag_bt;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, scalar_t, wmma::row_major> frag_b;
typedef wmma::fragment<wmma::accumulator, 16, 16, 16, float> frag_c;

extern "C" __global__ void __launch_bounds__(THREADS) flash_prefill(
    const scalar_t *__restrict__ q,           // (T, H, HEAD_DIM)
    scalar_t *__restrict__ out,               // (T, H, HEAD_DIM)
    const int *__restrict__ tile_seq,         // (tiles)
    const int *__restrict__ tile_q0,          // (tiles)
    const int *__restrict__ seq_q_start,      // (S) index of the sequence's first query token
    const int *__restrict__ seq_q_len,        // (S)
    const int *__restrict__ seq_kv_len,       // (S) keys in the cache including this chunk
    const long long *__restrict__ k_ptrs,     // (S)
    const long long *__restrict__ v_ptrs,     // (S)
    long long layer_offset, int num_heads, int num_kv_heads, int window, float scale) {
    PDL_ENTER();
    extern __shared__ __align__(128) unsigned char smem[];
    scalar_t *sQ = reinterpret_cast<scalar_t *>(smem);
    scalar_t *sK = sQ + BLOCK_M * LDS;
    scalar_t *sV = sK + BLOCK_N * LDS;
    scalar_t *sP = sV + BLOCK_N * LDS;
    float *sS = reinterpret_cast<float *>(sP + BLOCK_M * LDP);
    float *sO = sS + BLOCK_M * LDF;
    float *sRow = sO + BLOCK_M * LDO;  // per row: running max, running sum

    const int tile = blockIdx.x, h = blockIdx.y;
    const int kvh = h / (num_heads / num_kv_heads);
    const int s = tile_seq[tile], q0 = tile_q0[tile];
    const int q_len = seq_q_len[s], kv_len = seq_kv_len[s];
    const int start_pos = kv_len - q_len;
    const int rows = min(BLOCK_M, q_len - q0);
    const long long qbase = (long long)seq_q_start[s] + q0;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    constexpr int VEC = HEAD_DIM / 8;

    for (int i = tid; i < BLOCK_M * VEC; i += THREADS) {
        const int r = i / VEC, c = (i % VEC) * 8;
        uint4 v = make_uint4(0, 0, 0, 0);
        if (r < rows) v = *reinterpret_cast<const uint4 *>(q + ((qbase + r) * num_heads + h) * HEAD_DIM + c);
        *reinterpret_cast<uint4 *>(sQ + r * LDS + c) = v;
    }
    for (int i = tid; i < BLOCK_M * HEAD_DIM; i += THREADS) sO[(i / HEAD_DIM) * LDO + i % HEAD_DIM] = 0.0f;
    if (tid < BLOCK_M) {
        sRow[2 * tid] = NEG_INF;
        sRow[2 * tid + 1] = 0.0f;
    }

    const int q_first = start_pos + q0, q_last = start_pos + q0 + rows - 1;
    const int k_hi = q_last + 1;  // causal: no key past the last query
    const int k_lo = window > 0 ? max(0, q_first - window + 1) : 0;
    const long long kv_stride = (long long)num_kv_heads * HEAD_DIM;
    const scalar_t *kb = reinterpret_cast<const scalar_t *>(k_ptrs[s]) + layer_offset + kvh * HEAD_DIM;
    const scalar_t *vb = reinterpret_cast<const scalar_t *>(v_ptrs[s]) + layer_offset + kvh * HEAD_DIM;

    for (int n0 = (k_lo / BLOCK_N) * BLOCK_N; n0 < k_hi; n0 += BLOCK_N) {
        __syncthreads();  // everyone is done with the previous K/V tile
        for (int i = tid; i < BLOCK_N * VEC; i += THREADS) {
            const int r = i / VEC, c = (i % VEC) * 8, key = n0 + r;
            uint4 kv = make_uint4(0, 0, 0, 0), vv = make_uint4(0, 0, 0, 0);
            if (key < k_hi) {
                kv = *reinterpret_cast<const uint4 *>(kb + key * kv_stride + c);
                vv = *reinterpret_cast<const uint4 *>(vb + key * kv_stride + c);
            }
            *reinterpret_cast<uint4 *>(sK + r * LDS + c) = kv;
            *reinterpret_cast<uint4 *>(sV + r * LDS + c) = vv;
        }
        __syncthreads();

        // S (this warp's 16 rows x 64 keys) = Q K^T
        {
            frag_c acc[BLOCK_N / 16];
#pragma unroll
            for (int j = 0; j < BLOCK_N / 16; j++) wmma::fill_fragment(acc[j], 0.0f);
#pragma unroll
            for (int kk = 0; kk < HEAD_DIM; kk += 16) {
                frag_a a;
                wmma::load_matrix_sync(a, sQ + warp * 16 * LDS + kk, LDS);
#pragma unroll
                for (int j = 0; j < BLOCK_N / 16; j++) {
                    frag_bt b;
                    wmma::load_matrix_sync(b, sK + j * 16 * LDS + kk, LDS);
                    wmma::mma_sync(acc[j], a, b, acc[j]);
                }
            }
#pragma unroll
            for (int j = 0; j < BLOCK_N / 16; j++)
                wmma::store_matrix_sync(sS + warp * 16 * LDF + j * 16, acc[j], LDF, wmma::mem_row_major);
        }
        __syncwarp();

        // online softmax: lanes 2r and 2r+1 share row r of the warp, 32 keys each
        {
            const int r = warp * 16 + (lane >> 1), c0 = (lane & 1) * 32;
            const int q_pos = start_pos + q0 + r;
            float *srow = sS + r * LDF;
            float mx = NEG_INF;
            for (int c = 0; c < 32; c++) {
                const int key = n0 + c0 + c;
                const bool ok = key < k_hi && key <= q_pos && (window <= 0 || key > q_pos - window);
                const float v = ok ? srow[c0 + c] * scale : NEG_INF;
                srow[c0 + c] = v;
                mx = fmaxf(mx, v);
            }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            const float m_old = sRow[2 * r], l_old = sRow[2 * r + 1];
            const float m_new = fmaxf(m_old, mx);
            const bool none = m_new == NEG_INF;  // nothing visible yet: keep zeros, avoid inf - inf
            const float corr = none ? 1.0f : __expf(m_old - m_new);
            float sum = 0.0f;
            for (int c = 0; c < 32; c++) {
                const float p = none ? 0.0f : __expf(srow[c0 + c] - m_new);
                sum += p;
                sP[r * LDP + c0 + c] = from_float(p);
            }
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            const int d0 = (lane & 1) * (HEAD_DIM / 2);
            for (int d = d0; d < d0 + HEAD_DIM / 2; d++) sO[r * LDO + d] *= corr;
            __syncwarp();
            if ((lane & 1) == 0) {
                sRow[2 * r] = m_new;
                sRow[2 * r + 1] = l_old * corr + sum;
            }
        }
        __syncwarp();

        // O (16 rows x HEAD_DIM) += P V
#pragma unroll
        for (int j = 0; j < HEAD_DIM / 16; j++) {
            frag_c o;
            wmma::load_matrix_sync(o, sO + warp * 16 * LDO + j * 16, LDO, wmma::mem_row_major);
#pragma unroll
            for (int kk = 0; kk < BLOCK_N; kk += 16) {
                frag_a a;
                frag_b b;
                wmma::load_matrix_sync(a, sP + warp * 16 * LDP + kk, LDP);
                wmma::load_matrix_sync(b, sV + kk * LDS + j * 16, LDS);
                wmma::mma_sync(o, a, b, o);
            }
            wmma::store_matrix_sync(sO + warp * 16 * LDO + j * 16, o, LDO, wmma::mem_row_major);
        }
        __syncwarp();
    }

    for (int i = lane; i < 16 * HEAD_DIM; i += 32) {
        const int r = warp * 16 + i / HEAD_DIM, d = i % HEAD_DIM;
        if (r < rows) {
            const float l = sRow[2 * r + 1];
            out[((qbase + r) * num_heads + h) * HEAD_DIM + d] = from_float(l > 0.0f ? sO[r * LDO + d] / l : 0.0f);
        }
    }
}
