// HBM read bandwidth by address pattern (bench/kernels.py --read-patterns): the same grid and
// block as the skinny GEMM (gemv.cu: a block of 8 warps streams 8 weight rows of `rowb` bytes,
// each warp DEPTH 16-byte loads a lane a pass, all in flight before any is used), only the
// addresses a warp's load instruction covers differ:
//   PATTERN 0: 64 bytes of each of the 8 rows (the MMA fragments' own layout, gemv.cu's loads);
//   PATTERN 1: the same, a lane's consecutive loads on the two halves of a 128-byte line;
//   PATTERN 2: 512 contiguous bytes of the block's 8 rows taken as one array;
//   PATTERN 3: whole row segments of DEPTH x 64 bytes, 512 / (DEPTH x 64) rows an instruction.
// The loaded words are xor-ed, and a sink written only on an impossible value keeps the loads.
#ifndef PATTERN
#define PATTERN 0
#endif
#ifndef DEPTH
#define DEPTH 8
#endif
static_assert(DEPTH == 1 || DEPTH == 2 || DEPTH == 4 || DEPTH == 8, "a row segment is at most one instruction's 512 bytes");

extern "C" __global__ void __launch_bounds__(256) read_pattern(const unsigned char *__restrict__ w, int rowb,
                                                               unsigned long long *sink) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const unsigned char *base = w + (long long)blockIdx.x * 8 * rowb;
    const int chunks = rowb / 64;  // 64-byte chunks of a row; also 512-byte pieces of the block's rows
    uint4 acc = make_uint4(0, 0, 0, 0);
    for (int p0 = 0; p0 < chunks; p0 += 8 * DEPTH) {
        uint4 v[DEPTH];
#pragma unroll
        for (int u = 0; u < DEPTH; u++) {
            int c;  // the chunk (or piece) this load reads; past the row: none
            long long off;
            if (PATTERN == 0) {
                c = p0 + warp + 8 * u;
                off = (long long)g * rowb + c * 64 + q * 16;
            } else if (PATTERN == 1) {
                c = p0 + 2 * warp + 16 * (u >> 1) + (u & 1);
                off = (long long)g * rowb + c * 64 + q * 16;
            } else if (PATTERN == 2) {
                c = p0 + warp + 8 * u;
                off = (long long)c * 512 + lane * 16;
            } else {
                constexpr int SEG = DEPTH * 64, RPI = 512 / SEG;  // bytes of a row, rows an instruction
                const int r = u * RPI + lane / (32 / RPI), in = (lane % (32 / RPI)) * 16;
                c = p0 + warp * DEPTH + in / 64;  // u < DEPTH = 8 / RPI: the instructions cover the 8 rows
                off = (long long)r * rowb + (long long)(p0 + warp * DEPTH) * 64 + in;
            }
            v[u] = c < chunks ? __ldcs(reinterpret_cast<const uint4 *>(base + off)) : make_uint4(0, 0, 0, 0);
        }
        __syncwarp();  // every load of the pass issued before any is used
#pragma unroll
        for (int u = 0; u < DEPTH; u++) {
            acc.x ^= v[u].x;
            acc.y ^= v[u].y;
            acc.z ^= v[u].z;
            acc.w ^= v[u].w;
        }
    }
    if ((acc.x ^ acc.y ^ acc.z ^ acc.w) == 0x12345679u) sink[0] = 1;
}
