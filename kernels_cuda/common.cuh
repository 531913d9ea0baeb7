// Helpers shared by the kernel families: the 16-bit storage type, conversions,
// warp and block reductions. Compiled through NVRTC (CuPy RawModule) or nvcc.
//
// -DUSE_BF16=1 selects bfloat16 for weights, activations and the KV cache;
// otherwise float16. Arithmetic and accumulation are always float32.
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>

#ifndef USE_BF16
#define USE_BF16 0
#endif

#if USE_BF16
#define MMA_TYPE "bf16"
typedef __nv_bfloat16 scalar_t;
typedef __nv_bfloat162 scalar2_t;
__device__ __forceinline__ float to_float(scalar_t x) { return __bfloat162float(x); }
__device__ __forceinline__ scalar_t from_float(float x) { return __float2bfloat16(x); }
__device__ __forceinline__ float2 to_float2(scalar2_t x) { return __bfloat1622float2(x); }
__device__ __forceinline__ scalar2_t from_float2(float lo, float hi) { return __floats2bfloat162_rn(lo, hi); }
#else
#define MMA_TYPE "f16"
typedef __half scalar_t;
typedef __half2 scalar2_t;
__device__ __forceinline__ float to_float(scalar_t x) { return __half2float(x); }
__device__ __forceinline__ scalar_t from_float(float x) { return __float2half(x); }
__device__ __forceinline__ float2 to_float2(scalar2_t x) { return __half22float2(x); }
__device__ __forceinline__ scalar2_t from_float2(float lo, float hi) { return __floats2half2_rn(lo, hi); }
#endif

// -DRES16=1: the residual stream in the 16-bit type (rmsnorm.cu, embedding.cu; rmsnorm.py says
// when), else float32
#ifndef RES16
#define RES16 0
#endif
#if RES16
typedef scalar_t res_t;
__device__ __forceinline__ float res_to_float(res_t x) { return to_float(x); }
__device__ __forceinline__ res_t res_from_float(float x) { return from_float(x); }
#else
typedef float res_t;
__device__ __forceinline__ float res_to_float(res_t x) { return x; }
__device__ __forceinline__ res_t res_from_float(float x) { return x; }
#endif

// Programmatic dependent launch (Hopper): a kernel launched with the programmatic
// stream-serialization attribute may start while the previous one finishes; it must
// wait for that one's results before touching memory the previous kernels write. Every kernel
// opens with PDL_ENTER() (the matrix products first prefetch their weights, which nothing
// writes), which lets the next kernel start after its wait, or with -DEARLY_TRIGGER=1
// (_module.early_triggers: small models' decode graphs) before it, so that the next kernel's
// loads before its own wait overlap this one whole. Either way a kernel's wait returns once the
// kernels before it have completed. Before its wait a kernel reads only what nothing in the step
// writes (weights, earlier steps' keys) and the step's staged inputs (positions, K/V pointers
// and lengths, sampling parameters: flash_decode, gemv.cu's RopeKV, sample_tokens), which a copy
// before the step or stage_in wrote: the embedding after stage_in opens with PDL_ENTER_LATE(),
// so the kernel after it starts once stage_in is done. Without the attribute (or before sm_90)
// these are no-ops.
// -DSTAMPS=1 (bench/kernels.py --timeline): block (0, 0, 0) of every kernel also writes the
// global timer, past the wait, to the next slot of stamp_buf (_module.Timeline sets it; its
// first word counts the slots taken), so a graph's kernels can be timed where they run, PDL
// overlaps included. Off by default: the atomic delays block 0 by an L2 round trip.
#ifndef STAMPS
#define STAMPS 0
#endif
#if STAMPS
__device__ unsigned long long *stamp_buf;
__device__ __forceinline__ void stamp() {
    if ((blockIdx.x | blockIdx.y | blockIdx.z | threadIdx.x | threadIdx.y | threadIdx.z) == 0 && stamp_buf) {
        unsigned long long t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        stamp_buf[1 + atomicAdd(stamp_buf, 1ULL)] = t;
    }
}
#else
__device__ __forceinline__ void stamp() {}
#endif
// -DSTAMPS=2 (bench/kernels.py --timeline --points): block 0 also stamps at points inside some kernels,
// STAMP_POINT() (_module.STAMP_POINTS names them), so that their stages split there. A point must be
// passed once by block 0, after its wait.
#define STAMP_POINT()                 \
    do {                              \
        if (STAMPS >= 2) stamp();     \
    } while (0)
#ifndef EARLY_TRIGGER  // 1: PDL_ENTER lets the next kernel launch before this one's wait (see above)
#define EARLY_TRIGGER 0
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define PDL_ENTER()                                                                \
    do {                                                                           \
        if (EARLY_TRIGGER) asm volatile("griddepcontrol.launch_dependents;" :::);  \
        asm volatile("griddepcontrol.wait;" ::: "memory");                         \
        stamp();                                                                   \
        if (!EARLY_TRIGGER) asm volatile("griddepcontrol.launch_dependents;" :::); \
    } while (0)
