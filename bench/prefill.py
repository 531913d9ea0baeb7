"""Time to first token for one prompt of each length, against the GEMM floor.

    python bench/prefill.py --model random:llama3-8b --lengths 128,512,2048,8192

Each prompt runs alone through the engine (max_tokens 1) in one prefill step
(max_num_batched_tokens = the longest length). The floor is the prefill's FLOPs
(2 x parameters x L for the matrix products, 2 x L^2 x heads x head_dim per layer
for causal attention) at the fp16 GEMM rate measured in the same run with an
8192^3 cuBLAS product; the report gives TTFT / floor (the target is <= 1.4x).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import settings  # noqa: E402
from engine import Engine, EngineConfig, SamplingParams, SchedulerConfig  # noqa: E402
from engine.config import CacheConfig, ModelConfig  # noqa: E402


def gemm_rate(n: int = 8192, repeats: int = 10, fp8: bool = False, fast_accum: bool = False) -> float:
    """cuBLAS FLOP/s on random n x n x n operands: fp16, or (fp8) cuBLASLt's e4m3 product with
    per-row scales (--quantization fp8's, the quantization of x not included; fast_accum as
    the engine's --fp8-accumulation fast)."""
    import cupy as cp

    from bench.kernels import time_gpu
    from kernels_cuda.gemm import gemm, gemm_fp8
    from kernels_cuda.quant import quantize_matrix, quantize_rows
    a = cp.random.standard_normal((n, n), dtype=cp.float32).astype(cp.float16)
    b = cp.random.standard_normal((n, n), dtype=cp.float32).astype(cp.float16)
    out = cp.empty((n, n), cp.float32)
    if fp8:
        aq, _ = quantize_rows(a)
        b8 = quantize_matrix(b)

        def run():
            gemm_fp8(aq, b8, out, fast_accum)
    else:
        def run():
            gemm(a, b, out)
    return 2 * n ** 3 / (time_gpu(run, iters=repeats, warmup=2) * 1e-3)


def prefill_flops(cfg: ModelConfig, length: int) -> float:
    embed = cfg.vocab_size * cfg.hidden_size  # a lookup, not a product (the LM head runs on one row)
    matmul = 2 * (cfg.num_params() - embed) * length
    attention = 2 * length * length * cfg.num_heads * cfg.head_dim * cfg.num_layers  # causal QK^T + PV
    return matmul + attention


def ttft(engine: Engine, length: int, repeats: int) -> float:
    vocab = engine.model_config.vocab_size
    times = []
    for r in range(repeats):
        ids = [(97 * i + 13 * r) % (vocab - 300) + 100 for i in range(length)]
        done = threading.Event()
        out = []

        def sink(o):
            if o.finished:
                out.append(o)
                done.set()
        arrival = time.monotonic()
        engine.add_request(ids, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True), sink, arrival=arrival)
        done.wait(600)
        if out[0].error:
            raise RuntimeError(out[0].error)
        times.append(out[0].timings.first_token - arrival)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:llama3-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--lengths", default="128,256,512,1024,2048,4096,8192")
    ap.add_argument("--repeats", type=int, default=3)
    settings.add_weight_flags(ap, quantization_help="fp8: e4m3 layer weights; the floor then takes the fp8 GEMM "
                              "rate", dtype_help="auto, float16 or bfloat16 (the server's setting; the floor keeps "
                              "the fp16 GEMM rate, which Hopper's bfloat16 products share)")
    ap.add_argument("--json")
    settings.add_flag(ap)
    args = ap.parse_args()
    chosen = settings.from_args(ap, args)
    lengths = [int(x) for x in args.lengths.split(",")]
    longest = max(lengths)
    config = EngineConfig(model=args.model, device=args.device, cache=CacheConfig(kv_cache_bytes=8 << 30),
                          **settings.weight_settings(args),
                          scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=longest,
                                                    max_model_len=longest + 16))
    engine = settings.build_engine(chosen, config)
    engine.start()
    ttft(engine, min(lengths), 1)  # warm-up: compiles the prefill kernels
    fp8 = args.quantization == "fp8"
    rate = gemm_rate(fp8=fp8, fast_accum=args.fp8_accumulation == "fast") if args.device != "cpu" else float("nan")
    rows = []
    for length in lengths:
        seconds = ttft(engine, length, args.repeats)
        floor = prefill_flops(engine.model_config, length) / rate
        rows.append({"length": length, "ttft_ms": 1e3 * seconds, "prefill_tok_s": length / seconds,
                     "floor_ms": 1e3 * floor, "ratio": seconds / floor})
    engine.shutdown()
    print(f"model={args.model} {'fp8' if fp8 else 'fp16'} GEMM rate {rate / 1e12:.0f} TFLOP/s (8192^3, same run)")
    print(f"{'length':>7} {'TTFT ms':>9} {'tok/s':>10} {'floor ms':>9} {'TTFT/floor':>11}")
    for r in rows:
        print(f"{r['length']:>7} {r['ttft_ms']:>9.2f} {r['prefill_tok_s']:>10.0f} {r['floor_ms']:>9.2f} "
              f"{r['ratio']:>10.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "gemm_tflops": rate / 1e12, "rows": rows},
                                              indent=1))


if __name__ == "__main__":
    main()
