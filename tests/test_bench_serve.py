"""bench/serve.py: its reading of the server's latency histograms (GET /metrics), by which an HTTP
load reports the server's own TTFT and queue time beside the client's; --serve's servers started
in turn and their loads compared."""

from __future__ import annotations

import math

import pytest

from bench.serve import SERVER_HISTOGRAMS, histogram_delta, parse_histograms
from server.metrics import Metrics


def reading(metrics: Metrics) -> dict:
    hists = (metrics.ttft, metrics.queue, metrics.inbox, metrics.loop_lag)
    return parse_histograms("\n".join(line for h in hists for line in h.render()), SERVER_HISTOGRAMS.values())


def test_the_load_s_share_of_the_server_s_histograms():
    metrics = Metrics()
    ttft, queue = SERVER_HISTOGRAMS["server_ttft_ms"], SERVER_HISTOGRAMS["server_queue_ms"]
    for v in (0.05, 0.07):  # before the load: not counted
        metrics.ttft.observe(v)
    before = reading(metrics)
    assert set(before) == set(SERVER_HISTOGRAMS.values())
    values = (0.11, 0.12, 0.13, 0.14, 0.18, 0.25, 12.0)  # the last past every finite bound but 20 s
    for v in values:
        metrics.ttft.observe(v)
    after = reading(metrics)
    got = histogram_delta(before[ttft], after[ttft])
    assert got["requests"] == len(values)
    assert math.isclose(got["mean"], 1e3 * sum(values) / len(values))
    # the 4th of 7 lies in (0.1, 0.15], which holds 4 of them: 0.1 + 0.05 * 3.5 / 4
    assert math.isclose(got["p50"], 1e3 * (0.1 + 0.05 * 3.5 / 4))
    # the p99's rank, 6.93, lies in (10, 20], which holds the 7th alone: 10 + 10 * 0.93
    assert math.isclose(got["p99"], 1e3 * (10.0 + 10.0 * 0.93))
    assert histogram_delta(before[queue], after[queue]) is None  # nothing queued meanwhile


def test_a_server_without_the_histograms_gives_none():
    assert parse_histograms("# a server of another kind\nrequests_total 3\n", SERVER_HISTOGRAMS.values()) == {}


def test_the_queue_time_and_its_part_before_the_engine_took_the_request_in():
    """A first token's timings: the queue time (arrival to the first step) and, where the engine
    stamped when its loop took the request from its inbox, the part before that."""
    from engine.request import RequestTimings
    metrics = Metrics()
    before = reading(metrics)
    metrics.on_first_token(RequestTimings(arrival=10.0, received=10.004, first_scheduled=10.05, first_token=10.09))
    metrics.on_first_token(RequestTimings(arrival=20.0, first_scheduled=20.03, first_token=20.07))  # no stamp
    after = reading(metrics)
    queue, inbox = (histogram_delta(before[SERVER_HISTOGRAMS[k]], after[SERVER_HISTOGRAMS[k]])
                    for k in ("server_queue_ms", "server_inbox_ms"))
    assert queue["requests"] == 2 and math.isclose(queue["mean"], 40.0)
    assert inbox["requests"] == 1 and math.isclose(inbox["mean"], 4.0)
    assert 2.0 <= inbox["p50"] <= 5.0  # within its bucket, (2, 5] ms


def test_the_server_s_loop_lag_counts_a_blocked_loop():
    """Metrics.watch_loop: a callback that holds the loop for 60 ms makes the 10-ms timer fire
    ~50 ms late, and the histogram shows it."""
    import asyncio
    import time

    metrics = Metrics()

    async def main():
        watch = asyncio.create_task(metrics.watch_loop(0.01))
        await asyncio.sleep(0.05)  # idle: a few on-time samples
        idle = metrics.loop_lag.count
        time.sleep(0.06)  # the loop held, as by a burst of work
        await asyncio.sleep(0.03)
        watch.cancel()
        return idle
    idle = asyncio.run(main())
    lag = metrics.loop_lag
    assert idle >= 2 and lag.count > idle
    late = sum(n for bound, n in zip(lag.buckets, lag.counts) if bound > 0.02) + lag.counts[-1]
    assert late >= 1  # the blocked interval, ~0.05 s late
    assert lag.sum >= 0.03


