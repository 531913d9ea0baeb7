"""500 streamed requests at 64 concurrent, 10 % dropped by the client mid-stream."""

from __future__ import annotations

import asyncio

import pytest

from bench.load_test import run


def test_load_with_cancellations(busy_server):
    summary = asyncio.run(run(busy_server.url, requests=500, concurrency=64, cancel=0.1, max_tokens=6,
                              prompt_lens=(4, 12)))
    assert summary["server_errors"] == 0, summary["statuses"]
    assert summary["num_problems"] == 0, summary["problems"]
    assert summary["cancelled"] >= 30  # ~10 % of 500
    assert summary["completed_ok"] == 500 - summary["cancelled"]
    assert summary["idle_after"], summary["metrics_after"]  # 0 running, 0 waiting, KV back to empty
    assert busy_server.proc.poll() is None


def test_serve_bench_from_two_client_processes(busy_server):
    from bench import serve
    args = serve.parse_args(["--url", busy_server.url, "--num-prompts", "12", "--input-len", "8",
                             "--output-len", "5", "--concurrency", "6", "--processes", "2", "--vocab", "40000",
                             "--save-detailed"])
    summary = serve.run(args)
    assert summary["completed"] == 12 and summary["failed"] == 0, summary["errors"]
    assert summary["output_throughput"] == 12 * 5 / summary["duration_s"]
    assert 0 < summary["ttft_ms"]["p50"] <= summary["e2e_ms"]["p50"]
    # --save-detailed: every request, from both processes, in the order sent, on one clock
    requests = summary["requests"]
    assert len(requests) == 12 and requests[0]["start_s"] == 0.0
    assert [r["start_s"] for r in requests] == sorted(r["start_s"] for r in requests)
    assert requests[-1]["start_s"] < summary["duration_s"]
    assert all(0 < r["ttft_ms"] <= r["e2e_ms"] and r["output_tokens"] == 5 and r["error"] is None for r in requests)
    assert sorted(r["ttft_ms"] for r in requests)[6] == pytest.approx(summary["ttft_ms"]["p50"], abs=1e-3)


@pytest.mark.parametrize("where", ["thread", "process"])
def test_serve_bench_engine_mode_traces_every_step(smollm2_path, tmp_path, where, monkeypatch):
    import asyncio as aio
    import json
    import sys
    from pathlib import Path

    from bench import serve
    trace = tmp_path / "trace.json"
    # two token budgets: the load runs once per budget on one engine, a summary and a trace each
    args = serve.parse_args(["--engine", smollm2_path, "--device", "cpu", "--num-prompts", "6", "--input-len", "40",
                             "--output-len", "4", "--concurrency", "3", "--max-num-batched-tokens", "64,24",
                             "--max-num-seqs", "3", "--vocab", "40000", "--trace", str(trace)]
                            + (["--engine-process", "--set", "engine.engine.LATE_AHEAD_ARRIVALS_S=1.0"]
                               if where == "process" else
                               ["--kernel-trace", str(tmp_path / "kt"), "--kernel-trace-steps", "2,3"]))
    if where == "thread":  # a stand-in for torch.profiler (bench/kernel_trace.py): when it runs, what it writes
        from bench import kernel_trace
        calls = []

        class Recorder:
            def export_chrome_trace(self, path):
                calls.append(("export", path))
                Path(path).write_text(json.dumps({"traceEvents": [
                    {"cat": "kernel", "name": n, "ts": t, "dur": 5} for n, t in (("embedding", 0), ("embedding", 9))]}))

        def steps_so_far() -> int:  # the step trace of the on_step that calls start / stop
            return len(sys._getframe(2).f_locals["trace"])

        def start():
            calls.append(("start", steps_so_far()))
            return Recorder()

        def stop(prof):
            calls.append(("stop", steps_so_far()))
        monkeypatch.setattr(kernel_trace, "start", start)
        monkeypatch.setattr(kernel_trace, "stop", stop)
    summaries = aio.run(serve.run_engine(args))
    traces = json.loads(trace.read_text())
    if where == "thread":  # steps 3-5 of each load recorded, a trace written for each budget and summarized
        paths = [str((tmp_path / "kt" / f"kernels-{budget}.json").resolve()) for budget in (64, 24)]
        assert calls == [("start", 2), ("stop", 5), ("export", paths[0]), ("start", 2), ("stop", 5), ("export", paths[1])]
        assert [s["kernel_trace"]["kinds"]["decode"]["span_us_p50"] for s in summaries] == [5, 5]
    assert [s["max_num_batched_tokens"] for s in summaries] == [64, 24] and len(traces) == 2
    assert all(s["settings"] == (["engine.engine.LATE_AHEAD_ARRIVALS_S=1.0"] if where == "process" else [])
               for s in summaries)
    for summary, steps in zip(summaries, traces):
        assert summary["completed"] == 6 and summary["output_throughput"] == 6 * 4 / summary["duration_s"]
        assert sum(t[1] for t in steps) == 6 * 40  # every prompt token, once
        assert sum(t[0] for t in steps) == 6 * 3  # every token after a request's first is one decode row
        # within the budget, or half as much more in steps that catch up with a short queue
        assert max(t[0] + t[1] for t in steps) <= summary["max_num_batched_tokens"] * 3 // 2
        assert sum(k["steps"] for k in summary["steps"].values()) == len(steps)
        assert abs(sum(k["seconds"] for k in summary["steps"].values()) - summary["step_seconds"]) < 1e-6
        assert summary["step_seconds"] <= summary["duration_s"] * 1.01
    # 40-token prompts in 64-token steps: some prefills share a step with decodes, some are chunked
    assert {"decode", "mixed"} <= set(summaries[0]["steps"])


