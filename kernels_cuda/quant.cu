// Rows of a 16-bit matrix -> float8 e4m3 with one float32 scale a row (--quantization fp8):
// q = x / scale, scale = max |x| / 448, so each row uses e4m3's whole range. The same kernel
// quantizes the weights once at load (a scale per output feature) and the activations of
// every large step before the fp8 matrix product (a scale per token).
// One block per row; K a multiple of 8.
#include "common.cuh"

extern "C" __global__ void quantize_rows(const scalar_t *__restrict__ x, unsigned char *__restrict__ q,
                                         float *__restrict__ scale, int K) {
    __shared__ float scratch[32];
    PDL_ENTER();
    const long long row = blockIdx.x;
    quantize_row(x + row * K, q + row * K, scale + row, K, scratch);
}
