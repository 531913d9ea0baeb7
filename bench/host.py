"""The host's share of serving, measured without a GPU: the engine, and the real HTTP server,
driven by a stand-in runner whose steps take the time a cost model gives, launched
asynchronously as the CUDA runner's are (`submit`, steps chained ahead up to `chain_rows`).
The load is bench/serve.py's (random prompts, ignore_eos, streaming, a concurrency cap).

    python bench/host.py --num-prompts 1024 --input-len 512 --output-len 128 --concurrency 256

It runs the load twice, on the engine alone (in this process) and over HTTP (the server in a
child process, the client in --processes processes), and prints for each: output tok/s, TTFT
p50 seen by the client and by the engine (arrival to first token; the gap is the HTTP path),
the engine's queue time (and its part before the engine's loop took the request in), the
stand-in GPU's busy time and its idle time before each kind of step (time the host kept it
waiting), how bunched the requests arrived and finished after the load's first wave (counts in
20-ms bins), and for HTTP the server process's CPU per output token (and the engine process's
CPU). The HTTP run's engine runs in a process of its own, as the server's does by default;
--no-engine-process puts it on a thread of the server's process.

The default cost model is the H200's for Llama-3-8B with fp8 weights and fp8 K/V, bfloat16,
as of the fifty-fifth session (docs/performance.md): 1.69 ms a step + 22.4 us a decode row +
12.2 us a prompt token. It is fitted to three step times: a 256-row decode step (7.43 ms) and a
step of 250 decode rows + 1,791 prompt tokens (29.1 ms), both p50s of bench/serve.py --engine
loads, and a lone 512-token prompt's TTFT (7.92 ms, bench/prefill.py). With it, the engine
alone here came to 12,541 / 12,547 tok/s on a 2-core CPU; the GPU's own loads gave 12,436-12,509.
(The earlier model, 1.0 ms + 28 us + 14.6 us, was fitted at ~10k tok/s.) The numbers depend on
the host's CPU: compare runs on one machine. The model is linear, so it cannot judge the token
budget: a prompt token costs the GPU ~5 % more in a step of 1,282 prompt tokens than in one of
1,795, which the stand-in misses (a budget of 1,536: -0.4 % tok/s here, -4.4 % on the GPU;
docs/performance.md, sixty-fifth session). --schedule-prompts-ahead and
--late-ahead set the server's settings of those names in both runs (the stand-in marks the last
quarter of a step with prompt tokens for --late-ahead, as the CUDA runner does; --sim-mark-decode:
of decode-only steps too).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import serve


BIN_S = 0.02  # EngineTimes: arrivals and finishes counted in bins of this many seconds


class SimRunner:
    """A runner whose steps 'run' for base + per_decode x decode rows + per_prompt x prompt
    tokens seconds, one after the other, like a GPU stream: submit returns at once and the
    step's finish function sleeps until its step would end (releasing the GIL, as waiting
    for a CUDA event does). Samples a token id in [1000, 6000) for each sampling row (the
    load runs with ignore_eos). Keeps the stand-in GPU's busy time, and its idle time
    before each step by kind: 'ahead' (chained, launched before the previous step ended),
    'mixed' (with prompt tokens), 'decode'. A gap of over IDLE_MAX seconds is not counted:
    nothing was there to run (the load had not started)."""

    IDLE_MAX = 1.0

    device = "sim"

    def __init__(self, base: float, per_decode: float, per_prompt: float, chain_rows: int = 256,
                 num_kv_slots: int = 1 << 22, eager_launch: float = 0.0, mark_decode: bool = False) -> None:
        self.cost = (base, per_decode, per_prompt)
        self.eager_launch = eager_launch  # host seconds a step with prompt tokens takes to launch
        self.mark_decode = mark_decode  # decode-only steps mark their last quarter too (the CUDA runner's don't)
        self.chain_rows = chain_rows
        self.num_kv_slots = num_kv_slots
        self.busy_until = self.near_end = 0.0
        self.reset()

    def reset(self) -> None:
        self.busy = 0.0
        self.idle: dict[str, list] = {}  # kind -> [steps, idle seconds before them]

    def submit(self, out):
        decodes = sum(1 for s in out.seqs if s.num_tokens == 1)
        prompt = sum(s.num_tokens for s in out.seqs) - decodes
        base, per_decode, per_prompt = self.cost
        seconds = base + per_decode * decodes + per_prompt * prompt
        now = time.perf_counter()
        if prompt and self.eager_launch:  # the CUDA runner launches such a step kernel by kernel,
            # holding the GIL most of the time; the device starts on the first kernels meanwhile
            while time.perf_counter() - now < self.eager_launch:
                pass
        kind = "ahead" if out.chained else "mixed" if prompt else "decode"
        entry = self.idle.setdefault(kind, [0, 0.0])
        entry[0] += 1
        gap = now - self.busy_until
        entry[1] += gap if 0.0 < gap <= self.IDLE_MAX else 0.0
        end = self.busy_until = max(max(now, self.busy_until) + seconds, time.perf_counter())
        if prompt or self.mark_decode:  # the CUDA runner marks the last quarter of a step with prompts
            self.near_end = end - seconds / 4
        self.busy += seconds
        from engine.outputs import RunnerOutput
        sampled = {s.seq_id: 1000 + (s.seq_id * 7 + s.start_pos) % 5000 for s in out.seqs if s.sample}

        def finish() -> RunnerOutput:
            wait = end - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            return RunnerOutput(sampled=sampled)
        return finish

    def execute(self, out):
        return self.submit(out)()

    def wait_near_end(self) -> None:
        """As the CUDA runner's: until the last step marked (one with prompt tokens, or any with
        mark_decode) has a quarter left."""
        wait = self.near_end - time.perf_counter()
        if wait > 0:
            time.sleep(wait)

    def report(self) -> dict:
        return {"gpu_busy_s": self.busy,
                "idle_before": {k: {"steps": n, "idle_s": s} for k, (n, s) in sorted(self.idle.items())}}


def bunching(times: list[float], start: float, end: float, bin_s: float = BIN_S) -> dict[str, int]:
    """How bunched `times` came between start and end: the counts in bins of bin_s seconds,
    p50 / p99 / max (and how many fell there)."""
    inside = [t for t in times if start <= t <= end]
    bins = int((end - start) / bin_s) + 1 if end >= start else 0
    counts = [0] * bins
    for t in inside:
        counts[min(bins - 1, int((t - start) / bin_s))] += 1
    counts.sort()
    if not counts:
        return {"n": 0, "p50": 0, "p99": 0, "max": 0}
    p99 = counts[min(len(counts) - 1, int(0.99 * len(counts)))]
    return {"n": len(inside), "p50": counts[len(counts) // 2], "p99": p99, "max": counts[-1]}


class EngineTimes:
    """Engine-side first-token and queue times (arrival to first token / first step; of the
    queue, the part until the engine's loop took the request in), by wrapping the engine's
    observer; and how bunched the requests arrived and finished after the load's first wave
    (`report(skip)`: from the arrival of request `skip`, the first one sent after another ended,
    under a fixed concurrency of skip). Over HTTP on a short CPU they come in bursts that the
    steps drain at a few prompts each (docs/performance.md, sixty-fifth session)."""

    def __init__(self, engine) -> None:
        self.reset()
        observer = engine.observer
        first, finished = observer.on_first_token, observer.on_finished

        def on_first_token(t) -> None:
            self.ttft.append(t.first_token - t.arrival)
            self.arrivals.append(t.arrival)
            for kept, seconds in ((self.queue, t.queue_time), (self.inbox, t.inbox_time)):
                if seconds is not None:
                    kept.append(seconds)
            first(t)

        def on_finished(t) -> None:
            self.finishes.append(t.finished)
            finished(t)
        observer.on_first_token, observer.on_finished = on_first_token, on_finished

    def report(self, skip: int) -> dict:
        arrivals = sorted(self.arrivals)
        start, end = (arrivals[skip], arrivals[-1]) if len(arrivals) > skip else (0.0, 0.0)
        return {"engine_ttft_ms": serve.stats(self.ttft), "engine_queue_ms": serve.stats(self.queue),
                "engine_inbox_ms": serve.stats(self.inbox),
                "arrivals_per_bin": bunching(arrivals, start, end),
                "finishes_per_bin": bunching(self.finishes, start, end)}

    def reset(self) -> None:
        self.ttft, self.queue, self.inbox = [], [], []
        self.arrivals, self.finishes = [], []


def sim_config(args):
    from engine import EngineConfig, SchedulerConfig
    return EngineConfig(model=args.model, device="cpu", scheduler=SchedulerConfig(
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.input_len + args.output_len + 16, max_waiting=max(args.num_prompts, 1),
        **serve.scheduling_settings(args)))


def build_engine(args, config=None):
    """An engine on the stand-in runner (engine.runner); in an engine process, its `build`."""
    from engine import Engine
    from engine.loader import load_model
    model = load_model(args.model, with_tokenizer=True)
    runner = SimRunner(args.sim_step_ms / 1e3, args.sim_decode_ms / 1e3, args.sim_prompt_us / 1e6,
                       chain_rows=args.max_num_seqs, eager_launch=args.sim_eager_launch_ms / 1e3,
                       mark_decode=args.sim_mark_decode)
    return Engine(config or sim_config(args), model, runner=runner)


def _sim_start(engine) -> float:  # in the engine's process: the load starts
    engine.runner.reset()
    return time.process_time()


def _sim_report(engine) -> tuple[dict, float]:  # in the engine's process: the load is over
    return engine.runner.report(), time.process_time()


def serve_child(args) -> None:
    """The server side of the HTTP run: the real app over uvicorn on the stand-in runner,
    its engine in a process of its own as the server's default (--no-engine-process: on a
    thread). SIGUSR1 marks the start of the load; the next one prints the server's share as
    one JSON line (CPU seconds of the server's process and of the engine's, output tokens,
    the runner's and engine's times)."""
    import functools
    import threading

    import uvicorn

    from engine.engine_process import EngineProcess
    from server.app import create_app
    from server.settings import ServeSettings
    if args.engine_process:
        engine = EngineProcess(sim_config(args), build=functools.partial(build_engine, args))
    else:
        engine = build_engine(args)
    settings = ServeSettings(model=args.model, port=args.port, engine_process=args.engine_process)
    app = create_app(settings, engine=engine)
    engine.start()
    times = EngineTimes(engine)  # around the observer the app set
    mark: dict = {}

    def on_mark() -> None:
        if not mark:
            engine_cpu = engine.call(_sim_start)
            times.reset()
            mark.update(cpu=time.process_time(), engine_cpu=engine_cpu, tokens=engine.stats.generation_tokens)
            return
        report, engine_cpu = engine.call(_sim_report)
        tokens = engine.stats.generation_tokens - mark["tokens"]
        cpu = time.process_time() - mark["cpu"]
        line = {"server_cpu_s": cpu, "tokens": tokens, "server_cpu_us_per_token": cpu / max(tokens, 1) * 1e6,
                **report, **times.report(args.concurrency)}
        if args.engine_process:
            line["engine_cpu_s"] = engine_cpu - mark["engine_cpu"]
        print("SIM " + json.dumps(line), flush=True)
        mark.clear()

    # the handler only starts a thread: it may run while this thread holds a lock that
    # engine.call takes
    signal.signal(signal.SIGUSR1, lambda *_: threading.Thread(target=on_mark).start())
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning",
                timeout_keep_alive=settings.keep_alive_timeout)  # its lifespan shuts the engine down


async def engine_run(args) -> dict:
    engine = build_engine(args)
    runner = engine.runner
    times = EngineTimes(engine)
    prompts = serve.make_prompts(args)
    engine.start()
    try:
        await serve.engine_request(engine, prompts[0][:16], 4)  # warm-up
        runner.reset()
        times.reset()
        rng = random.Random(args.seed + 2)

        async def send(prompt, n):
            if args.arrival_delay_ms > 0:  # what HTTP adds between one request's end and the next one's arrival
                await asyncio.sleep(args.arrival_delay_ms * 1e-3 * rng.lognormvariate(0.0, 0.5))
            return await serve.engine_request(engine, prompt, n)

        results, start, end = await serve.closed_loop(
            prompts, args.concurrency, args.request_rate, args.seed + 1, args.output_len, send)
    finally:
        engine.shutdown()
    return {**serve.summarize(args, args.model, results, end - start), **runner.report(),
            **times.report(args.concurrency)}


def http_run(args) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    child = subprocess.Popen([sys.executable, __file__, *args.argv, "--serve-child"], env=env,
                             stdout=subprocess.PIPE, text=True)
    try:
        import httpx
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{args.url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if child.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the stand-in server did not start")
            time.sleep(0.5)
        child.send_signal(signal.SIGUSR1)
        args.gpu_clocks = False  # the stand-in's steps draw nothing from a GPU this host may have
        summary = serve.run(args)
        child.send_signal(signal.SIGUSR1)
        for line in child.stdout:
            if line.startswith("SIM "):
                summary.update(json.loads(line[4:]))
                break
    finally:
        child.terminate()
        child.wait(30)
    return summary


def report(name: str, s: dict) -> None:
    idle = ", ".join(f"{k} {v['idle_s']:.2f}s / {v['steps']} steps" for k, v in s["idle_before"].items())
    print(f"{name}: {s['output_throughput']:.1f} output tok/s, {s['completed']}/{s['num_prompts']} ok in "
          f"{s['duration_s']:.2f}s; TTFT p50 client {s['ttft_ms']['p50']:.1f} ms, engine "
          f"{s['engine_ttft_ms']['p50']:.1f} ms (queue {s['engine_queue_ms']['p50']:.1f} ms, inbox "
          f"{s['engine_inbox_ms']['p50']:.1f} ms); TPOT p50 "
          f"{s['tpot_ms']['p50']:.2f} ms")
    print(f"  stand-in GPU busy {s['gpu_busy_s']:.2f}s; idle before {idle}")
    a, f = s["arrivals_per_bin"], s["finishes_per_bin"]
    print(f"  after the first wave, a {BIN_S * 1e3:g}-ms bin: arrivals p50 {a['p50']}, p99 {a['p99']}, max {a['max']}; "
          f"finishes p50 {f['p50']}, p99 {f['p99']}, max {f['max']}")
    if "server_cpu_s" in s:
        engine = f"; engine process CPU {s['engine_cpu_s']:.2f}s" if "engine_cpu_s" in s else ""
        print(f"  server process CPU {s['server_cpu_s']:.2f}s for {s['tokens']} tokens: "
              f"{s['server_cpu_us_per_token']:.1f} us a token{engine}")
    if "server_loop_lag_ms" in s:  # how late the server's event loop ran its 10-ms timer
        lag = s["server_loop_lag_ms"]
        print(f"  server event loop lag p50 ~{lag['p50']:.2f} ms, p99 ~{lag['p99']:.2f} ms")
    if s["errors"]:
        print("  errors:", s["errors"])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:llama3-8b", help="a model whose tokenizer and shape the load uses")
    ap.add_argument("--num-prompts", type=int, default=1024)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--request-rate", type=float, default=float("inf"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--processes", type=int, default=None, help="HTTP client processes (bench/serve.py's)")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    serve.add_scheduling_flags(ap)
    ap.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                    help="as the server's setting: the HTTP run's engine in a process of its own (default)")
    ap.add_argument("--sim-step-ms", type=float, default=1.69, help="cost model: ms a step")
    ap.add_argument("--sim-decode-ms", type=float, default=0.0224, help="cost model: ms a decode row")
    ap.add_argument("--sim-prompt-us", type=float, default=12.2, help="cost model: us a prompt token")
    ap.add_argument("--sim-eager-launch-ms", type=float, default=0.0,
                    help="cost model: host ms to launch a step with prompt tokens (the CUDA runner's are eager, "
                         "kernel by kernel: H200, 8B fp8, ~10 ms for a 512-token prefill); decode graphs cost none")
    ap.add_argument("--sim-mark-decode", action=argparse.BooleanOptionalAction, default=False,
                    help="decode-only steps mark their last quarter for --late-ahead too (the CUDA runner marks "
                         "only steps with prompt tokens)")
    ap.add_argument("--port", type=int, default=0, help="the HTTP run's server port (0: a free one)")
    ap.add_argument("--mode", choices=("both", "engine", "http"), default="both")
    ap.add_argument("--arrival-delay-ms", type=float, default=0.0,
                    help="engine run: each request waits this median (lognormal, sigma 0.5; p90 ~1.9x) before it "
                         "reaches the engine, as over HTTP from a request's end to the client's next one")
    ap.add_argument("--json")
    ap.add_argument("--serve-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.port == 0 and not args.serve_child:
        import socket
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            args.port = sock.getsockname()[1]
    args.argv = [*(sys.argv[1:] if argv is None else argv), "--port", str(args.port)]
    args.url = f"http://127.0.0.1:{args.port}"
    args.api_key = None
    args.vocab = 30000
    args.processes = args.processes or serve.default_processes(args.concurrency)
    return args


def main() -> None:
    args = parse_args()
    if args.serve_child:
        serve_child(args)
        return
    results = {}
    if args.mode in ("both", "engine"):
        results["engine"] = asyncio.run(engine_run(args))
        report("engine alone", results["engine"])
    if args.mode in ("both", "http"):
        results["http"] = http_run(args)
        report("over HTTP", results["http"])
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
