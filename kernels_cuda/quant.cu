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
    const vec8 *xr = reinterpret_cast<const vec8 *>(x + row * K);
    uint2 *qr = reinterpret_cast<uint2 *>(q + row * K);
    const int n8 = K / 8;
    float m = 0.0f;
    for (int i = threadIdx.x; i < n8; i += blockDim.x) {
        float f[8];
        vec8_to_float(xr[i], f);
#pragma unroll
        for (int j = 0; j < 8; j++) m = fmaxf(m, fabsf(f[j]));
    }
    m = block_max(m, scratch);
    const float inv = m > 0.0f ? FP8_MAX / m : 1.0f;
    if (threadIdx.x == 0) scale[row] = m > 0.0f ? m / FP8_MAX : 1.0f;
    for (int i = threadIdx.x; i < n8; i += blockDim.x) {
        float f[8];
        vec8_to_float(xr[i], f);
        unsigned w[4];
#pragma unroll
        for (int j = 0; j < 4; j++) w[j] = fp8x2_from_floats(f[2 * j] * inv, f[2 * j + 1] * inv);
        qr[i] = make_uint2(w[0] | (w[1] << 16), w[2] | (w[3] << 16));
    }
}