#define PDL_ENTER_LATE()                                       \
    do {                                                       \
        asm volatile("griddepcontrol.wait;" ::: "memory");     \
        stamp();                                               \
        asm volatile("griddepcontrol.launch_dependents;" :::); \
    } while (0)
#else
#define PDL_ENTER() \
    do {            \
        stamp();    \
    } while (0)
#define PDL_ENTER_LATE() PDL_ENTER()
#endif

#define NEG_INF (__int_as_float(0xff800000))
#define POS_INF (__int_as_float(0x7f800000))

// 8 x 16-bit values moved as one 16-byte access
struct __align__(16) vec8 {
    scalar2_t v[4];
};

__device__ __forceinline__ void vec8_to_float(const vec8 &in, float out[8]) {
#pragma unroll
    for (int i = 0; i < 4; i++) {
        float2 f = to_float2(in.v[i]);
        out[2 * i] = f.x;
        out[2 * i + 1] = f.y;
    }
}

__device__ __forceinline__ vec8 float_to_vec8(const float in[8]) {
    vec8 out;
#pragma unroll
    for (int i = 0; i < 4; i++) out.v[i] = from_float2(in[2 * i], in[2 * i + 1]);
    return out;
}

// SiLU(g) * u = g / (1 + e^-g) * u = (h + h tanh(h)) * u with h = g / 2; every kernel that
// applies SiLU (the activation kernel, the gate/up product's epilogue, mlp_block) shares it so all
// give the same bits. One hardware tanh (tanh.approx.f32, sm_75+: relative error ~2^-11, so an
// absolute error ~2.4e-4 |g|, less than the 16-bit rounding that SiLU's output gets in every
// kernel: NumPy runner, SmolLM2 teacher-forced, docs/performance.md's fifty-seventh session): one
// MUFU op a value where e^-g and the division took two, and before them tanhf ~18 instructions.
// H200, silu_mul at 2,040 x 14,336, bfloat16 into e4m3 codes, graph-timed: 41.0 -> 38.7 us
// (256 rows 8.3 -> 7.7); a mixed step's 32 in place (eager) 1.47-1.58 -> 1.35-1.42 ms. Past
// |h| ~ 9, tanh is +-1 and the result g or 0, SiLU's limits. Older GPUs keep the exp form.
__device__ __forceinline__ float silu_times(float g, float u) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 750
    const float h = 0.5f * g;
    float t;
    asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(h));
    return fmaf(h, t, h) * u;
#else
    return __fdividef(g, 1.0f + __expf(-g)) * u;
#endif
}

