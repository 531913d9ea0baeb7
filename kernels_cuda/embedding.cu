// Embedding gather: the residual stream starts as float32 rows of the table.
#include "common.cuh"

// out (T, hidden) float32 <- table[ids[t]] ; grid (T), block (any)
extern "C" __global__ void embedding(const int *__restrict__ ids, const scalar_t *__restrict__ table,
                                     float *__restrict__ out, int hidden) {
    PDL_ENTER();
    const long long t = blockIdx.x;
    const scalar_t *row = table + (long long)ids[t] * hidden;
    float *o = out + t * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) o[i] = to_float(row[i]);
}
