// Token sampling and logprobs on the GPU, with the NumPy runner's semantics
// (engine/runner/sampling.py): logit_bias, min_tokens bans, repetition / frequency /
// presence penalties, then greedy, or temperature -> top-k -> min-p -> top-p and an
// inverse-CDF draw in token-id order with the same splitmix64 uniform number.
// Thresholds come from the few tokens that can pass them, gathered into shared memory
// (sample_few), or, where those are many, by bisection over the values' bit patterns
// (sample_bisect); a row with a temperature alone draws in two levels (sample_all).
// One block of 1024 threads per row; rows whose parameters say "nothing to do" are cheap, and
// a plain greedy row given the LM head's greedy keys (gemv.cu's gemv_keys) reads those alone.
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

__device__ __forceinline__ float block_sum_f(float v) {
    __shared__ float scratch[32];
    return block_sum(v, scratch);
}

__device__ __forceinline__ float block_max_f(float v) {
    __shared__ float scratch[32];
    return block_max(v, scratch);
}

__device__ __forceinline__ unsigned long long block_max_u64(unsigned long long v) {
    __shared__ unsigned long long sv[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (lane == 0) sv[warp] = v;
    __syncthreads();
    v = lane < (THREADS >> 5) ? sv[lane] : 0ull;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
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

// A sampled row's token by bisection over the whole row: top-k's and top-p's thresholds in 32
// passes each, then the draw with each thread's contiguous run of ids. Rows with no filter (a
// temperature alone), and rows whose filters keep too many tokens for sample_few.
__device__ __noinline__ int sample_bisect(const float *__restrict__ src, int V, float inv_t, float mx, int k,
                                          float tp, float mp, float u) {
    const int tid = threadIdx.x;
    // top-k: the largest key K with count(key >= K) >= k
    unsigned int kth_key = 0;
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
    float total = 0.0f;
    for (int v = tid; v < V; v += THREADS) total += allowed_q(src[v], inv_t, mx, kth_key, mp);
    total = block_sum_f(total);
    // top-p: the largest key K whose tokens (q >= K) hold at least top_p of the mass
    unsigned int p_key = 0;
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
    const float target = u * total;
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
    if (chosen >= 0) return chosen;
    return (int)block_max_f((float)last_kept);  // rounding put the target past the end: the last kept token
}

// ---- sample_few: rows whose filters keep few tokens ----
// Top-k, min-p and top-p each keep the tokens at or above a threshold. Two passes over the row
// find them: the first counts the tokens in bins of d = max - s (1/16 nat wide, 64 nats deep),
// which bounds the last bin a kept token can lie in; the second gathers the tokens up to that
// bin, in id order, into shared memory. The thresholds (each from the few candidates of the bins
// it can lie in, a warp a candidate summing over the others) and the draw (in id order, as
// sample_bisect's) then read shared memory only. A nucleus of more tokens than that holds
// gathers only the bins its threshold can lie in, and is drawn over the row (sample_all). Every
// sum is over threads in a fixed order, so a row's token depends on its logits alone.
#define WARPS (THREADS / 32)
#define FEW_BINS 1024  // == THREADS: a bin a thread where the bins are scanned
#define BINS_PER_NAT 16.0f
#define FEW_CAP 4096   // candidates at most (sampling.FEW_CAP)
#define FEW_LOADS 8    // loads in flight a lane in the passes over the row
// dynamic shared memory: each warp's bin counts (16-bit, two a word), which the candidates
// (their scaled logits, ids, keys and q) replace; then the bins' prefixes (count, mass bounds),
// and the candidates a threshold can be
#define WHIST_WORDS (WARPS * FEW_BINS / 2)
#define FEW_SMEM (WHIST_WORDS * 4 + FEW_BINS * 12 + FEW_CAP * 2)  // sampling.FEW_SMEM
static_assert(FEW_BINS == THREADS, "a bin a thread");
static_assert(FEW_CAP * 16 <= WHIST_WORDS * 4, "the candidates take the counts' place");

// s, q and the bin of a logit, rounded the same in both passes (no contraction across them)
__device__ __forceinline__ float scaled(float x, float inv_t) { return __fmul_rn(x, inv_t); }
__device__ __forceinline__ float q_of(float s, float mx) { return __expf(__fsub_rn(s, mx)); }
__device__ __forceinline__ int bin_of_d(float d) {  // d = max - s; NaN and +inf fall past the last bin
    return d < (float)FEW_BINS / BINS_PER_NAT ? (int)__fmul_rn(d, BINS_PER_NAT) : FEW_BINS;
}
__device__ __forceinline__ int bin_of(float s, float mx) { return bin_of_d(__fsub_rn(mx, s)); }

// f(x, v, in) for each id v of a warp's run [v_begin, v_end), 32 consecutive ids a step (lane l
// takes v0 + l), FEW_LOADS loads in flight; in: v < v_end, a constant true but in the last group
// (every lane calls f, as ballots need).
template <typename F>
__device__ __forceinline__ void for_run(const float *__restrict__ src, int v_begin, int v_end, F f) {
    const int lane = threadIdx.x & 31;
    int v0 = v_begin;
    for (; v0 + 32 * FEW_LOADS <= v_end; v0 += 32 * FEW_LOADS) {
        float x[FEW_LOADS];
#pragma unroll
        for (int j = 0; j < FEW_LOADS; j++) x[j] = src[v0 + j * 32 + lane];
#pragma unroll
        for (int j = 0; j < FEW_LOADS; j++) f(x[j], v0 + j * 32 + lane, true);
    }
    if (v0 < v_end) {
        float x[FEW_LOADS];
#pragma unroll
        for (int j = 0; j < FEW_LOADS; j++) x[j] = v0 + j * 32 + lane < v_end ? src[v0 + j * 32 + lane] : 0.0f;
#pragma unroll
        for (int j = 0; j < FEW_LOADS; j++) f(x[j], v0 + j * 32 + lane, v0 + j * 32 + lane < v_end);
    }
}

// sample_few's first pass over a warp's run: the allowed tokens (q >= q_min; NaN never) counted
// into the warp's bins h, their count and (with Q: min-p or top-p) their mass
template <bool Q>
__device__ __forceinline__ void count_run(const float *__restrict__ src, int v_begin, int v_end, float inv_t,
                                          float mx, float q_min, unsigned int *h, float &mass,
                                          unsigned int &allowed) {
    for_run(src, v_begin, v_end, [&](float x, int, bool in) {
        const float d = __fsub_rn(mx, scaled(x, inv_t));
        const float q = Q ? __expf(-d) : 0.0f;  // q_of's bits: s - max is -(max - s)
        if (in && (Q ? q >= q_min : d == d)) {
            if (Q) mass += q;
            allowed++;
            const int b = bin_of_d(d);
            if (b < FEW_BINS) atomicAdd(h + (b >> 1), 1u << ((b & 1) << 4));
        }
    });
}

// sample_few's second pass: the allowed tokens with d_lo <= d < d_end (bins b_lo .. bc), in id
// order, from cand[pos]; with Q (min-p, or bins from b_lo > 0), q too, and the mass of the allowed
// tokens with d < d_lo summed into `before`
template <bool Q>
__device__ __forceinline__ void gather_run(const float *__restrict__ src, int v_begin, int v_end, float inv_t,
                                           float mx, float q_min, float d_lo, float d_end, int pos, float *cand_s,
                                           int *cand_id, float &before) {
    const unsigned int below = (1u << (threadIdx.x & 31)) - 1u;
    for_run(src, v_begin, v_end, [&](float x, int v, bool in) {
        const float s = scaled(x, inv_t), d = __fsub_rn(mx, s);
        const float q = Q ? __expf(-d) : 0.0f;  // q_of's bits
        const bool ok = in && (!Q || q >= q_min);
        if (Q && ok && d < d_lo) before += q;
        const bool take = ok && d >= d_lo && d < d_end;
        const unsigned int ballot = __ballot_sync(0xffffffffu, take);
        if (ballot != 0u) {
            const int at = pos + __popc(ballot & below);
            if (take && at < FEW_CAP) {
                cand_s[at] = s;
                cand_id[at] = v;
            }
            pos += __popc(ballot);
        }
    });
}

// Prefixes over the block's threads in thread order, of N values a thread at once: thread t gets
// lo = the sum over threads before it and hi = lo's value for thread t + 1 (the same rounding),
// and the total. So the threads' ranges [lo, hi) tile [0, total) with no gap or overlap,
// whatever the rounding. wtot: N * (WARPS + 1) floats.
template <int N>
__device__ __forceinline__ void block_ranges_n(const float (&v)[N], float (&lo)[N], float (&hi)[N], float (&total)[N],
                                               float *wtot) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float incl[N];
#pragma unroll
    for (int n = 0; n < N; n++) incl[n] = v[n];
#pragma unroll
    for (int o = 1; o < 32; o <<= 1)
#pragma unroll
        for (int n = 0; n < N; n++) {
            const float y = __shfl_up_sync(0xffffffffu, incl[n], o);
            if (lane >= o) incl[n] += y;
        }
    __syncthreads();  // wtot may still be read by a previous call
    if (lane == 31)
#pragma unroll
        for (int n = 0; n < N; n++) wtot[n * (WARPS + 1) + warp] = incl[n];
    __syncthreads();
    if (threadIdx.x < N) {  // each warp's start, summed in warp order, and the total after them
        float *t = wtot + threadIdx.x * (WARPS + 1);
        float run = 0.0f;
        for (int j = 0; j < WARPS; j++) {
            const float w = t[j];
            t[j] = run;
            run += w;
        }
        t[WARPS] = run;
    }
    __syncthreads();
#pragma unroll
    for (int n = 0; n < N; n++) {
        float excl = __shfl_up_sync(0xffffffffu, incl[n], 1);
        if (lane == 0) excl = 0.0f;
        const float before = wtot[n * (WARPS + 1) + warp];
        lo[n] = before + excl;
        hi[n] = before + incl[n];  // lane 31: the next warp's start
        total[n] = wtot[n * (WARPS + 1) + WARPS];
    }
}

__device__ __forceinline__ void block_ranges(float v, float &lo, float &hi, float &total, float *wtot) {
    float a[1] = {v}, l[1], h[1], t[1];
    block_ranges_n<1>(a, l, h, t, wtot);
    lo = l[0];
    hi = h[0];
    total = t[0];
}

// block-wide max of unsigned ints; every thread gets it. `scratch`: WARPS words
__device__ __forceinline__ unsigned int block_max_u(unsigned int v, unsigned int *scratch) {
    v = __reduce_max_sync(0xffffffffu, v);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
    __syncthreads();
    unsigned int all = 0u;
    for (int w = 0; w < WARPS; w++) all = max(all, scratch[w]);
    return all;
}

// The draw in index order over each thread's run i0 .. i1 of weights w(i) (0: not kept; the runs
// in thread order): the first index at which the running sum passes target_of(total), the total
// being the block's sum; past the end (rounding), the last index kept. Every thread calls it and
// gets the index (-1 where nothing is kept). pick: a shared int.
template <typename W, typename T>
__device__ __forceinline__ int draw_runs(int i0, int i1, W w, T target_of, float *f_tot, int &pick) {
    float local = 0.0f;
    int last_kept = -1;
    for (int i = i0; i < i1; i++) {
        const float q = w(i);
        if (q > 0.0f) {
            local += q;
            last_kept = i;
        }
    }
    float lo, hi, all;
    block_ranges(local, lo, hi, all, f_tot);
    const float target = target_of(all);
    if (threadIdx.x == 0) pick = -1;
    __syncthreads();
    if (lo <= target && target < hi) {
        float acc = lo;
        int at = last_kept;
        for (int i = i0; i < i1; i++) {
            const float q = w(i);
            if (q > 0.0f) {
                acc += q;
                if (acc > target) {
                    at = i;
                    break;
                }
            }
        }
        pick = at;
    }
    __syncthreads();
    return pick >= 0 ? pick : (int)block_max_f((float)last_kept);
}

// The draw in id order over the whole row of the tokens with q >= q_keep: a row with no filter (a
// temperature alone, q_keep 0), or one whose top-p sample_few thresholds over too many tokens to
// hold. In two levels: one pass sums q over each warp's run of ids (as sample_few's passes take
// them); the run that holds the target is then split among the block's threads, a few ids each.
__device__ __noinline__ int sample_all(const float *__restrict__ src, int V, float inv_t, float mx, float u,
                                       float q_keep) {
    __shared__ float w_sum[WARPS], f_tot[WARPS + 1];
    __shared__ int pick;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int seg = (V + THREADS - 1) / THREADS * 32;
    const int v_begin = min(V, warp * seg), v_end = min(V, v_begin + seg);
    float m = 0.0f;
    for_run(src, v_begin, v_end, [&](float x, int, bool in) {
        const float q = q_of(scaled(x, inv_t), mx);
        if (in && q >= q_keep) m += q;  // q_keep >= 0 leaves out NaN
    });
    m = warp_sum(m);
    if (lane == 0) w_sum[warp] = m;
    __syncthreads();
    // the run whose range [lo, lo + its sum) holds u * total, found alike by every thread
    float total = 0.0f;
    for (int w = 0; w < WARPS; w++) total += w_sum[w];
    float target = u * total, lo = 0.0f;
    int run = -1;
    for (int w = 0; w < WARPS; w++) {
        const float hi = lo + w_sum[w];
        if (w_sum[w] > 0.0f) {
            run = w;
            if (target < hi) break;
        }
        lo = hi;
    }
    if (run < 0) return -1;  // nothing to draw: no finite logit
    target -= lo;  // within the run; past its end (rounding) the run's last kept token is taken
    const int r0 = min(V, run * seg), r1 = min(V, r0 + seg);
    const int per = (r1 - r0 + THREADS - 1) / THREADS, i0 = min(r1, r0 + tid * per), i1 = min(r1, i0 + per);
    return draw_runs(
        i0, i1,
        [&](int i) {
            const float q = q_of(scaled(src[i], inv_t), mx);
            return q >= q_keep ? q : 0.0f;  // (NaN: 0)
        },
        [&](float) { return target; }, f_tot, pick);
}

// The candidates of bins >= b_from with cand_q > 0 into t_idx, in id order; returns how many, and
// in `before` the sum of cand_q over the others (in a fixed order). Each thread takes its
// candidates i0 .. i1.
__device__ __forceinline__ int list_bins_from(int b_from, const float *cand_s, const float *cand_q, float mx, int i0,
                                              int i1, unsigned short *t_idx, float &before, float *f_tot) {
    float v[2] = {0.0f, 0.0f}, lo[2], hi[2], total[2];
    for (int i = i0; i < i1; i++) {
        const float q = cand_q[i];
        if (q > 0.0f) {
            if (bin_of(cand_s[i], mx) >= b_from) v[0] += 1.0f;
            else v[1] += q;
        }
    }
    block_ranges_n<2>(v, lo, hi, total, f_tot);
    int at = (int)lo[0];
    for (int i = i0; i < i1; i++)
        if (cand_q[i] > 0.0f && bin_of(cand_s[i], mx) >= b_from) t_idx[at++] = (unsigned short)i;
    before = total[1];
    __syncthreads();
    return (int)total[0];
}

// The token of a row with top-k, top-p or min-p, or -1 where its kept tokens may lie beyond the
// bins or be more than `cap` (the caller then bisects), or -2 where the caller draws over the
// row the tokens with q >= q_wide (sample_all). The same thresholds as sample_bisect's:
// top-k keeps keys >= the k-th largest, min-p q >= min_p, top-p q >= the largest q whose tokens
// (q' >= q) hold top_p of the allowed mass. Every thread calls it; it returns the same value to all.
__device__ __noinline__ int sample_few(const float *__restrict__ src, int V, float inv_t, float mx, int k,
                                       float tp, float mp, float u, int cap, unsigned char *smem, float &q_wide) {
    unsigned int *whist = reinterpret_cast<unsigned int *>(smem);
    float *cand_s = reinterpret_cast<float *>(smem);  // the candidates, in id order, in whist's place
    int *cand_id = reinterpret_cast<int *>(smem + FEW_CAP * 4);
    unsigned int *cand_key = reinterpret_cast<unsigned int *>(smem + FEW_CAP * 8);
    float *cand_q = reinterpret_cast<float *>(smem + FEW_CAP * 12);  // q of those top-k allows, else 0
    unsigned int *cum = reinterpret_cast<unsigned int *>(smem + WHIST_WORDS * 4);  // allowed tokens in bins <= b
    float *cum_lb = reinterpret_cast<float *>(cum + FEW_BINS);  // a lower and an upper bound of their mass
    float *cum_ub = cum_lb + FEW_BINS;
    unsigned short *t_idx = reinterpret_cast<unsigned short *>(cum_ub + FEW_BINS);  // a threshold's candidates
    __shared__ unsigned int u_tot[WARPS], w_cnt[WARPS];
    __shared__ float f_tot[5 * (WARPS + 1)];
    __shared__ int last_bin, first_bin, pick;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    for (int i = tid; i < WHIST_WORDS; i += THREADS) whist[i] = 0u;
    if (tid == 0) {
        last_bin = -1;
        first_bin = 0;
    }
    __syncthreads();

    // pass 1: each warp counts its own run of ids, coalesced, into its own bins
    const int seg = (V + THREADS - 1) / THREADS * 32;
    const int v_begin = min(V, warp * seg), v_end = min(V, v_begin + seg);
    unsigned int *h = whist + warp * (FEW_BINS / 2);
    const float q_min = fmaxf(mp, 0.0f);  // min-p; q >= 0 also leaves out NaN
    float mass = 0.0f;
    unsigned int allowed = 0;
    if (mp > 0.0f || tp < 1.0f) count_run<true>(src, v_begin, v_end, inv_t, mx, q_min, h, mass, allowed);
    else count_run<false>(src, v_begin, v_end, inv_t, mx, q_min, h, mass, allowed);  // mass unused
    __syncthreads();
    unsigned int c = 0;  // this thread's bin, over the warps
    for (int w = 0; w < WARPS; w++) c += (whist[w * (FEW_BINS / 2) + (tid >> 1)] >> ((tid & 1) << 4)) & 0xffffu;
    // the bin's count, and bounds of its mass (bin b's tokens have e^-(b+1)/16 < q <= e^-b/16), in
    // prefixes over the bins; the allowed mass and count, in totals (counts in floats: < 2^24)
    const float e = (float)tid * (1.0f / BINS_PER_NAT);
    const float vals[5] = {(float)c, (float)c * __expf(-e - 1.0f / BINS_PER_NAT), (float)c * __expf(-e), mass,
                           (float)allowed};
    float p_lo[5], p_hi[5], p_all[5];
    block_ranges_n<5>(vals, p_lo, p_hi, p_all, f_tot);
    cum[tid] = (unsigned int)p_hi[0];
    const unsigned int c_all = (unsigned int)p_all[0], n_allowed = (unsigned int)p_all[4];
    const float total_all = p_all[3];  // the allowed mass (min-p), in a fixed order
    const float lo_hi = p_hi[1], lo_all = p_all[1], up_hi = p_hi[2], up_all = p_all[2];
    const bool topk = k > 0 && (unsigned int)k < n_allowed;
    // lower (upper) bounds of the allowed mass in bins <= b: their tokens at their bins' lower
    // (upper) ends, or the total less the other tokens at their upper (lower) ends, which is
    // tight where top_p is near 1; with room for the rounding
    const float beyond = (float)(n_allowed - c_all) * __expf(-(float)FEW_BINS / BINS_PER_NAT);
    cum_lb[tid] = fmaxf(lo_hi * (1.0f - 1e-4f),
                        total_all * (1.0f - 1e-5f) - (up_all - up_hi) - up_all * 1e-5f - beyond);
    const float rest_lb = fmaxf(0.0f, (lo_all - lo_hi) * (1.0f - 1e-4f) - lo_all * 1e-5f);
    cum_ub[tid] = topk ? up_hi * (1.0f + 1e-4f)  // (the total of what top-k allows is not known yet)
                       : fminf(up_hi * (1.0f + 1e-4f), total_all * (1.0f + 1e-5f) - rest_lb);
    __syncthreads();
    // the last bin the candidates need: top-k's k-th token; without top-k, the first bin whose
    // mass surely reaches top-p's; min-p alone: every allowed token
    const float p_need = tp * total_all * (1.0f - 1e-6f);
    bool here;
    if (topk) here = cum[tid] >= (unsigned int)k && (tid == 0 || cum[tid - 1] < (unsigned int)k);
    else if (tp < 1.0f) here = cum_lb[tid] >= p_need && (tid == 0 || cum_lb[tid - 1] < p_need);
    else here = tid == FEW_BINS - 1 && cum[tid] == n_allowed;
    if (here) last_bin = tid;
    __syncthreads();
    const int bc = last_bin;
    if (bc < 0 || cum[bc] == 0u) return -1;
    // the candidates: bins b_lo .. bc. Past `cap`, top-p alone (no top-k) takes them from the first
    // bin its threshold can lie in; the mass of the bins before is summed in pass 2, and the draw
    // runs over the whole row (sample_all).
    int b_lo = 0;
    if (cum[bc] > (unsigned int)cap) {
        if (topk || tp >= 1.0f) return -1;
        if (cum_ub[tid] >= p_need && tid > 0 && cum_ub[tid - 1] < p_need) first_bin = tid;
        __syncthreads();
        b_lo = first_bin;
        if (b_lo == 0 || cum[bc] - cum[b_lo - 1] > (unsigned int)cap) return -1;
    }
    const bool wide = b_lo > 0;
    const int n = (int)(cum[bc] - (wide ? cum[b_lo - 1] : 0u));
    unsigned int mine = 0;  // this warp's candidates
    for (int b = b_lo + lane; b <= bc; b += 32) mine += (h[b >> 1] >> ((b & 1) << 4)) & 0xffffu;
    mine = __reduce_add_sync(0xffffffffu, mine);
    if (lane == 0) w_cnt[warp] = mine;
    __syncthreads();  // ... and every warp has read its counts before the candidates replace them
    int pos = 0;
    for (int w = 0; w < warp; w++) pos += (int)w_cnt[w];

    // pass 2: the candidates, in id order: allowed, and d_lo <= d < the end of bin bc
    const float d_lo = (float)b_lo * (1.0f / BINS_PER_NAT), d_end = (float)(bc + 1) * (1.0f / BINS_PER_NAT);
    float before = 0.0f;  // (wide) the mass of the allowed tokens before bin b_lo
    if (mp > 0.0f || wide) gather_run<true>(src, v_begin, v_end, inv_t, mx, q_min, d_lo, d_end, pos, cand_s, cand_id, before);
    else gather_run<false>(src, v_begin, v_end, inv_t, mx, q_min, d_lo, d_end, pos, cand_s, cand_id, before);
    if (wide) {
        float lo, hi;
        block_ranges(before, lo, hi, before, f_tot);  // the total, in a fixed order
    }
    __syncthreads();
    for (int i = tid; i < n; i += THREADS) cand_key[i] = ord_key(cand_s[i]);
    __syncthreads();

    const int per = (n + THREADS - 1) / THREADS, i0 = min(n, tid * per), i1 = min(n, i0 + per);
    // top-k: the largest key with at least k keys >= it, one of bin bc's (a warp a key)
    unsigned int kth = 0u;
    if (topk) {
        unsigned int best = 0u;
        for (int i = warp; i < n; i += WARPS) {
            const unsigned int key = cand_key[i];
            if (key <= best || bin_of(cand_s[i], mx) != bc) continue;
            unsigned int ge = 0u;
            for (int j = lane; j < n; j += 32) ge += cand_key[j] >= key ? 1u : 0u;
            if (__reduce_add_sync(0xffffffffu, ge) >= (unsigned int)k) best = key;
        }
        kth = block_max_u(best, u_tot);
        if (kth == 0u) return -1;  // (bin bc holds the k-th key; never taken)
    }
    for (int i = tid; i < n; i += THREADS) cand_q[i] = cand_key[i] >= kth ? q_of(cand_s[i], mx) : 0.0f;
    __syncthreads();
    float lo, hi, all;
    // top-p: the largest q whose tokens (q' >= q) hold `need`, one of the bins from the first whose
    // upper bound reaches `need` (a warp a q; sums over lanes in a fixed order, larger for a smaller
    // q). Past 512 candidates, those bins' candidates are listed first, and a q's sum runs over
    // them alone, after the mass of the bins before.
    float q_keep = 0.0f;
    if (tp < 1.0f) {
        float need = p_need;
        if (topk) {
            float local = 0.0f;
            for (int i = i0; i < i1; i++) local += cand_q[i];
            block_ranges(local, lo, hi, all, f_tot);
            need = tp * all * (1.0f - 1e-6f);
        }
        if (cum_ub[tid] >= need && tid > 0 && cum_ub[tid - 1] < need) first_bin = tid;
        __syncthreads();
        const int b_first = first_bin;
        const bool listed = !wide && n > 512;  // (wide: every candidate is of those bins)
        const int nt = listed ? list_bins_from(b_first, cand_s, cand_q, mx, i0, i1, t_idx, before, f_tot) : n;
        float best = 0.0f;
        for (int t = warp; t < nt; t += WARPS) {
            const int i = listed ? t_idx[t] : t;
            const float qi = cand_q[i];
            if (qi <= best || (!listed && bin_of(cand_s[i], mx) < b_first)) continue;
            float m = 0.0f;
            for (int j = lane; j < nt; j += 32) {
                const float q = cand_q[listed ? t_idx[j] : j];
                m += q >= qi ? q : 0.0f;
            }
            if (before + warp_sum(m) >= need) best = qi;
        }
        q_keep = block_max_f(best);
        if (q_keep <= 0.0f) return -1;  // no q reaches it (rounding against the bounds): bisect
    }

    // the draw, in id order over the candidates (wide: the caller's, over the row)
    if (wide) {
        q_wide = q_keep;
        return -2;
    }
    const int at = draw_runs(
        i0, i1, [&](int i) { return cand_q[i] >= q_keep ? cand_q[i] : 0.0f; }, [&](float all) { return u * all; },
        f_tot, pick);
    return at >= 0 ? cand_id[at] : -1;
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
    int *__restrict__ top_ids, float *__restrict__ top_lp, int max_top,
    int few_cap,                             // candidates sample_few may take (0: bisect every row)
    int *__restrict__ few_used,              // null, or per row: 1 where sample_few gave the token, else 0
    // null, or (R, key_stride): the LM head's greedy keys (gemv.cu's gemv_keys), n_keys a row
    const unsigned long long *__restrict__ keys, int n_keys, int key_stride) {
    extern __shared__ __align__(16) unsigned char few_smem[];  // FEW_SMEM bytes
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
    if (temp == 0.0f && keys != nullptr && src == raw) {  // the LM head's tiles' keys, not V logits
        const unsigned long long *k = keys + (long long)row * key_stride;
        unsigned long long best = 0ull;
        for (int i = tid; i < n_keys; i += THREADS) best = max(best, k[i]);
        token = greedy_token(block_max_u64(best));
    } else if (temp == 0.0f) {
        float bv = NEG_INF;
        int bi = 0x7fffffff;
        for (int v = tid; v < V; v += THREADS) argmax_pair(bv, bi, src[v], v);
        token = block_argmax(bv, bi);
        if (token >= V) token = 0;  // a row of NaNs only, as greedy_token gives
    } else {
        const float inv_t = 1.0f / temp;
        float mx = NEG_INF;
        for (int v = tid; v < V; v += THREADS) mx = fmaxf(mx, src[v] * inv_t);
        mx = block_max_f(mx);
        const int k = top_k[row];
        const float tp = top_p[row], mp = min_p[row];
        const float u = seeded_uniform(seeds[row], (unsigned long long)counters[row]);
        token = -1;
        float q_keep = 0.0f;  // sample_all's: 0, or (sample_few gave -2) top-p's threshold
        const bool filtered = (k > 0 && k < V) || tp < 1.0f || mp > 0.0f;
        if (few_cap > 0 && filtered)
            token = sample_few(src, V, inv_t, mx, k, tp, mp, u, min(few_cap, FEW_CAP), few_smem, q_keep);
        if (few_used != nullptr && tid == 0) few_used[row] = token >= 0 || token == -2;
        if (token < 0) token = few_cap > 0 && (!filtered || token == -2)
                                   ? sample_all(src, V, inv_t, mx, u, q_keep)
                                   : sample_bisect(src, V, inv_t, mx, k, tp, mp, u);
        token = max(token, 0);  // a row with no finite logit: 0, as greedy gives
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
