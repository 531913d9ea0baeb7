"""HTTP load generator for an OpenAI-compatible server, in the manner of `vllm bench serve`.

    cuserve serve --model random:llama3-8b --max-num-seqs 256 &
    python bench/serve.py --url http://127.0.0.1:8000 --num-prompts 512 --input-len 512 \\
        --output-len 128 --concurrency 256 --json serve.json

Prompts are random token ids of exactly --input-len tokens (sent as token-id prompts to
/v1/completions, streamed, ignore_eos, max_tokens --output-len). Arrivals: all at once
under a concurrency cap, or a Poisson process (--request-rate). Reports request and
output-token throughput and mean / p50 / p99 of TTFT, TPOT (per output token after the
first), ITL (between streamed chunks) and end-to-end latency, in ms. The load comes from
--processes client processes (default one per 64 streams, each with its share of the
streams, starting together): at 256 streams an 8B model on an H200 sends ~20k events/s,
more than one Python client parses, and a client that falls behind sends its next request
late and counts its own lag as TTFT (H200, fp8 8B: 5.1-5.3k tok/s from one process, 8.3k
from four, 8.6k for the engine alone). --save-detailed adds every request's send time, TTFT
and latency to the JSON: under a fixed concurrency the requests come in waves, and TTFT
moves from wave to wave in whole engine steps.

    python bench/serve.py --engine random:llama3-8b --quantization fp8 --num-prompts 512 ...

    python bench/serve.py --serve "--model random:llama3-8b --max-num-seqs 256 --quantization fp8" \
        --loads 3 --num-prompts 1024 ...

With --serve, this script starts `cuserve serve` with those flags on a free local port, waits
until /health answers, runs the load --loads times against it and stops it (its log goes to
--serve-log, else a temporary file that the output names). --loads works with --url too.
--serve given twice or more compares servers: each is started in turn (A, B, ..., again
--rounds times), and the end lists every server's loads side by side, its mean throughput as
a ratio to A's, and its flags; the JSON tags each load with its server, flags and round:

    python bench/serve.py --serve "$FLAGS" --serve "$FLAGS --quantize-lm-head" --rounds 2 --loads 2 \
        --goal 12000,150 ...

--goal TOK_S,TTFT_MS adds, for each server, in how many loads the throughput and the client's
TTFT p50 reached it.

With --engine, the same load drives the engine in this process (no HTTP, no tokenizer),
and every engine step is traced: how many decode rows and prompt tokens it ran and how
long it took. The summary splits the run's time into decode-only, mixed and prefill-only
steps, which shows where a serving run loses to the engine's own rates. A list of
--max-num-batched-tokens (e.g. 8192,2048,1024) runs the load once per token budget on the
one engine, so the budgets are compared on the same weights in the same process. The
engine runs on a thread of this process, so the load's own asyncio work shares its GIL;
--engine-process runs it in a process of its own, as `cuserve serve` does, which makes
the run what HTTP is compared against.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import random
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import kernel_trace, settings  # noqa: E402
from bench.gpu_clocks import GpuClocks, describe  # noqa: E402
from bench.server_process import start_server  # noqa: E402


@dataclass
class Result:
    ok: bool = False
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    error: str = ""
    start: float = field(default_factory=time.perf_counter)
    last: float | None = None  # when the latest chunk with tokens came

    def chunk(self, now: float) -> None:
        """A chunk with tokens came at `now`: the first sets TTFT, the others add an ITL."""
        if self.last is None:
            self.ttft = now - self.start
        else:
            self.itl.append(now - self.last)
        self.last = now

    def done(self) -> None:
        self.e2e = time.perf_counter() - self.start
        self.ok = self.output_tokens > 0


async def one_request(client: httpx.AsyncClient, model: str, prompt: list[int], output_len: int) -> Result:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    result = Result()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return result
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if "error" in chunk:
                    result.error = chunk["error"]["message"]
                    return result
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices"):
                    result.chunk(now)
        result.done()
    except httpx.HTTPError as exc:
        result.error = repr(exc)
    return result


def stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), "p50": float("nan"), "p99": float("nan")}
    s = sorted(values)
    return {"mean": 1e3 * statistics.fmean(s), "p50": 1e3 * s[len(s) // 2],
            "p99": 1e3 * s[min(len(s) - 1, int(0.99 * len(s)))]}


async def engine_request(engine, prompt: list[int], output_len: int) -> Result:
    """The engine-mode twin of one_request: the same timings, from engine.generate's deltas."""
    from engine import SamplingParams
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    result = Result()
    async for out in engine.generate(prompt, params):
        now = time.perf_counter()
        if out.error:
            result.error = out.error
            return result
        if any(c.token_ids for c in out.outputs):
            result.chunk(now)
        result.output_tokens = out.num_generated_tokens
    result.done()
    return result


