// Token sampling and logprobs on the GPU, with the NumPy runner's semantics
// (engine/runner/sampling.py): logit_bias, min_tokens bans, repetition / frequency /
// presence penalties, then greedy, or temperature -> top-k -> min-p -> top-p and an
// inverse-CDF draw in token-id order with the same splitmix64 uniform number.
// Thresholds are found by bisection over the values' bit patterns instead of sorting.
// One block of 1024 threads per row; rows whose parameters say "nothing to do" are cheap.
#include "common.cuh"

#define THREADS 1024

__device__ __forceinline__ unsigned long long splitmix64(unsigned long long x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

// the same 24-bit uniform as engine.runner.sampling.seeded_uniform
__device__ __forceinline__ float seeded_uniform(unsigned long long seed, unsigned long long counter) {
    return (float)(splitmix64(splitmix64(seed) ^ counter) >> 40) * (1.0f / 16777216.0f);
}

// order-preserving map from float to unsigned int
__device__ __forceinline__ unsigned int ord_key(float f) {
    const unsigned int u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float block_sum_f(float v) {
    __shared__ float scratch[32];
    return block_sum(v, scratch);
}

__device__ __forceinline__ float block_max_f(float v) {
    __shared__ float scratch[32];
    return block_max(v, scratch);
}

// (value, index) max with ties to the lower index
__device__ __forceinline__ void argmax_pair(float &v, int &i, float ov, int oi) {
    if (ov > v || (ov == v && oi < i)) {
        v = ov;
        i = oi;
    }
}

__device__ __forceinline__ int block_argmax(float v, int i) {
    __shared__ float sv[32];
    __shared__ int si[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) argmax_pair(v, i, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, i, o));
    __syncthreads();
    if (lane == 0) {
        sv[warp] = v;
        si[warp] = i;
    }
    __syncthreads();
    v = lane < (THREADS >> 5) ? sv[lane] : NEG_INF;
    i = lane < (THREADS >> 5) ? si[lane] : 0x7fffffff;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) argmax_pair(v, i, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, i, o));
    return i;
}

// unnormalised probability exp(s - max) of an allowed token (top-k and min-p), else 0
__device__ __forceinline__ float allowed_q(float x, float inv_t, float mx, unsigned int kth_key, float mp) {
    const float s = x * inv_t;
    if (ord_key(s) < kth_key) return 0.0f;
    const float q = __expf(s - mx);
    return (mp <= 0.0f || q >= mp) ? q : 0.0f;
}

// ... and still kept after top-p
__device__ __forceinline__ float kept_q(float x, float inv_t, float mx, unsigned int kth_key, float mp,
                                        unsigned int p_key) {
    const float q = allowed_q(x, inv_t, mx, kth_key, mp);
    return (q > 0.0f && ord_key(q) >= p_key) ? q : 0.0f;
}

// Logprob of `target` under the raw logits x of one row, its rank, and the top-n (n <= max_top)
// with their logprobs, into the row's outputs; every thread of the block calls it.
__device__ __forceinline__ void row_logprobs(const float *__restrict__ x, int V, int n, int target, int row,
                                             float *__restrict__ out_lp, int *__restrict__ out_rank,
                                             int *__restrict__ top_ids, float *__restrict__ top_lp, int max_top) {
    const int tid = threadIdx.x;
    float mx = NEG_INF;
    for (int v = tid; v < V; v += THREADS) mx = fmaxf(mx, x[v]);
    mx = block_max_f(mx);
    float se = 0.0f;
    for (int v = tid; v < V; v += THREADS) se += __expf(x[v] - mx);
    const float lse = mx + logf(block_sum_f(se));
    const float tv = x[target];
    float above = 0.0f;
    for (int v = tid; v < V; v += THREADS) above += x[v] > tv ? 1.0f : 0.0f;
    above = block_sum_f(above);
    if (tid == 0) {
        out_lp[row] = tv - lse;
        out_rank[row] = (int)above + 1;
    }
    // top-n, best first, lower id first among equal values
    float prev_v = POS_INF;
    int prev_i = -1;
    for (int j = 0; j < n && j < max_top; j++) {
        float bv = NEG_INF;
        int bi = 0x7fffffff;
        for (int v = tid; v < V; v += THREADS) {
            const float xv = x[v];
            if (xv < prev_v || (xv == prev_v && v > prev_i)) argmax_pair(bv, bi, xv, v);
        }
        const int best = block_argmax(bv, bi);
        prev_i = best;
        prev_v = x[best];
        if (tid == 0) {
            top_ids[row * max_top + j] = best;
            top_lp[row * max_top + j] = prev_v - lse;
        }
    }
}

