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


def test_the_stand_in_marks_the_near_end_of_steps_with_prompts_only():
    """As the CUDA runner's: wait_near_end waits for the last quarter of the last step with prompt
    tokens, not of a decode-only step after it (mark_decode: of that one too)."""
    from engine.outputs import ScheduledSeq, SchedulerOutput

    prompt = SchedulerOutput([ScheduledSeq(0, list(range(40)), 0, 0, True)])
    decode = SchedulerOutput([ScheduledSeq(0, [5], 40, 0, True)])
    for mark_decode in (False, True):
        runner = host.SimRunner(0.0, 0.2, 0.001, mark_decode=mark_decode)  # a 40-ms prompt step, 200-ms decode steps
        runner.submit(prompt)
        mark = runner.near_end
        assert mark == runner.busy_until - 0.040 / 4
        runner.submit(decode)  # chained behind it: ends 200 ms later
        assert runner.near_end == (runner.busy_until - 0.2 / 4 if mark_decode else mark)


def test_bunching_counts_arrivals_in_bins():
    """host.bunching: counts in bins of 20 ms between start and end, their p50 / p99 / max; times
    outside the window are left out."""
    times = [0.0, 0.001, 0.002, 0.003, 0.015, 0.05, 0.07, 0.5, 9.0]  # 9.0: past the end
    got = host.bunching(times, 0.0, 0.1)  # 6 bins: 5 in the first (4 at once and 0.015), then 0, 1, 1, 0, 0
    assert got == {"n": 7, "p50": 1, "p99": 5, "max": 5}  # sorted counts 0, 0, 0, 1, 1, 5
    assert host.bunching(times, 0.2, 0.2)["max"] == 0  # an empty window
    assert host.bunching([], 0.0, 1.0) == {"n": 0, "p50": 0, "p99": 0, "max": 0}


def test_engine_run_reports_how_bunched_requests_came_after_the_first_wave():
    r = run()
    # 24 requests 8 at a time: from the 9th arrival (the first sent after another ended) to the last
    assert r["arrivals_per_bin"]["n"] == 24 - 8
    assert 1 <= r["arrivals_per_bin"]["max"] <= 16 and 1 <= r["finishes_per_bin"]["max"]
