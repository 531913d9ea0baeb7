"""Engine-level decode throughput (no HTTP): B concurrent requests, ignore_eos.

    python bench/decode.py --model SmolLM2-135M-Instruct --device cpu --batch 1,8,32

    python bench/decode.py --model random:llama3-8b --device cuda --batch 1,32,128 --prompt-len 512

    python bench/decode.py --model SmolLM2-135M-Instruct --device cuda --batch 1 --temperature 0.8 --top-p 0.9

For each batch size: B requests of `--prompt-len` tokens each, submitted at once to
the engine running on its own thread (as under the server), each generating
`--max-tokens` tokens. Reports output tokens/s over the whole run; decode tokens/s at
batch B, B over the median step of those that decode every request (ms/step); the decode
phase's tokens/s (from the last first-token to the end: the tokens sampled after it over
that time, so with the tail where early requests have finished and the batch shrinks); and on
the GPU the fraction of the HBM roofline: the bytes a decode step must read (every
weight once, plus the K/V of the batch at its mean context) over the device-to-device
copy bandwidth measured in the same run, against the median step time.
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
from engine.config import CacheConfig  # noqa: E402
from engine.engine import freeze_long_lived  # noqa: E402


def run_batch(engine: Engine, batch: int, prompt_len: int, max_tokens: int, sampling: dict | None = None) -> dict:
    """One run of `batch` requests; the decode phase runs from the last request's first
    token to the end, and counts only the tokens sampled in it: steps after the one that
    gave that first token (requests admitted early have decoded some of their tokens
    before it). The step time is the median of the steps that sample a token for every
    request (falling back to the last three quarters of all steps). sampling: SamplingParams'
    temperature / top_p / top_k (default greedy), each request seeded by its index."""
    vocab = engine.model_config.vocab_size
    prompts = [[(17 + 31 * i + 7 * j) % (vocab - 300) + 100 for j in range(prompt_len)] for i in range(batch)]
    sampling = sampling or {"temperature": 0.0}
    params = [SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=i, **sampling) for i in range(batch)]
    done = threading.Event()
    finished = []
    steps: list[tuple[float, float, int]] = []  # (end, seconds, rows that sample)
    engine.on_step = lambda _engine, out, seconds: steps.append(
        (time.monotonic(), seconds, sum(row.sample for row in out.seqs)))

    def sink(out):  # called on the engine thread
        if out.finished:
            finished.append(out)
            if len(finished) == batch:
                done.set()

    start = time.perf_counter()
    for p, sp in zip(prompts, params):
        engine.add_request(p, sp, sink)
    if not done.wait(3600):
        raise TimeoutError("benchmark did not finish")
    end = time.perf_counter()
    engine.on_step = None
    errors = [o.error for o in finished if o.error]
    if errors:
        raise RuntimeError(errors[0])
    last_first = max(o.timings.first_token for o in finished)
    # the step that gave the last first token ends (on_step) just after it was stamped
    first_after = next(i for i, (t, _, _) in enumerate(steps) if t >= last_first) + 1
    decode_tokens = sum(rows for _, _, rows in steps[first_after:])
    decode_seconds = max(o.timings.finished for o in finished) - last_first
    full = [s for _, s, rows in steps if rows == batch]
    step_s = statistics.median(full or [s for _, s, _ in steps[len(steps) // 4:]] or [s for _, s, _ in steps])
    result = {
        "batch": batch, "prompt_len": prompt_len, "max_tokens": max_tokens,
        "total_s": end - start,
        "tok_s": batch * max_tokens / (end - start),
        "decode_tokens": decode_tokens,
        "decode_tok_s": batch / step_s,  # steady decoding: every request decodes each step
        "phase_tok_s": decode_tokens / decode_seconds if decode_seconds > 0 else float("nan"),
        "step_ms_median": 1e3 * step_s,
        "full_steps": len(full),
        "steps": [(round(1e3 * sec, 4), rows) for _, sec, rows in steps],  # (ms, rows that sample), in order
    }
    runner = engine.runner
    if hasattr(runner, "decode_step_bytes"):
        mean_context = prompt_len + max_tokens // 2
        floor_s = runner.decode_step_bytes(batch * mean_context, batch) / runner.copy_bandwidth
        result.update(roofline_tok_s=batch / floor_s, roofline_pct=100 * floor_s / step_s,
                      bandwidth_gb_s=runner.copy_bandwidth / 1e9)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--kv-cache-gib", type=float, default=None)
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto or fp8 (e4m3)")
    settings.add_weight_flags(ap)
    ap.add_argument("--schedule-prompts-ahead", action=argparse.BooleanOptionalAction, default=True,
                    help="as the server's setting (--no-schedule-prompts-ahead: off)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the default)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=None)
    ap.add_argument("--json", help="write the results here")
    settings.add_flag(ap)
    args = ap.parse_args()
    chosen = settings.from_args(ap, args)
    sampling = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}
    batches = [int(b) for b in args.batch.split(",")]
    kv = int(args.kv_cache_gib * 2**30) if args.kv_cache_gib else None
    config = EngineConfig(model=args.model, device=args.device, **settings.weight_settings(args),
                          cache=CacheConfig(kv_cache_bytes=kv, kv_cache_dtype=args.kv_cache_dtype),
                          scheduler=SchedulerConfig(max_num_seqs=max(batches), max_waiting=max(batches),
                                                    max_num_batched_tokens=max(2048, max(batches)),
                                                    max_model_len=args.prompt_len + args.max_tokens + 16,
                                                    prompts_ahead=args.schedule_prompts_ahead))
    engine = settings.build_engine(chosen, config)
    engine.start()
    run_batch(engine, 1, args.prompt_len, 8)  # warm-up: compile, allocate, touch memory
    freeze_long_lived()  # as the engine process does: no full collection walks the model mid-run
    results = [run_batch(engine, b, args.prompt_len, args.max_tokens, sampling) for b in batches]
    engine.shutdown()
    device = getattr(engine.runner, "device", "?")
    print(f"model={args.model} device={device} dtype={args.dtype} kv_cache_dtype={args.kv_cache_dtype} "
          f"quantization={args.quantization}{' (LM head too)' * args.quantize_lm_head} prompt_len={args.prompt_len} "
          f"max_tokens={args.max_tokens} temperature={args.temperature} top_p={args.top_p} top_k={args.top_k}"
          + (f" bandwidth={results[0]['bandwidth_gb_s']:.0f} GB/s" if "bandwidth_gb_s" in results[0] else ""))
    print(f"{'batch':>6} {'tok/s':>10} {'decode tok/s':>13} {'ms/step':>9} {'phase tok/s':>12} {'roofline tok/s':>15} "
          f"{'% roofline':>11}")
    for r in results:
        roof = (f"{r['roofline_tok_s']:>15.1f} {r['roofline_pct']:>10.1f}%" if "roofline_pct" in r else "")
        print(f"{r['batch']:>6} {r['tok_s']:>10.1f} {r['decode_tok_s']:>13.1f} {r['step_ms_median']:>9.2f} "
              f"{r['phase_tok_s']:>12.1f} {roof}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
