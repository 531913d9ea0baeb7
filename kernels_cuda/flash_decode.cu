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
// flash_decode_reduce: grid (heads, B). Combines the partials into the output.
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

union ChunkShared {
    uint4 ring[STAGES][2][THREADS];  // K, V: one 16-byte piece per thread per round
    struct {
        float m[GROUPS][GROUP], l[GROUPS][GROUP], acc[GROUPS][GROUP][HEAD_DIM];
    } red;
};

__device__ __forceinline__ int window_start(int kv_len, int window) {
    return window > 0 && kv_len > window ? kv_len - window : 0;
}

extern "C" __global__ void __launch_bounds__(THREADS) flash_decode_chunk(
    const scalar_t *__restrict__ q,         // (B, H, HEAD_DIM)
    const long long *__restrict__ k_ptrs,   // (B)
    const long long *__restrict__ v_ptrs,   // (B)
    const int *__restrict__ kv_lens,        // (B)
    long long layer_offset,
    float *__restrict__ part_o,             // (B, H, max_splits, HEAD_DIM)
    float *__restrict__ part_ml,            // (B, H, max_splits, 2): max, sum
    int num_heads, int num_kv_heads, int max_splits, int window, float scale) {
    PDL_ENTER();
    const int split = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
    const int kv_len = kv_lens[b];
    const int start = window_start(kv_len, window) + split * CHUNK;
    const int end = min(kv_len, start + CHUNK);
    const int tid = threadIdx.x, grp = tid / TPT, sub = tid % TPT;
    const int h0 = kvh * GROUP;
    const long long head_stride = (long long)max_splits * HEAD_DIM;
    float *po = part_o + ((long long)b * num_heads + h0) * head_stride + (long long)split * HEAD_DIM;
    float *pml = part_ml + (((long long)b * num_heads + h0) * max_splits + split) * 2;
    if (start >= end) {
        if (tid < GROUP) {
            pml[(long long)tid * max_splits * 2] = NEG_INF;
            pml[(long long)tid * max_splits * 2 + 1] = 0.0f;
        }
        return;
    }
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
    const long long kv_stride = (long long)num_kv_heads * HEAD_DIM;
    const scalar_t *kb = reinterpret_cast<const scalar_t *>(k_ptrs[b]) + layer_offset + kvh * HEAD_DIM + sub * 8;
    const scalar_t *vb = reinterpret_cast<const scalar_t *>(v_ptrs[b]) + layer_offset + kvh * HEAD_DIM + sub * 8;
    __shared__ ChunkShared sh;
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

extern "C" __global__ void flash_decode_reduce(
    const float *__restrict__ part_o, const float *__restrict__ part_ml, const int *__restrict__ kv_lens,
    scalar_t *__restrict__ out,  // (B, H, HEAD_DIM)
    int num_heads, int max_splits, int window) {
    PDL_ENTER();
    const int h = blockIdx.x, b = blockIdx.y;
    const int kv_len = kv_lens[b];
    const long long row = (long long)b * num_heads + h;
    const int splits = min(max_splits, (kv_len - window_start(kv_len, window) + CHUNK - 1) / CHUNK);
    const float *ml = part_ml + row * max_splits * 2;
    float M = NEG_INF;
    for (int s = 0; s < splits; s++) M = fmaxf(M, ml[2 * s]);
    for (int d = threadIdx.x; d < HEAD_DIM; d += blockDim.x) {
        float O = 0.0f, L = 0.0f;
        for (int s = 0; s < splits; s++) {
            const float w = ml[2 * s] == NEG_INF ? 0.0f : __expf(ml[2 * s] - M);
            O += part_o[(row * max_splits + s) * HEAD_DIM + d] * w;
            L += ml[2 * s + 1] * w;
        }
        out[row * HEAD_DIM + d] = from_float(L > 0.0f ? O / L : 0.0f);
    }
}