def test_serve_starts_servers_in_turn_runs_the_loads_and_stops_them(smollm2_path, tmp_path):
    """bench/serve.py --serve A --serve B --loads 2: `cuserve serve` (SmolLM2 on the CPU) with each
    set of flags in turn, two loads each, every load reported and in the JSON's list with its server;
    each server's own log; the two compared at the end; no server left afterwards."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    import httpx
    root = Path(__file__).resolve().parent.parent
    out, log = tmp_path / "serve.json", tmp_path / "server.log"
    flags = f"--model {smollm2_path} --device cpu --max-model-len 256 --kv-cache-gib 1 --max-num-seqs "
    result = subprocess.run(
        [sys.executable, "bench/serve.py", "--serve", flags + "4", "--serve", flags + "2", "--serve-log", str(log),
         "--loads", "2", "--num-prompts", "4", "--input-len", "8", "--output-len", "3", "--concurrency", "2",
         "--vocab", "1000", "--no-gpu-clocks", "--json", str(out)], cwd=root, capture_output=True, text=True,
        timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    loads = json.loads(out.read_text())
    assert [(s["server"], s["round"], s["load"]) for s in loads] == [("A", 1, 1), ("A", 1, 2), ("B", 1, 1), ("B", 1, 2)]
    assert [s["serve"] for s in loads] == [flags + "4"] * 2 + [flags + "2"] * 2
    assert all(s["completed"] == 4 and s["failed"] == 0 and not s["errors"] for s in loads), loads
    assert "server B, round 1, load 2 of 2:" in result.stdout and "servers compared" in result.stdout
    for label in "AB":
        log_path = tmp_path / f"server-{label}1.log"
        assert f"(log: {log_path})" in result.stdout and log_path.read_text()  # each server's own log
    for url in (line.split(" ready at ", 1)[1].split()[0] for line in result.stdout.splitlines()
                if " ready at " in line):
        with pytest.raises(httpx.HTTPError):  # stopped after its loads
            httpx.get(url + "/health", timeout=2)


def test_compare_puts_each_servers_loads_side_by_side():
    from bench.serve import compare

    def load(server, tok, ttft):
        return {"server": server, "serve": f"--flags-{server}", "output_throughput": tok, "ttft_ms": {"p50": ttft}}

    lines = compare([load("A", 100.0, 10.0), load("B", 102.0, 11.0), load("A", 102.0, 12.0), load("B", 104.0, 13.0)])
    assert lines == [
        "servers compared (loads in the order run):",
        "  A: 2 loads, output tok/s 100.0 / 102.0, mean 101.0 (1.0000x A); TTFT p50 10.0 / 12.0 ms",
        "     cuserve serve --flags-A",
        "  B: 2 loads, output tok/s 102.0 / 104.0, mean 103.0 (1.0198x A); TTFT p50 11.0 / 13.0 ms",
        "     cuserve serve --flags-B"]
    goal = compare([load("A", 100.0, 10.0), load("A", 102.0, 12.0), load("A", 103.0, 11.5)], goal=(101.0, 11.5))
    assert goal[-1] == ("     goal >= 101 tok/s with TTFT p50 <= 11.5 ms: throughput in 2, TTFT in 2, both in 1 "
                        "of 3 loads")
    failed = compare([load("A", 0.0, 0.0), load("B", 50.0, 9.0)])  # A's loads all failed: no ratio to it
    assert failed[3] == "  B: 1 loads, output tok/s 50.0, mean 50.0 (A produced nothing); TTFT p50 9.0 ms"
