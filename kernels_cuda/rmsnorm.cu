// RMSNorm, and the fused residual add + RMSNorm of the decoder layers.
// One block per row (add_rms_norm_rows, at the end: a group of threads per row, for steps of
// many rows with a 16-bit residual stream); the residual stream is float32 (or 16-bit: -DRES16),
// the normed output 16-bit (it feeds a matrix product), the norm weights float32.
//
// A decode step runs two of these per layer on one row each, so they are written for
// latency: every thread loads its first NORM_VEC float4 of the row (and of the delta) at
// once and keeps them in registers for the second pass; a row longer than that (or one
// whose length is not a multiple of 4) goes through the plain loop for the rest.
#include "common.cuh"

// -DNORM_VEC: float4 of the row a thread holds (rmsnorm.py picks it with the block size)
#ifndef NORM_VEC
#define NORM_VEC 4
#endif
// -DNORM_AHEAD=1: a thread issues the loads of all its float4 of the row, the weights and the
// delta before it uses the first (more bytes in flight; rmsnorm.py takes it for many rows,
// where the kernel is bound by memory; fewer rows run faster with the loads issued in turn)
#ifndef NORM_AHEAD
#define NORM_AHEAD 0
#endif

// -DRES16=1 (common.cuh's res_t): each sum is rounded to 16 bits before it is normed, so this
// step's norm and the next read the same values

// four residual values at r[4 i .. 4 i + 3], and back
__device__ __forceinline__ float4 load_res4(const res_t *r, int i) {
#if RES16
    const uint2 u = reinterpret_cast<const uint2 *>(r)[i];
    const float2 a = to_float2(*reinterpret_cast<const scalar2_t *>(&u.x));
    const float2 b = to_float2(*reinterpret_cast<const scalar2_t *>(&u.y));
    return make_float4(a.x, a.y, b.x, b.y);
#else
    return reinterpret_cast<const float4 *>(r)[i];
#endif
}

// stores v at r[4 i ..] and returns what the residual now holds (v rounded, for RES16)
__device__ __forceinline__ float4 store_res4(res_t *r, int i, float4 v) {
#if RES16
    const scalar2_t lo = from_float2(v.x, v.y), hi = from_float2(v.z, v.w);
    uint2 u;
    u.x = *reinterpret_cast<const unsigned *>(&lo);
    u.y = *reinterpret_cast<const unsigned *>(&hi);
    reinterpret_cast<uint2 *>(r)[i] = u;
    const float2 a = to_float2(lo), b = to_float2(hi);
    return make_float4(a.x, a.y, b.x, b.y);
#else
    reinterpret_cast<float4 *>(r)[i] = v;
    return v;
#endif
}

