"""bench/host.py's engine run on the CPU stand-in (no GPU): the load completes, and the HTTP-like
delay before each arrival (--arrival-delay-ms) is spent before a request reaches the engine."""

from __future__ import annotations

import asyncio

from bench import host


def run(*extra: str) -> dict:
    args = host.parse_args(["--mode", "engine", "--num-prompts", "24", "--concurrency", "8", "--input-len", "64",
                            "--output-len", "8", "--sim-step-ms", "0.5", *extra])
    return asyncio.run(host.engine_run(args))


def test_engine_run_with_arrival_delays():
    plain = run()
    delayed = run("--arrival-delay-ms", "100")
    for r in (plain, delayed):
        assert r["completed"] == 24 and not r["errors"]
        assert round(r["output_throughput"] * r["duration_s"]) == 24 * 8
    # 24 requests, 8 at a time: each of the three in a row behind a ~100 ms (median) delay; the
    # client's TTFT starts at the submission, after the delay, so it stays the engine's
    assert delayed["duration_s"] > plain["duration_s"] + 0.15
    assert delayed["ttft_ms"]["p50"] < 50