// RoPE of one (x1, x2) pair in the rotate-half layout (x1 at j, x2 at j + HEAD_DIM / 2).
__device__ __forceinline__ void rope_rotate(float x1, float x2, float c, float s, float &o1, float &o2) {
    o1 = x1 * c - x2 * s;
    o2 = x2 * c + x1 * s;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// (value, index) max with ties to the lower index
__device__ __forceinline__ void argmax_pair(float &v, int &i, float ov, int oi) {
    if (ov > v || (ov == v && oi < i)) {
        v = ov;
        i = oi;
    }
}

// order-preserving map from float to unsigned int
__device__ __forceinline__ unsigned int ord_key(float f) {
    const unsigned int u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// A logit and its token as one key whose max is argmax_pair's pick: the larger logit, then the
// lower token (-0 as +0, which compare equal); NaN gives 0, below every other key, so is never
// picked. The LM head's tiles leave a key a row (gemv.cu's gemv_keys), whose max the sampling
// kernel takes for a greedy row instead of reading the row's logits (greedy_token).
__device__ __forceinline__ unsigned long long greedy_key(float v, int token) {
    if (v != v) return 0ull;
    return ((unsigned long long)ord_key(v == 0.0f ? 0.0f : v) << 32) | (0xffffffffu - (unsigned)token);
}
__device__ __forceinline__ int greedy_token(unsigned long long key) {  // a row of NaNs only: 0
    return key == 0ull ? 0 : (int)(0xffffffffu - (unsigned)key);
}

// The sums of an RMSNorm over float4s of a row, shared by rmsnorm.cu and the skinny GEMM's
// folded norm (gemv.cu, NORM_IN) so that both give the same bits: residual + delta + bias,
// and a float4's sum of squares.
__device__ __forceinline__ float4 add_delta(float4 v, float4 e, float4 b) {
    return make_float4(v.x + e.x + b.x, v.y + e.y + b.y, v.z + e.z + b.z, v.w + e.w + b.w);
}
__device__ __forceinline__ float sq4(float4 v) { return v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w; }

// e + float4 i of parts 1 .. parts - 1 of a delta in parts (`stride` floats apart), added in
// order. The loads of up to 8 parts issue together: in a loop, one after the other, each part
// cost an L2 round trip (mlp_block.cu's down product comes in 12 parts for SmolLM2).
__device__ __forceinline__ float4 add_parts(float4 e, const float *d, long long stride, int parts, int i) {
    for (int p0 = 1; p0 < parts; p0 += 8) {
        float4 f[8];
#pragma unroll
        for (int k = 0; k < 8; k++)
            if (p0 + k < parts) f[k] = reinterpret_cast<const float4 *>(d + (p0 + k) * stride)[i];
#pragma unroll
        for (int k = 0; k < 8; k++)
            if (p0 + k < parts) e = make_float4(e.x + f[k].x, e.y + f[k].y, e.z + f[k].z, e.w + f[k].w);
    }
    return e;
}

// block-wide sum / max; every thread gets the result. `scratch` holds >= 32 floats.
__device__ __forceinline__ float block_sum(float v, float *scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();  // scratch may still be read from a previous reduction
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : 0.0f;
    return warp_sum(v);
}

__device__ __forceinline__ float block_max(float v, float *scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : NEG_INF;
    return warp_max(v);
}

// The sum (OP 0) or max (OP 1) of v over a group of G threads (32, or a multiple of 32) that take
// a row together, several groups a block (rmsnorm.cu's add_rms_norm_rows, quant.cu's
// quantize_rows_group); every thread of the group gets it. red: G / 32 floats of the group's own,
// a region per reduction of a kernel; the group's warps meet at a named barrier of its own (id
// group + 1), so groups never wait for each other, and a group whose row is past the last may exit.
#define ROW_GROUP_BLOCK 256  // threads a block of such kernels (_module.ROW_GROUP_BLOCK)
template <int G, int OP>
__device__ __forceinline__ float group_reduce(float v, float *red, int group) {
    v = OP == 0 ? warp_sum(v) : warp_max(v);
    if constexpr (G == 32) {
        return v;
    } else {
        if ((threadIdx.x & 31) == 0) red[(threadIdx.x % G) >> 5] = v;
        asm volatile("bar.sync %0, %1;" ::"r"(group + 1), "n"(G) : "memory");
        float s = red[0];
#pragma unroll
        for (int i = 1; i < G / 32; i++) s = OP == 0 ? s + red[i] : fmaxf(s, red[i]);
        return s;
    }
}

// ------------------------------------------------------------------ tensor cores (sm_80+)
// Inline PTX rather than <mma.h>: NVRTC needs no toolkit headers for these.

// c (16x8 float32) += a (16x16, row-major fragments) * b (16x8, col-major fragments).
// Fragments of lane l = 4g + q: a0 (row g, k 2q..2q+1), a1 (row g+8, same k), a2 (row g,
// k 2q+8..), a3 (row g+8, k 2q+8..); b0 (k 2q..2q+1, col g), b1 (k 2q+8.., col g);
// c0 c1 (row g, cols 2q, 2q+1), c2 c3 (row g+8, same cols). Lower k in the lower 16 bits.
// F16: the operands are float16 (the default: the model's 16-bit type, MMA_TYPE).
#define MMA_16816_PTX(T) \
    "mma.sync.aligned.m16n8k16.row.col.f32." T "." T ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
template <bool F16 = !USE_BF16>
__device__ __forceinline__ void mma_16816(float c[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                          unsigned b0, unsigned b1) {
    if constexpr (F16)
        asm volatile(MMA_16816_PTX("f16") : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    else
        asm volatile(MMA_16816_PTX("bf16") : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// One tile of scores into a warp's running softmax (flash attention, log2 domain). sc:
// STILES 16x8 tiles of raw q.k scores (masked keys at -inf), rows g and g + 8 of the lane's
// mma group; m_run: the two rows' running max (times scale2), l_run: this lane's running
// sums; o: the OTILES output tiles. Leaves sc as exp2(s * scale2 - max), the unnormalised
// probabilities, and rescales o and l_run by the change of the max (skipped when no row of
// the warp has a new max, the common case once a row has seen its largest scores). A row
// that has seen nothing yet keeps a max of -inf and a base of zero. LIVE = 1: rows 8..15
// are padding (a decode tile of <= 8 heads); their probabilities are left at zero and
// their outputs are never rescaled.
template <int STILES, int OTILES, int LIVE = 2>
__device__ __forceinline__ void online_softmax(float (&sc)[STILES][4], float m_run[2], float l_run[2],
                                               float (&o)[OTILES][4], float scale2) {
    static_assert(LIVE == 1 || LIVE == 2, "one or both row halves");
    float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
    for (int j = 0; j < STILES; j++) {
        mx[0] = fmaxf(mx[0], fmaxf(sc[j][0], sc[j][1]));
        mx[1] = fmaxf(mx[1], fmaxf(sc[j][2], sc[j][3]));
    }
    float base[2], corr[2] = {1.0f, 1.0f};
#pragma unroll
    for (int r = 0; r < LIVE; r++) {
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
        const float m_new = fmaxf(m_run[r], mx[r] * scale2);
        base[r] = m_new == NEG_INF ? 0.0f : m_new;
        corr[r] = exp2f(m_run[r] - base[r]);
        m_run[r] = m_new;
    }
    float sum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int j = 0; j < STILES; j++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            if ((i >> 1) >= LIVE) {
                sc[j][i] = 0.0f;
                continue;
            }
            sc[j][i] = exp2f(fmaf(sc[j][i], scale2, -base[i >> 1]));
            sum[i >> 1] += sc[j][i];
        }
#pragma unroll
    for (int r = 0; r < LIVE; r++) l_run[r] = l_run[r] * corr[r] + sum[r];
    if (__any_sync(0xffffffffu, corr[0] != 1.0f || corr[1] != 1.0f)) {
#pragma unroll
        for (int j = 0; j < OTILES; j++)
#pragma unroll
            for (int i = 0; i < 2 * LIVE; i++) o[j][i] *= corr[i >> 1];
    }
}

__device__ __forceinline__ unsigned pack2(float lo, float hi) {
    scalar2_t v = from_float2(lo, hi);
    return *reinterpret_cast<unsigned *>(&v);
}
// the same in float16, whatever the model's type (pack2 itself for a float16 model)
__device__ __forceinline__ unsigned pack2_f16(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<unsigned *>(&v);
}

// The prefill attention kernels' arguments (flash_prefill.cu, flash_prefill_wgmma.cu: one launch
// contract, flash_prefill.py's)
#define PREFILL_ATTENTION_ARGS                                                                         \
    const scalar_t *__restrict__ q,        /* (T, H, HEAD_DIM) */                                      \
        scalar_t *__restrict__ out,        /* (T, H, HEAD_DIM) */                                      \
        const int *__restrict__ tile_seq,  /* (tiles) a tile's sequence */                             \
        const int *__restrict__ tile_q0,   /* (tiles) its first query in the sequence's chunk */       \
        const int *__restrict__ seq_q_start, /* (S) index of the sequence's first query token */      \
        const int *__restrict__ seq_q_len,   /* (S) */                                                 \
        const int *__restrict__ seq_kv_len,  /* (S) keys in the cache including this chunk */          \
        const long long *__restrict__ k_ptrs, /* (S) */                                                \
        const long long *__restrict__ v_ptrs, /* (S) */                                                \
        long long layer_offset, int num_heads, int num_kv_heads, int window, float scale

// Prefill attention tiles (flash_prefill.cu, flash_prefill_wgmma.cu), a warp's 16 query rows:
// lane 4g + qd holds rows g and g + 8 (positions pos0, pos0 + 8) and, of 8-key tile j, keys
// n0 + 8j + 2qd + (i & 1). CAUSAL_MASK: keys past a row's position, past k_hi (the chunk's end)
// or before its window to -inf (the callers skip it where the tile is wholly visible to the
// warp's rows). A macro, not a function: as a function ptxas gave flash_prefill_wgmma.cu's
// consumers 4 more registers and a spill at its 168-register cap.
#define CAUSAL_MASK(sc, STILES, n0, pos0, k_hi, window, qd)                                            \
    _Pragma("unroll") for (int j_ = 0; j_ < (STILES); j_++) {                                           \
        _Pragma("unroll") for (int i_ = 0; i_ < 4; i_++) {                                              \
            const int key_ = (n0) + j_ * 8 + 2 * (qd) + (i_ & 1), pos_ = (pos0) + (i_ >> 1) * 8;        \
            const bool ok_ = key_ <= pos_ && key_ < (k_hi) && ((window) <= 0 || key_ > pos_ - (window)); \
            if (!ok_) sc[j_][i_] = NEG_INF;                                                             \
        }                                                                                               \
    }

// The probabilities as the A fragments of P V (m16n8k16's, and wgmma's register A): the
// accumulators of 8-key tiles 2kk and 2kk + 1 are 16-key fragment kk.
template <int STILES>
__device__ __forceinline__ void p_fragments(const float (&sc)[STILES][4], unsigned (&a)[STILES / 2][4]) {
#pragma unroll
    for (int kk = 0; kk < STILES / 2; kk++) {
        a[kk][0] = pack2(sc[2 * kk][0], sc[2 * kk][1]);
        a[kk][1] = pack2(sc[2 * kk][2], sc[2 * kk][3]);
        a[kk][2] = pack2(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);
        a[kk][3] = pack2(sc[2 * kk + 1][2], sc[2 * kk + 1][3]);
    }
}

// The warp's output rows, divided by the running sums (summed over the lane quad) and rounded:
// row g at o_g (this lane's first column), row g + 8 at o_g + row8; rows from `rows` on (a
// tile's padding) not written. r0: row g's index in the tile.
template <int OTILES>
__device__ __forceinline__ void store_rows(const float (&o)[OTILES][4], float l_run[2], scalar_t *o_g, long long row8,
                                           int r0, int rows) {
#pragma unroll
    for (int r = 0; r < 2; r++) {
        l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 1);
        l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 2);
    }
    const float inv0 = l_run[0] > 0.0f ? 1.0f / l_run[0] : 0.0f, inv1 = l_run[1] > 0.0f ? 1.0f / l_run[1] : 0.0f;
#pragma unroll
    for (int j = 0; j < OTILES; j++) {
        if (r0 < rows) *reinterpret_cast<unsigned *>(o_g + j * 8) = pack2(o[j][0] * inv0, o[j][1] * inv0);
        if (r0 + 8 < rows) *reinterpret_cast<unsigned *>(o_g + row8 + j * 8) = pack2(o[j][2] * inv1, o[j][3] * inv1);
    }
}

__device__ __forceinline__ unsigned smem_addr(const void *p) {
    unsigned a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// Four 8x8 16-bit matrices from shared memory; lanes 8i..8i+7 give the row addresses of
// matrix i. Lane 4g + q receives (row g, cols 2q, 2q+1) of each, or with .trans the
// transposed pair (rows 2q, 2q+1, col g).
__device__ __forceinline__ void ldsm_x4(unsigned r[4], const void *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

__device__ __forceinline__ void ldsm_x4_trans(unsigned r[4], const void *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

// 16 bytes global -> shared without passing through registers; zero-filled when !valid
// (src must still be a mapped address).
__device__ __forceinline__ void cp_async16(void *dst, const void *src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
                 "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// ------------------------------------------------------------------ float8 e4m3
// One byte: 4 exponent bits, 3 mantissa bits, saturating at +-448 (the fp8 K/V cache and the
// fp8 weights / activations of --quantization fp8). Converted through PTX (sm_89+), so NVRTC
// needs no cuda_fp8.h; a module that never calls these builds for older GPUs too.
#define FP8_MAX 448.0f
// two values -> two e4m3 bytes, lo in the lower byte
__device__ __forceinline__ unsigned short fp8x2_from_floats(float lo, float hi) {
    unsigned short r;  // cvt packs its first operand into the upper byte, the second into the lower
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
}
__device__ __forceinline__ unsigned char fp8_from_float(float x) {
    return (unsigned char)(fp8x2_from_floats(x, 0.0f) & 0xff);
}
// two e4m3 bytes (lower byte first) -> two float16 values in one word, exactly
__device__ __forceinline__ unsigned fp8x2_to_f16x2(unsigned short v) {
    unsigned h;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"(v));
    return h;
}
// the same as two floats
__device__ __forceinline__ float2 fp8x2_to_float2(unsigned short v) {
    const unsigned h = fp8x2_to_f16x2(v);
    return __half22float2(*reinterpret_cast<const __half2 *>(&h));
}
// the same in the model's 16-bit type
__device__ __forceinline__ unsigned fp8x2_to_scalar2(unsigned short v) {
#if USE_BF16
    const float2 f = fp8x2_to_float2(v);
    return pack2(f.x, f.y);
#else
    return fp8x2_to_f16x2(v);
#endif
}
// four e4m3 bytes -> lo: bytes 0, 1 and hi: bytes 2, 3 as two 16-bit values each; the
// converts read the word's halves in place (no masking or shifting first)
// (fp8x4_to_f16x2x2: the same into float16, whatever the model's type: one convert a pair)
__device__ __forceinline__ void fp8x4_to_f16x2x2(unsigned w, unsigned &lo, unsigned &hi) {
    asm("{\n\t.reg .b16 l, h;\n\tmov.b32 {l, h}, %2;\n\tcvt.rn.f16x2.e4m3x2 %0, l;\n\tcvt.rn.f16x2.e4m3x2 %1, h;\n\t}"
        : "=r"(lo), "=r"(hi)
        : "r"(w));
}
__device__ __forceinline__ void fp8x4_to_scalar2x2(unsigned w, unsigned &lo, unsigned &hi) {
#if USE_BF16
    lo = fp8x2_to_scalar2((unsigned short)(w & 0xffff));
    hi = fp8x2_to_scalar2((unsigned short)(w >> 16));
#else
    fp8x4_to_f16x2x2(w, lo, hi);
#endif
}
// 16 e4m3 bytes (one 16-byte load) -> 8 words of two 16-bit values, lower byte first
__device__ __forceinline__ void fp8x16_to_scalar2x8(const uint4 &v, unsigned out[8]) {
    const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int j = 0; j < 4; j++) fp8x4_to_scalar2x2(w[j], out[2 * j], out[2 * j + 1]);
}

// 8 int8 codes (GGUF Q8_0, lower k first) times their block's float16 scale d -> 8 values of the
// 16-bit type, each the exact product rounded once to nearest (as the loader's float32 product is
// rounded to the model's type). float16: the codes become exact halves (byte ^ 0x80 under a 0x64
// exponent is 1024 + code + 128) and one f16x2 product a pair rounds; bfloat16: float32 products
// (exact: 8 x 11 significant bits), then one rounding a value.
__device__ __forceinline__ uint4 q8x8_to_scalar8(uint2 q, unsigned short d) {
    const unsigned u[2] = {q.x ^ 0x80808080u, q.y ^ 0x80808080u};  // code + 128 in each byte
    uint4 out;
    unsigned *o = &out.x;
#if USE_BF16
    const float df = __half2float(__ushort_as_half(d));
#pragma unroll
    for (int j = 0; j < 4; j++) {  // bytes 2j, 2j + 1
        const unsigned w = u[j >> 1], s = (j & 1) * 2;
        const float lo = __int_as_float(0x4B000000 | __byte_perm(w, 0, 0x4440 + s)) - 8388736.0f;  // 2^23 + 128
        const float hi = __int_as_float(0x4B000000 | __byte_perm(w, 0, 0x4441 + s)) - 8388736.0f;
        o[j] = pack2(lo * df, hi * df);
    }
#else
    const __half2 dd = __half2half2(__ushort_as_half(d)), bias = __half2half2(__ushort_as_half(0x6480));  // 1152
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const unsigned h = __byte_perm(u[j >> 1], 0x64646464u, (j & 1) ? 0x4342 : 0x4140);
        const __half2 v = __hmul2_rn(__hsub2(*reinterpret_cast<const __half2 *>(&h), bias), dd);
        o[j] = *reinterpret_cast<const unsigned *>(&v);
    }
#endif
    return out;
}

// A row quantized to e4m3 with one float32 scale: scale = max |x| / 448 (1 for a zero row),
// q = x / scale, so the row uses e4m3's whole range. quant_inv: the block's max of its
// threads' m (their largest |x|) -> writes the scale (thread 0), returns 448 / max (1 for a
// zero row); scratch: 32 floats of shared memory. fp8x4 / fp8x8: the codes of 4 / 8 values.
// quant_scale: from the whole row's largest |x| m, the scale (scale[i], written where `write`) and
// 448 / m. group_quant_inv: quant_inv over a group of G threads a row (group_reduce's; red as
// there), its thread t = 0 writing scale[i].
__device__ __forceinline__ float quant_scale(float m, float *scale, long long i, bool write) {
    if (write) scale[i] = m > 0.0f ? m / FP8_MAX : 1.0f;
    return m > 0.0f ? FP8_MAX / m : 1.0f;
}
__device__ __forceinline__ float quant_inv(float m, float *scale, float *scratch) {
    return quant_scale(block_max(m, scratch), scale, 0, threadIdx.x == 0);
}
template <int G>
__device__ __forceinline__ float group_quant_inv(float m, float *scale, long long i, float *red, int group, int t) {
    return quant_scale(group_reduce<G, 1>(m, red, group), scale, i, t == 0);
}
__device__ __forceinline__ unsigned fp8x4(const float f[4], float inv) {
    return fp8x2_from_floats(f[0] * inv, f[1] * inv) | ((unsigned)fp8x2_from_floats(f[2] * inv, f[3] * inv) << 16);
}
__device__ __forceinline__ uint2 fp8x8(const float f[8], float inv) {
    return make_uint2(fp8x4(f, inv), fp8x4(f + 4, inv));
}

// One row of 16-bit values (K a multiple of 8) -> e4m3 codes and its scale, by a whole block:
// quant.cu's quantize_rows (the weights at load, the activations before a float8 product).
// A thread keeps its first 8 values in registers for the second pass (all of them when the
// block has a thread per 8 values, as quantize_rows launches it); the rest are read again.
__device__ __forceinline__ void quantize_row(const scalar_t *__restrict__ x, unsigned char *__restrict__ q,
                                             float *__restrict__ scale, int K, float *scratch) {
    const vec8 *xr = reinterpret_cast<const vec8 *>(x);
    uint2 *qr = reinterpret_cast<uint2 *>(q);
    const int n8 = K / 8, first = threadIdx.x;
    float held[8], m = 0.0f;
    if (first < n8) vec8_to_float(xr[first], held);
    for (int i = first + blockDim.x; i < n8; i += blockDim.x) {
        float f[8];
        vec8_to_float(xr[i], f);
#pragma unroll
        for (int j = 0; j < 8; j++) m = fmaxf(m, fabsf(f[j]));
    }
    if (first < n8) {
#pragma unroll
        for (int j = 0; j < 8; j++) m = fmaxf(m, fabsf(held[j]));
    }
    const float inv = quant_inv(m, scale, scratch);
    if (first < n8) qr[first] = fp8x8(held, inv);
    for (int i = first + blockDim.x; i < n8; i += blockDim.x) {
        float f[8];
        vec8_to_float(xr[i], f);
        qr[i] = fp8x8(f, inv);
    }
}

// -DQUANT_OUT=1: a kernel whose 16-bit output feeds a float8 product (RMSNorm, SiLU * up)
// also writes it as e4m3 codes with a scale per row, the bits quantize_row gives on that
// output, saving the product's own quantize_rows launch. Such kernels keep their share of
// the row in registers (rounded to 16 bits, as quantize_row reads it) and quantize from there.
#ifndef QUANT_OUT
#define QUANT_OUT 0
#endif

// A matrix product's output, as the kernel after it reads it. -DPROD=0: float32 (the
// skinny GEMM's); 1: float16, 2: bfloat16 (cuBLAS / cuBLASLt write 16 bits for steps of
// many rows: half the bytes to write and read back; a float8 product's raw sums need
// bfloat16's range).
#ifndef PROD
#define PROD 0
#endif
#if PROD == 1
typedef __half prod_t;
__device__ __forceinline__ float prod_to_float(prod_t v) { return __half2float(v); }
#elif PROD == 2
typedef __nv_bfloat16 prod_t;
__device__ __forceinline__ float prod_to_float(prod_t v) { return __bfloat162float(v); }
#else
typedef float prod_t;
__device__ __forceinline__ float prod_to_float(prod_t v) { return v; }
#endif

// N (1 or a multiple of 4) consecutive float32s, in 16-byte loads from N = 4 on (p aligned so)
template <int N>
__device__ __forceinline__ void load_f32(const float *p, float f[N]) {
    if constexpr (N == 1) {
        f[0] = p[0];
    } else {
#pragma unroll
        for (int h = 0; h < N / 4; h++) {
            const float4 v = reinterpret_cast<const float4 *>(p)[h];
            f[4 * h] = v.x, f[4 * h + 1] = v.y, f[4 * h + 2] = v.z, f[4 * h + 3] = v.w;
        }
    }
}

// 8 consecutive product values as loaded (16-byte aligned): a kernel that asks for many before
// it uses any holds them so, in half the registers of their float32s for 16-bit products.
struct prod8 {
#if PROD == 0
    float4 lo, hi;
#else
    uint4 w;  // pairs of 16-bit values, lower element first
#endif
};

__device__ __forceinline__ prod8 load_prod8(const prod_t *p) {
    prod8 r;
#if PROD == 0
    r.lo = reinterpret_cast<const float4 *>(p)[0];
    r.hi = reinterpret_cast<const float4 *>(p)[1];
#else
    r.w = *reinterpret_cast<const uint4 *>(p);
#endif
    return r;
}

// n 16-bit pairs (lower element first) to 2 n float32s
template <int N>
__device__ __forceinline__ void prod_pairs_to_float(const unsigned (&w)[N], float *f) {
#pragma unroll
    for (int j = 0; j < N; j++) {
        f[2 * j] = prod_to_float(reinterpret_cast<const prod_t *>(&w[j])[0]);
        f[2 * j + 1] = prod_to_float(reinterpret_cast<const prod_t *>(&w[j])[1]);
    }
}

__device__ __forceinline__ void prod8_to_float(const prod8 &r, float f[8]) {
#if PROD == 0
    f[0] = r.lo.x, f[1] = r.lo.y, f[2] = r.lo.z, f[3] = r.lo.w;
    f[4] = r.hi.x, f[5] = r.hi.y, f[6] = r.hi.z, f[7] = r.hi.w;
#else
    const unsigned w[4] = {r.w.x, r.w.y, r.w.z, r.w.w};
    prod_pairs_to_float<4>(w, f);
#endif
}

// N (1, 4 or 8) consecutive product values (one load: aligned to its size).
template <int N>
__device__ __forceinline__ void load_prod(const prod_t *p, float f[N]) {
    static_assert(N == 1 || N == 4 || N == 8, "1, 4 or 8 values");
    if constexpr (N == 1) {
        f[0] = prod_to_float(p[0]);
    } else if constexpr (N == 8) {
        prod8_to_float(load_prod8(p), f);
    } else if constexpr (PROD == 0) {
        const float4 v = *reinterpret_cast<const float4 *>(p);
        f[0] = v.x, f[1] = v.y, f[2] = v.z, f[3] = v.w;
    } else {
        const uint2 v = *reinterpret_cast<const uint2 *>(p);
        const unsigned w[2] = {v.x, v.y};
        prod_pairs_to_float<2>(w, f);
    }
}

// --quantization fp8: cuBLASLt's float8 product leaves the raw sums of the codes; whoever
// reads them multiplies by the token's scale (rs, the row of x) and the feature's (cs, the
// row of W). rs null: a 16-bit product, nothing to scale.
__device__ __forceinline__ float dequant(prod_t v, const float *rs, const float *cs, long long t, long long n) {
    const float f = prod_to_float(v);
    return rs != nullptr ? f * rs[t] * cs[n] : f;
}

// dequant of N (1 or a multiple of 4) consecutive values from feature n on (n a multiple of N)
template <int N>
__device__ __forceinline__ void dequant_n(float f[N], const float *rs, const float *cs, long long t, long long n) {
    if (rs == nullptr) return;
    const float r = rs[t];
    if constexpr (N == 1) {
        f[0] = f[0] * r * cs[n];
        return;
    }
#pragma unroll
    for (int h = 0; h < N / 4; h++) {
        const float4 c = reinterpret_cast<const float4 *>(cs + n)[h];
        f[4 * h] = f[4 * h] * r * c.x, f[4 * h + 1] = f[4 * h + 1] * r * c.y;
        f[4 * h + 2] = f[4 * h + 2] * r * c.z, f[4 * h + 3] = f[4 * h + 3] * r * c.w;
    }
}

// the KV cache's element. -DKV_FP8=1: float8 e4m3 (scale 1), else the 16-bit type.
#ifndef KV_FP8
#define KV_FP8 0
#endif
#if KV_FP8
typedef unsigned char kv_t;
__device__ __forceinline__ kv_t to_kv(float x) { return fp8_from_float(x); }
#else
typedef scalar_t kv_t;
__device__ __forceinline__ kv_t to_kv(float x) { return from_float(x); }
#endif

// Where the K (or V) row of a token at position pos lands: ptrs[t] is the element address
// of the token's sequence region in layer 0; the pool is (layers, slots, kv_heads, head_dim).
__device__ __forceinline__ kv_t *kv_row(const long long *ptrs, long long t, long long layer_offset, int pos,
                                        int kv_width) {
    return reinterpret_cast<kv_t *>(ptrs[t]) + layer_offset + (long long)pos * kv_width;
}

// Byte offset of 16-byte chunk `chunk` of row r in a tile of 128-byte rows with the 128-byte
// swizzle of Hopper's wgmma operands (wgmma.cuh's smem_desc): 8-row groups of 1,024 bytes, a
// row's chunks permuted by the row's place in its group.
__device__ __forceinline__ int smem_swizzle(int r, int chunk) { return r * 128 + ((chunk ^ (r & 7)) << 4); }

// K and V rows of keys n0 .. n0 + ROWS - 1 into shared memory with cp.async (16 bytes a
// copy, by the block's NTHREADS threads): they land in rows row0 .. row0 + ROWS - 1, row r at dk /
// dv + r * stride (kv_t elements, a multiple of 16 bytes); SWIZZLED_K: K's rows of 128 bytes at
// dk + smem_swizzle(r, chunk) instead (the wgmma operand's layout). Keys from `limit` on are zeros
// (never NaN times 0 in P V) and read key `fallback`'s address, which must be mapped. Key `skip`
// is left alone (not copied). thread: this thread's place among the NTHREADS (-1: threadIdx.x).
template <int ROWS, int DIM, int NTHREADS, bool SWIZZLED_K = false>
__device__ __forceinline__ void load_kv_tile(kv_t *dk, kv_t *dv, int stride, const kv_t *kb, const kv_t *vb,
                                             long long kv_stride, int n0, int limit, int fallback, int skip = -1,
                                             int row0 = 0, int thread = -1) {
    constexpr int PIECES = DIM * (int)sizeof(kv_t) / 16, PER = 16 / (int)sizeof(kv_t);
    static_assert(!SWIZZLED_K || PIECES == 8, "SWIZZLED_K: rows of 128 bytes");
#pragma unroll
    for (int i = thread < 0 ? (int)threadIdx.x : thread; i < ROWS * PIECES; i += NTHREADS) {
        const int r = i / PIECES, c = (i % PIECES) * PER, key = n0 + r;
        if (key == skip) continue;
        const bool ok = key < limit;
        const long long off = (long long)(ok ? key : fallback) * kv_stride + c;
        cp_async16(SWIZZLED_K ? dk + smem_swizzle(row0 + r, i % PIECES) : dk + (row0 + r) * stride + c, kb + off, ok);
        cp_async16(dv + (row0 + r) * stride + c, vb + off, ok);
    }
}

#if KV_FP8
// rows x dim e4m3 bytes (16-byte aligned rows, in shared memory) -> 16-bit rows of stride
// lds elements.
__device__ __forceinline__ void kv_tile_to_scalar(const unsigned char *src, scalar_t *dst, int rows, int dim,
                                                  int lds) {
    // 8 bytes a thread, so that 8 neighbouring threads write 128 contiguous bytes of a row
    // (16 bytes a thread from 16 bytes read took each row's stores in two passes)
    const int per_row = dim / 8;
    for (int i = threadIdx.x; i < rows * per_row; i += blockDim.x) {
        const int r = i / per_row, c = (i % per_row) * 8;
        const uint2 v = *reinterpret_cast<const uint2 *>(src + r * dim + c);
        uint4 out;
        fp8x4_to_scalar2x2(v.x, out.x, out.y);
        fp8x4_to_scalar2x2(v.y, out.z, out.w);
        *reinterpret_cast<uint4 *>(dst + r * lds + c) = out;
    }
}
#endif