def test_serve_bench_budget_list_needs_engine_mode(capsys):
    from bench import serve
    for argv, message in ((["--max-num-batched-tokens", "2048,8192"], "need --engine"),
                          (["--engine", "x", "--max-num-batched-tokens", "2048,lots"], "expected integers"),
                          (["--kernel-trace", "out"], "needs --engine"),
                          (["--engine", "x", "--kernel-trace", "out", "--kernel-trace-steps", "5"], "FIRST,COUNT")):
        with pytest.raises(SystemExit):
            serve.parse_args(argv)
        assert message in capsys.readouterr().err
    assert serve.parse_args(["--engine", "x", "--max-num-batched-tokens", "2048,8192"]).budgets == [2048, 8192]


def test_host_bench_engine_alone_runs_the_cost_model():
    """bench/host.py: the stand-in GPU is busy exactly as the cost model says for the load's
    prompt tokens and decode rows (base 0; a budget that never splits a prompt)."""
    import asyncio as aio

    from bench import host
    args = host.parse_args(["--num-prompts", "12", "--concurrency", "4", "--input-len", "24", "--output-len", "6",
                            "--max-num-batched-tokens", "256", "--sim-step-ms", "0", "--sim-decode-ms", "0.5",
                            "--sim-prompt-us", "40", "--mode", "engine"])
    s = aio.run(host.engine_run(args))
    assert s["completed"] == 12 and s["failed"] == 0, s["errors"]
    assert s["gpu_busy_s"] == pytest.approx(12 * 5 * 0.5e-3 + 12 * 24 * 40e-6)
    assert s["engine_ttft_ms"]["p50"] > 0 and s["engine_queue_ms"]["p50"] >= 0
    assert sum(k["steps"] for k in s["idle_before"].values()) >= 6  # 12 prompts + 5 tokens after each, 4 at a time


def test_host_bench_over_http_reports_the_server_share():
    from bench import host
    args = host.parse_args(["--num-prompts", "8", "--concurrency", "4", "--input-len", "16", "--output-len", "5",
                            "--processes", "1", "--mode", "http"])
    s = host.http_run(args)
    assert s["completed"] == 8 and s["failed"] == 0, s["errors"]
    assert s["tokens"] == 8 * 5 + 4  # and the client's warm-up request of 4 tokens
    assert s["server_cpu_s"] > 0 and s["server_cpu_us_per_token"] == s["server_cpu_s"] / s["tokens"] * 1e6
    assert s["gpu_busy_s"] > 0 and len(s["engine_ttft_ms"]) and s["engine_ttft_ms"]["p50"] > 0


def test_decode_bench_counts_only_the_decode_phase_tokens():
    """bench/decode.py on the stand-in runner: requests admitted one a step have decoded some
    tokens before the last one's first token; those are not counted in the decode phase, and
    the step time is that of the steps that decode every request (base + 4 rows), not of the
    tail where the batch shrinks."""
    from bench import decode, host
    args = host.parse_args(["--max-num-seqs", "4", "--max-num-batched-tokens", "32", "--input-len", "24",
                            "--output-len", "8", "--sim-step-ms", "2", "--sim-decode-ms", "1", "--sim-prompt-us", "100"])
    engine = host.build_engine(args)
    engine.start()
    try:
        r = decode.run_batch(engine, 4, 24, 8)
    finally:
        engine.shutdown()
    assert 7 <= r["decode_tokens"] < 4 * 7  # the last request's 7, and less than every request's 7
    assert r["full_steps"] >= 1
    # a 4-row decode step (2 + 4 x 1 ms; slack for the host's timers both ways: a step is timed
    # from when the host saw the one before end, a little after the stand-in's device did), not
    # the shrinking tail's
    assert 5.8 <= r["step_ms_median"] < 10.0
    assert r["decode_tok_s"] == pytest.approx(4e3 / r["step_ms_median"])
    assert sum(rows for _, rows in r["steps"]) == 4 * 8 and sum(rows == 4 for _, rows in r["steps"]) == r["full_steps"]
