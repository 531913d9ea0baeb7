// An fp8 LM head's logits made exact where sampling decides (--quantize-lm-head): each row's
// CAND largest logits are recomputed from the 16-bit head and the row's 16-bit input, and written
// over the e4m3 product's values. Greedy decoding then takes the 16-bit head's token wherever that
// token is among the fp8 head's CAND largest (SmolLM2 on the H200, CAND 8: at 226 positions of 226,
// though one 16-bit third-largest read 1.5 lower in e4m3 and fell outside them; docs/performance.md,
// fifty-eighth session), and top-k / top-p see exact values where the mass is.
//
// A warp keeps a list of the CAND largest (value, id) it has been offered, sorted, lane j holding
// the j-th; 32 values (a lane's each) are offered at once, and only those above the list's last
// enter it, one at a time (a vote, then shuffles). Past the first few offers almost none do, so a
// value costs a compare and a vote. top_candidates: grid (splits, rows), TOP_THREADS threads; block
// (s, r) takes the s-th of `splits` slices of row r (whole float4s where the row is), its warps'
// lists merged into one, written (value, id) to cand_v / cand_i (rows, splits, CAND).
// rescore_candidates: grid rows, RESCORE_THREADS threads; merges a row's splits' lists the same
// way and recomputes each of the CAND winners as a warp's float32 dot product of x's row with the
// head's row (a fixed order), written to logits. NaN is never a candidate; a row with fewer than
// CAND logits above -inf leaves the missing candidates out (id -1). The same logits give the same
// candidates, whatever the launch's other rows.
// -DCAND (candidates a row, at most 32), -DUSE_BF16 (x and the head's type).
#include "common.cuh"

#ifndef CAND
#define CAND 8
#endif
#define TOP_THREADS 256
#define TOP_UNROLL 4  // float4 loads a thread has in flight
#define RESCORE_THREADS 256
#define FULL 0xffffffffu
static_assert(CAND >= 1 && CAND <= 32, "a warp's lanes hold the candidates");

// A warp's list of its CAND largest (value, id), descending: lane j < CAND holds the j-th (lv, li),
// -inf / -1 while empty; thr is the last one's value (warp-uniform).
struct WarpTop {
    float lv = NEG_INF, thr = NEG_INF;
    int li = -1;

    // each lane's (x, i) offered; those above thr enter in lane order (ids unique across the lanes)
    __device__ __forceinline__ void offer(float x, int i) {
        const int lane = threadIdx.x & 31;
        unsigned b = __ballot_sync(FULL, x > thr);  // NaN: false
        while (b) {
            const int src = __ffs(b) - 1;
            b &= b - 1;
            const float cv = __shfl_sync(FULL, x, src);
            const int ci = __shfl_sync(FULL, i, src);
            if (!(cv > thr)) continue;  // passed by an earlier one of these
            const bool ahead = lane < CAND && (lv > cv || (lv == cv && li < ci));
            const int pos = __popc(__ballot_sync(FULL, ahead));  // < CAND, as cv > thr
            const float uv = __shfl_up_sync(FULL, lv, 1);
            const int ui = __shfl_up_sync(FULL, li, 1);
            if (lane == pos) {
                lv = cv;
                li = ci;
            } else if (lane > pos && lane < CAND) {
                lv = uv;
                li = ui;
            }
            thr = __shfl_sync(FULL, lv, CAND - 1);
        }
    }
};

// The block's CAND largest from its warps' lists: warp 0's list at the end (sv / si: THREADS / 32
// lists of CAND in shared memory)
template <int THREADS>
__device__ __forceinline__ void block_top(WarpTop &top, float *sv, int *si) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane < CAND) {
        sv[warp * CAND + lane] = top.lv;
        si[warp * CAND + lane] = top.li;
    }
    __syncthreads();
    if (warp == 0) {
        top = WarpTop();
        for (int j = lane; j - lane < THREADS / 32 * CAND; j += 32) {
            const bool in = j < THREADS / 32 * CAND;
            top.offer(in ? sv[j] : NEG_INF, in ? si[j] : -1);
        }
    }
}

