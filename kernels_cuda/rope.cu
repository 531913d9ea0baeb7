// RoPE (HF's rotate-half layout; llama3 / linear scaling are in the cos/sin table)
// fused with the KV-cache write. Reads the QKV product of one layer (-DPROD: float32 or 16
// bits, common.cuh), adds the q/k/v bias if the model has one, rotates q and k, writes q
// (16-bit) for attention and k, v into each token's KV slot. After a float8 product (--quantization fp8) the
// sums are scaled first (rs, cs: common.cuh's dequant).
//
// -DHEAD_DIM (even), -DKV_FP8 (the cache's element, common.cuh). KV pool layout: (layers, slots, kv_heads, HEAD_DIM); a token's
// K row is at k_ptrs[t] + layer_offset + position * kv_heads * HEAD_DIM (elements).
#include "common.cuh"

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#define HALF (HEAD_DIM / 2)

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
    const int rot_pairs = (num_heads + num_kv_heads) * HALF;
    for (int i = threadIdx.x; i < rot_pairs; i += blockDim.x) {
        const int head = i / HALF, j = i % HALF;
        const int base = head * HEAD_DIM;
        float x1 = dequant(row[base + j], rs, cs, t, base + j);
        float x2 = dequant(row[base + j + HALF], rs, cs, t, base + j + HALF);
        if (bias != nullptr) {
            x1 += bias[base + j];
            x2 += bias[base + j + HALF];
        }
        float o1, o2;
        rope_rotate(x1, x2, c[j], s[j], o1, o2);
        if (head < num_heads) {
            q_out[t * num_heads * HEAD_DIM + base + j] = from_float(o1);
            q_out[t * num_heads * HEAD_DIM + base + j + HALF] = from_float(o2);
        } else {
            const int kb = (head - num_heads) * HEAD_DIM;
            k_dst[kb + j] = to_kv(o1);
            k_dst[kb + j + HALF] = to_kv(o2);
        }
    }
    const int v_off = (num_heads + num_kv_heads) * HEAD_DIM;
    for (int i = threadIdx.x; i < num_kv_heads * HEAD_DIM; i += blockDim.x)
        v_dst[i] = to_kv(dequant(row[v_off + i], rs, cs, t, v_off + i) + (bias != nullptr ? bias[v_off + i] : 0.0f));
}
