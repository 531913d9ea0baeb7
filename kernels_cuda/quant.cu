// Rows of a 16-bit matrix -> float8 e4m3 with one float32 scale a row (--quantization fp8):
// q = x / scale, scale = max |x| / 448, so each row uses e4m3's whole range. The same kernel
// quantizes the weights once at load (a scale per output feature) and the activations of
// every large step before the fp8 matrix product (a scale per token).
// One block per row; K a multiple of 8. quantize_rows_group (-DQ_ROW_THREADS): a group of threads
// per row, for steps of many rows (quant.py).
#include "common.cuh"

extern "C" __global__ void quantize_rows(const scalar_t *__restrict__ x, unsigned char *__restrict__ q,
                                         float *__restrict__ scale, int K) {
    __shared__ float scratch[32];
    PDL_ENTER();
    const long long row = blockIdx.x;
    quantize_row(x + row * K, q + row * K, scale + row, K, scratch);
}

// -DQ_ROW_THREADS (32, 64 or 128; 0: not built), -DQ_K (the rows' length, a multiple of 8 x
// Q_ROW_THREADS): a group of Q_ROW_THREADS threads takes a row, ROW_GROUP_BLOCK / Q_ROW_THREADS rows a block,
// its max through group_reduce (no block-wide barrier), each thread's 8-value chunks in registers
// from one load each. A max is exact in any order: quantize_row's codes and scale, bit for bit.
#ifndef Q_ROW_THREADS
#define Q_ROW_THREADS 0
#endif
#if Q_ROW_THREADS
#ifndef Q_K
#error "quantize_rows_group needs -DQ_K"
#endif
constexpr int QG = Q_ROW_THREADS, QNC = Q_K / (8 * QG);
static_assert(QG == 32 || QG == 64 || QG == 128, "Q_ROW_THREADS: 32, 64 or 128");
static_assert(Q_K % (8 * QG) == 0, "Q_K: a multiple of 8 x Q_ROW_THREADS");

extern "C" __global__ void __launch_bounds__(ROW_GROUP_BLOCK) quantize_rows_group(const scalar_t *__restrict__ x,
                                                                      unsigned char *__restrict__ q,
                                                                      float *__restrict__ scale, int rows) {
    __shared__ float red[ROW_GROUP_BLOCK / QG][QG / 32];
    PDL_ENTER();
    const int group = threadIdx.x / QG, t = threadIdx.x % QG;
    const long long row = (long long)blockIdx.x * (ROW_GROUP_BLOCK / QG) + group;
    if (row >= rows) return;  // the whole group: its barrier is its own
    const vec8 *xr = reinterpret_cast<const vec8 *>(x + row * Q_K);
    vec8 v[QNC];
#pragma unroll
    for (int c = 0; c < QNC; c++) v[c] = xr[c * QG + t];
    float m = 0.0f;
#pragma unroll
    for (int c = 0; c < QNC; c++) {
        float f[8];
        vec8_to_float(v[c], f);
#pragma unroll
        for (int j = 0; j < 8; j++) m = fmaxf(m, fabsf(f[j]));
    }
    const float inv = group_quant_inv<QG>(m, scale, row, red[group], group, t);
    uint2 *qr = reinterpret_cast<uint2 *>(q + row * Q_K);
#pragma unroll
    for (int c = 0; c < QNC; c++) {
        float f[8];
        vec8_to_float(v[c], f);
        qr[c * QG + t] = fp8x8(f, inv);
    }
}
#endif
