"""Load with client cancellations, then check the server came back to idle.

    python bench/load_test.py --url http://127.0.0.1:8000 --requests 500 --concurrency 64 --cancel 0.1

Each request streams a completion of `--max-tokens` tokens (ignore_eos) from a random
token-id prompt; a `--cancel` fraction of them is dropped by the client after its first
chunk. Every other request must end with usage.completion_tokens == max_tokens and
finish_reason "length"; no response may be a 5xx. Afterwards /metrics must show no
running or waiting request and the KV cache back to empty. Used by the reliability
tests on the CPU (tests/reliability) and as a GPU run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import Counter

import httpx


async def one(client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int, cancel: bool) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.7, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    out = {"cancel": cancel, "status": None, "tokens": None, "finish": None, "error": None}
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            out["status"] = r.status_code
            if r.status_code != 200:
                out["error"] = (await r.aread()).decode(errors="replace")[:200]
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out["error"] = chunk["error"]["message"]
                    continue
                if cancel and chunk.get("choices"):
                    return out  # leaving the block drops the connection mid-stream
                if chunk.get("usage"):
                    out["tokens"] = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", []):
                    if choice.get("finish_reason"):
                        out["finish"] = choice["finish_reason"]
    except httpx.HTTPError as exc:
        out["error"] = repr(exc)
    return out


async def metrics(client: httpx.AsyncClient) -> dict[str, float]:
    values = {}
    for line in (await client.get("/metrics")).text.splitlines():
        if line.startswith(("cuserve_num_requests_", "cuserve_kv_cache_usage_perc")):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def idle(m: dict[str, float]) -> bool:
    return (m.get("cuserve_num_requests_running") == 0 and m.get("cuserve_num_requests_waiting") == 0
            and m.get("cuserve_kv_cache_usage_perc") == 0)


async def run(url: str, requests: int = 500, concurrency: int = 64, cancel: float = 0.1, max_tokens: int = 8,
              prompt_lens: tuple[int, int] = (4, 16), vocab: int = 30000, seed: int = 0,
              api_key: str | None = None, idle_timeout: float = 60.0) -> dict:
    rng = random.Random(seed)
    plan = [([rng.randrange(100, vocab) for _ in range(rng.randint(*prompt_lens))], rng.random() < cancel)
            for _ in range(requests)]
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=300, headers=headers, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        gate = asyncio.Semaphore(concurrency)

        async def limited(prompt, drop):
            async with gate:
                return await one(client, model, prompt, max_tokens, drop)

        start = time.perf_counter()
        results = await asyncio.gather(*[limited(p, c) for p, c in plan])
        duration = time.perf_counter() - start
        deadline = time.monotonic() + idle_timeout
        after = await metrics(client)
        while time.monotonic() < deadline and not idle(after):
            await asyncio.sleep(0.2)
            after = await metrics(client)
    completed = [r for r in results if not r["cancel"]]
    problems = [r for r in completed if r["status"] != 200 or r["error"] or r["tokens"] != max_tokens
                or r["finish"] != "length"]
    return {
        "requests": requests, "concurrency": concurrency, "cancelled": sum(r["cancel"] for r in results),
        "completed_ok": len(completed) - len(problems), "problems": problems[:5], "num_problems": len(problems),
        "statuses": dict(Counter(r["status"] for r in results)),
        "server_errors": sum(1 for r in results if (r["status"] or 0) >= 500),
        "duration_s": duration, "output_tok_s": max_tokens * (len(completed) - len(problems)) / duration,
        "metrics_after": after, "idle_after": idle(after),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--cancel", type=float, default=0.1)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=30000)
    ap.add_argument("--api-key")
    ap.add_argument("--json")
    args = ap.parse_args()
    summary = asyncio.run(run(args.url, args.requests, args.concurrency, args.cancel, args.max_tokens,
                              vocab=args.vocab, api_key=args.api_key))
    print(json.dumps({k: v for k, v in summary.items() if k != "problems"}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