async def closed_loop(prompts: list[list[int]], concurrency: int, request_rate: float, seed: int, output_len: int,
                      send) -> tuple[list[Result], float, float]:
    """Send every prompt (send(prompt, output_len) -> Result), at most `concurrency` at a
    time, all at once or at Poisson arrivals; the results, and when it started and ended."""
    rng = random.Random(seed)
    gate = asyncio.Semaphore(concurrency)

    async def limited(prompt):
        async with gate:
            return await send(prompt, output_len)

    start = time.perf_counter()
    tasks = []
    for prompt in prompts:
        tasks.append(asyncio.create_task(limited(prompt)))
        if request_rate != float("inf"):
            await asyncio.sleep(rng.expovariate(request_rate))
    results = await asyncio.gather(*tasks)
    return results, start, time.perf_counter()


def make_prompts(args) -> list[list[int]]:
    rng = random.Random(args.seed)
    return [[rng.randrange(100, args.vocab) for _ in range(args.input_len)] for _ in range(args.num_prompts)]


async def http_part(args, part: int) -> tuple[str, list[Result], float, float]:
    """Client process `part` of --processes: prompts part, part + P, ...; its share of the
    concurrency and of the arrival rate."""
    P = args.processes
    prompts = make_prompts(args)[part::P]
    concurrency = args.concurrency // P + (part < args.concurrency % P)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    # a client (one keep-alive connection) for each request in flight: httpx's pool scans
    # all of its connections, with two system calls each, whenever a request starts or
    # ends, so one pool for all of them costs O(concurrency) a request and delays the
    # successors of requests that finish together
    one = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    async with contextlib.AsyncExitStack() as stack:
        clients = asyncio.Queue()
        for _ in range(max(concurrency, 1)):
            clients.put_nowait(await stack.enter_async_context(
                httpx.AsyncClient(base_url=args.url, timeout=None, limits=one, headers=headers)))

        async def send(prompt: list[int], n: int) -> Result:
            client = clients.get_nowait()  # closed_loop runs at most `concurrency` at once
            try:
                return await one_request(client, model, prompt, n)
            finally:
                clients.put_nowait(client)

        first = clients.get_nowait()
        model = args.model or (await first.get("/v1/models")).json()["data"][0]["id"]
        clients.put_nowait(first)
        await send(prompts[0][:16], 4)  # warm-up
        if args.start_at:  # every process starts its load at the same moment
            await asyncio.sleep(max(0.0, args.start_at - time.time()))
        results, start, end = await closed_loop(prompts, concurrency, args.request_rate / P, args.seed + 1 + part,
                                                args.output_len, send)
    return model, results, start, end


def _run_part(args, part: int):
    return asyncio.run(http_part(args, part))


# the server's latency histograms (server/metrics.py) read before and after an HTTP load
SERVER_HISTOGRAMS = {"server_ttft_ms": "cuserve_time_to_first_token_seconds",
                     "server_queue_ms": "cuserve_request_queue_time_seconds",
                     # of which before the engine took the request in (the trip to its process, its loop's wait)
                     "server_inbox_ms": "cuserve_request_inbox_time_seconds",
                     # how late the server's event loop ran a 10-ms timer (samples, not requests)
                     "server_loop_lag_ms": "cuserve_event_loop_lag_seconds"}


