// SiLU(gate) * up over the fused gate/up product (steps the skinny GEMM does not fuse).
#include "common.cuh"

// gate_up (T, 2 * inter) [gate | up] (-DPROD: float32 or 16 bits, common.cuh) -> out (T,
// inter) 16-bit; rs, cs: the float8 product's scales (common.cuh's dequant), or null.
// -DQUANT_OUT=1: out also as e4m3 codes q (T, inter) and a scale per row (common.cuh's
// quantize_out), for the float8 product it feeds; else q and q_scale are unused.
extern "C" __global__ void silu_mul(const prod_t *__restrict__ gate_up, scalar_t *__restrict__ out, int inter,
                                    const float *__restrict__ rs, const float *__restrict__ cs,
                                    unsigned char *__restrict__ q, float *__restrict__ q_scale) {
    PDL_ENTER();
    const long long t = blockIdx.x;
    const prod_t *g = gate_up + t * 2 * inter;
    const prod_t *u = g + inter;
    for (int i = threadIdx.x; i < inter; i += blockDim.x)
        out[t * inter + i] = from_float(silu_times(dequant(g[i], rs, cs, t, i), dequant(u[i], rs, cs, t, inter + i)));
    quantize_out(out + t * inter, q, q_scale, t, inter);
}
