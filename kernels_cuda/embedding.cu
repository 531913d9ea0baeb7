// Embedding gather: the residual stream starts as float32 rows of the table (-DRES16=1: as the
// table's own 16-bit rows, common.cuh's res_t).
#include "common.cuh"

// out (T, hidden) res_t <- table[token t]; grid (T), block (any). Token t is ids[t], or, where
// src is given and src[t] >= 0, sampled[src[t]]: a token the step before sampled, still on the
// device (a step launched ahead of the host's update reads its inputs from there).
extern "C" __global__ void embedding(const int *__restrict__ ids, const int *__restrict__ src,
                                     const int *__restrict__ sampled, const scalar_t *__restrict__ table,
                                     res_t *__restrict__ out, int hidden) {
    PDL_ENTER();
    const long long t = blockIdx.x;
    int id = ids[t];
    if (src != nullptr && src[t] >= 0) id = sampled[src[t]];
    const scalar_t *row = table + (long long)id * hidden;
    res_t *o = out + t * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) o[i] = res_from_float(to_float(row[i]));
}

// dst <- src, n16 16-byte words: a decode step's staged inputs read from mapped host memory by the
// first kernel of its graph, instead of a copy queued before the graph (the copy engine's round
// trip between two graphs cost ~10 us a step: H200, SmolLM2 at one row, 0.377 -> 0.387 ms). It
// signals no early launch: the next kernel starts once every word is in place.
extern "C" __global__ void stage_in(const uint4 *__restrict__ src, uint4 *__restrict__ dst, int n16) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n16; i += gridDim.x * blockDim.x) dst[i] = src[i];
    __threadfence();
}
