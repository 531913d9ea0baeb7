"""/metrics in the Prometheus text format (0.0.4), without a client library.

Gauges and counters are read from the engine at scrape time (an engine process sends them
with every step's outputs); histograms are fed by the engine's observer hooks and by the
HTTP layer, under one lock.

With several HTTP server processes (`--api-server-count`), a scrape reaches one of them, and
each must answer for all: every histogram and HTTP counter lives in a table of float64 cells
shared by the processes, a row each. A process adds to its own row only; a scrape sums the rows.
"""

from __future__ import annotations

import asyncio
import bisect
import multiprocessing
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
# the HTTP counters' cells: one per (path, status), the app's paths (and "other") in a fixed order
HTTP_STATUSES = range(100, 600)
MAX_PATHS = 32


def _rows(shared, width: int) -> list[memoryview]:
    cells = memoryview(shared).cast("B").cast("d")
    return [cells[i * width:(i + 1) * width] for i in range(len(cells) // width)]


def _sums(rows: list[memoryview], start: int, width: int) -> list[float]:
    """Cells [start, start + width) summed over the rows (the processes)."""
    return [sum(cells) for cells in zip(*(row[start:start + width] for row in rows))]


class Histogram:
    """Cells [base, base + width) of a metrics table: a count per bucket (+Inf last), the sum, the
    count. `observe` adds to this process's row (`row`); `render` sums every row. Without a
    table it has one row of its own."""

    def __init__(self, name: str, help: str, buckets: tuple[float, ...] = LATENCY_BUCKETS,
                 rows: list[memoryview] | None = None, row: int = 0, base: int = 0) -> None:
        self.name, self.help, self.buckets = PREFIX + name, help, buckets
        self.width = len(buckets) + 3
        if rows is None:
            rows = _rows(bytearray(8 * self.width), self.width)
        self.rows, self.mine, self.base = rows, rows[row], base

    def observe(self, value: float) -> None:
        mine, base, n = self.mine, self.base, len(self.buckets)
        mine[base + bisect.bisect_left(self.buckets, value)] += 1
        mine[base + n + 1] += value
        mine[base + n + 2] += 1

    def totals(self) -> list[float]:
        return _sums(self.rows, self.base, self.width)

    @property
    def count(self) -> int:
        return int(self.totals()[-1])

    @property
    def sum(self) -> float:
        return self.totals()[-2]

    @property
    def counts(self) -> list[int]:
        """Observations a bucket (not cumulative), +Inf's last, over every row."""
        return [int(c) for c in self.totals()[:len(self.buckets) + 1]]

    def render(self) -> list[str]:
        totals = self.totals()
        n = len(self.buckets)
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, count in zip(self.buckets, totals):
            cumulative += int(count)
            lines.append(f'{self.name}_bucket{{le="{bound}"}} {cumulative}')
        lines.append(f'{self.name}_bucket{{le="+Inf"}} {int(totals[n + 2])}')
        lines.append(f"{self.name}_sum {totals[n + 1]}")
        lines.append(f"{self.name}_count {int(totals[n + 2])}")
        return lines


def _metric(name: str, kind: str, help: str, samples: list[tuple[str, float]]) -> list[str]:
    lines = [f"# HELP {PREFIX}{name} {help}", f"# TYPE {PREFIX}{name} {kind}"]
    lines += [f"{PREFIX}{name}{labels} {value}" for labels, value in samples]
    return lines


class Metrics(EngineObserver):
    """The server's histograms and HTTP counters. `processes` > 1 makes a table that many HTTP
    processes share (`shared`, a RawArray to hand to the others as a Process argument); another
    process passes that `shared` and its own `process` index."""

    def __init__(self, processes: int = 1, shared=None, process: int = 0) -> None:
        self._lock = threading.Lock()
        specs = [("time_to_first_token_seconds", "Time from arrival to the first output token.", LATENCY_BUCKETS),
                 ("inter_token_latency_seconds", "Time between two output tokens of a sequence.", LATENCY_BUCKETS),
                 ("e2e_request_latency_seconds", "Time from arrival to the last output.", LATENCY_BUCKETS),
                 ("request_queue_time_seconds", "Time from arrival to the first scheduled step.", LATENCY_BUCKETS),
                 # of which the part before the scheduler saw it: a time of a few ms, as the loop's lag
                 ("request_inbox_time_seconds", "Time from arrival to the engine taking the request in: its trip to "
                  "the engine's process and the wait for the engine's loop, which takes requests in between "
                  "steps.", LOOP_LAG_BUCKETS),
                 ("event_loop_lag_seconds", "How late the HTTP event loop ran a timer: the time a callback "
                  f"waited behind the loop's other work (sampled every {LOOP_LAG_INTERVAL_S * 1e3:g} ms; summed "
                  "over the HTTP processes).", LOOP_LAG_BUCKETS)]
        width = sum(len(buckets) + 3 for _, _, buckets in specs) + MAX_PATHS * len(HTTP_STATUSES)
        if shared is None:
            shared = (multiprocessing.get_context("spawn").RawArray("d", processes * width) if processes > 1
                      else bytearray(8 * width))
        self.shared = shared
        rows = _rows(shared, width)
        if not 0 <= process < len(rows):
            raise ValueError(f"process {process} is not a row of a table of {len(rows)}")
        self.hists: list[Histogram] = []
        base = 0
        for name, help, buckets in specs:
            self.hists.append(Histogram(name, help, buckets, rows, process, base))
            base += len(buckets) + 3
        self.ttft, self.itl, self.e2e, self.queue, self.inbox, self.loop_lag = self.hists
        self._rows, self._mine, self._http_base = rows, rows[process], base
        self.paths: list[str] = []  # the HTTP counters' paths (the app's, then "other"), in every process alike
        self._path_index: dict[str, int] = {}
        self.set_paths(set())

    def set_paths(self, paths: set[str]) -> None:
        ordered = sorted(paths) + ["other"]
        if len(ordered) > MAX_PATHS:
            raise ValueError(f"{len(ordered)} paths for the HTTP counters, more than MAX_PATHS ({MAX_PATHS})")
        self.paths, self._path_index = ordered, {path: i for i, path in enumerate(ordered)}

    # engine observer hooks (the thread that delivers the engine's outputs)
    def on_first_token(self, t: RequestTimings) -> None:
        with self._lock:
            self.ttft.observe(t.first_token - t.arrival)
            for hist, seconds in ((self.queue, t.queue_time), (self.inbox, t.inbox_time)):
                if seconds is not None:
                    hist.observe(seconds)

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
        """One response: `path` one of `paths` (else counted as "other")."""
        index = self._path_index.get(path, len(self.paths) - 1)
        status = status if status in HTTP_STATUSES else 500
        with self._lock:
            self._mine[self._http_base + index * len(HTTP_STATUSES) + status - HTTP_STATUSES.start] += 1

    def http_counts(self) -> dict[tuple[str, int], int]:
        """(path, status) -> responses, over every HTTP process."""
        n = len(HTTP_STATUSES)
        totals = _sums(self._rows, self._http_base, len(self.paths) * n)
        return {(self.paths[i // n], HTTP_STATUSES.start + i % n): int(total)
                for i, total in enumerate(totals) if total}

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
            for hist in self.hists:
                lines += hist.render()
            lines += _metric("http_requests_total", "counter", "HTTP responses by path and status.",
                             [(f'{{path="{p}",status="{s}"}}', n) for (p, s), n in sorted(self.http_counts().items())])
        return "\n".join(lines) + "\n"
