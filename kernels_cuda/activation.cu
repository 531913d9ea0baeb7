// SiLU(gate) * up over the fused gate/up product.
#include "common.cuh"

// gate_up (T, 2 * inter) float32 [gate | up] -> out (T, inter) 16-bit
extern "C" __global__ void silu_mul(const float *__restrict__ gate_up, scalar_t *__restrict__ out, int inter) {
    PDL_ENTER();
    const long long t = blockIdx.x;
    const float *g = gate_up + t * 2 * inter;
    const float *u = g + inter;
    for (int i = threadIdx.x; i < inter; i += blockDim.x) {
        const float x = g[i];
        out[t * inter + i] = from_float(x * (0.5f * (1.0f + tanhf(0.5f * x))) * u[i]);  // sigmoid via tanh
    }
}
