// SiLU(gate) * up over the fused gate/up product (steps the skinny GEMM does not fuse).
#include "common.cuh"

// -DSILU_VEC: 8-value groups of the row a thread takes (activation.py picks it with the block
// size); it keeps them in registers, as 16-bit pairs, for the e4m3 copy. A row longer than
// SILU_VEC * 8 * blockDim.x (or of a length not a multiple of 8) goes through the plain loop
// for the rest.
#ifndef SILU_VEC
#define SILU_VEC 2
#endif

// gate_up (T, 2 * inter) [gate | up] (-DPROD: float32 or 16 bits, common.cuh) -> out (T,
// inter) 16-bit; rs, cs: the float8 product's scales (common.cuh's dequant), or null.
// -DQUANT_OUT=1: out also as e4m3 codes q (T, inter) and a scale per row (common.cuh), for
// the float8 product it feeds (out may then be null: the codes only); else q and q_scale
// are unused. One block per row; a thread
// takes 8 values at a time (16- or 32-byte loads), all of its groups' loads at once.
// -DSILU_MIN_BLOCKS=n (with -DSILU_BLOCK, the launch's threads): registers capped so that n
// blocks fit an SM; 0 (default): no cap
#ifndef SILU_MIN_BLOCKS
#define SILU_MIN_BLOCKS 0
#endif
#if SILU_MIN_BLOCKS
#define SILU_BOUNDS __launch_bounds__(SILU_BLOCK, SILU_MIN_BLOCKS)
#else
#define SILU_BOUNDS
#endif

// The 8-value groups i = threadIdx.x + v * blockDim.x < n8 of row t that a thread takes, read
// from g / u (global or shared memory): SiLU(gate) * up rounded to 16 bits into held (and to o[i]
// where o is not null). Returns the thread's largest |value|.
__device__ __forceinline__ float silu_groups(const prod_t *g, const prod_t *u, int inter, int n8, const float *rs,
                                             const float *cs, long long t, vec8 held[SILU_VEC], scalar_t *o) {
    float m = 0.0f;
#pragma unroll
    for (int v = 0; v < SILU_VEC; v++) {
        const int i = threadIdx.x + v * blockDim.x;
        if (i >= n8) break;
        float gf[8], uf[8];
        load_prod<8>(g + 8 * i, gf);
        load_prod<8>(u + 8 * i, uf);
        dequant_n<8>(gf, rs, cs, t, 8 * i);
        dequant_n<8>(uf, rs, cs, t, inter + 8 * i);
#pragma unroll
        for (int j = 0; j < 4; j++) {
            held[v].v[j] = from_float2(silu_times(gf[2 * j], uf[2 * j]), silu_times(gf[2 * j + 1], uf[2 * j + 1]));
            const float2 back = to_float2(held[v].v[j]);
            m = fmaxf(m, fmaxf(fabsf(back.x), fabsf(back.y)));
        }
        if (o != nullptr) reinterpret_cast<vec8 *>(o)[i] = held[v];
    }
    return m;
}

// held (silu_groups') as e4m3 codes of scale 1 / inv into the row's codes qr
__device__ __forceinline__ void silu_codes(const vec8 held[SILU_VEC], int n8, float inv, unsigned char *qr) {
#pragma unroll
    for (int v = 0; v < SILU_VEC; v++) {
        const int i = threadIdx.x + v * blockDim.x;
        if (i >= n8) break;
        float f[8];
        vec8_to_float(held[v], f);
        reinterpret_cast<uint2 *>(qr)[i] = fp8x8(f, inv);
    }
}

