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

// N values converted to T, stored as one access of N * sizeof(T) bytes (N = 1 or 4)
template <int N, class T, class Convert>
__device__ __forceinline__ void store_n(T *dst, const float *f, Convert convert) {
    if constexpr (N == 1) {
        dst[0] = convert(f[0]);
    } else {
        static_assert(N == 4 && (sizeof(T) == 1 || sizeof(T) == 2), "4 values of 1 or 2 bytes");
        union {
            T v[4];
            unsigned w[2];
        } u;
#pragma unroll
        for (int e = 0; e < 4; e++) u.v[e] = convert(f[e]);
        if constexpr (sizeof(T) == 2)
            *reinterpret_cast<uint2 *>(dst) = make_uint2(u.w[0], u.w[1]);
        else
            *reinterpret_cast<unsigned *>(dst) = u.w[0];
    }
}

template <int N>
__device__ __forceinline__ void load_f32(const float *p, float f[N]) {
    if constexpr (N == 1) {
        f[0] = p[0];
    } else {
        const float4 v = *reinterpret_cast<const float4 *>(p);
        f[0] = v.x, f[1] = v.y, f[2] = v.z, f[3] = v.w;
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
        dequant_n<RV>(x1, rs, cs, t, n1);
        dequant_n<RV>(x2, rs, cs, t, n2);
        if (bias != nullptr) {
            float b1[RV], b2[RV];
            load_f32<RV>(bias + n1, b1);
            load_f32<RV>(bias + n2, b2);
#pragma unroll
            for (int e = 0; e < RV; e++) x1[e] += b1[e], x2[e] += b2[e];
        }
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
        dequant_n<RV>(x, rs, cs, t, v_off + i);
        if (bias != nullptr) {
            float b[RV];
            load_f32<RV>(bias + v_off + i, b);
#pragma unroll
            for (int e = 0; e < RV; e++) x[e] += b[e];
        }
        store_n<RV>(v_dst + i, x, to_kv);
    }
}
