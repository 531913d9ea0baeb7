"""HTTP load generator for an OpenAI-compatible server, in the manner of `vllm bench serve`.

    cuserve serve --model random:llama3-8b --max-num-seqs 256 &
    python bench/serve.py --url http://127.0.0.1:8000 --num-prompts 512 --input-len 512 \\
        --output-len 128 --concurrency 256 --json serve.json

Prompts are random token ids of exactly --input-len tokens (sent as token-id prompts to
/v1/completions, streamed, ignore_eos, max_tokens --output-len). Arrivals: all at once
under a concurrency cap, or a Poisson process (--request-rate). Reports request and
output-token throughput and mean / p50 / p99 of TTFT, TPOT (per output token after the
first), ITL (between streamed chunks) and end-to-end latency, in ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx


@dataclass
class Result:
    ok: bool = False
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    error: str = ""


async def one_request(client: httpx.AsyncClient, model: str, prompt: list[int], output_len: int) -> Result:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    result = Result()
    start = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return result
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if "error" in chunk:
                    result.error = chunk["error"]["message"]
                    return result
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices"):
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
        result.e2e = time.perf_counter() - start
        result.ok = result.output_tokens > 0
    except httpx.HTTPError as exc:
        result.error = repr(exc)
    return result


def stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), "p50": float("nan"), "p99": float("nan")}
    s = sorted(values)
    return {"mean": 1e3 * statistics.fmean(s), "p50": 1e3 * s[len(s) // 2],
            "p99": 1e3 * s[min(len(s) - 1, int(0.99 * len(s)))]}


async def run(args) -> dict:
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(100, args.vocab) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(base_url=args.url, timeout=None, limits=limits, headers=headers) as client:
        model = args.model or (await client.get("/v1/models")).json()["data"][0]["id"]
        await one_request(client, model, prompts[0][:16], 4)  # warm-up
        gate = asyncio.Semaphore(args.concurrency)

        async def limited(prompt):
            async with gate:
                return await one_request(client, model, prompt, args.output_len)

        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(limited(prompt)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    ok = [r for r in results if r.ok]
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    summary = {
        "model": model, "num_prompts": args.num_prompts, "completed": len(ok), "failed": len(results) - len(ok),
        "input_len": args.input_len, "output_len": args.output_len, "concurrency": args.concurrency,
        "request_rate": args.request_rate, "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": sum(r.output_tokens for r in ok) / duration,
        "ttft_ms": stats([r.ttft for r in ok]), "tpot_ms": stats(tpot),
        "itl_ms": stats([g for r in ok for g in r.itl]), "e2e_ms": stats([r.e2e for r in ok]),
        "errors": sorted({r.error for r in results if r.error})[:5],
    }
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", help="model id (default: the server's first)")
    ap.add_argument("--api-key")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second")
    ap.add_argument("--vocab", type=int, default=30000, help="prompt token ids are drawn below this")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    args = ap.parse_args()
    summary = asyncio.run(run(args))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    print(f"{summary['completed']}/{args.num_prompts} ok in {summary['duration_s']:.2f}s: "
          f"{summary['request_throughput']:.2f} req/s, {summary['output_throughput']:.1f} output tok/s")
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        s = summary[key]
        print(f"  {key[:-3]:5s} mean {s['mean']:9.2f}  p50 {s['p50']:9.2f}  p99 {s['p99']:9.2f} ms")
    if summary["errors"]:
        print("  errors:", summary["errors"])


if __name__ == "__main__":
    main()