extern "C" __global__ void __launch_bounds__(THREADS) sample_tokens(
    const float *__restrict__ logits,        // (R, V) raw
    float *__restrict__ work,                // (R, V) scratch: processed logits of rows that need it
    int V,
    const float *__restrict__ temperature,   // (R) 0 = greedy
    const int *__restrict__ top_k,           // (R) 0 = all
    const float *__restrict__ top_p,         // (R)
    const float *__restrict__ min_p,         // (R)
    const unsigned long long *__restrict__ seeds,  // (R)
    const int *__restrict__ counters,        // (R) tokens generated so far
    const float *__restrict__ rep_pen, const float *__restrict__ freq_pen, const float *__restrict__ pres_pen,
    const int *__restrict__ pen_slot,        // (R) penalty-state slot, -1 = no penalties
    int *__restrict__ counts,                // (slots, V) tokens generated per slot
    const unsigned int *__restrict__ prompt_mask,  // (slots, (V + 31) / 32) tokens of the prompt
    const int *__restrict__ bias_n, const int *__restrict__ bias_ids, const float *__restrict__ bias_vals,
    int max_bias,
    const int *__restrict__ banned_n, const int *__restrict__ banned_ids, int max_banned,
    int *__restrict__ sampled,               // (R)
    int *__restrict__ host_out,              // null, or pinned host memory the host reads the tokens from:
    const int *__restrict__ out_index,       // (R) where each row's token goes in it
    // null, or per row: how many top logprobs (-1: none) of the sampled token (token_logprobs' outputs)
    const int *__restrict__ lp_n, float *__restrict__ out_lp, int *__restrict__ out_rank,
    int *__restrict__ top_ids, float *__restrict__ top_lp, int max_top) {
    const int row = blockIdx.x, tid = threadIdx.x;
    // the row's parameters are staged inputs (a copy or stage_in, kernels before the LM head):
    // loaded before the wait, so that neither the branches below nor the token's store wait on them
    const int slot = pen_slot[row], nb = bias_n[row], nban = banned_n[row];
    const float temp = temperature[row];
    const int out_at = host_out != nullptr ? out_index[row] : 0, n_lp = lp_n != nullptr ? lp_n[row] : -1;
    PDL_ENTER();
    const float *raw = logits + (long long)row * V;
    float *w = work + (long long)row * V;
    const float *src = raw;
    if (slot >= 0 || nb > 0 || nban > 0) {
        for (int v = tid; v < V; v += THREADS) w[v] = raw[v];
        __syncthreads();
        for (int j = tid; j < nb; j += THREADS) w[bias_ids[row * max_bias + j]] += bias_vals[row * max_bias + j];
        __syncthreads();
        for (int j = tid; j < nban; j += THREADS) w[banned_ids[row * max_banned + j]] = NEG_INF;
        __syncthreads();
        if (slot >= 0) {
            const float rep = rep_pen[row], freq = freq_pen[row], pres = pres_pen[row];
            const int *cnt = counts + (long long)slot * V;
            const unsigned int *mask = prompt_mask + (long long)slot * ((V + 31) / 32);
            for (int v = tid; v < V; v += THREADS) {
                const int c = cnt[v];
                float x = w[v];
                if (rep != 1.0f && (c > 0 || ((mask[v >> 5] >> (v & 31)) & 1u))) x = x > 0.0f ? x / rep : x * rep;
                if (c > 0) x -= freq * c + pres;
                w[v] = x;
            }
            __syncthreads();
        }
        src = w;
    }

    int token;
    if (temp == 0.0f) {
        float bv = NEG_INF;
        int bi = 0x7fffffff;
        for (int v = tid; v < V; v += THREADS) argmax_pair(bv, bi, src[v], v);
        token = block_argmax(bv, bi);
    } else {
        const float inv_t = 1.0f / temp;
        float mx = NEG_INF;
        for (int v = tid; v < V; v += THREADS) mx = fmaxf(mx, src[v] * inv_t);
        mx = block_max_f(mx);
        // top-k: the largest key K with count(key >= K) >= k
        unsigned int kth_key = 0;
        const int k = top_k[row];
        if (k > 0 && k < V) {
            unsigned long long lo = 0, hi = 0x100000000ull;
            while (hi - lo > 1) {
                const unsigned long long mid = (lo + hi) >> 1;
                float c = 0.0f;
                for (int v = tid; v < V; v += THREADS) c += ord_key(src[v] * inv_t) >= mid ? 1.0f : 0.0f;
                if (block_sum_f(c) >= (float)k) lo = mid; else hi = mid;
            }
            kth_key = (unsigned int)lo;
        }
        // unnormalised probabilities q = exp(s - max) of the allowed tokens (the max has q = 1)
        const float mp = min_p[row];
        float total = 0.0f;
        for (int v = tid; v < V; v += THREADS) total += allowed_q(src[v], inv_t, mx, kth_key, mp);
        total = block_sum_f(total);
        // top-p: the largest key K whose tokens (q >= K) hold at least top_p of the mass
        unsigned int p_key = 0;
        const float tp = top_p[row];
        if (tp < 1.0f) {
            const float target = tp * total * (1.0f - 1e-6f);
            unsigned long long lo = 0, hi = 0x100000000ull;
            while (hi - lo > 1) {
                const unsigned long long mid = (lo + hi) >> 1;
                float m = 0.0f;
                for (int v = tid; v < V; v += THREADS) {
                    const float q = allowed_q(src[v], inv_t, mx, kth_key, mp);
                    m += (q > 0.0f && ord_key(q) >= mid) ? q : 0.0f;
                }
                if (block_sum_f(m) >= target) lo = mid; else hi = mid;
            }
            p_key = (unsigned int)lo;
            total = 0.0f;
            for (int v = tid; v < V; v += THREADS) total += kept_q(src[v], inv_t, mx, kth_key, mp, p_key);
            total = block_sum_f(total);
        }
        // inverse CDF in token-id order: each thread owns a contiguous run of ids
        const float target = seeded_uniform(seeds[row], (unsigned long long)counters[row]) * total;
        const int per = (V + THREADS - 1) / THREADS;
        const int v0 = tid * per, v1 = min(V, v0 + per);
        float local = 0.0f;
        int last_kept = -1;
        for (int v = v0; v < v1; v++) {
            const float q = kept_q(src[v], inv_t, mx, kth_key, mp, p_key);
            local += q;
            if (q > 0.0f) last_kept = v;
        }
        // exclusive prefix over threads
        __shared__ float warp_tot[32];
        __shared__ int chosen;
        const int lane = tid & 31, warp = tid >> 5;
        float incl = local;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const float y = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += y;
        }
        if (lane == 31) warp_tot[warp] = incl;
        if (tid == 0) chosen = -1;
        __syncthreads();
        float before = 0.0f;
        for (int j = 0; j < warp; j++) before += warp_tot[j];
        const float prefix = before + incl - local;
        if (local > 0.0f && prefix <= target && target < prefix + local) {
            float acc = prefix;
            int pick = last_kept;
            for (int v = v0; v < v1; v++) {
                const float q = kept_q(src[v], inv_t, mx, kth_key, mp, p_key);
                acc += q;
                if (acc > target && q > 0.0f) {
                    pick = v;
                    break;
                }
            }
            chosen = pick;  // exactly one thread's range holds the target
        }
        __syncthreads();
        token = chosen;
        if (token < 0) {  // rounding put the target past the end: take the last kept token
            float bv = (float)last_kept;
            bv = block_max_f(bv);
            token = (int)bv;
        }
    }
    if (tid == 0) {
        sampled[row] = token;
        if (host_out != nullptr) host_out[out_at] = token;  // visible to the host once the step is done
        if (slot >= 0) counts[(long long)slot * V + token] += 1;
    }
    if (n_lp >= 0) {  // in this kernel: a decode step ends one launch sooner
        __syncthreads();
        row_logprobs(raw, V, n_lp, token, row, out_lp, out_rank, top_ids, top_lp, max_top);
    }
}

// Logprob of target_ids[row] under the raw distribution, its rank, and the top-n (prompt
// logprobs; sample_tokens does the same for the tokens it samples). grid (R), block 1024; rows
// with lp_n < 0 return at once.
extern "C" __global__ void __launch_bounds__(THREADS) token_logprobs(
    const float *__restrict__ logits, int V, const int *__restrict__ lp_n, const int *__restrict__ target_ids,
    float *__restrict__ out_lp, int *__restrict__ out_rank, int *__restrict__ top_ids,
    float *__restrict__ top_lp, int max_top) {
    PDL_ENTER();
    const int row = blockIdx.x;
    const int n = lp_n[row];
    if (n < 0) return;
    row_logprobs(logits + (long long)row * V, V, n, target_ids[row], row, out_lp, out_rank, top_ids, top_lp, max_top);
}
