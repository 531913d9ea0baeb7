// Flash decoding (split-KV) for one query token per sequence, GQA-aware.
//
// flash_decode_chunk: grid (max_splits, kv_heads, B). Each block takes CHUNK keys of
// one sequence for the GROUP query heads that share a KV head, and writes an
// unnormalised partial output with its max and sum. The grid is static (graph-safe):
// lengths and pointers come from device arrays, and splits past a sequence's length
// (or a padding row's length 0) exit at once. K/V stream through a ring of STAGES
// rounds per thread in shared memory, filled by cp.async, so STAGES - 1 rounds of loads
// are in flight while one is used (each thread reads back only what it copied: no
// barrier); the ring's memory is reused for the block's final combine.
// The last of a row's non-empty split blocks of a KV head to finish (a counter per pair,
// back to 0 after) combines the partials into the output: no separate reduce kernel.
//
// -DHEAD_DIM (multiple of 8, <= 256), -DGROUP (query heads per KV head), -DCHUNK.
// KV pool layout: (layers, slots, kv_heads, HEAD_DIM); row b's keys start at
// k_ptrs[b] + layer_offset (elements).
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
#define THREADS 128
#define TPT (HEAD_DIM / 8)       // threads per key: 8 dims each, one 16-byte load
#define GROUPS (THREADS / TPT)   // keys per round of the block
#define STAGES 8                 // rounds of K/V a thread keeps in its ring

#define MAX_SPLITS 64             // flash_decode.py keeps the grid's splits within this

union ChunkShared {
    uint4 ring[STAGES][2][THREADS];  // K, V: one 16-byte piece per thread per round
    struct {
        float m[GROUPS][GROUP], l[GROUPS][GROUP], acc[GROUPS][GROUP][HEAD_DIM];
    } red;
    struct {
        float w[GROUP][MAX_SPLITS], inv_l[GROUP];  // each split's weight exp(m_s - M), 1 / sum
    } comb;
};

__device__ __forceinline__ int window_start(int kv_len, int window) {
    return window > 0 && kv_len > window ? kv_len - window : 0;
}

// One block's keys [start, end) for the GROUP heads at h0: partial output and its max, sum.
__device__ __forceinline__ void chunk_partial(const scalar_t *__restrict__ q, const scalar_t *kb, const scalar_t *vb,
                                              long long kv_stride, int start, int end, int b, int h0, int num_heads,
                                              float scale, float *po, float *pml, long long head_stride,
                                              int max_splits, ChunkShared &sh) {
    const int tid = threadIdx.x, grp = tid / TPT, sub = tid % TPT;
    float qf[GROUP][8];
#pragma unroll
    for (int g = 0; g < GROUP; g++) {
        const uint4 raw = *reinterpret_cast<const uint4 *>(q + ((long long)b * num_heads + h0 + g) * HEAD_DIM + sub * 8);
        vec8_to_float(*reinterpret_cast<const vec8 *>(&raw), qf[g]);
#pragma unroll
        for (int i = 0; i < 8; i++) qf[g][i] *= scale;
    }
    float m[GROUP], l[GROUP], acc[GROUP][8];
#pragma unroll
    for (int g = 0; g < GROUP; g++) {
        m[g] = NEG_INF;
        l[g] = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; i++) acc[g][i] = 0.0f;
    }
    kb += sub * 8;
    vb += sub * 8;
    const int rounds = (end - start + GROUPS - 1) / GROUPS;
    auto issue = [&](int i) {  // round i: key start + i * GROUPS + grp, zeros past the end
        if (i < rounds) {
            const int t = start + i * GROUPS + grp;
            const long long off = (long long)(t < end ? t : start) * kv_stride;
            cp_async16(&sh.ring[i % STAGES][0][tid], kb + off, t < end);
            cp_async16(&sh.ring[i % STAGES][1][tid], vb + off, t < end);
        }
        cp_async_commit();
    };
