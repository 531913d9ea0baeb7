// Decode attention and the o product of a small model in one kernel, for steps of up to 16
// one-token rows: at one row a small model's step is a chain of short kernels, each ~1 us of
// launch boundary plus its loads after the wait (docs/performance.md), and attention and o
// are two of a layer's five. Here they are one stage.
//
// grid (SLICES x kv_heads, B), block THREADS (flash_decode.cu's 128): block (c, g) of row b
// runs the attention of KV head g's GROUP query heads over all of the row's keys with
// flash_decode.cu's arithmetic (decode_split, the row as one split: the bits of flash_decode
// wherever it too takes the row in one split), writes it to attn_out as that kernel does,
// and then takes the o product of its HIDDEN / SLICES output features over those heads'
// columns, written to out_parts[g]: o is the kv_heads parts added, which the next kernel's
// norm does (gemv.NormIn / add_rms_norm with parts, as for attn_block.cu). The SLICES blocks of
// a KV head each compute its attention (the K/V of one head, a few tens of KB, from the L2;
// they write the same bits): no exchange between blocks, so no barrier.
//
// Before the wait for the previous kernel (the QKV product, which writes q and the token's
// K/V row) a block copies in its o weight slice (bulk copies on an mbarrier) and, in
// decode_split, its first tile of earlier steps' keys and values.
//
// -DHEAD_DIM, -DGROUP, -DKV_FP8, -DSWAP (flash_decode.cu's), -DHIDDEN, -DSLICES, -DUSE_BF16;
// dynamic shared memory: attn_o.py's smem_bytes (the kernel checks it).
#include "small_shape.cuh"
#ifndef SLICES
#define SLICES 16
#endif
#define TILE 64                                   // small_attn.cuh's (unused here)
#define KSTR (HEAD_DIM + 16 / (int)sizeof(kv_t))  // ditto
#include "flash_decode.cu"
#include "cluster.cuh"
#include "small_attn.cuh"

constexpr int QW = GROUP * HEAD_DIM, OC = HIDDEN / SLICES;
static_assert(HIDDEN % SLICES == 0, "HIDDEN must be a multiple of SLICES");
static_assert(QW % 8 == 0, "whole 16-byte pieces");
constexpr int OFF_O = (SMEM_BYTES + 15) / 16 * 16;  // OC x QW 16-bit, after decode_split's
constexpr int ATTN_O_SMEM = OFF_O + OC * QW * 2;

extern "C" __global__ void __launch_bounds__(THREADS) attn_o(
    const scalar_t *__restrict__ q,       // (B, heads, HEAD_DIM), rotated
    const scalar_t *__restrict__ w_o,     // HIDDEN x heads HEAD_DIM
    const long long *__restrict__ k_ptrs, const long long *__restrict__ v_ptrs,  // (B)
    const int *__restrict__ kv_lens,      // (B), the token's key included; 0: a padding row
    long long layer_offset,
    scalar_t *__restrict__ attn_out,      // (B, heads, HEAD_DIM)
    float *__restrict__ out_parts,        // (kv_heads, B, HIDDEN) with parts part_stride apart
    long long part_stride, int heads, int kv_heads, int window, float scale) {
    const int c = blockIdx.x % SLICES, g = blockIdx.x / SLICES, b = blockIdx.y;
    const int tid = threadIdx.x;
    if (kv_lens[b] <= 0) return;  // a padding row: its parts are not read for anything kept
    extern __shared__ __align__(128) unsigned char attn_smem[];  // decode_split's, then sO
    if (tid == 0 && dynamic_smem_bytes() < ATTN_O_SMEM) __trap();  // attn_o.py's smem_bytes disagrees with this file
    scalar_t *sO = reinterpret_cast<scalar_t *>(attn_smem + OFF_O);
    __shared__ __align__(8) unsigned long long wbar;
    if (tid == 0) {
        mbar_init(&wbar);
        mbar_expect(&wbar, OC * QW * 2);
    }
    __syncthreads();
    for (int r = tid; r < OC; r += THREADS)
        bulk_copy(sO + r * QW, w_o + (long long)(c * OC + r) * heads * HEAD_DIM + g * QW, QW * 2, &wbar);
    decode_split(0, g, b, q, k_ptrs, v_ptrs, kv_lens, layer_offset, nullptr, nullptr, nullptr, attn_out, heads,
                 kv_heads, 1, window, scale);
    mbar_wait(&wbar, 0);
    __syncthreads();  // the group's attention rows in attn_out, written by this block

    const scalar_t *attn = attn_out + ((long long)b * heads + (long long)g * GROUP) * HEAD_DIM;
    float *op = out_parts + g * part_stride + (long long)b * HIDDEN + c * OC;
    warp_rows<OC, QW>(
        sO, [&](int u, float f[8]) { vec8_to_float(*reinterpret_cast<const vec8 *>(attn + u * 8), f); },
        [&](int r, float v) { op[r] = v; });
}
