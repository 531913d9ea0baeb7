"""Where decode time goes, on the GPU: copy bandwidth (the roofline), the matrix
products of a shape at small batches (our GEMV vs cuBLAS), and the decode graph
alone vs a whole runner step (the difference is host work).

    python bench/kernels.py --shape llama3-8b --batch 1,8,64
    python bench/kernels.py --shape llama3-8b --batch 32,64 --context 4096 --skip-matmul --kv-cache-dtype fp8
    ncu --profile-from-start off --graph-profiling node --csv --print-units base \
        --metrics gpu__time_duration.sum,dram__bytes_read.sum \
        python bench/kernels.py --shape llama3-8b --batch 1 --profile > ncu.csv
    python bench/kernels.py --ncu-summary ncu.csv      # each kernel of one decode graph, by name
    python bench/kernels.py --shape smollm2-135m --batch 1 --context 96 --timeline  # a decode graph by kernel
    python bench/kernels.py --batch 256 --context 576 --quantization fp8 --kv-cache-dtype fp8 --dtype bfloat16 \
        --kernel-trace   # a decode graph's kernels in place, by CUPTI (torch.profiler), by the kernel before each
    python bench/kernels.py --mixed 252,576,4,448 --quantization fp8 --kv-cache-dtype fp8  # a mixed step by kernel
    python bench/kernels.py --attention 512,2048,4x512 --kv-cache-dtype fp8   # prefill attention alone, and stop
    python bench/kernels.py --read-patterns   # HBM reads of the skinny GEMM's grid by warp load pattern, and stop
    python bench/kernels.py --shape smollm2-135m --batch 1,128 --sampling   # the sampling kernel alone, and stop
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cupy as cp  # noqa: E402


def time_gpu(fn, iters: int = 50, warmup: int = 5) -> float:
    """Median milliseconds of fn() on the current stream, by events."""
    for _ in range(warmup):
        fn()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end))
    return statistics.median(times)


def time_graph(fn, launches: int = 10) -> float:
    """Median milliseconds of one fn(), from a CUDA graph of `launches` calls replayed (no host
    time between the kernels: a short kernel's launch costs the host more than its GPU time)."""
    cp.cuda.Device().synchronize()  # fn's inputs, written on the default stream, which this one does not wait for
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        fn()
        stream.synchronize()
        stream.begin_capture()
        for _ in range(launches):
            fn()
        graph = stream.end_capture()
        ms = time_gpu(lambda: graph.launch(stream), iters=15, warmup=3)
        stream.synchronize()
    del graph
    return ms / launches


def copy_bandwidth(nbytes: int = 4 << 30) -> float:
    """Device-to-device copy, bytes read + written per second (GB/s)."""
    a = cp.random.random(nbytes // 4, dtype=cp.float32)
    b = cp.empty_like(a)
    ms = time_gpu(lambda: b.__setitem__(Ellipsis, a), iters=20)
    return 2 * nbytes / (ms * 1e-3) / 1e9


READ_PATTERNS = {0: "8 rows x 64 B (gemv.cu's loads)", 1: "8 rows x 64 B, 128-B lines in pairs",
                 2: "512 contiguous bytes", 3: "row segments of DEPTH x 64 B"}


def read_pattern_table(rounds: int = 3) -> list[str]:
    """HBM read bandwidth of the skinny GEMM's grid (a block of 8 warps streams 8 rows) by the
    addresses a warp's load covers (bench/read_patterns.cu), on the Llama-3-8B gate/up, down and
    o shapes (16-bit), two buffers taking turns so the L2 holds none of it; best of `rounds`."""
    source = (Path(__file__).resolve().parent / "read_patterns.cu").read_text(encoding="utf-8")
    import numpy as np
    shapes = {"gate/up 28672 x 8 KB": (28672, 8192), "down 4096 x 28 KB": (4096, 28672), "o 4096 x 8 KB": (4096, 8192)}
    size = max(n * rowb for n, rowb in shapes.values())
    bufs = [cp.random.randint(0, 2**31, size=size // 4, dtype=cp.int32) for _ in range(2)]
    sink = cp.zeros(1, cp.uint64)
    kernels = {(depth, pattern): cp.RawModule(code=source, options=("-std=c++17", f"-DPATTERN={pattern}",
                                                                  f"-DDEPTH={depth}")).get_function("read_pattern")
               for depth in (4, 8) for pattern in READ_PATTERNS}
    best: dict[tuple, float] = {}
    for _ in range(rounds):
        for (depth, pattern), kernel in kernels.items():
            for name, (n, rowb) in shapes.items():
                turn = [0]

                def run(n=n, rowb=rowb, turn=turn, kernel=kernel):
                    kernel((n // 8,), (256,), (bufs[turn[0] % 2], np.int32(rowb), sink))
                    turn[0] += 1
                ms = time_graph(run, launches=8)
                key = (depth, pattern, name)
                best[key] = min(best.get(key, ms), ms)
    lines = [f"read patterns (GB/s, best of {rounds}; copy bandwidth {copy_bandwidth():.0f} GB/s read + write)",
             f"{'pattern':38s} {'DEPTH':>5s} " + " ".join(f"{name:>20s}" for name in shapes)]
    for depth in (4, 8):
        for pattern, label in READ_PATTERNS.items():
            cells = [f"{n * rowb / best[(depth, pattern, name)] / 1e6:14.0f} GB/s" for name, (n, rowb) in shapes.items()]
            lines.append(f"{label:38s} {depth:5d} " + " ".join(f"{c:>20s}" for c in cells))
    return lines


def step_matrices(shape: dict) -> dict[str, tuple[int, int, int]]:
    """A decode step's matrix products of a shape: name -> (N, K, uses per step)."""
    h, i, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_layers"]
    q, kv = shape["num_heads"] * shape["head_dim"], shape["num_kv_heads"] * shape["head_dim"]
    return {"qkv": (q + 2 * kv, h, layers), "o": (h, q, layers), "gate_up": (2 * i, h, layers),
            "down": (h, i, layers), "lm_head": (shape["vocab_size"], h, 1)}


def rotating_weights(n: int, k: int, min_total: int = 256 << 20) -> list:
    """Enough copies of an (n, k) fp16 matrix that cycling through them defeats the L2."""
    copies = max(3, -(-min_total // (n * k * 2)))
    return [(cp.random.standard_normal((n, k), dtype=cp.float32) * 0.02).astype(cp.float16) for _ in range(copies)]


def time_rotating(fn, x: cp.ndarray, ws: list, out: cp.ndarray) -> float:
    """Median ms of fn(x, w, out), with w the next of `ws` each run (no L2 reuse between runs)."""
    state = {"j": 0}

    def go():
        state["j"] = (state["j"] + 1) % len(ws)
        fn(x, ws[state["j"]], out)
    return time_gpu(go)


def matmul_table(shape: dict, batches: list[int]) -> list[str]:
    from kernels_cuda.gemm import gemm
    from kernels_cuda.gemv import MAX_ROWS, gemv
    rows = []
    for name, (n, k, _) in step_matrices(shape).items():
        ws = rotating_weights(n, k)
        nbytes = n * k * 2
        for b in batches:
            x = (cp.random.standard_normal((b, k), dtype=cp.float32)).astype(cp.float16)
            out = cp.empty((b, n), cp.float32)
            t_blas = time_rotating(gemm, x, ws, out)
            t_gemv = time_rotating(gemv, x, ws, out) if b <= MAX_ROWS else float("nan")
            rows.append(f"{name:8s} {n:6d}x{k:<6d} B={b:<4d} cublas {t_blas * 1e3:8.1f} us {nbytes / t_blas / 1e6:7.0f} GB/s"
                        f"   gemv {t_gemv * 1e3:8.1f} us {nbytes / t_gemv / 1e6:7.0f} GB/s")
        del ws
    return rows


def fp8_table(shape: dict, batches: list[int]) -> list[str]:
    """--quantization fp8's matrix products against the 16-bit ones, per matrix of a shape:
    cuBLAS fp16 vs cuBLASLt e4m3 into bfloat16 as the runner asks for it (promoted sums, fast
    accumulation, and fast accumulation with the per-token quantization of x in front: the
    runner's default path), and the skinny GEMM on 16-bit vs e4m3 weights. On Hopper, up to
    256 rows, also cuBLASLt with fast accumulation against gemm_fp8.cu's candidates for the
    bucket, both as captured graphs (gemm.tune_gemm_fp8_wgmma: the runner's choice at start)."""
    from kernels_cuda.gemm import WGMMA_CANDIDATES, gemm, gemm_fp8, rows_bucket, tune_gemm_fp8_wgmma, wgmma_supported
    from kernels_cuda.gemv import MAX_ROWS, gemv
    from kernels_cuda.quant import quantize_matrix, quantize_rows
    rows = []
    for name, (n, k, _) in step_matrices(shape).items():
        if name == "lm_head":
            continue  # stays 16-bit
        ws = rotating_weights(n, k)
        w8 = [quantize_matrix(w) for w in ws]
        for b in batches:
            x = (cp.random.standard_normal((b, k), dtype=cp.float32)).astype(cp.float16)
            out = cp.empty((b, n), cp.float32)
            xq, xs = quantize_rows(x)
            cells = []
            if b <= MAX_ROWS:
                t16, t8 = time_rotating(gemv, x, ws, out), time_rotating(gemv, x, w8, out)
                cells.append(f"gemv fp16 {t16 * 1e3:7.1f} us fp8 {t8 * 1e3:7.1f} us ({t16 / t8:4.2f}x, "
                             f"{n * k / t8 / 1e6:5.0f} GB/s)")
            else:
                t16 = time_rotating(gemm, x, ws, out)
                out16 = cp.empty((b, n), cp.uint16)  # bfloat16 bits
                t8 = time_rotating(lambda x_, w_, o_: gemm_fp8(xq, w_, o_), x, w8, out16)
                t8f = time_rotating(lambda x_, w_, o_: gemm_fp8(xq, w_, o_, fast_accum=True), x, w8, out16)
                tq = time_rotating(lambda x_, w_, o_: gemm_fp8(quantize_rows(x_, xq, xs)[0], w_, o_, fast_accum=True),
                                   x, w8, out16)
                flops = 2 * b * n * k
                cells.append(f"cublas fp16 {t16 * 1e3:7.1f} us ({flops / t16 / 1e9:5.0f} TFLOP/s)  lt fp8 "
                             f"{t8 * 1e3:7.1f} us ({flops / t8 / 1e9:5.0f})  fast-accum {t8f * 1e3:7.1f} us ({flops / t8f / 1e9:5.0f})  "
                             f"fast-accum +quantize x {tq * 1e3:7.1f} us ({t16 / tq:4.2f}x)")
                if wgmma_supported() and rows_bucket(b) in WGMMA_CANDIDATES:
                    lt_us, times, _ = tune_gemm_fp8_wgmma(xq, w8, out16, cp.cuda.Stream(non_blocking=True), pdl=True)
                    best = min(times, key=times.__getitem__, default=None)
                    cells.append(f"graphs: lt {lt_us:6.1f} us, gemm_fp8.cu " + (
                        f"{times[best]:6.1f} us ({lt_us / times[best]:4.2f}x; {best})" if best else "none fits"))
            rows.append(f"fp8 {name:8s} {n:6d}x{k:<6d} B={b:<5d} " + "  ".join(cells))
        del ws, w8
    return rows


SWEEP = [{"WARPS": 8, "DEPTH": 8}, {"WARPS": 8, "DEPTH": 4}, {"WARPS": 16, "DEPTH": 4}, {"WARPS": 4, "DEPTH": 8},
         {"WARPS": 16, "DEPTH": 8}, {"WARPS": 4, "DEPTH": 4}, {"WARPS": 8, "DEPTH": 2},
         {"STAGED": 1, "WARPS": 8, "DEPTH": 4, "STAGES": 2, "MIN_BLOCKS": 4},
         {"STAGED": 1, "WARPS": 8, "DEPTH": 8, "STAGES": 1}]  # gemv.cu shape constants (gemv.STAGED_CONFIG*: staged)


def sweep_label(config: dict) -> str:
    """A SWEEP config's column name: W8,D4 (direct) or staged,W8,D4,S2,M4."""
    return ",".join("staged" if key == "STAGED" else f"{key[0]}{val}" for key, val in config.items())


def gemv_sweep(shape: dict, batches: list[int], fp8: bool = False) -> list[str]:
    """Each SWEEP config of the skinny GEMM, and the one gemv.py chooses for each matrix and row
    count ("chosen"), against cuBLAS on a shape's matrices: checked against cuBLAS, then timed;
    the total is one decode step's matrix products. fp8: the skinny GEMM reads the matrices
    quantized to e4m3 (the LM head stays 16-bit)."""
    from kernels_cuda.gemm import gemm
    from kernels_cuda.gemv import gemv
    from kernels_cuda.quant import quantize_matrix
    mats = step_matrices(shape)
    candidates = ([("cublas", gemm), ("chosen", lambda x_, w_, o_: gemv(x_, w_, o_))]  # gemv.py's own choice
                  + [(sweep_label(c), lambda x_, w_, o_, c=c: gemv(x_, w_, o_, config=c)) for c in SWEEP])
    rows = []
    for b in batches:
        totals: dict[str, float] = {}
        per: dict[str, list[str]] = {}
        for name, (n, k, count) in mats.items():
            ws = rotating_weights(n, k)
            x = cp.random.standard_normal((b, k), dtype=cp.float32).astype(cp.float16)
            out = cp.empty((b, n), cp.float32)
            ref = gemm(x, ws[0], cp.empty((b, n), cp.float32))
            w8 = [quantize_matrix(w) for w in ws] if fp8 and name != "lm_head" else None
            for label, fn in candidates:
                wl = w8 if w8 is not None and label != "cublas" else ws
                if wl is w8 and label.startswith("staged"):
                    continue  # the staged form takes 16-bit weights
                fn(x, wl[0], out)
                err = float(cp.abs(out - ref).max() / (cp.abs(ref).max() + 1e-9))
                t = time_rotating(fn, x, wl, out)
                totals[label] = totals.get(label, 0.0) + count * t
                nbytes = n * k * (1 if wl is w8 else 2)
                per.setdefault(label, []).append(f"{name} {t * 1e3:6.1f}us {nbytes / t / 1e6:5.0f}GB/s"
                                                 + (f" ERR {err:.1e}" if err > (6e-2 if wl is w8 else 1e-2) else ""))
            del ws, w8
        step_bytes = sum(n * k * 2 * count for n, k, count in mats.values())
        for label, total in sorted(totals.items(), key=lambda kv_: kv_[1]):
            rows.append(f"B={b:<3d} {label:28s} step matmuls {total:7.3f} ms {step_bytes / total / 1e6:5.0f} GB/s | "
                        + "; ".join(per[label]))
    return rows


def attention_table(shape: dict, specs: list[str], kv_dtype: str = "auto") -> list[str]:
    """Prefill attention alone, every head of one layer (launches replayed from a graph): each
    spec is one causal sequence of L tokens ("2048") or N of them in one launch ("4x512", as
    a serving step's prompts); kv_dtype fp8: the cache holds e4m3 bytes (random, no NaN codes).
    Where flash_prefill launches flash_prefill_wgmma.cu (Hopper), flash_prefill.cu is timed
    beside it and their outputs compared bit for bit."""
    import numpy as np

    import kernels_cuda.flash_prefill as fpm
    H, KVH, D = shape["num_heads"], shape["num_kv_heads"], shape["head_dim"]
    fp8 = kv_dtype == "fp8"
    rows = []
    for spec in specs:
        n, _, length = spec.rpartition("x")
        n, L = int(n or 1), int(length)
        q_lens = np.full(n, L, np.int32)
        q = (cp.random.standard_normal((n * L, H, D), dtype=cp.float32)).astype(cp.float16)
        if fp8:  # codes 0x00..0x7d with either sign: no NaN (0x7f, 0xff)
            codes = cp.random.randint(0, 0x7E, (2, n, L, KVH, D), dtype=cp.int32)
            cache = (codes | (cp.random.randint(0, 2, codes.shape, dtype=cp.int32) << 7)).astype(cp.uint8)
        else:
            cache = cp.random.standard_normal((2, n, L, KVH, D), dtype=cp.float32).astype(cp.float16)
        tile_seq, tile_q0 = (cp.asarray(a) for a in fpm.tiles(q_lens, q_lens))
        q_start = cp.asarray(np.arange(n, dtype=np.int32) * L)
        lens = cp.asarray(q_lens)
        kp = cp.asarray([cache[0, i].data.ptr for i in range(n)], dtype=cp.int64)
        vp = cp.asarray([cache[1, i].data.ptr for i in range(n)], dtype=cp.int64)
        flops = n * 4 * (L * (L + 1) / 2) * H * D  # Q K^T and P V over the causal half
        kernels = ["flash_prefill.cu"] + (["flash_prefill_wgmma.cu"] if fpm.use_wgmma(D, L) else [])
        outs, default = [], fpm.WGMMA
        for kernel in kernels:
            fpm.WGMMA = kernel != "flash_prefill.cu"
            try:
                out = cp.empty_like(q)
                ms = time_graph(lambda out=out: fpm.flash_prefill(q, tile_seq, tile_q0, q_start, lens, lens, kp, vp, 0,
                                                                  KVH, D ** -0.5, out, kv_fp8=fp8, max_keys=L))
            finally:
                fpm.WGMMA = default
            outs.append(out)
            same = "" if len(outs) == 1 else f", the same bits: {bool((outs[0] == out).all())}"
            rows.append(f"prefill attention {n}x{L:<5d} H={H} KVH={KVH} D={D} kv={'fp8' if fp8 else '16'} {kernel:22s}: "
                        f"{ms * 1e3:8.1f} us {flops / ms / 1e9:6.1f} TFLOP/s{same}")
    return rows


def decode_table(shape_name: str, batches: list[int], context: int, pdl: bool | None = None,
                 kv_dtype: str = "auto", quantization: str | None = None) -> list[str]:
    """The decode graph alone vs a whole runner step; `pdl`: programmatic dependent launch."""
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.loader import load_model
    from engine.outputs import ScheduledSeq, SchedulerOutput
    from engine.request import SamplingParams
    from engine.runner.cuda_runner import CudaRunner
    model = load_model(f"random:{shape_name}", with_tokenizer=False)
    cfg = model.config
    pool_bytes = max(8 << 30, int(1.1 * max(batches) * (context + 256) * cfg.kv_bytes_per_token(2)))
    config = EngineConfig(model=shape_name, device="cuda", quantization=quantization,
                          cache=CacheConfig(kv_cache_bytes=pool_bytes, kv_cache_dtype=kv_dtype),
                          scheduler=SchedulerConfig(max_num_seqs=max(batches), max_model_len=context + 256,
                                                    max_num_batched_tokens=max(2048, max(batches))))
    runner = CudaRunner(config, model, progress=False, pdl=pdl)
    rows = []
    greedy = SamplingParams(temperature=0)
    for B in batches:
        region = context + 256
        seqs = [ScheduledSeq(i, [5], context, i * region, True, greedy, rng_seed=i) for i in range(B)]
        out = SchedulerOutput(seqs)
        runner.execute(out)  # fills the step inputs (and compiles nothing new)
        graph = runner.decode_graph(B)
        with runner.stream:
            t_graph = time_gpu(lambda s=runner.stream: graph.launch(s), iters=30)
        step = []
        for _ in range(20):
            t0 = time.perf_counter()
            runner.execute(out)
            step.append((time.perf_counter() - t0) * 1e3)
        t_step = statistics.median(step)
        step_bytes = runner.decode_step_bytes(B * context, B)  # weights + K/V
        rows.append(f"{shape_name} pdl={runner.pdl:d} kv={kv_dtype} w={quantization or '16'} B={B:<4d} "
                    f"ctx={context}: graph {t_graph:7.3f} ms "
                    f"({step_bytes / t_graph / 1e6:6.0f} GB/s of weights+KV), runner.execute "
                    f"{t_step:7.3f} ms -> {B / t_step * 1e3:9.1f} tok/s")
    del runner
    cp.get_default_memory_pool().free_all_blocks()
    return rows


def decode_runner(shape_name: str, batch: int, context: int, kv_dtype: str = "auto",
                  quantization: str | None = None, fill_kv: bool = False, dtype: str = "auto"):
    """A CUDA runner of a random-weight shape whose step inputs hold `batch` decode rows at
    `context` keys (one step executed); fill_kv: random K/V in its pool first; dtype: the model's
    16-bit type (EngineConfig.dtype)."""
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.loader import load_model
    from engine.outputs import ScheduledSeq, SchedulerOutput
    from engine.request import SamplingParams
    from engine.runner.cuda_runner import CudaRunner
    model = load_model(f"random:{shape_name}", with_tokenizer=False)
    config = EngineConfig(model=shape_name, device="cuda", quantization=quantization, dtype=dtype,
                          cache=CacheConfig(kv_cache_bytes=8 << 30, kv_cache_dtype=kv_dtype),
                          scheduler=SchedulerConfig(max_num_seqs=batch, max_model_len=context + 256,
                                                    max_num_batched_tokens=2048))
    runner = CudaRunner(config, model, progress=False)
    if fill_kv:
        fill_kv_random(runner)
    greedy = SamplingParams(temperature=0)
    runner.execute(SchedulerOutput([ScheduledSeq(i, [5], context, i * (context + 256), True, greedy, rng_seed=i)
                                    for i in range(batch)]))
    runner.stream.synchronize()
    return runner


def profile_graph(shape_name: str, batch: int, context: int, kv_dtype: str = "auto",
                  quantization: str | None = None, launches: int = 1) -> None:
    """Launch the decode graph of `batch` rows `launches` times between cudaProfilerStart/Stop,
    for `ncu --profile-from-start off --graph-profiling node` (see ncu_summary; one launch) or
    `nsys profile --capture-range=cudaProfilerApi --cuda-graph-trace=node` (the kernels timed
    inside the graph, overlaps included)."""
    runner = decode_runner(shape_name, batch, context, kv_dtype, quantization)
    cp.cuda.profiler.start()
    for _ in range(launches):
        runner.decode_graph(batch).launch(runner.stream)
    runner.stream.synchronize()
    cp.cuda.profiler.stop()


def capture_decode_graph(runner, batch: int):
    """A graph of the runner's decode body for `batch` rows, its kernels launched with programmatic
    dependent launch where the runner's graphs use it (CudaRunner._capture_graphs)."""
    from kernels_cuda._module import early_triggers
    runner._launch_pdl = runner.pdl
    try:
        with runner.stream, early_triggers(runner.early_launch):
            runner.stream.begin_capture()
            runner._decode_body(batch)
            return runner.stream.end_capture()
    finally:
        runner._launch_pdl = False


def timeline_table(shape_name: str, batch: int, context: int, kv_dtype: str = "auto",
                   quantization: str | None = None, replays: int = 20, points: bool = False) -> list[str]:
    """Where a decode graph's time goes with every kernel in place (PDL overlaps included):
    each kernel's block 0 stamps the global timer once past its wait (_module.Timeline), and a
    kernel's stage is the time from its stamp to the next kernel's, i.e. its own run after the
    wait plus the boundary to the next. cuBLAS kernels (steps over 16 rows) stamp nothing: their
    time falls into the stage before them. Medians over the replays, summed by kernel (and the
    kernel before it, which tells e.g. the o projection from the down projection). points: the
    kernels of _module.STAMP_POINTS also stamp at points inside them ("kernel:point" stages)."""
    import numpy as np

    from kernels_cuda._module import Timeline
    tl = Timeline(points=points)
    with tl.compiling():
        runner = decode_runner(shape_name, batch, context, kv_dtype, quantization, fill_kv=True)
        tl.names.clear()
        graph = capture_decode_graph(runner, batch)
        names = list(tl.names)
    stream = runner.stream
    with stream:
        timed = {on: [] for on in (False, True)}
        for _ in range(3):
            for on in (False, True):
                tl.enable(on)
                timed[on].append(time_gpu(lambda: graph.launch(stream), iters=20))
        tl.enable(True)
        stages = []
        for _ in range(replays):
            tl.reset()
            graph.launch(stream)
            stream.synchronize()
            t = tl.read()
            if len(t) != len(names):
                raise RuntimeError(f"{len(t)} stamps for {len(names)} kernels")
            stages.append(np.diff(t) / 1e3)
    med = np.median(np.stack(stages), axis=0)  # us, stage i = kernel i (the last kernel has none)
    totals: dict[str, list] = {}
    for i, us in enumerate(med):
        key = f"{names[i]} (after {names[i - 1] if i else '-'})"
        t = totals.setdefault(key, [0, 0.0])
        t[0] += 1
        t[1] += us
    ms = {on: statistics.median(v) for on, v in timed.items()}
    out = [(f"timeline {shape_name} w={quantization or '16'} kv={kv_dtype} B={batch} ctx={context}: graph "
            f"{ms[False]:.3f} ms ({ms[True]:.3f} with the stamps), {len(names)} kernels, stages {med.sum() / 1e3:.3f} "
            "ms to the last kernel's start")]
    for key, (n, us) in sorted(totals.items(), key=lambda kv: -kv[1][1]):
        out.append(f"  {key:58s} x{n:<4d} {us:9.1f} us ({us / n:6.2f} each)")
    del runner
    cp.get_default_memory_pool().free_all_blocks()
    return out


def kernel_trace_table(shape_name: str, batch: int, context: int, kv_dtype: str = "auto",
                       quantization: str | None = None, dtype: str = "auto", replays: int = 8) -> list[str]:
    """A decode graph's kernels in place: `replays` replays recorded by torch.profiler (CUPTI, as
    bench/kernel_trace.py reads a serving load's), each kernel's duration summed by family and by
    (family, the family launched before it). Unlike --timeline's stamps, a cuBLAS(Lt) product is
    timed as itself, not folded into the stage before it; a kernel launched with programmatic
    dependent launch counts its wait for the one before it (its span)."""
    import json
    import tempfile

    from bench import kernel_trace
    runner = decode_runner(shape_name, batch, context, kv_dtype, quantization, fill_kv=True, dtype=dtype)
    graph = capture_decode_graph(runner, batch)
    stream = runner.stream
    with stream:
        ms = time_gpu(lambda: graph.launch(stream), iters=20)
        prof = kernel_trace.start()
        for _ in range(replays + 1):  # the window's last step is left out
            graph.launch(stream)
        kernel_trace.stop(prof)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        summary = kernel_trace.summarize(json.loads(path.read_text()))
    del graph, runner
    cp.get_default_memory_pool().free_all_blocks()
    return ([f"kernel trace {shape_name} {dtype} w={quantization or '16'} kv={kv_dtype} B={batch} ctx={context}: "
             f"graph {ms:.3f} ms (events, no profiler)"] + kernel_trace.report(summary, families=24, after=True))


def leave_out_table(shape_name: str, batches: list[int], context: int, kv_dtype: str = "auto",
                    quantization: str | None = None, dtype: str = "auto", rounds: int = 5) -> list[str]:
    """What each row-wise kernel and the decode attention cost a decode graph in place: the graph
    of each --batch recaptured with one of them left out (its output stale: timing only), each
    replay timed right after one of the whole graph, so that the clock's drift over the run
    (the power cap) falls out of the difference; medians over rounds. What a kernel costs alone
    (--profile, ncu) leaves out its launch boundaries and its overlap with its neighbours (PDL)."""
    from contextlib import ExitStack
    from unittest import mock

    import engine.runner.cuda_runner as cuda_runner
    runner = decode_runner(shape_name, max(batches), context, kv_dtype, quantization, fill_kv=True, dtype=dtype)
    layers = runner.config.num_layers
    skip = {  # what to leave out: (object, attribute, stand-in)
        "the decode attention": (runner, "_decode_attention", lambda *a, **k: None),
        "SiLU * up": (cuda_runner, "silu_mul", lambda *a, **k: None),
        "RoPE + K/V write": (cuda_runner, "rope_kv_write", lambda *a, **k: None),
        "the attention output's quantize": (cuda_runner, "quantize_rows",
                                            lambda x, q=None, scale=None, pdl=False: (q, scale)),
        "the norms (add + RMSNorm)": (runner, "_norm", lambda *a, **k: None),
    }

    def capture(B: int, left_out: str | None):
        with ExitStack() as stack:
            if left_out is not None:
                obj, name, stand_in = skip[left_out]
                stack.enter_context(mock.patch.object(obj, name, stand_in))
            return capture_decode_graph(runner, B)

    out = []
    for B in batches:
        graphs = {name: capture(B, name) for name in (None, *skip)}
        whole: list[float] = []
        saved: dict = {name: [] for name in skip}  # ms, each against the whole graph timed just before it
        with runner.stream:
            time_gpu(lambda: graphs[None].launch(runner.stream), iters=50)  # the clock settles at the step's load
            for _ in range(rounds):
                for name in skip:
                    whole.append(time_gpu(lambda: graphs[None].launch(runner.stream), iters=20))
                    saved[name].append(whole[-1] - time_gpu(lambda g=graphs[name]: g.launch(runner.stream), iters=20))
        out.append(f"leave-out {shape_name} w={quantization or '16'} kv={kv_dtype} dtype={dtype} B={B} ctx={context}: "
                   f"graph {statistics.median(whole):.3f} ms ({min(whole):.3f}-{max(whole):.3f})")
        for name, diffs in saved.items():
            out.append(f"  without {name:34s} {1e3 * statistics.median(diffs) / layers:7.2f} us a layer less "
                       f"({1e3 * min(diffs) / layers:.2f}-{1e3 * max(diffs) / layers:.2f})")
    del runner
    cp.get_default_memory_pool().free_all_blocks()
    return out


# the kernel functions a runner step calls (engine/runner/cuda_runner.py's imports), timed by --mixed
STEP_KERNELS = ("embedding", "rms_norm", "add_rms_norm", "gemm", "gemm_fp8", "gemm_fp8_scaled", "quantize_rows",
                "gemv", "gemv_rope", "gemv_silu", "rope_kv_write", "flash_prefill", "flash_decode", "silu_mul",
                "sample_tokens", "token_logprobs")


def fill_kv_random(runner) -> None:
    """Random K/V in the whole pool (e4m3 codes without NaN, or 16-bit values of about the
    size a layer writes): attention is not timed on zeros."""
    with runner.stream:
        for pool in (runner.k_cache, runner.v_cache):
            raw = pool.view(cp.uint8).reshape(-1)
            chunk = 1 << 28
            for i in range(0, raw.size, chunk):
                m = min(chunk, raw.size - i)
                if runner.kv_fp8:
                    raw[i:i + m] = cp.random.randint(0, 0x7E, m, dtype=cp.uint8) | \
                        (cp.random.randint(0, 2, m, dtype=cp.uint8) << 7)
                else:
                    vals = (cp.random.standard_normal(-(-m // 2), dtype=cp.float32) * 0.5).astype(cp.float16)
                    raw[i:i + m] = vals.view(cp.uint8)[:m]
        runner.stream.synchronize()


def mixed_table(shape_name: str, decodes: int, context: int, prompts: int, prompt_len: int,
                quantization: str | None = None, kv_dtype: str = "auto", rounds: int = 8,
                eager: bool = False, dtype: str = "auto") -> list[str]:
    """GPU time of one mixed step (`decodes` one-token rows at `context` keys + `prompts`
    prompts of `prompt_len` tokens, one runner.submit) by kernel: events around every kernel
    function the runner calls; the gaps between kernels are what the step's events hold
    beyond them. Medians over the rounds after the first two. The kernels inside the step's
    graphs (a ragged step's layers, a decode step) count as gaps; with `eager` the runner
    captures none (enforce_eager), so every kernel is timed. A step of 2,040 rows takes as
    long either way (H200, 8B fp8: 31.35 ms); a decode-only step eager is the host's pace.
    dtype: the model's 16-bit type (EngineConfig.dtype; bfloat16: a 16-bit residual stream)."""
    import numpy as np

    import engine.runner.cuda_runner as cr
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.loader import load_model
    from engine.outputs import ScheduledSeq, SchedulerOutput
    from engine.request import SamplingParams
    model = load_model(f"random:{shape_name}", with_tokenizer=False)
    cfg = model.config
    region = max(context, prompt_len) + 64
    rows = decodes + prompts * prompt_len
    pool_bytes = int(1.1 * (decodes + prompts) * region * cfg.kv_bytes_per_token(1 if kv_dtype == "fp8" else 2))
    config = EngineConfig(model=shape_name, device="cuda", quantization=quantization, dtype=dtype,
                          cache=CacheConfig(kv_cache_bytes=max(pool_bytes, 1 << 30), kv_cache_dtype=kv_dtype),
                          scheduler=SchedulerConfig(max_num_seqs=max(decodes + prompts, 1), max_model_len=region,
                                                    max_num_batched_tokens=max(2048, rows)),
                          enforce_eager=eager)
    runner = cr.CudaRunner(config, model, progress=False)
    fill_kv_random(runner)
    params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    rng = np.random.default_rng(0)
    vocab = cfg.vocab_size
    seqs = [ScheduledSeq(i, [int(rng.integers(vocab))], context - 1, i * region, True, params,
                         prompt_token_ids=[1] * (context - 1)) for i in range(decodes)]
    for j in range(prompts):
        tokens = [int(t) for t in rng.integers(vocab, size=prompt_len)]
        seqs.append(ScheduledSeq(decodes + j, tokens, 0, (decodes + j) * region, True, params,
                                 prompt_token_ids=tokens))
    step = SchedulerOutput(seqs=seqs, step=1)
    events: dict[str, list] = {}

    def timed(name: str, fn):
        def call(*args, **kwargs):
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record()
            result = fn(*args, **kwargs)
            end.record()
            events.setdefault(name, []).append((start, end))
            return result
        return call

    originals = {name: getattr(cr, name) for name in STEP_KERNELS}
    times: dict[str, list[float]] = {}
    try:
        for name, fn in originals.items():
            setattr(cr, name, timed(name, fn))
        for _ in range(rounds):
            events.clear()
            start, end = cp.cuda.Event(), cp.cuda.Event()
            with runner.stream:
                start.record()
            finish = runner.submit(step)
            with runner.stream:
                end.record()
            finish()
            end.synchronize()
            total = cp.cuda.get_elapsed_time(start, end)
            inside = 0.0
            for name, pairs in events.items():
                ms = sum(cp.cuda.get_elapsed_time(a, b) for a, b in pairs)
                times.setdefault(f"{name} x{len(pairs)}", []).append(ms)
                inside += ms
            times.setdefault("step", []).append(total)
            times.setdefault("between kernels", []).append(total - inside)
    finally:
        for name, fn in originals.items():
            setattr(cr, name, fn)
    del runner
    cp.get_default_memory_pool().free_all_blocks()
    med = {name: statistics.median(v[2:] if len(v) > 2 else v) for name, v in times.items()}
    out = [(f"mixed step {shape_name} {dtype} w={quantization or '16'} kv={kv_dtype}: {decodes} decode rows at "
            f"{context} keys + {prompts} prompts x {prompt_len} = {rows} rows{' (eager)' if eager else ''}: "
            f"{med.pop('step'):.3f} ms")]
    for name, ms in sorted(med.items(), key=lambda kv: -kv[1]):
        out.append(f"  {name:24s} {ms:8.3f} ms")
    return out


def lm_head_table(shape: dict, batches: list[int], cand: int = 8) -> list[str]:
    """The shape's LM head alone (graphs of ten launches, us a launch) at these row counts: 16-bit,
    e4m3 (--quantize-lm-head's product: the skinny GEMM up to 16 rows, else the rows quantized and
    cuBLASLt's epilogue-scaled product into float32), e4m3 with each row's `cand` largest logits
    rescored from the 16-bit head (rescore.py), and the rescore alone. Random weights (std 0.02)
    and inputs: the logits the rescore reads are a real product's, not zeros."""
    from kernels_cuda.gemm import gemm, gemm_fp8_scaled
    from kernels_cuda.gemv import MAX_ROWS, gemv
    from kernels_cuda.quant import quantize_matrix, quantize_rows
    from kernels_cuda.rescore import candidate_buffers, rescore
    V, H = shape["vocab_size"], shape["hidden_size"]
    rng = cp.random.default_rng(0)
    w = (rng.standard_normal((V, H), dtype=cp.float32) * 0.02).astype(cp.float16)
    wq = quantize_matrix(w)
    scratch = candidate_buffers(max(batches), V, cand)
    out = [f"LM head {V} x {H}, us a launch: 16-bit | fp8 | fp8 + rescore ({cand}) | rescore alone"]
    for n in batches:
        x = rng.standard_normal((n, H), dtype=cp.float32).astype(cp.float16)
        logits = cp.empty((n, V), cp.float32)
        q, qs = cp.empty((n, H), cp.uint8), cp.empty(n, cp.float32)

        def head16():
            (gemv if n <= MAX_ROWS else gemm)(x, w, logits)

        def head8():
            if n <= MAX_ROWS:
                gemv(x, wq, logits)
            else:
                quantize_rows(x, q, qs)
                if not gemm_fp8_scaled(q, qs, wq, logits, True):
                    raise RuntimeError("cuBLASLt has no epilogue-scaled fp8 product into float32 here")

        def rescored():
            head8()
            rescore(logits, x, w, cand, scratch)

        times = [1e3 * time_graph(fn) for fn in (head16, head8, rescored)]
        times.append(1e3 * time_graph(lambda: rescore(logits, x, w, cand, scratch)))
        out.append(f"  {n:4d} rows: " + " | ".join(f"{t:8.1f}" for t in times))
    return out


SAMPLING_CASES = (("greedy", 0.0, 0, 1.0), ("t 0.8", 0.8, 0, 1.0), ("t 0.8 top_p 0.9", 0.8, 0, 0.9),
                  ("t 0.8 top_k 50", 0.8, 50, 1.0), ("t 0.8 top_k 50 top_p 0.9", 0.8, 50, 0.9),
                  ("t 1.0 top_p 0.9", 1.0, 0, 0.9))  # the last: a nucleus of 6,422 of 128,256 logits


def sampling_table(vocab: int, batches: list[int]) -> list[str]:
    """sample_tokens alone (graphs of ten launches), us a launch, at these row counts of random
    logits (scale 3) of the vocabulary: greedy against temperature, top-p and top-k rows."""
    import numpy as np

    from kernels_cuda.sampling import plain_params, sample_tokens
    rng = np.random.default_rng(0)
    out = [f"sampling, vocab {vocab}, us a launch: " + " | ".join(c[0] for c in SAMPLING_CASES)]
    for rows in batches:
        logits = cp.asarray((rng.standard_normal((rows, vocab)) * 3).astype(np.float32))
        work, sampled = cp.empty_like(logits), cp.zeros(rows, cp.int32)
        counts, mask = cp.zeros((1, vocab), cp.int32), cp.zeros((1, (vocab + 31) // 32), cp.uint32)
        times = []
        for _, temperature, top_k, top_p in SAMPLING_CASES:
            params = plain_params([temperature] * rows, top_k, top_p)
            times.append(1e3 * time_graph(lambda p=params: sample_tokens(logits, work, p, counts, mask, sampled)))
        out.append(f"  {rows:4d} rows: " + " | ".join(f"{t:8.1f}" for t in times))
    return out


def ncu_summary(csv_path: str) -> list[str]:
    """Per-kernel times of one profiled graph (ncu --csv --print-units base, metrics
    gpu__time_duration.sum and dram__bytes_read.sum), summed by kernel name."""
    import csv
    kernels: dict[str, dict] = {}
    with open(csv_path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]  # skip ncu's own messages
    for row in csv.DictReader(lines):
        k = kernels.setdefault(row["ID"], {"name": row["Kernel Name"].split("(")[0]})
        k[row["Metric Name"]] = float(row["Metric Value"].replace(",", ""))
    totals: dict[str, list[float]] = {}
    for k in kernels.values():
        t = totals.setdefault(k["name"], [0, 0.0, 0.0])
        t[0] += 1
        t[1] += k.get("gpu__time_duration.sum", 0.0) / 1e3
        t[2] += k.get("dram__bytes_read.sum", 0.0)
    all_us = sum(t[1] for t in totals.values())
    out = [f"{len(kernels)} kernels, {all_us:.1f} us run one at a time"]
    for name, (n, us, nbytes) in sorted(totals.items(), key=lambda kv: -kv[1][1]):
        out.append(f"  {name:28s} x{n:<4d} {us:9.1f} us ({us / n:7.2f} each) {nbytes / max(us, 1e-9) / 1e3:7.0f} GB/s")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--batch", default="1,8,64")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--skip-matmul", action="store_true")
    ap.add_argument("--gemv-sweep", action="store_true", help="compare gemv.cu shape constants and stop")
    ap.add_argument("--attention", default="", help="prefill attention alone at these lengths, e.g. 2048,8192, "
                    "or N prompts of a length in one launch, e.g. 4x512 (with --kv-cache-dtype), and stop")
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto or fp8: the decode graphs' K/V cache "
                    "(fp8: with programmatic dependent launch only)")
    ap.add_argument("--fp8", action="store_true", help="the fp8 matrix products against the 16-bit ones and stop")
    ap.add_argument("--quantization", default=None, help="fp8: the decode graphs with e4m3 layer weights")
    ap.add_argument("--profile", action="store_true",
                    help="launch the first batch's decode graph once inside cudaProfilerStart/Stop (run under ncu)")
    ap.add_argument("--launches", type=int, default=1, help="--profile: launch the graph this many times")
    ap.add_argument("--ncu-summary", default="", help="summarise an ncu --csv file of such a run and stop")
    ap.add_argument("--timeline", action="store_true", help="the decode graph of each --batch by kernel, every kernel in "
                    "place (stamps of the GPU's global timer), and stop")
    ap.add_argument("--points", action="store_true", help="--timeline: the decode attention's stage split "
                    "where its q and first tiles have landed and where its tiles are done (kernels_cuda/_module.py's "
                    "STAMP_POINTS)")
    ap.add_argument("--kernel-trace", action="store_true", help="the decode graph of each --batch under torch.profiler "
                    "(CUPTI): each kernel in place, by family and by the kernel launched before it, and stop")
    ap.add_argument("--mixed", default="", help="D,C,P,L: one mixed step of D decode rows at C keys and P prompts of "
                    "L tokens, its GPU time by kernel, and stop (with --quantization, --kv-cache-dtype)")
    ap.add_argument("--eager", action="store_true", help="--mixed: the runner without graphs, so that the kernels "
                    "inside them are timed too")
    ap.add_argument("--dtype", default="auto", help="--mixed, --leave-out, --kernel-trace: the model's 16-bit type "
                    "(auto, float16, bfloat16)")
    ap.add_argument("--leave-out", action="store_true", help="the decode graph of each --batch with each row-wise "
                    "kernel and the decode attention left out in turn (timing only): what each costs in place, and stop")
    ap.add_argument("--read-patterns", action="store_true", help="HBM read bandwidth of the skinny GEMM's grid by "
                    "the addresses a warp load covers (bench/read_patterns.cu), and stop")
    ap.add_argument("--lm-head", action="store_true", help="the shape's LM head alone at --batch rows: 16-bit, "
                    "e4m3 and e4m3 with its largest logits rescored (--quantize-lm-head), and stop")
    ap.add_argument("--sampling", action="store_true", help="the sampling kernel alone at the shape's vocabulary, "
                    "--batch rows: greedy, temperature, top-p, top-k (bench/kernels.py's SAMPLING_CASES), and stop")
    args = ap.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    if args.sampling:
        from engine.loader.random_model import SHAPES
        print("\n".join(sampling_table(SHAPES[args.shape]["vocab_size"], batches)))
        return
    if args.read_patterns:
        print("\n".join(read_pattern_table()))
        return
    if args.lm_head:
        from engine.loader.random_model import SHAPES
        print("\n".join(lm_head_table(SHAPES[args.shape], batches)))
        return
    if args.ncu_summary:
        print("\n".join(ncu_summary(args.ncu_summary)))
        return
    if args.mixed:
        decodes, context, prompts, prompt_len = (int(x) for x in args.mixed.split(","))
        print("\n".join(mixed_table(args.shape, decodes, context, prompts, prompt_len, args.quantization,
                                    args.kv_cache_dtype, eager=args.eager, dtype=args.dtype)))
        return
    if args.leave_out:
        print("\n".join(leave_out_table(args.shape, batches, args.context, args.kv_cache_dtype, args.quantization,
                                         args.dtype)), flush=True)
        return
    if args.kernel_trace:
        for B in batches:
            print("\n".join(kernel_trace_table(args.shape, B, args.context, args.kv_cache_dtype, args.quantization,
                                               args.dtype)), flush=True)
        return
    if args.timeline:
        for B in batches:
            print("\n".join(timeline_table(args.shape, B, args.context, args.kv_cache_dtype, args.quantization,
                                            points=args.points)), flush=True)
        return
    if args.profile:
        profile_graph(args.shape, batches[0], args.context, args.kv_cache_dtype, args.quantization, args.launches)
        return
    from engine.loader.random_model import SHAPES
    lines = [f"copy bandwidth: {copy_bandwidth():.0f} GB/s (read + write)"]
    specs = args.attention.split(",") if args.attention else []
    if specs:
        lines += attention_table(SHAPES[args.shape], specs, args.kv_cache_dtype)
        if not (args.gemv_sweep or args.fp8):  # prefill attention alone
            print("\n".join(lines))
            return
    if args.gemv_sweep:
        print("\n".join(lines + gemv_sweep(SHAPES[args.shape], batches, fp8=args.quantization == "fp8")))
        return
    if args.fp8:
        print("\n".join(lines + fp8_table(SHAPES[args.shape], batches)))
        return
    if not args.skip_matmul:
        lines += matmul_table(SHAPES[args.shape], sorted(set(batches + [1, 2, 4, 8])))
    if args.kv_cache_dtype == "auto" and args.quantization is None:
        lines += decode_table(args.shape, batches, args.context, pdl=False)
    lines += decode_table(args.shape, batches, args.context, pdl=True, kv_dtype=args.kv_cache_dtype,
                          quantization=args.quantization)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
