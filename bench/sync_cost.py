"""What one step between two dependent stages of a small decode costs on the GPU: a kernel
boundary (the next kernel of a CUDA graph, with and without programmatic dependent launch)
against a grid-wide barrier inside one persistent kernel (the "megakernel" way). Each stage
reads what another block wrote in the stage before; optionally each also streams MB of fresh
weights from HBM, as a small skinny product does.

    python bench/sync_cost.py            # stages of no work, then of 1 and 4 MB

It decides whether a persistent decode kernel would shorten a one-row step, which is a chain
of ~150-200 short dependent kernels (SmolLM2, Llama-3-8B at B=1): only if the barrier costs
less than the boundary it replaces. Prints microseconds a stage (medians of graph replays).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402

from kernels_cuda._module import launch, sm_count  # noqa: E402

SRC = r"""
__device__ __forceinline__ unsigned ld_acquire(const unsigned *p) {
    unsigned v; asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v;
}
__device__ __forceinline__ void red_release(unsigned *p, unsigned v) {
    asm volatile("red.release.gpu.global.add.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}
// one stage: stream n16 16-byte words of w (the weights of a small product; 0: none), then
// each block reads its neighbour's value of the last stage and writes its own
__device__ __forceinline__ void stage(const float *in, float *out, const uint4 *w, long long n16, float &acc) {
    for (long long i = blockIdx.x * blockDim.x + threadIdx.x; i < n16; i += (long long)gridDim.x * blockDim.x) {
        const uint4 v = w[i];
        acc += __int_as_float(v.x ^ v.y ^ v.z ^ v.w);
    }
    if (threadIdx.x == 0) out[blockIdx.x] = in[(blockIdx.x + 1) % gridDim.x] + 1.0f;
}
// a stage as a kernel of its own (launched with or without programmatic dependent launch)
extern "C" __global__ void chain_step(const float *in, float *out, const uint4 *w, long long n16) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;");
    float acc = 0.0f;
    stage(in, out, w, n16, acc);
    if (acc == 12345.0f) out[0] = acc;  // keeps the loads
}
// `rounds` stages in one kernel, a grid barrier after each (all blocks resident)
extern "C" __global__ void persistent(float *buf, unsigned *bar, int rounds, const uint4 *w, long long n16) {
    const int G = gridDim.x;
    float acc = 0.0f;
    for (int r = 0; r < rounds; r++) {
        stage(buf + (r & 1) * G, buf + ((r + 1) & 1) * G, w + (long long)r * n16, n16, acc);
        __syncthreads();
        if (threadIdx.x == 0) {
            red_release(bar, 1);
            const unsigned target = (unsigned)(r + 1) * G;
            while (ld_acquire(bar) < target) {}
        }
        __syncthreads();
    }
    if (acc == 12345.0f) buf[0] = acc;
}
"""
ROUNDS = 600


def per_stage_us(stream: cp.cuda.Stream, fn) -> float:
    """Median microseconds a stage of fn (ROUNDS stages), captured once and replayed."""
    with stream:
        fn()
        stream.synchronize()
        stream.begin_capture()
        fn()
        graph = stream.end_capture()
        for _ in range(3):
            graph.launch(stream)
        stream.synchronize()
        times = []
        for _ in range(15):
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record(stream)
            graph.launch(stream)
            end.record(stream)
            end.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, end))
    return statistics.median(times) * 1e3 / ROUNDS


def main() -> None:
    mod = cp.RawModule(code=SRC, options=("-std=c++17",))
    stream = cp.cuda.Stream(non_blocking=True)
    sms = sm_count()
    weights = cp.random.randint(0, 1 << 30, size=(ROUNDS * (4 << 20) // 4,), dtype=np.int32).view(np.uint8)
    print(f"{cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}, {sms} SMs; us a stage")
    for mb in (0, 1, 4):
        n16 = np.int64((mb << 20) // 16)
        for per_sm in (1, 2):
            G = sms * per_sm
            buf, bar = cp.zeros(2 * G, np.float32), cp.zeros(1, np.uint32)

            def chain(pdl: bool):
                k = mod.get_function("chain_step")
                return lambda: [launch(k, (G,), (256,), (buf[(r & 1) * G:], buf[((r + 1) & 1) * G:],
                                                         weights[r * (mb << 20):], n16), pdl=pdl)
                                for r in range(ROUNDS)]

            def persistent():
                bar.fill(0)
                mod.get_function("persistent")((G,), (256,), (buf, bar, np.int32(ROUNDS), weights, n16))

            plain = f"kernels {per_stage_us(stream, chain(False)):.2f}, " if mb == 0 else ""
            tc, tp = per_stage_us(stream, chain(True)), per_stage_us(stream, persistent)
            rate = f" ({mb * 1.048576 / tc:.2f} / {mb * 1.048576 / tp:.2f} TB/s)" if mb else ""
            print(f"{mb} MB streamed a stage, {G} blocks: {plain}kernels with PDL {tc:.2f}, "
                  f"grid barrier {tp:.2f}{rate}")


if __name__ == "__main__":
    main()
