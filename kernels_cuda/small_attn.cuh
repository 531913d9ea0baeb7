// Pieces of the small-model decode kernels that run a KV head's attention in one block's
// scalar code (attn_block.cu, attn_o.cu): K/V elements as floats, a warp-interleaved
// product of a few shared-memory weight rows, and one tile of keys of online softmax.
// The including file defines HEAD_DIM, GROUP, THREADS (WARPS = THREADS / 32), TILE and KSTR
// (a staged K/V row's stride, elements).
#pragma once
#include "common.cuh"

#ifndef WARPS
#define WARPS (THREADS / 32)
#endif

__device__ __forceinline__ float kv_to_float(kv_t v) {
#if KV_FP8
    const unsigned w = fp8x2_to_scalar2((unsigned short)v);
    return to_float2(*reinterpret_cast<const scalar2_t *>(&w)).x;
#else
    return to_float(v);
#endif
}

// 8 consecutive K/V elements of shared memory (16-byte aligned for 16-bit, 8 for e4m3) as floats
__device__ __forceinline__ void kv8_to_float(const kv_t *p, float f[8]) {
#if KV_FP8
    const uint2 w = *reinterpret_cast<const uint2 *>(p);
    vec8 v;
    unsigned *u = reinterpret_cast<unsigned *>(&v);
    fp8x4_to_scalar2x2(w.x, u[0], u[1]);
    fp8x4_to_scalar2x2(w.y, u[2], u[3]);
    vec8_to_float(v, f);
#else
    vec8_to_float(*reinterpret_cast<const vec8 *>(p), f);
#endif
}

// out(r, W[r] . x) for the rows r of an (NROWS, WIDTH) 16-bit matrix W in shared memory, a warp
// taking rows warp, warp + WARPS, ... together (their loads and sums interleave: a row at a time
// took ~2x as long); x8(u, f) gives x's 8 values of 16-byte group u as floats.
template <int NROWS, int WIDTH, class X8, class Out>
__device__ __forceinline__ void warp_rows(const scalar_t *w, X8 x8, Out out) {
    constexpr int ROWS = (NROWS + WARPS - 1) / WARPS;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    float acc[ROWS];
#pragma unroll
    for (int k = 0; k < ROWS; k++) acc[k] = 0.0f;
    for (int u = lane; u < WIDTH / 8; u += 32) {
        float xf[8];
        x8(u, xf);
#pragma unroll
        for (int k = 0; k < ROWS; k++) {
            const int r = warp + k * WARPS;
            if (r >= NROWS) break;
            float wf[8];
            vec8_to_float(*reinterpret_cast<const vec8 *>(w + r * WIDTH + u * 8), wf);
#pragma unroll
            for (int e = 0; e < 8; e++) acc[k] = fmaf(wf[e], xf[e], acc[k]);
        }
    }
#pragma unroll
    for (int k = 0; k < ROWS; k++) acc[k] = warp_sum(acc[k]);
#pragma unroll
    for (int k = 0; k < ROWS; k++)
        if (lane == 0 && warp + k * WARPS < NROWS) out(warp + k * WARPS, acc[k]);
}

// One tile of keys for the GROUP heads (q: GROUP x HEAD_DIM floats): each (head, key)
// score, the running max m and sum l of each head (log2 domain; finite, a tile has a key),
// the accumulated output acc (GROUP x HEAD_DIM) rescaled and P V added. s: GROUP x TILE
// floats, alpha: GROUP floats of scratch. valid: the tile's keys (the rest are not read).
// Ends with the block synchronised: the tile's buffers may be reused.
__device__ __forceinline__ void attend_tile(const kv_t *tk, const kv_t *tv, int valid, const float *q, float *s,
                                            float *m, float *l, float *alpha, float *acc, float scale2) {
    constexpr int D = HEAD_DIM, QW = GROUP * HEAD_DIM;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    for (int i = tid; i < GROUP * TILE; i += THREADS) {
        const int h = i / TILE, j = i % TILE;
        float sc = NEG_INF;
        if (j < valid) {
            float a = 0.0f;
#pragma unroll
            for (int u = 0; u < D / 8; u++) {
                float kf[8];
                kv8_to_float(tk + j * KSTR + u * 8, kf);
                const float *qh = q + h * D + u * 8;
#pragma unroll
                for (int k = 0; k < 8; k++) a = fmaf(qh[k], kf[k], a);
            }
            sc = a * scale2;
        }
        s[i] = sc;
    }
    __syncthreads();
    for (int h = warp; h < GROUP; h += WARPS) {  // the running max and sum of head h
        float mt = NEG_INF;
        for (int j = lane; j < TILE; j += 32) mt = fmaxf(mt, s[h * TILE + j]);
        mt = warp_max(mt);
        const float m_old = m[h], m_new = fmaxf(m_old, mt);
        float ps = 0.0f;
        for (int j = lane; j < TILE; j += 32) {
            const float p = exp2f(s[h * TILE + j] - m_new);
            s[h * TILE + j] = p;
            ps += p;
        }
        ps = warp_sum(ps);
        if (lane == 0) {
            const float a = exp2f(m_old - m_new);
            alpha[h] = a;
            l[h] = l[h] * a + ps;
            m[h] = m_new;
        }
    }
    __syncthreads();
    for (int i = tid; i < QW; i += THREADS) {
        const int h = i / D, d = i % D;
        float a = acc[i] * alpha[h];
        for (int j = 0; j < valid; j++) a = fmaf(s[h * TILE + j], kv_to_float(tv[j * KSTR + d]), a);
        acc[i] = a;
    }
    __syncthreads();
}