extern "C" __global__ void SILU_BOUNDS silu_mul(const prod_t *__restrict__ gate_up, scalar_t *__restrict__ out,
                                                int inter, const float *__restrict__ rs, const float *__restrict__ cs,
                                                unsigned char *__restrict__ q, float *__restrict__ q_scale) {
    PDL_ENTER();
    const long long t = blockIdx.x;
    const prod_t *g = gate_up + t * 2 * inter;
    const prod_t *u = g + inter;
    scalar_t *o = out != nullptr ? out + t * inter : nullptr;
    const int n8 = inter % 8 == 0 ? min(inter / 8, SILU_VEC * (int)blockDim.x) : 0;
    auto tail = [&](int i) {  // one value past the 8-value groups
        return from_float(silu_times(dequant(g[i], rs, cs, t, i), dequant(u[i], rs, cs, t, inter + i)));
    };
    vec8 held[SILU_VEC];
    float m = silu_groups(g, u, inter, n8, rs, cs, t, held, o);  // largest |output| (as rounded to 16 bits)
    for (int i = 8 * n8 + threadIdx.x; i < inter; i += blockDim.x) {
        const scalar_t v = tail(i);
        if (o != nullptr) o[i] = v;
        m = fmaxf(m, fabsf(to_float(v)));
    }
#if QUANT_OUT
    __shared__ float scratch[32];
    const float inv = quant_inv(m, q_scale + t, scratch);
    unsigned char *qr = q + t * inter;
    silu_codes(held, n8, inv, qr);
    for (int i = 8 * n8 + threadIdx.x; i < inter; i += blockDim.x)  // the value above, again
        qr[i] = fp8_from_float(to_float(tail(i)) * inv);
#endif
}

// -DSILU_STAGES=n: silu_mul_bulk, for many rows of a 16-bit product (sm_90): a block per SM
// (or a few) takes rows t = blockIdx.x, + gridDim.x, ... Each row [gate | up] comes into shared
// memory as one bulk copy on an mbarrier, n rows ahead, so the next rows' bytes are in flight
// while the block works out this one: the one-block-a-row kernel stops loading while its block
// reduces and writes. Same arguments as silu_mul and rows; the same bits. Every group of a row
// in a thread's registers (inter a multiple of 8, inter / 8 <= SILU_VEC * blockDim.x: the
// Python side checks); dynamic shared memory n * 2 * inter * sizeof(prod_t).
#ifdef SILU_STAGES
#include "cluster.cuh"
extern "C" __global__ void SILU_BOUNDS silu_mul_bulk(const prod_t *__restrict__ gate_up, scalar_t *__restrict__ out,
                                                     int inter, const float *__restrict__ rs,
                                                     const float *__restrict__ cs, unsigned char *__restrict__ q,
                                                     float *__restrict__ q_scale, int rows) {
    extern __shared__ __align__(128) unsigned char rows_in[];
    __shared__ unsigned long long full[SILU_STAGES];
    const unsigned row_bytes = 2u * inter * sizeof(prod_t);
    const int n8 = inter / 8;
    if (threadIdx.x == 0) {
        for (int s = 0; s < SILU_STAGES; s++) mbar_init(&full[s]);
    }
    __syncthreads();
    PDL_ENTER();
    auto fetch = [&](long long t, int s) {  // thread 0: row t into stage s
        if (t < rows) {
            mbar_expect(&full[s], row_bytes);
            bulk_copy(rows_in + s * row_bytes, gate_up + t * 2 * inter, row_bytes, &full[s]);
        }
    };
    if (threadIdx.x == 0) {
        for (int s = 0; s < SILU_STAGES; s++) fetch(blockIdx.x + (long long)s * gridDim.x, s);
    }
    int k = 0;
    for (long long t = blockIdx.x; t < rows; t += gridDim.x, k++) {
        const int s = k % SILU_STAGES;
        mbar_wait(&full[s], (k / SILU_STAGES) & 1);
        const prod_t *g = reinterpret_cast<const prod_t *>(rows_in + s * row_bytes);
        vec8 held[SILU_VEC];
        const float m = silu_groups(g, g + inter, inter, n8, rs, cs, t, held, out != nullptr ? out + t * inter : nullptr);
#if QUANT_OUT
        __shared__ float scratch[32];
        // block_max's barriers: every thread is past its reads of stage s before thread 0 refills it
        const float inv = quant_inv(m, q_scale + t, scratch);
        if (threadIdx.x == 0) fetch(t + (long long)SILU_STAGES * gridDim.x, s);
        silu_codes(held, n8, inv, q + t * inter);
#else
        (void)m;
        __syncthreads();  // every thread is past its reads of stage s
        if (threadIdx.x == 0) fetch(t + (long long)SILU_STAGES * gridDim.x, s);
#endif
    }
}
#endif
