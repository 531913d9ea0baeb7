// RoPE (HF's rotate-half layout; llama3 / linear scaling are in the cos/sin table)
// fused with the KV-cache write. Reads the QKV product of one layer (-DPROD: float32 or 16
// bits, common.cuh), adds the q/k/v bias if the model has one, rotates q and k, writes q
// (16-bit) for attention and k, v into each token's KV slot. After a float8 product
// (--quantization fp8) the sums are scaled first (rs, cs: common.cuh's dequant).
//
// -DHEAD_DIM (even), -DKV_FP8 (the cache's element, common.cuh). KV pool layout: (layers, slots, kv_heads, HEAD_DIM); a token's
// K row is at k_ptrs[t] + layer_offset + position * kv_heads * HEAD_DIM (elements).
//
// One block per token. A thread takes RV pairs (j, j + HALF) of a head at a time, and RV
// values of v: one load or store of each kind for all of them (a decode step of many rows
// is otherwise a chain of dependent round trips per thread).
#include "common.cuh"

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#define HALF (HEAD_DIM / 2)
#define RV (HALF % 4 == 0 ? 4 : 1)

// N values converted to T, stored as one access of N * sizeof(T) bytes (N = 1, 4 or 8)
template <int N, class T, class Convert>
__device__ __forceinline__ void store_n(T *dst, const float *f, Convert convert) {
    if constexpr (N == 1) {
        dst[0] = convert(f[0]);
    } else {
        static_assert((N == 4 || N == 8) && (sizeof(T) == 1 || sizeof(T) == 2), "4 or 8 values of 1 or 2 bytes");
        union {
            T v[N];
            unsigned w[N * sizeof(T) / 4];
        } u;
#pragma unroll
        for (int e = 0; e < N; e++) u.v[e] = convert(f[e]);
        if constexpr (N * sizeof(T) == 16)
            *reinterpret_cast<uint4 *>(dst) = make_uint4(u.w[0], u.w[1], u.w[2], u.w[3]);
        else if constexpr (N * sizeof(T) == 8)
            *reinterpret_cast<uint2 *>(dst) = make_uint2(u.w[0], u.w[1]);
        else
            *reinterpret_cast<unsigned *>(dst) = u.w[0];
    }
}

// x (N values of feature n on) dequantized and biased, as both kernels below do it
template <int N>
__device__ __forceinline__ void finish_n(float x[N], const float *bias, const float *rs, const float *cs, long long t,
                                         int n) {
    dequant_n<N>(x, rs, cs, t, n);
    if (bias != nullptr) {
        float b[N];
        load_f32<N>(bias + n, b);
#pragma unroll
        for (int e = 0; e < N; e++) x[e] += b[e];
    }
}

extern "C" __global__ void rope_kv_write(
    const prod_t *__restrict__ qkv,       // (T, (H + 2 KVH) * HEAD_DIM)
    const float *__restrict__ bias,        // ((H + 2 KVH) * HEAD_DIM) or null
    const int *__restrict__ positions,     // (T)
    const float *__restrict__ cos_table,   // (max_len, HALF)
    const float *__restrict__ sin_table,
    scalar_t *__restrict__ q_out,          // (T, H, HEAD_DIM)
    const long long *__restrict__ k_ptrs,  // (T) element addresses of each token's K region (layer 0)
    const long long *__restrict__ v_ptrs,
    long long layer_offset, int num_heads, int num_kv_heads,
    const float *__restrict__ rs, const float *__restrict__ cs) {  // float8 product's scales, or null
    PDL_ENTER();
    const long long t = blockIdx.x;
    const int width = (num_heads + 2 * num_kv_heads) * HEAD_DIM;
    const prod_t *row = qkv + t * width;
    const int pos = positions[t];
    const float *c = cos_table + (long long)pos * HALF;
    const float *s = sin_table + (long long)pos * HALF;
    kv_t *k_dst = kv_row(k_ptrs, t, layer_offset, pos, num_kv_heads * HEAD_DIM);
    kv_t *v_dst = kv_row(v_ptrs, t, layer_offset, pos, num_kv_heads * HEAD_DIM);
    constexpr int PER_HEAD = HALF / RV;
    const int groups = (num_heads + num_kv_heads) * PER_HEAD;
#pragma unroll 4
    for (int i = threadIdx.x; i < groups; i += blockDim.x) {
        const int head = i / PER_HEAD, j = (i % PER_HEAD) * RV;
        const int n1 = head * HEAD_DIM + j, n2 = n1 + HALF;
        float x1[RV], x2[RV], cj[RV], sj[RV];
        load_prod<RV>(row + n1, x1);
        load_prod<RV>(row + n2, x2);
        finish_n<RV>(x1, bias, rs, cs, t, n1);
        finish_n<RV>(x2, bias, rs, cs, t, n2);
        load_f32<RV>(c + j, cj);
        load_f32<RV>(s + j, sj);
        float o1[RV], o2[RV];
#pragma unroll
        for (int e = 0; e < RV; e++) rope_rotate(x1[e], x2[e], cj[e], sj[e], o1[e], o2[e]);
        if (head < num_heads) {
            scalar_t *dst = q_out + t * num_heads * HEAD_DIM + n1;
            store_n<RV>(dst, o1, from_float);
            store_n<RV>(dst + HALF, o2, from_float);
        } else {
            kv_t *dst = k_dst + (head - num_heads) * HEAD_DIM + j;
            store_n<RV>(dst, o1, to_kv);
            store_n<RV>(dst + HALF, o2, to_kv);
        }
    }
    const int v_off = (num_heads + num_kv_heads) * HEAD_DIM;
#pragma unroll 4
    for (int i = threadIdx.x * RV; i < num_kv_heads * HEAD_DIM; i += blockDim.x * RV) {
        float x[RV];
        load_prod<RV>(row + v_off + i, x);
        finish_n<RV>(x, bias, rs, cs, t, v_off + i);
        store_n<RV>(v_dst + i, x, to_kv);
    }
}