extern "C" __global__ void __launch_bounds__(TOP_THREADS) top_candidates(const float *__restrict__ logits, int vocab,
                                                                          int splits, float *__restrict__ cand_v,
                                                                          int *__restrict__ cand_i) {
    PDL_ENTER();
    __shared__ float sv[TOP_THREADS / 32 * CAND];
    __shared__ int si[TOP_THREADS / 32 * CAND];
    const int split = blockIdx.x, lane = threadIdx.x & 31;
    const long long row = blockIdx.y;
    const float *x = logits + row * vocab;
    const int slice = ((vocab + splits - 1) / splits + 3) & ~3;
    const int lo = min(vocab, split * slice), hi = min(vocab, lo + slice);
    WarpTop top;
    // warp-uniform trips (votes and shuffles need every lane): lanes past the end take -inf
    if ((vocab & 3) == 0) {  // rows and slices of whole float4s
        const float4 *x4 = reinterpret_cast<const float4 *>(x);
        const int lo4 = lo >> 2, hi4 = hi >> 2;
        for (int base = lo4 + threadIdx.x; base - lane < hi4; base += TOP_THREADS * TOP_UNROLL) {
            float4 f[TOP_UNROLL];
#pragma unroll
            for (int u = 0; u < TOP_UNROLL; u++) {
                const int k = base + u * TOP_THREADS;
                f[u] = k < hi4 ? __ldg(x4 + k) : make_float4(NEG_INF, NEG_INF, NEG_INF, NEG_INF);
            }
#pragma unroll
            for (int u = 0; u < TOP_UNROLL; u++) {
                if (__any_sync(FULL, fmaxf(fmaxf(f[u].x, f[u].y), fmaxf(f[u].z, f[u].w)) > top.thr)) {
                    const int i = 4 * (base + u * TOP_THREADS);
                    top.offer(f[u].x, i);
                    top.offer(f[u].y, i + 1);
                    top.offer(f[u].z, i + 2);
                    top.offer(f[u].w, i + 3);
                }
            }
        }
    } else {
        for (int i = lo + threadIdx.x; i - lane < hi; i += TOP_THREADS) top.offer(i < hi ? x[i] : NEG_INF, i);
    }
    block_top<TOP_THREADS>(top, sv, si);
    if (threadIdx.x < CAND) {
        const long long at = (row * splits + split) * CAND + threadIdx.x;
        cand_v[at] = top.lv;
        cand_i[at] = top.li;
    }
}

// a warp's dot product of 16-bit rows a and b (n values), in float32, in a fixed order
__device__ __forceinline__ float warp_dot(const scalar_t *__restrict__ a, const scalar_t *__restrict__ b, int n) {
    const int lane = threadIdx.x & 31;
    float sum = 0.0f;
    if ((n & 7) == 0) {
        constexpr int AHEAD = 4;  // 16-byte loads of each row in flight (a lone row's step waits on them)
        for (int k0 = lane * 8; k0 < n; k0 += 32 * 8 * AHEAD) {
            vec8 va[AHEAD], vb[AHEAD];
#pragma unroll
            for (int u = 0; u < AHEAD; u++) {
                const int k = k0 + u * 32 * 8;
                if (k < n) {
                    va[u] = *reinterpret_cast<const vec8 *>(a + k);
                    vb[u] = *reinterpret_cast<const vec8 *>(b + k);
                }
            }
#pragma unroll
            for (int u = 0; u < AHEAD; u++) {
                if (k0 + u * 32 * 8 < n) {
                    float fa[8], fb[8];
                    vec8_to_float(va[u], fa);
                    vec8_to_float(vb[u], fb);
#pragma unroll
                    for (int e = 0; e < 8; e++) sum = fmaf(fa[e], fb[e], sum);
                }
            }
        }
    } else {
        for (int k = lane; k < n; k += 32) sum = fmaf(to_float(a[k]), to_float(b[k]), sum);
    }
    return warp_sum(sum);
}

#define MERGE_LOADS 4  // a thread's entries of the row's lists loaded at once (4 x 256 >= MAX_SPLITS x CAND)
extern "C" __global__ void __launch_bounds__(RESCORE_THREADS) rescore_candidates(
    float *__restrict__ logits, int vocab, int splits, const float *__restrict__ cand_v,
    const int *__restrict__ cand_i, const scalar_t *__restrict__ x, const scalar_t *__restrict__ head, int hidden) {
    PDL_ENTER();
    __shared__ float sv[RESCORE_THREADS / 32 * CAND];
    __shared__ int si[RESCORE_THREADS / 32 * CAND], chosen[CAND];
    const long long row = blockIdx.x;
    const int lane = threadIdx.x & 31, n = splits * CAND;
    const float *rv = cand_v + row * n;
    const int *ri = cand_i + row * n;
    WarpTop top;  // each warp offers its share of the row's lists (loaded first), then block_top
    for (int j0 = threadIdx.x - lane; j0 < n; j0 += RESCORE_THREADS * MERGE_LOADS) {
        float v[MERGE_LOADS];
        int id[MERGE_LOADS];
#pragma unroll
        for (int u = 0; u < MERGE_LOADS; u++) {
            const int j = j0 + lane + u * RESCORE_THREADS;
            v[u] = j < n ? rv[j] : NEG_INF;
            id[u] = j < n ? ri[j] : -1;
        }
#pragma unroll
        for (int u = 0; u < MERGE_LOADS; u++) top.offer(v[u], id[u]);
    }
    block_top<RESCORE_THREADS>(top, sv, si);
    if (threadIdx.x < CAND) chosen[threadIdx.x] = top.li;
    __syncthreads();
    const scalar_t *xr = x + row * hidden;
    for (int c = threadIdx.x >> 5; c < CAND; c += RESCORE_THREADS / 32) {
        const int t = chosen[c];
        if (t < 0) continue;
        const float sum = warp_dot(xr, head + (long long)t * hidden, hidden);
        if (lane == 0) logits[row * vocab + t] = sum;
    }
}