// residual += delta (+ bias) when delta is not null; out = rms_norm(residual) * w. The delta
// is a matrix product's output (-DPROD, common.cuh: float32, or 16 bits in steps of many
// rows); from a float8 product it is scaled first: by rsv (the token's scale) and cs (per
// feature), when cs is not null. -DQUANT_OUT=1: out also as e4m3 codes q and its scale
// (common.cuh), from the values in registers; out may then be null (the codes only).
__device__ __forceinline__ void norm_row(res_t *__restrict__ r, const prod_t *__restrict__ d,
                                         const float *__restrict__ bias, const float *__restrict__ w,
                                         scalar_t *__restrict__ out, int hidden, float eps, float rsv,
                                         const float *__restrict__ cs, unsigned char *__restrict__ q,
                                         float *__restrict__ q_scale, long long d_stride = 0, int parts = 1) {
    __shared__ float scratch[32];
    const int n4 = hidden % 4 == 0 ? min(hidden / 4, NORM_VEC * (int)blockDim.x) : 0;
    float4 v[NORM_VEC], g[NORM_VEC], dl[NORM_VEC];  // g: the weights, loaded with the row (not after the sum)
    auto load = [&](int u, int i) {
        v[u] = load_res4(r, i);
        g[u] = reinterpret_cast<const float4 *>(w)[i];
        if (d == nullptr) return;
        if constexpr (PROD == 0) {
            dl[u] = reinterpret_cast<const float4 *>(d)[i];
        } else {
            float f[4];
            load_prod<4>(d + 4 * i, f);
            dl[u] = make_float4(f[0], f[1], f[2], f[3]);
        }
    };
    if (NORM_AHEAD) {
#pragma unroll
        for (int u = 0; u < NORM_VEC; u++)
            if (threadIdx.x + u * blockDim.x < n4) load(u, threadIdx.x + u * blockDim.x);
    }
    float ss = 0.0f;
#pragma unroll
    for (int u = 0; u < NORM_VEC; u++) {
        const int i = threadIdx.x + u * blockDim.x;
        if (i >= n4) break;
        if (!NORM_AHEAD) load(u, i);
        if (d != nullptr) {
            float4 e = dl[u];
            // the parts as gemv.cu's NormIn adds them; a float32 delta only (the cast is a no-op)
            if constexpr (PROD == 0) e = add_parts(e, reinterpret_cast<const float *>(d), d_stride, parts, i);
            if (cs != nullptr) {
                const float4 f = reinterpret_cast<const float4 *>(cs)[i];
                e = make_float4(e.x * rsv * f.x, e.y * rsv * f.y, e.z * rsv * f.z, e.w * rsv * f.w);
            }
            const float4 b = bias != nullptr ? reinterpret_cast<const float4 *>(bias)[i] : make_float4(0, 0, 0, 0);
            v[u] = store_res4(r, i, add_delta(v[u], e, b));
        }
        ss += sq4(v[u]);
    }
    for (int i = 4 * n4 + threadIdx.x; i < hidden; i += blockDim.x) {
        float x = res_to_float(r[i]);
        if (d != nullptr) {
            float e = prod_to_float(d[i]);
            for (int p = 1; p < parts; p++) e += prod_to_float(d[p * d_stride + i]);
            x += (cs != nullptr ? e * rsv * cs[i] : e) + (bias != nullptr ? bias[i] : 0.0f);
            r[i] = res_from_float(x);
            x = res_to_float(r[i]);
        }
        ss += x * x;
    }
    const float inv = rsqrtf(block_sum(ss, scratch) / hidden + eps);
    float m = 0.0f;  // largest |output| of this thread, as rounded to 16 bits
#pragma unroll
    for (int u = 0; u < NORM_VEC; u++) {
        const int i = threadIdx.x + u * blockDim.x;
        if (i >= n4) break;
        scalar2_t *o = reinterpret_cast<scalar2_t *>(out) + 2 * i;
        const scalar2_t lo = from_float2(v[u].x * inv * g[u].x, v[u].y * inv * g[u].y);
        const scalar2_t hi = from_float2(v[u].z * inv * g[u].z, v[u].w * inv * g[u].w);
        if (out != nullptr) o[0] = lo, o[1] = hi;
        if (QUANT_OUT) {
            const float2 a = to_float2(lo), b = to_float2(hi);
            v[u] = make_float4(a.x, a.y, b.x, b.y);
            m = fmaxf(m, fmaxf(fmaxf(fabsf(a.x), fabsf(a.y)), fmaxf(fabsf(b.x), fabsf(b.y))));
        }
    }
    for (int i = 4 * n4 + threadIdx.x; i < hidden; i += blockDim.x) {
        const scalar_t v = from_float(res_to_float(r[i]) * inv * w[i]);
        if (out != nullptr) out[i] = v;
        m = fmaxf(m, fabsf(to_float(v)));
    }
#if QUANT_OUT
    const float qinv = quant_inv(m, q_scale, scratch);
#pragma unroll
    for (int u = 0; u < NORM_VEC; u++) {
        const int i = threadIdx.x + u * blockDim.x;
        if (i >= n4) break;
        const float f[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
        reinterpret_cast<unsigned *>(q)[i] = fp8x4(f, qinv);
    }
    for (int i = 4 * n4 + threadIdx.x; i < hidden; i += blockDim.x)  // the value above, again
        q[i] = fp8_from_float(to_float(from_float(res_to_float(r[i]) * inv * w[i])) * qinv);
#endif
}

// -DQUANT_OUT=1 (both kernels): the normed row also as e4m3 codes q (rows, hidden) and a
// scale per row (common.cuh), for the float8 product it feeds; else q and q_scale are unused
// (null).

// out = x / sqrt(mean(x^2) + eps) * w
extern "C" __global__ void rms_norm(const res_t *__restrict__ x, const float *__restrict__ w,
                                    scalar_t *__restrict__ out, int hidden, float eps,
                                    unsigned char *__restrict__ q, float *__restrict__ q_scale) {
    PDL_ENTER();
    const long long row = blockIdx.x;
    norm_row(const_cast<res_t *>(x) + row * hidden, nullptr, nullptr, w, out ? out + row * hidden : out, hidden, eps,
             1.0f, nullptr, q + row * hidden, q_scale + row);
}

// residual += delta (+ bias); out = rms_norm(residual) * w.  bias may be null; rs, cs: the
// scales of a float8 product's delta (common.cuh's dequant), or null. A float32 delta may
// come in `parts` parts d_stride floats apart (attn_block.cu's o product), added in order
// first.
extern "C" __global__ void add_rms_norm(res_t *__restrict__ residual, const prod_t *__restrict__ delta,
                                        const float *__restrict__ bias, const float *__restrict__ w,
                                        scalar_t *__restrict__ out, int hidden, float eps,
                                        const float *__restrict__ rs, const float *__restrict__ cs,
                                        unsigned char *__restrict__ q, float *__restrict__ q_scale,
                                        long long d_stride, int parts) {
    PDL_ENTER();
    const long long row = blockIdx.x;
    norm_row(residual + row * hidden, delta + row * hidden, bias, w, out ? out + row * hidden : out, hidden, eps,
             rs != nullptr ? rs[row] : 1.0f, rs != nullptr ? cs : nullptr, q + row * hidden, q_scale + row, d_stride,
             parts);
}

// ---------------------------------------------------------------- many rows: a row a group
// add_rms_norm for steps of many rows (rmsnorm.py: ROWS_MIN_ROWS): a group of ROW_THREADS
// threads takes a row of HIDDEN values, ROW_GROUP_BLOCK / ROW_THREADS rows a block, and its sums go across
// the group's warps through shared memory and a barrier of the group's own (no block-wide
// barrier). A thread issues all its loads of the residual and the delta at once and keeps the
// new residual packed as stored (16 bits: -DRES16 only), with the weights and the product's
// per-feature scales read when used (the same for every row: L1 / L2). So a row holds fewer
// registers than norm_row's, and an SM has more rows in flight: norm_row's blocks of a row
// each wait through their loads, two block-wide reductions and their stores with 3-4 rows an
// SM. Per value the arithmetic is norm_row's; the sum of squares adds in another order.
// -DROW_THREADS (32, 64 or 128; 0: not built), -DHIDDEN (a multiple of 8 x ROW_THREADS).
#ifndef ROW_THREADS
#define ROW_THREADS 0
#endif
// -DROW_SCALED=1: the delta is a float8 product's raw sums, scaled by rs and cs (else they are
// not read); -DROW_BIAS=1: a bias is added (else not read). Built in, so that a row's registers
// hold only what its launch reads.
#ifndef ROW_SCALED
#define ROW_SCALED 0
#endif
#ifndef ROW_BIAS
#define ROW_BIAS 0
#endif
// -DROW_DELTA=0: no delta (nor bias, nor scales): the residual, as stored, is normed alone and
// not written (the products that feed it added their output in their epilogue: gemm.py's
// gemm_fp8_scaled with add).
#ifndef ROW_DELTA
#define ROW_DELTA 1
#endif
#if ROW_THREADS
#ifndef HIDDEN
#error "add_rms_norm_rows needs -DHIDDEN"
#endif
constexpr int RT = ROW_THREADS, RPB = ROW_GROUP_BLOCK / ROW_THREADS, RW = ROW_THREADS / 32;
constexpr int NC = HIDDEN / (8 * ROW_THREADS);  // 8-value chunks a thread: chunk c at (c x RT + t) x 8
static_assert(RT == 32 || RT == 64 || RT == 128, "ROW_THREADS: 32, 64 or 128");
static_assert(HIDDEN % (8 * RT) == 0, "HIDDEN: a multiple of 8 x ROW_THREADS");
static_assert(RES16, "add_rms_norm_rows: a 16-bit residual stream (a float32 one lost by it: rmsnorm.py)");
static_assert(ROW_DELTA || (!ROW_SCALED && !ROW_BIAS), "add_rms_norm_rows: scales and a bias go with a delta");

// a 16-byte word of 8 16-bit values as common.cuh's vec8, and back
__device__ __forceinline__ const vec8 &as_vec8(const uint4 &u) { return reinterpret_cast<const vec8 &>(u); }
__device__ __forceinline__ uint4 as_uint4(const vec8 &v) { return reinterpret_cast<const uint4 &>(v); }

extern "C" __global__ void __launch_bounds__(ROW_GROUP_BLOCK) add_rms_norm_rows(
    res_t *__restrict__ residual, const prod_t *__restrict__ delta, const float *__restrict__ bias,
    const float *__restrict__ w, scalar_t *__restrict__ out, int rows, float eps, const float *__restrict__ rs,
    const float *__restrict__ cs, unsigned char *__restrict__ q, float *__restrict__ q_scale) {
    __shared__ float red[2][RPB][RW];
    PDL_ENTER();
    const int group = threadIdx.x / RT, t = threadIdx.x % RT;
    const long long row = (long long)blockIdx.x * RPB + group;
    if (row >= rows) return;  // the whole group: its barrier is its own
    res_t *r = residual + row * HIDDEN;
    const prod_t *d = delta + row * HIDDEN;
    uint4 rv[NC];
    prod8 dv[NC];
#pragma unroll
    for (int c = 0; c < NC; c++) {
        const int i = c * RT + t;
        rv[c] = reinterpret_cast<const uint4 *>(r)[i];
        if (ROW_DELTA) dv[c] = load_prod8(d + 8 * i);
    }
    const float rsv = ROW_SCALED ? rs[row] : 1.0f;
    float ss = 0.0f;
#pragma unroll
    for (int c = 0; c < NC; c++) {
        const int i = c * RT + t;
        float x[8];
        vec8_to_float(as_vec8(rv[c]), x);
        if (ROW_DELTA) {
            float e[8];
            prod8_to_float(dv[c], e);
            if (ROW_SCALED) {
                float f[8];
                load_f32<8>(cs + 8 * i, f);
#pragma unroll
                for (int j = 0; j < 8; j++) e[j] = e[j] * rsv * f[j];
            }
            float b[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
            if (ROW_BIAS) load_f32<8>(bias + 8 * i, b);
#pragma unroll
            for (int j = 0; j < 8; j++) x[j] = x[j] + e[j] + b[j];
            rv[c] = as_uint4(float_to_vec8(x));  // the sum rounded to 16 bits, stored, and normed as stored
            reinterpret_cast<uint4 *>(r)[i] = rv[c];
            vec8_to_float(as_vec8(rv[c]), x);
        }
#pragma unroll
        for (int j = 0; j < 8; j += 4) ss += x[j] * x[j] + x[j + 1] * x[j + 1] + x[j + 2] * x[j + 2] + x[j + 3] * x[j + 3];
    }
    const float inv = rsqrtf(group_reduce<RT, 0>(ss, red[0][group], group) / HIDDEN + eps);
    float m = 0.0f;
#pragma unroll
    for (int c = 0; c < NC; c++) {
        const int i = c * RT + t;
        float x[8];
        vec8_to_float(as_vec8(rv[c]), x);
        float g[8];
        load_f32<8>(w + 8 * i, g);
#pragma unroll
        for (int j = 0; j < 8; j++) x[j] = x[j] * inv * g[j];
        rv[c] = as_uint4(float_to_vec8(x));  // the output, rounded to 16 bits (the residual is stored already)
        if (out != nullptr) reinterpret_cast<uint4 *>(out + row * HIDDEN)[i] = rv[c];
        if (QUANT_OUT) {
            vec8_to_float(as_vec8(rv[c]), x);
#pragma unroll
            for (int j = 0; j < 8; j++) m = fmaxf(m, fabsf(x[j]));
        }
    }
#if QUANT_OUT
    const float qinv = group_quant_inv<RT>(m, q_scale, row, red[1][group], group, t);
#pragma unroll
    for (int c = 0; c < NC; c++) {
        float x[8];
        vec8_to_float(as_vec8(rv[c]), x);
        reinterpret_cast<uint2 *>(q + row * HIDDEN)[c * RT + t] = fp8x8(x, qinv);
    }
#endif
}
#endif
