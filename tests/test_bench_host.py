"""bench/host.py's engine run on the CPU stand-in (no GPU): the load completes, and the HTTP-like
delay before each arrival (--arrival-delay-ms) is spent before a request reaches the engine."""

from __future__ import annotations

import asyncio
import random

from bench import host


def run(*extra: str) -> dict:
    args = host.parse_args(["--mode", "engine", "--num-prompts", "24", "--concurrency", "8", "--input-len", "64",
                            "--output-len", "8", "--sim-step-ms", "0.5", *extra])
    return asyncio.run(host.engine_run(args))


def test_engine_run_with_arrival_delays():
    plain = run()
    delayed = run("--arrival-delay-ms", "300")
    for r in (plain, delayed):
        assert r["completed"] == 24 and not r["errors"]
        assert round(r["output_throughput"] * r["duration_s"]) == 24 * 8
    # 24 requests, 8 at a time, each behind a delay of ~300 ms (median) drawn from the run's seeded
    # generator: the 8 slots sleep them one after another, so the load lasts at least their sum over
    # 8 (~1 s), whatever the machine's speed (the plain run: ~0.1-0.4 s); the client's TTFT starts at
    # the submission, after the delay, so it stays the engine's
    rng = random.Random(host.parse_args([]).seed + 2)
    slept = sum(0.3 * rng.lognormvariate(0.0, 0.5) for _ in range(24))
    assert delayed["duration_s"] >= slept / 8 > 0.8
    assert delayed["duration_s"] > plain["duration_s"]
    assert delayed["ttft_ms"]["p50"] < 50