// Steps of many tokens (rope.py's ROWS_MIN_ROWS): the same arguments and bits as rope_kv_write,
// one block of few threads a token, each thread taking ROPE_ITEMS items of 8 values: an item is
// 8 pairs (j .. j + 7, j + HALF .. j + HALF + 7) of a q or k head, or 8 values of v. A thread
// asks for all of its items' product values (16-byte loads of 16-bit sums) before it uses any,
// so a token's row is in flight at once; the one-block-a-token form above issues 8-byte loads a
// few at a time. -DROPE_ITEMS: items a thread at most (rope.py picks it for the launch's threads).
#ifndef ROPE_ITEMS
#define ROPE_ITEMS 4
#endif
#if HALF % 8 == 0  // (head_dim a multiple of 16)
extern "C" __global__ void rope_kv_write_rows(
    const prod_t *__restrict__ qkv, const float *__restrict__ bias, const int *__restrict__ positions,
    const float *__restrict__ cos_table, const float *__restrict__ sin_table, scalar_t *__restrict__ q_out,
    const long long *__restrict__ k_ptrs, const long long *__restrict__ v_ptrs, long long layer_offset,
    int num_heads, int num_kv_heads, const float *__restrict__ rs, const float *__restrict__ cs) {
    PDL_ENTER();
    const long long t = blockIdx.x;
    const int width = (num_heads + 2 * num_kv_heads) * HEAD_DIM;
    const prod_t *row = qkv + t * width;
    constexpr int PER_HEAD = HALF / 8;
    const int rot_items = (num_heads + num_kv_heads) * PER_HEAD;  // items of q and k heads
    const int items = rot_items + num_kv_heads * HEAD_DIM / 8;     // then v's
    const int v_off = (num_heads + num_kv_heads) * HEAD_DIM;
    prod8 r1[ROPE_ITEMS], r2[ROPE_ITEMS];
    // an item's first feature: the pair's first half (q, k) or the 8 values (v)
    auto first = [&](int i) {
        return i < rot_items ? (i / PER_HEAD) * HEAD_DIM + (i % PER_HEAD) * 8 : v_off + (i - rot_items) * 8;
    };
#pragma unroll
    for (int c = 0; c < ROPE_ITEMS; c++) {
        const int i = threadIdx.x + c * blockDim.x;
        if (i < items) {
            r1[c] = load_prod8(row + first(i));
            if (i < rot_items) r2[c] = load_prod8(row + first(i) + HALF);
        }
    }
    const int pos = positions[t];
    const float *cp_ = cos_table + (long long)pos * HALF;
    const float *sp_ = sin_table + (long long)pos * HALF;
    kv_t *k_dst = kv_row(k_ptrs, t, layer_offset, pos, num_kv_heads * HEAD_DIM);
    kv_t *v_dst = kv_row(v_ptrs, t, layer_offset, pos, num_kv_heads * HEAD_DIM);
#pragma unroll
    for (int c = 0; c < ROPE_ITEMS; c++) {
        const int i = threadIdx.x + c * blockDim.x;
        if (i >= items) break;
        const int n1 = first(i);
        float x1[8], x2[8];
        prod8_to_float(r1[c], x1);
        finish_n<8>(x1, bias, rs, cs, t, n1);
        if (i >= rot_items) {
            store_n<8>(v_dst + (n1 - v_off), x1, to_kv);
            continue;
        }
        prod8_to_float(r2[c], x2);
        finish_n<8>(x2, bias, rs, cs, t, n1 + HALF);
        const int head = i / PER_HEAD, j = (i % PER_HEAD) * 8;
        float cj[8], sj[8], o1[8], o2[8];
        load_f32<8>(cp_ + j, cj);
        load_f32<8>(sp_ + j, sj);
#pragma unroll
        for (int e = 0; e < 8; e++) rope_rotate(x1[e], x2[e], cj[e], sj[e], o1[e], o2[e]);
        if (head < num_heads) {
            scalar_t *dst = q_out + t * num_heads * HEAD_DIM + n1;
            store_n<8>(dst, o1, from_float);
            store_n<8>(dst + HALF, o2, from_float);
        } else {
            kv_t *dst = k_dst + (head - num_heads) * HEAD_DIM + j;
            store_n<8>(dst, o1, to_kv);
            store_n<8>(dst + HALF, o2, to_kv);
        }
    }
}
#endif