def parse_histograms(text: str, names) -> dict[str, tuple[list[float], list[float], float, float]]:
    """Prometheus histograms of a /metrics text: name -> (upper bounds, cumulative counts,
    sum, count); names absent from the text are left out."""
    out: dict[str, tuple[list[float], list[float], float, float]] = {}
    for name in names:
        bounds, counts, total, count = [], [], None, None
        for line in text.splitlines():
            if line.startswith(name + '_bucket{le="'):
                le, value = line[len(name) + 12:].split('"} ')
                bounds.append(float(le))
                counts.append(float(value))
            elif line.startswith(name + "_sum "):
                total = float(line.split()[1])
            elif line.startswith(name + "_count "):
                count = float(line.split()[1])
        if bounds and total is not None and count is not None:
            out[name] = (bounds, counts, total, count)
    return out


def histogram_delta(before, after) -> dict[str, float] | None:
    """Mean, p50 and p99 (ms) of what a histogram gathered between two readings
    (parse_histograms's tuples): the mean exact, the quantiles interpolated within their
    bucket. None if nothing came."""
    bounds, counts_after, sum_after, n_after = after
    _, counts_before, sum_before, n_before = before
    n = n_after - n_before
    if n <= 0:
        return None
    counts = [a - b for a, b in zip(counts_after, counts_before)]

    def quantile(q: float) -> float:
        rank, lower, below = q * n, 0.0, 0.0
        for bound, cumulative in zip(bounds, counts):
            if cumulative >= rank:
                inside = cumulative - below
                if bound == float("inf") or inside <= 0:
                    return lower
                return lower + (bound - lower) * (rank - below) / inside
            lower, below = bound, cumulative
        return float("nan")
    return {"mean": 1e3 * (sum_after - sum_before) / n, "p50": 1e3 * quantile(0.5), "p99": 1e3 * quantile(0.99),
            "requests": n}


