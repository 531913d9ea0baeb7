"""/metrics in the Prometheus text format (0.0.4), without a client library.

Gauges and counters are read from the engine at scrape time (an engine process sends them
with every step's outputs); histograms are fed by the engine's observer hooks and by the
HTTP layer, under one lock.
"""

from __future__ import annotations

import asyncio
import bisect
import threading
from typing import TYPE_CHECKING

from engine.engine import EngineObserver

if TYPE_CHECKING:
    from engine.engine import EngineAPI
    from engine.request import RequestTimings

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                   2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
PREFIX = "cuserve_"
# the event loop's lag: how late a timer of LOOP_LAG_INTERVAL_S fires (Metrics.watch_loop). Under
# hundreds of streams the loop's work a token can outgrow it (H200, 8B fp8, 256 streams: 97 % of a
# core in decode-only steps, a callback waiting ~12 ms at the median; forty-third session), and
# then a request's first token, its last, and new requests all wait behind the stream of tokens
LOOP_LAG_INTERVAL_S = 0.01
LOOP_LAG_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)


class Histogram:
    def __init__(self, name: str, help: str, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.name, self.help, self.buckets = PREFIX + name, help, buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, n in zip(self.buckets, self.counts):
            cumulative += n
            lines.append(f'{self.name}_bucket{{le="{bound}"}} {cumulative}')
        lines.append(f'{self.name}_bucket{{le="+Inf"}} {self.count}')
        lines.append(f"{self.name}_sum {self.sum}")
        lines.append(f"{self.name}_count {self.count}")
        return lines


def _metric(name: str, kind: str, help: str, samples: list[tuple[str, float]]) -> list[str]:
    lines = [f"# HELP {PREFIX}{name} {help}", f"# TYPE {PREFIX}{name} {kind}"]
    lines += [f"{PREFIX}{name}{labels} {value}" for labels, value in samples]
    return lines


class Metrics(EngineObserver):
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.ttft = Histogram("time_to_first_token_seconds", "Time from arrival to the first output token.")
        self.itl = Histogram("inter_token_latency_seconds", "Time between two output tokens of a sequence.")
        self.e2e = Histogram("e2e_request_latency_seconds", "Time from arrival to the last output.")
        self.queue = Histogram("request_queue_time_seconds", "Time from arrival to the first scheduled step.")
        self.loop_lag = Histogram("event_loop_lag_seconds", "How late the HTTP event loop ran a timer: the time "
                                  "a callback waited behind the loop's other work (sampled every "
                                  f"{LOOP_LAG_INTERVAL_S * 1e3:g} ms).", LOOP_LAG_BUCKETS)
        self.http: dict[tuple[str, int], int] = {}

    # engine observer hooks (the thread that delivers the engine's outputs)
    def on_first_token(self, t: RequestTimings) -> None:
        with self._lock:
            self.ttft.observe(t.first_token - t.arrival)
            if t.first_scheduled is not None:
                self.queue.observe(t.first_scheduled - t.arrival)

    def on_token_gap(self, seconds: float) -> None:
        with self._lock:
            self.itl.observe(seconds)

    def on_finished(self, t: RequestTimings) -> None:
        with self._lock:
            self.e2e.observe(t.finished - t.arrival)

    # HTTP layer (event loop thread)
    async def watch_loop(self, interval: float = LOOP_LAG_INTERVAL_S) -> None:
        """Observe the running loop's lag forever: sleep `interval`, record how much later than
        that the loop came back (cancel the task to stop)."""
        loop = asyncio.get_running_loop()
        while True:
            start = loop.time()
            await asyncio.sleep(interval)
            lag = max(0.0, loop.time() - start - interval)
            with self._lock:
                self.loop_lag.observe(lag)

    def count_http(self, path: str, status: int) -> None:
        with self._lock:
            self.http[(path, status)] = self.http.get((path, status), 0) + 1

    def render(self, engine: EngineAPI | None) -> str:
        lines: list[str] = []
        if engine is not None:
            gauges, stats = engine.gauges(), engine.stats
            lines += _metric("num_requests_running", "gauge", "Requests with sequences in the running batch.",
                             [("", gauges.running)])
            lines += _metric("num_requests_waiting", "gauge", "Requests queued or preempted.",
                             [("", gauges.waiting)])
            lines += _metric("kv_cache_usage_perc", "gauge", "Fraction of the KV cache owned by sequences (0-1).",
                             [("", gauges.kv_usage)])
            lines += _metric("prompt_tokens_total", "counter", "Prompt tokens admitted.",
                             [("", stats.prompt_tokens)])
            lines += _metric("generation_tokens_total", "counter", "Tokens generated.",
                             [("", stats.generation_tokens)])
            lines += _metric("request_success_total", "counter", "Finished sequences by finish reason.",
                             [(f'{{finished_reason="{k}"}}', v) for k, v in sorted(stats.requests_finished.items())]
                             or [('{finished_reason="stop"}', 0)])
            lines += _metric("num_preemptions_total", "counter", "Sequences preempted to free KV memory.",
                             [("", gauges.preemptions)])
            lines += _metric("num_catch_up_steps_total", "counter",
                             "Engine steps that took catch_up_tokens more to drain a queue that steps passed over.",
                             [("", gauges.catch_up_steps)])
            lines += _metric("engine_step_errors_total", "counter", "Engine steps the runner failed.",
                             [("", stats.step_errors)])
            if gauges.roofline_fraction is not None:
                lines += _metric("decode_roofline_fraction", "gauge",
                                 "Last decode step timed (one in 8): bytes read / (step time x measured bandwidth).",
                                 [("", gauges.roofline_fraction)])
        with self._lock:
            for hist in (self.ttft, self.itl, self.e2e, self.queue, self.loop_lag):
                lines += hist.render()
            lines += _metric("http_requests_total", "counter", "HTTP responses by path and status.",
                             [(f'{{path="{p}",status="{s}"}}', n) for (p, s), n in sorted(self.http.items())])
        return "\n".join(lines) + "\n"
