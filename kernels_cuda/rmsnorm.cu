// RMSNorm, and the fused residual add + RMSNorm of the decoder layers.
// One block per row; the residual stream is float32 (or 16-bit: -DRES16), the normed output
// 16-bit (it feeds a matrix product), the norm weights float32.
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
