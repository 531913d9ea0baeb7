// Embedding gather: the residual stream starts as float32 rows of the table (-DRES16=1: as the
// table's own 16-bit rows, common.cuh's res_t).
#include "common.cuh"

// out (T, hidden) res_t <- table[token t]; grid (T), block (any). Token t is ids[t], or, where
// src is given and src[t] >= 0, sampled[src[t]]: a token the step before sampled, still on the
// device (a step launched ahead of the host's update reads its inputs from there).
// The row is gathered before the wait for the previous kernel (PDL), up to HELD values a thread,
// and only its store waits: nothing in the step writes what the gather reads. ids and src are
// a copy queued before the step (a kernel after a copy starts once it is done), or the host side
// itself (mapped memory, which the host leaves alone while the step runs: a decode graph, whose
// stage_in before this kernel lets it start at once), sampled is the step before's (its graph or
// kernels done before this step's first kernel starts), the table is a weight.
#define HELD 8
extern "C" __global__ void embedding(const int *__restrict__ ids, const int *__restrict__ src,
                                     const int *__restrict__ sampled, const scalar_t *__restrict__ table,
                                     res_t *__restrict__ out, int hidden) {
    const long long t = blockIdx.x;
    int id = ids[t];
    if (src != nullptr && src[t] >= 0) id = sampled[src[t]];
    const scalar_t *row = table + (long long)id * hidden;
    res_t v[HELD];
#pragma unroll
    for (int j = 0; j < HELD; j++) {
        const int i = threadIdx.x + j * blockDim.x;
        if (i < hidden) v[j] = res_from_float(to_float(row[i]));
    }
    PDL_ENTER_LATE();  // the next kernel may read stage_in's words before its wait
    res_t *o = out + t * hidden;
#pragma unroll
    for (int j = 0; j < HELD; j++) {
        const int i = threadIdx.x + j * blockDim.x;
        if (i < hidden) o[i] = v[j];
    }
    for (int i = threadIdx.x + HELD * blockDim.x; i < hidden; i += blockDim.x) o[i] = res_from_float(to_float(row[i]));
}

// dst <- src, n16 16-byte words: a decode step's staged inputs read from mapped host memory by the
// first kernel of its graph, instead of a copy queued before the graph (the copy engine's round
// trip between two graphs cost ~10 us a step: H200, SmolLM2 at one row, 0.377 -> 0.387 ms). It
// lets the next kernel (the embedding, which reads nothing of dst) launch at once, so that the
// kernel after that one still starts once every word is in place (H200, SmolLM2's B=1 decode
// graph at 40 / 160 keys: 323.1 / 338.4 -> 322.2 / 337.8 us).
extern "C" __global__ void stage_in(const uint4 *__restrict__ src, uint4 *__restrict__ dst, int n16) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n16; i += gridDim.x * blockDim.x) dst[i] = src[i];
    __threadfence();
}
