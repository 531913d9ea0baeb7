"""bench/serve.py's reading of the server's latency histograms (GET /metrics), by which an HTTP
load reports the server's own TTFT and queue time beside the client's."""

from __future__ import annotations

import math

from bench.serve import SERVER_HISTOGRAMS, histogram_delta, parse_histograms
from server.metrics import Metrics


def reading(metrics: Metrics) -> dict:
    return parse_histograms("\n".join(metrics.ttft.render() + metrics.queue.render()), SERVER_HISTOGRAMS.values())


def test_the_load_s_share_of_the_server_s_histograms():
    metrics = Metrics()
    ttft, queue = SERVER_HISTOGRAMS["server_ttft_ms"], SERVER_HISTOGRAMS["server_queue_ms"]
    for v in (0.05, 0.07):  # before the load: not counted
        metrics.ttft.observe(v)
    before = reading(metrics)
    assert set(before) == {ttft, queue}
    values = (0.11, 0.12, 0.13, 0.14, 0.18, 0.25, 12.0)  # the last past every finite bound but 20 s
    for v in values:
        metrics.ttft.observe(v)
    after = reading(metrics)
    got = histogram_delta(before[ttft], after[ttft])
    assert got["requests"] == len(values)
    assert math.isclose(got["mean"], 1e3 * sum(values) / len(values))
    # the 4th of 7 lies in (0.1, 0.15], which holds 4 of them: 0.1 + 0.05 * 3.5 / 4
    assert math.isclose(got["p50"], 1e3 * (0.1 + 0.05 * 3.5 / 4))
    assert histogram_delta(before[queue], after[queue]) is None  # nothing queued meanwhile


def test_a_server_without_the_histograms_gives_none():
    assert parse_histograms("# a server of another kind\nrequests_total 3\n", SERVER_HISTOGRAMS.values()) == {}
