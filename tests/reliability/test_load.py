"""500 streamed requests at 64 concurrent, 10 % dropped by the client mid-stream."""

from __future__ import annotations

import asyncio

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