#pragma unroll
    for (int i = 0; i < STAGES - 1; i++) issue(i);
    // every lane of a warp runs the same number of rounds (the shuffles need the whole
    // warp); a group whose key is past the end does the arithmetic and drops it
    for (int r = 0; r < rounds; r++) {
        issue(r + STAGES - 1);
        cp_async_wait<STAGES - 1>();  // round r has landed
        const bool live = start + r * GROUPS + grp < end;
        const uint4 kraw = sh.ring[r % STAGES][0][tid], vraw = sh.ring[r % STAGES][1][tid];
        float kf[8], vf[8];
        vec8_to_float(*reinterpret_cast<const vec8 *>(&kraw), kf);
        vec8_to_float(*reinterpret_cast<const vec8 *>(&vraw), vf);
#pragma unroll
        for (int g = 0; g < GROUP; g++) {
            float dot = 0.0f;
#pragma unroll
            for (int i = 0; i < 8; i++) dot += qf[g][i] * kf[i];
#pragma unroll
            for (int o = TPT / 2; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
            if (!live) continue;
            const float m_new = fmaxf(m[g], dot);
            const float corr = __expf(m[g] - m_new);
            const float p = __expf(dot - m_new);
            l[g] = l[g] * corr + p;
#pragma unroll
            for (int i = 0; i < 8; i++) acc[g][i] = acc[g][i] * corr + p * vf[i];
            m[g] = m_new;
        }
    }
    // combine the key groups of the block (in the ring's memory, once everyone is done with it)
    cp_async_wait<0>();
    __syncthreads();
#pragma unroll
    for (int g = 0; g < GROUP; g++) {
        if (sub == 0) {
            sh.red.m[grp][g] = m[g];
            sh.red.l[grp][g] = l[g];
        }
#pragma unroll
        for (int i = 0; i < 8; i++) sh.red.acc[grp][g][sub * 8 + i] = acc[g][i];
    }
    __syncthreads();
    for (int i = tid; i < GROUP * HEAD_DIM; i += THREADS) {
        const int g = i / HEAD_DIM, d = i % HEAD_DIM;
        float M = NEG_INF;
        for (int j = 0; j < GROUPS; j++) M = fmaxf(M, sh.red.m[j][g]);
        float O = 0.0f, L = 0.0f;
        for (int j = 0; j < GROUPS; j++) {
            const float w = sh.red.m[j][g] == NEG_INF ? 0.0f : __expf(sh.red.m[j][g] - M);
            O += sh.red.acc[j][g][d] * w;
            L += sh.red.l[j][g] * w;
        }
        po[(long long)g * head_stride + d] = O;
        if (d == 0) {
            pml[(long long)g * max_splits * 2] = M;
            pml[(long long)g * max_splits * 2 + 1] = L;
        }
    }
}

extern "C" __global__ void __launch_bounds__(THREADS) flash_decode_chunk(
    const scalar_t *__restrict__ q,         // (B, H, HEAD_DIM)
    const long long *__restrict__ k_ptrs,   // (B)
    const long long *__restrict__ v_ptrs,   // (B)
    const int *__restrict__ kv_lens,        // (B)
    long long layer_offset,
    float *__restrict__ part_o,             // (B, H, max_splits, HEAD_DIM)
    float *__restrict__ part_ml,            // (B, H, max_splits, 2): max, sum
    int *__restrict__ counters,             // (B, kv_heads), zero between launches
    scalar_t *__restrict__ out,             // (B, H, HEAD_DIM)
    int num_heads, int num_kv_heads, int max_splits, int window, float scale) {
    PDL_ENTER();
    const int split = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
    const int kv_len = kv_lens[b];
    const int first = window_start(kv_len, window);
    const int start = first + split * CHUNK;
    const int end = min(kv_len, start + CHUNK);
    const int tid = threadIdx.x;
    const int h0 = kvh * GROUP;
    const long long head_stride = (long long)max_splits * HEAD_DIM;
    const long long row0 = (long long)b * num_heads + h0;  // (row, head) of the group's first head
    float *po = part_o + row0 * head_stride + (long long)split * HEAD_DIM;
    float *pml = part_ml + (row0 * max_splits + split) * 2;
    if (start >= end) return;  // past this row's keys (a padding row has none)
    const int splits = min(max_splits, (kv_len - first + CHUNK - 1) / CHUNK);
    __shared__ ChunkShared sh;
    __shared__ bool last;
    const long long kv_stride = (long long)num_kv_heads * HEAD_DIM;
    const long long head_off = layer_offset + kvh * HEAD_DIM;
    chunk_partial(q, reinterpret_cast<const scalar_t *>(k_ptrs[b]) + head_off,
                  reinterpret_cast<const scalar_t *>(v_ptrs[b]) + head_off, kv_stride, start, end, b, h0, num_heads,
                  scale, po, pml, head_stride, max_splits, sh);
    // the last of the row's `splits` blocks for this KV head combines their partials
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
    // a warp per head: the splits' max, their weights and the sum
    const int warp = tid >> 5, lane = tid & 31;
    for (int g = warp; g < GROUP; g += THREADS / 32) {
        const float *ml = part_ml + (row0 + g) * max_splits * 2;
        float M = NEG_INF;
        for (int s = lane; s < splits; s += 32) M = fmaxf(M, __ldcg(ml + 2 * s));
        M = warp_max(M);
        float L = 0.0f;
        for (int s = lane; s < splits; s += 32) {
            const float m = __ldcg(ml + 2 * s);
            const float w = m == NEG_INF ? 0.0f : __expf(m - M);
            sh.comb.w[g][s] = w;
            L += __ldcg(ml + 2 * s + 1) * w;
        }
        L = warp_sum(L);
        if (lane == 0) sh.comb.inv_l[g] = L > 0.0f ? 1.0f / L : 0.0f;
    }
    __syncthreads();
    for (int i = tid; i < GROUP * HEAD_DIM; i += THREADS) {
        const int g = i / HEAD_DIM, d = i % HEAD_DIM;
        const long long row = row0 + g;
        const float *o = part_o + row * head_stride + d;
        float O = 0.0f;
#pragma unroll 4
        for (int s = 0; s < splits; s++) O += __ldcg(o + (long long)s * HEAD_DIM) * sh.comb.w[g][s];
        out[row * HEAD_DIM + d] = from_float(O * sh.comb.inv_l[g]);
    }
}
