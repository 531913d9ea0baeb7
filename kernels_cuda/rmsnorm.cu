// RMSNorm, and the fused residual add + RMSNorm of the decoder layers.
// One block per row; the residual stream is float32, the normed output 16-bit
// (it feeds a matrix product), the norm weights float32.
#include "common.cuh"

// out = x / sqrt(mean(x^2) + eps) * w
extern "C" __global__ void rms_norm(const float *__restrict__ x, const float *__restrict__ w,
                                    scalar_t *__restrict__ out, int hidden, float eps) {
    PDL_ENTER();
    __shared__ float scratch[32];
    const long long row = blockIdx.x;
    const float *xr = x + row * hidden;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) ss += xr[i] * xr[i];
    const float inv = rsqrtf(block_sum(ss, scratch) / hidden + eps);
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) out[row * hidden + i] = from_float(xr[i] * inv * w[i]);
}

// residual += delta (+ bias); out = rms_norm(residual) * w.  bias may be null.
extern "C" __global__ void add_rms_norm(float *__restrict__ residual, const float *__restrict__ delta,
                                        const float *__restrict__ bias, const float *__restrict__ w,
                                        scalar_t *__restrict__ out, int hidden, float eps) {
    PDL_ENTER();
    __shared__ float scratch[32];
    const long long row = blockIdx.x;
    float *r = residual + row * hidden;
    const float *d = delta + row * hidden;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        float v = r[i] + d[i] + (bias != nullptr ? bias[i] : 0.0f);
        r[i] = v;
        ss += v * v;
    }
    const float inv = rsqrtf(block_sum(ss, scratch) / hidden + eps);
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) out[row * hidden + i] = from_float(r[i] * inv * w[i]);
}
