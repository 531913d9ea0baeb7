// RMSNorm, and the fused residual add + RMSNorm of the decoder layers.
// One block per row; the residual stream is float32, the normed output 16-bit
// (it feeds a matrix product), the norm weights float32.
//
// The row work is common.cuh's norm_row (the skinny GEMM's add-norm epilogue runs it too).
#include "common.cuh"

// out = x / sqrt(mean(x^2) + eps) * w
extern "C" __global__ void rms_norm(const float *__restrict__ x, const float *__restrict__ w,
                                    scalar_t *__restrict__ out, int hidden, float eps) {
    PDL_ENTER();
    const long long row = blockIdx.x;
    norm_row(const_cast<float *>(x) + row * hidden, nullptr, nullptr, w, out + row * hidden, hidden, eps);
}

// residual += delta (+ bias); out = rms_norm(residual) * w.  bias may be null.
extern "C" __global__ void add_rms_norm(float *__restrict__ residual, const float *__restrict__ delta,
                                        const float *__restrict__ bias, const float *__restrict__ w,
                                        scalar_t *__restrict__ out, int hidden, float eps) {
    PDL_ENTER();
    const long long row = blockIdx.x;
    norm_row(residual + row * hidden, delta + row * hidden, bias, w, out + row * hidden, hidden, eps);
}