def server_histograms(args) -> dict:
    """SERVER_HISTOGRAMS as the server exports them now ({} from a server without them)."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        text = httpx.get(args.url.rstrip("/") + "/metrics", headers=headers, timeout=10.0).text
    except httpx.HTTPError:
        return {}
    return parse_histograms(text, SERVER_HISTOGRAMS.values())


def run(args) -> dict:
    """The HTTP load, from one client process or --processes of them (a single Python
    client can fall behind the server's events at hundreds of streams). With a cuserve
    server, also its own TTFT and queue time over the load (from the request handed to the
    engine's API in the HTTP process to the first token / the first step: server_ttft_ms,
    server_queue_ms, of which server_inbox_ms until the engine's loop took it in; the client
    processes' one warm-up request each included), so the HTTP path's share of the client's
    TTFT shows, and how late its event loop ran (server_loop_lag_ms: the HTTP side falling behind)."""
    before = server_histograms(args)
    args.start_at = None
    with GpuClocks(gpu_clocks_wanted(args)) as clocks:
        if args.processes == 1:
            parts = [_run_part(args, 0)]
        else:
            import concurrent.futures
            import multiprocessing
            args.start_at = time.time() + 10.0  # after every process has started and warmed up
            spawn = multiprocessing.get_context("spawn")
            with concurrent.futures.ProcessPoolExecutor(args.processes, mp_context=spawn) as pool:
                parts = list(pool.map(_run_part, [args] * args.processes, range(args.processes)))
    results = [r for part in parts for r in part[1]]
    summary = summarize(args, parts[0][0], results, max(p[3] for p in parts) - min(p[2] for p in parts))
    summary["gpu"] = clocks.summary()
    after = server_histograms(args)
    for key, name in SERVER_HISTOGRAMS.items():
        delta = histogram_delta(before[name], after[name]) if name in before and name in after else None
        if delta is not None:
            summary[key] = delta
    return summary


def step_summary(trace: list[tuple[int, int, float]]) -> dict:
    """Engine steps by kind: (decode rows, prompt tokens, seconds) each."""
    kinds = {"decode": [], "mixed": [], "prefill": []}
    for decodes, prefill, seconds in trace:
        kinds["decode" if not prefill else "prefill" if not decodes else "mixed"].append((decodes, prefill, seconds))
    total = sum(t[2] for t in trace) or 1.0
    out = {}
    for kind, steps in kinds.items():
        if steps:
            seconds = sum(t[2] for t in steps)
            out[kind] = {"steps": len(steps), "seconds": seconds, "share": seconds / total,
                         "ms_p50": 1e3 * statistics.median(t[2] for t in steps),
                         "decode_rows_p50": statistics.median(t[0] for t in steps),
                         "prompt_tokens_p50": statistics.median(t[1] for t in steps),
                         "prompt_tok_s": sum(t[1] for t in steps) / max(1e-9, seconds)}
    return out


def _trace_steps(engine, budget: int, kernels: tuple[str, int, int] | None = None) -> None:
    """From now on, run steps within `budget` tokens and trace each: (decode rows, prompt
    tokens, seconds). kernels: (path, first step, steps): record the device's kernels over
    that window of the load's steps (bench/kernel_trace.py), written to path by _take_trace.
    Run through engine.call, where the engine lives."""
    from dataclasses import replace
    engine.scheduler.config = replace(engine.scheduler.config, max_num_batched_tokens=budget)
    trace: list[tuple[int, int, float]] = []

    def on_step(_engine, out, seconds):  # a decode row: one token past the prompt
        decodes = sum(1 for s in out.seqs if s.num_tokens == 1 and s.start_pos >= len(s.prompt_token_ids))
        trace.append((decodes, out.num_tokens - decodes, seconds))
        if kernels is not None and len(trace) == kernels[1]:
            on_step.profiler = kernel_trace.start()
        elif on_step.profiler is not None and len(trace) == sum(kernels[1:]):
            kernel_trace.stop(on_step.profiler)
    on_step.trace, on_step.kernels, on_step.profiler = trace, kernels, None
    engine.on_step = on_step


def _take_trace(engine) -> list[tuple[int, int, float]]:
    """The steps' trace; and where the kernels were recorded, their trace written (a load that
    ended inside the window: up to its end)."""
    on_step, engine.on_step = engine.on_step, None
    if on_step.profiler is not None:
        if len(on_step.trace) < sum(on_step.kernels[1:]):  # not stopped at the window's end
            kernel_trace.stop(on_step.profiler)
        on_step.profiler.export_chrome_trace(on_step.kernels[0])
    return on_step.trace


async def run_engine(args) -> list[dict]:
    """The load on the engine without HTTP, in this process or (--engine-process) in one of
    its own as the server runs it, once per token budget of --max-num-batched-tokens (the
    engine is built for the largest); a summary each."""
    from engine import EngineConfig, SchedulerConfig
    from engine.config import CacheConfig
    from engine.engine_process import EngineProcess
    gib = int(args.kv_cache_gib * 2**30) if args.kv_cache_gib else None
    config = EngineConfig(
        model=args.engine, device=args.device, **settings.weight_settings(args),
        cache=CacheConfig(kv_cache_bytes=gib, kv_cache_dtype=args.kv_cache_dtype),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs, max_waiting=max(args.num_prompts, 1),
                                  max_num_batched_tokens=max(args.budgets),
                                  max_model_len=args.input_len + args.output_len + 16,
                                  **scheduling_settings(args)))
    if args.engine_process:
        engine = EngineProcess(config, build=functools.partial(settings.build_engine, args.settings))
    else:
        engine = settings.build_engine(args.settings, config)
    args.vocab = min(args.vocab, engine.model_config.vocab_size)
    prompts = make_prompts(args)
    summaries, traces = [], []
    engine.start()
    try:
        await engine_request(engine, prompts[0][:16], 4)  # warm-up
        for budget in args.budgets:
            kernels = None
            if args.kernel_trace:
                Path(args.kernel_trace).mkdir(parents=True, exist_ok=True)
                kernels = (str(Path(args.kernel_trace).resolve() / f"kernels-{budget}.json"),
                           *args.kernel_trace_window)
            engine.call(_trace_steps, budget, kernels)
            with GpuClocks(gpu_clocks_wanted(args)) as clocks:
                results, start, end = await closed_loop(prompts, args.concurrency, args.request_rate, args.seed + 1,
                                                        args.output_len,
                                                        lambda prompt, n: engine_request(engine, prompt, n))
            trace = engine.call(_take_trace)
            summary = summarize(args, args.engine, results, end - start)
            summary.update(max_num_batched_tokens=budget, steps=step_summary(trace),
                           step_seconds=sum(t[2] for t in trace), gpu=clocks.summary(), settings=args.set)
            if kernels is not None and Path(kernels[0]).exists():
                summary["kernel_trace"] = kernel_trace.summarize(json.loads(Path(kernels[0]).read_text()))
            summaries.append(summary)
            traces.append(trace)
    finally:
        engine.shutdown()
    if args.trace:
        Path(args.trace).write_text(json.dumps(traces[0] if len(traces) == 1 else traces))
    return summaries


def summarize(args, model: str, results: list[Result], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    summary = {
        "model": model, "num_prompts": args.num_prompts, "completed": len(ok), "failed": len(results) - len(ok),
        "input_len": args.input_len, "output_len": args.output_len, "concurrency": args.concurrency,
        "request_rate": args.request_rate, "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": sum(r.output_tokens for r in ok) / duration,
        "ttft_ms": stats([r.ttft for r in ok]), "tpot_ms": stats(tpot),
        "itl_ms": stats([g for r in ok for g in r.itl]), "e2e_ms": stats([r.e2e for r in ok]),
        "errors": sorted({r.error for r in results if r.error})[:5],
    }
    if getattr(args, "save_detailed", False) and results:
        # every request in the order it was sent: when (s from the first send; the clock is
        # the host's monotonic one, shared by the client processes), TTFT and end-to-end ms
        t0 = min(r.start for r in results)
        summary["first_send_monotonic"] = t0  # to line the requests up with server-side stamps
        summary["requests"] = [{"start_s": round(r.start - t0, 6), "ttft_ms": round(1e3 * r.ttft, 3),
                                "e2e_ms": round(1e3 * r.e2e, 3), "output_tokens": r.output_tokens,
                                "error": r.error or None} for r in sorted(results, key=lambda r: r.start)]
    return summary


def gpu_clocks_wanted(args) -> bool:
    """--gpu-clocks, or where it is not given: the engine here, or a server on this host (the
    GPU that nvidia-smi sees here is the one serving)."""
    if args.gpu_clocks is not None:
        return args.gpu_clocks
    return bool(args.engine) or urlsplit(args.url).hostname in ("127.0.0.1", "localhost", "::1")


def add_scheduling_flags(ap) -> None:
    """The server's scheduling settings, for a run that builds its own engine (--engine here,
    bench/host.py)."""
    ap.add_argument("--schedule-prompts-ahead", action=argparse.BooleanOptionalAction, default=True,
                    help="as the server's setting (--no-schedule-prompts-ahead: off)")
    ap.add_argument("--late-ahead", action=argparse.BooleanOptionalAction, default=True,
                    help="as the server's setting of that name")
    ap.add_argument("--catch-up-tokens", type=int, default=None,
                    help="as the server's setting (default: half the budget; 0: off)")


def scheduling_settings(args) -> dict:
    """SchedulerConfig's fields from add_scheduling_flags' flags."""
    return {"prompts_ahead": args.schedule_prompts_ahead, "late_ahead": args.late_ahead,
            "catch_up_tokens": args.catch_up_tokens}


def default_processes(concurrency: int) -> int:
    """HTTP client processes for a load: one per 64 streams."""
    return max(1, min(concurrency, (concurrency + 63) // 64))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", help="model id (default: the server's first)")
    ap.add_argument("--api-key")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second")
    ap.add_argument("--vocab", type=int, default=30000, help="prompt token ids are drawn below this")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--processes", type=int, default=None,
                    help="client processes sharing the load (HTTP; default: one per 64 streams): one Python "
                         "client falls behind a server that sends ~20k events/s, and then measures itself")
    ap.add_argument("--json")
    ap.add_argument("--serve", metavar="ARGS", action="append",
                    help="start `cuserve serve ARGS` on a free local port for the load(s), then stop it (--url "
                         "unused); given again, each server in turn (A, B, ...; --rounds), compared at the end")
    ap.add_argument("--rounds", type=int, default=1,
                    help="--serve: start the servers in turn this many times (A, B, A, B, ...), --loads each")
    ap.add_argument("--goal", metavar="TOK_S,TTFT_MS",
                    help="with several loads: count those that reach this output tok/s with this client TTFT "
                         "p50 or lower (issue 6's serving target: 12000,150)")
    ap.add_argument("--serve-log", help="--serve: the server's log (default: a temporary file, named in the output); "
                                        "with several servers or rounds, each its own, e.g. server-B2.log")
    ap.add_argument("--serve-timeout", type=float, default=900.0,
                    help="--serve: seconds to wait for /health (default 900: an 8B model's random weights, fp8 "
                         "quantization, product tuning and graph capture)")
    ap.add_argument("--loads", type=int, default=1,
                    help="HTTP: run the load this many times against the server (each --serve server), each "
                         "reported (the JSON is then a list)")
    ap.add_argument("--gpu-clocks", action=argparse.BooleanOptionalAction, default=None,
                    help="sample the GPU's SM clock and power draw during the load (nvidia-smi; default: "
                         "with --engine or a server on this host); reported, and in the JSON as \"gpu\"")
    ap.add_argument("--save-detailed", action="store_true",
                    help="with --json: also each request's send time, TTFT, end-to-end latency and tokens "
                         "(how TTFT moves over a run: the waves of a fixed concurrency)")
    engine = ap.add_argument_group("engine mode (no HTTP)")
    engine.add_argument("--engine", metavar="MODEL", help="drive this model's engine (no HTTP) instead of --url")
    engine.add_argument("--device", default="auto")
    settings.add_weight_flags(engine)
    engine.add_argument("--kv-cache-dtype", default="auto")
    engine.add_argument("--kv-cache-gib", type=float, default=None)
    engine.add_argument("--max-num-seqs", type=int, default=256)
    engine.add_argument("--max-num-batched-tokens", default="8192",
                        help="token budget per step; a comma-separated list runs the load once per budget")
    add_scheduling_flags(engine)
    engine.add_argument("--engine-process", action="store_true",
                        help="the engine in a process of its own, as the server runs it (this process then "
                             "only sends the requests and reads the outputs, as an HTTP client would); default: "
                             "on a thread of this process, sharing its GIL with the load's asyncio work")
    engine.add_argument("--trace", help="write every step's (decode rows, prompt tokens, seconds) here "
                                        "(a list of such traces with several budgets)")
    engine.add_argument("--kernel-trace", metavar="DIR",
                        help="record the device's kernels over a window of the load's steps with torch.profiler "
                             "(bench/kernel_trace.py), write the trace to DIR/kernels-BUDGET.json and report "
                             "where each kind of step's time goes; disturbs the load's throughput")
    engine.add_argument("--kernel-trace-steps", default="250,30", metavar="FIRST,COUNT",
                        help="the window: from the load's step FIRST, COUNT steps (default 250,30)")
    settings.add_flag(engine)
    args = ap.parse_args(argv)
    args.settings = settings.from_args(ap, args)
    if args.settings and not args.engine:
        ap.error("--set needs --engine (a server's engine is out of reach)")
    try:
        args.kernel_trace_window = tuple(int(v) for v in args.kernel_trace_steps.split(","))
        if len(args.kernel_trace_window) != 2 or min(args.kernel_trace_window) < 1:
            raise ValueError
    except ValueError:
        ap.error(f"--kernel-trace-steps: expected FIRST,COUNT (two positive integers), got {args.kernel_trace_steps!r}")
    if args.kernel_trace and not args.engine:
        ap.error("--kernel-trace needs --engine (the recording runs where the engine does)")
    if args.engine and (args.serve or args.loads != 1 or args.rounds != 1):
        ap.error("--serve, --loads and --rounds are for HTTP loads (with --engine, list budgets in "
                 "--max-num-batched-tokens)")
    if args.loads < 1 or args.rounds < 1:
        ap.error(f"--loads and --rounds must be >= 1, got {args.loads} and {args.rounds}")
    if args.rounds > 1 and not args.serve:
        ap.error("--rounds needs --serve (it starts the servers again)")
    if args.goal is not None:
        try:
            goal = tuple(float(v) for v in args.goal.split(","))
            if len(goal) != 2:
                raise ValueError
        except ValueError:
            ap.error(f"--goal: expected TOK_S,TTFT_MS (two numbers), got {args.goal!r}")
        args.goal = goal
    if args.serve and len(args.serve) > 26:
        ap.error("--serve: at most 26 servers (labelled A to Z)")
    try:
        args.budgets = [int(b) for b in str(args.max_num_batched_tokens).split(",")]
    except ValueError:
        ap.error(f"--max-num-batched-tokens: expected integers, got {args.max_num_batched_tokens!r}")
    if len(args.budgets) > 1 and not args.engine:
        ap.error("several --max-num-batched-tokens need --engine (a server has its own)")
    if args.processes is None:
        args.processes = default_processes(args.concurrency)
    return args


def main() -> None:
    args = parse_args()
    summaries = asyncio.run(run_engine(args)) if args.engine else run_http(args)
    if args.json:
        Path(args.json).write_text(json.dumps(summaries[0] if len(summaries) == 1 else summaries, indent=1))
    if args.engine or len(summaries) == 1:
        for summary in summaries:
            report(args, summary)
    if len({s.get("server") for s in summaries}) > 1 or args.rounds > 1 or (args.goal and len(summaries) > 1):
        print("\n".join(compare(summaries, args.goal)))


def run_http(args) -> list[dict]:
    """The HTTP loads: --loads against --url, or against each --serve server in turn, --rounds
    times; with more than one load, each summary tagged (server, round, load) and reported as it
    ends (a long series may be cut off)."""
    serve = args.serve or [None]
    labelled = len(serve) > 1 or args.rounds > 1  # the servers named A, B, ... and their rounds counted
    summaries = []
    for rnd in range(1, args.rounds + 1):
        for i, cmd in enumerate(serve):
            label = chr(ord("A") + i) if labelled else None
            with served(args, cmd, label, rnd):
                for load in range(1, args.loads + 1):
                    summaries.append(run(args))
                    if labelled or args.loads > 1:
                        summaries[-1].update(load=load, **({"server": label, "serve": cmd, "round": rnd}
                                                           if labelled else {}))
                        report(args, summaries[-1], flush=True)
    return summaries


@contextlib.contextmanager
def served(args, cmd: str | None, label: str | None = None, rnd: int = 1):
    """`cuserve serve CMD` on a free local port while the block runs (args.url set to it), its log
    in --serve-log (with several servers or rounds, `-{label}{round}` before its suffix) or a
    temporary file; nothing without CMD."""
    if cmd is None:
        yield
        return
    tag = f"-{label}{rnd}" if label else ""
    if args.serve_log:
        log = Path(args.serve_log)
        log = log.with_name(f"{log.stem}{tag}{log.suffix}")
    else:
        fd, name = tempfile.mkstemp(prefix=f"cuserve-serve{tag}-", suffix=".log")
        log = Path(name)
        os.close(fd)
    start = time.monotonic()
    proc = start_server(*shlex.split(cmd), log_path=log, timeout=args.serve_timeout)
    print(f"server {label + ' ' if label else ''}ready at {proc.url} after {time.monotonic() - start:.0f} s "
          f"(log: {log})", flush=True)
    args.url = proc.url
    try:
        yield
    finally:
        proc.stop()


def compare(summaries: list[dict], goal: tuple[float, float] | None = None) -> list[str]:
    """The loads of each server (summaries tagged by run_http) side by side: output tok/s and the
    client's TTFT p50 of each load in order, the mean throughput and its ratio to the first
    server's; goal (output tok/s, TTFT p50 ms): in how many loads each half and both held."""
    groups: dict[str, list[dict]] = {}
    for s in summaries:
        groups.setdefault(s.get("server") or "-", []).append(s)
    means = {label: statistics.fmean(s["output_throughput"] for s in loads) for label, loads in groups.items()}
    base_label, base = next(iter(means.items()))
    lines = ["servers compared (loads in the order run):"]
    for label, loads in groups.items():
        tok = " / ".join(f"{s['output_throughput']:.1f}" for s in loads)
        ttft = " / ".join(f"{s['ttft_ms']['p50']:.1f}" for s in loads)
        ratio = f"{means[label] / base:.4f}x {base_label}" if base > 0 else f"{base_label} produced nothing"
        lines.append(f"  {label}: {len(loads)} loads, output tok/s {tok}, mean {means[label]:.1f} ({ratio}); "
                     f"TTFT p50 {ttft} ms")
        if loads[0].get("serve"):
            lines.append(f"     cuserve serve {loads[0]['serve']}")
        if goal:
            fast, quick, both = goal_counts(loads, goal)
            lines.append(f"     goal >= {goal[0]:g} tok/s with TTFT p50 <= {goal[1]:g} ms: throughput in {fast}, "
                         f"TTFT in {quick}, both in {both} of {len(loads)} loads")
    return lines


def goal_counts(loads: list[dict], goal: tuple[float, float]) -> tuple[int, int, int]:
    """Of these load summaries, how many reached goal's output tok/s, its client TTFT p50 (ms or
    less), and both."""
    fast = [s["output_throughput"] >= goal[0] for s in loads]
    quick = [s["ttft_ms"]["p50"] <= goal[1] for s in loads]
    return sum(fast), sum(quick), sum(map(all, zip(fast, quick)))


def report(args, summary: dict, flush: bool = False) -> None:
    if "max_num_batched_tokens" in summary:
        print(f"max_num_batched_tokens {summary['max_num_batched_tokens']}:")
    if "load" in summary:
        where = f"server {summary['server']}, round {summary['round']}, " if "server" in summary else ""
        print(f"{where}load {summary['load']} of {args.loads}:")
    print(f"{summary['completed']}/{args.num_prompts} ok in {summary['duration_s']:.2f}s: "
          f"{summary['request_throughput']:.2f} req/s, {summary['output_throughput']:.1f} output tok/s")
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        s = summary[key]
        print(f"  {key[:-3]:5s} mean {s['mean']:9.2f}  p50 {s['p50']:9.2f}  p99 {s['p99']:9.2f} ms")
    for key in SERVER_HISTOGRAMS:
        if key in summary:  # the server's own, from /metrics
            s = summary[key]
            print(f"  {key[:-3]:15s} mean {s['mean']:9.2f}  p50 ~{s['p50']:8.2f}  p99 ~{s['p99']:8.2f} ms "
                  "(server's histogram)")
    if describe(summary.get("gpu")):
        print("  " + describe(summary["gpu"]))
    if summary["errors"]:
        print("  errors:", summary["errors"])
    if "steps" in summary:
        print(f"  engine steps ({summary['step_seconds']:.2f}s of {summary['duration_s']:.2f}s):")
        print(f"  {'kind':8s} {'steps':>6} {'seconds':>8} {'share':>6} {'ms p50':>8} {'decodes p50':>12} "
              f"{'prompt tok p50':>15} {'prompt tok/s':>13}")
        for kind, k in summary["steps"].items():
            print(f"  {kind:8s} {k['steps']:>6} {k['seconds']:>8.2f} {100 * k['share']:>5.1f}% {k['ms_p50']:>8.2f} "
                  f"{k['decode_rows_p50']:>12.0f} {k['prompt_tokens_p50']:>15.0f} {k['prompt_tok_s']:>13.0f}")
    if "kernel_trace" in summary:
        print("\n".join("  " + line for line in kernel_trace.report(summary["kernel_trace"])))
    if flush:
        sys.stdout.flush()


if __name__ == "__main__":
    main()
