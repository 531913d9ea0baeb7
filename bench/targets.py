"""Issue 6's speed targets in one command: each benchmark runs as it is, in a process of its own
(decode.py, prefill.py, serve.py, with --json), and a table gives each figure against its goal,
met or not, with the device, the date and the commit.

    python bench/targets.py                                  # all six (one H200: ~5 minutes)
    python bench/targets.py --only decode_8b_b1,smollm2_b1   # some of them
    python bench/targets.py --smollm2 random:smollm2-135m    # SmolLM2's shape with random weights

The targets (docs/performance.md, "Targets (issue 6)"):
- decode_8b_b1: Llama-3-8B shape, 16-bit, one stream of 512 + 128 tokens: >= 240 decode tok/s;
- smollm2_b1: SmolLM2-135M-Instruct (the GGUF; --smollm2), 32 + 256 tokens: >= 3,000 decode tok/s;
- decode_8b_b128: 8B, fp8 weights and K/V, 128 streams of 512 + 128: >= 25,000 decode tok/s;
- prefill_8b_2048: 8B 16-bit, one prompt of 2,048 tokens: TTFT <= 1.4x the floor of the fp16 GEMM
  rate measured in the same run;
- serve_8b: `cuserve serve` with the serving flags (SERVE_FLAGS), 1,024 requests of 512 + 128 at
  256 streams, --loads times: >= 12,000 output tok/s with a client TTFT p50 <= 150 ms in every load;
- http_b1: the same server at one stream (16 requests) against the engine alone in its own process:
  the HTTP path loses <= 5 % of output tok/s.

A benchmark that fails, or runs past --timeout (it and every process it started are then
stopped), gives its row "error" (its log is named); the rest still run. Each
benchmark's log and JSON stay in --out (default: a new temporary folder). Where the issue gives a
peer's figure for the same work (llama.cpp's CUDA build on an H200, measured elsewhere), the row
also gives our ratio to it in tok/s.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.serve import goal_counts  # noqa: E402

BENCH = ROOT / "bench"
SERVE_FLAGS = ("--model random:llama3-8b --max-num-seqs 256 --quantization fp8 --kv-cache-dtype fp8 "
               "--dtype bfloat16 --kv-cache-gib 40 --max-model-len 2048")
SERVE_LOAD = ["--num-prompts", "1024", "--input-len", "512", "--output-len", "128", "--concurrency", "256",
              "--vocab", "120000"]
SERVE_GOAL = (12000.0, 150.0)  # output tok/s, client TTFT p50 ms
ONE_STREAM = ["--num-prompts", "16", "--input-len", "512", "--output-len", "128", "--concurrency", "1",
              "--vocab", "120000"]


@dataclass
class Target:
    name: str
    label: str
    goal: str
    runs: Callable[[argparse.Namespace], list[list[str]]]  # each run's arguments (a script under bench/ first)
    judge: Callable[[list], tuple[str, bool, float | None]]  # the runs' JSON -> (figure, met, tok/s)
    peer: tuple[str, float] | None = None  # the figure of a peer for the same work: (who, tok/s)


def decode_runs(model: str | None, batch: int, prompt: int, tokens: int, *extra: str) -> Callable:
    """bench/decode.py at one batch size (model None: --smollm2's)."""
    return lambda args: [["decode.py", "--model", model or args.smollm2, "--device", args.device, "--batch",
                          str(batch), "--prompt-len", str(prompt), "--max-tokens", str(tokens), *extra]]


def decode_judge(goal: float) -> Callable:
    def judge(outs: list) -> tuple[str, bool, float]:
        r = outs[0]["results"][0]
        roof = f", {r['roofline_pct']:.1f} % of the roofline" if "roofline_pct" in r else ""
        return (f"{r['decode_tok_s']:,.1f} tok/s ({r['step_ms_median']:.2f} ms a step{roof})",
                r["decode_tok_s"] >= goal, r["decode_tok_s"])
    return judge


def prefill_judge(outs: list) -> tuple[str, bool, float]:
    r, rate = outs[0]["rows"][0], outs[0]["gemm_tflops"]
    return (f"{r['ttft_ms']:.2f} ms, {r['ratio']:.2f}x the floor ({r['floor_ms']:.2f} ms at {rate:.0f} TFLOP/s)",
            r["ratio"] <= 1.4, r["prefill_tok_s"])


def loads(out) -> list[dict]:
    """serve.py's JSON: one summary, or a list of them (--loads > 1)."""
    return out if isinstance(out, list) else [out]


def serve_judge(outs: list) -> tuple[str, bool, None]:
    runs = loads(outs[0])
    tok = [s["output_throughput"] for s in runs]
    ttft = [s["ttft_ms"]["p50"] for s in runs]
    both = goal_counts(runs, SERVE_GOAL)[2]
    return (f"{min(tok):,.1f}-{max(tok):,.1f} tok/s, TTFT p50 {min(ttft):.1f}-{max(ttft):.1f} ms; both in {both} of "
            f"{len(runs)} loads"), both == len(runs) and both > 0, None


def http_judge(outs: list) -> tuple[str, bool, None]:
    http, alone = (statistics.fmean(s["output_throughput"] for s in loads(o)) for o in outs)
    loss = 1 - http / alone
    return f"{http:.1f} tok/s over HTTP, {alone:.1f} alone: {100 * loss:.1f} % lost", loss <= 0.05, None


TARGETS = [
    Target("decode_8b_b1", "8B fp16 decode B=1", ">= 240 tok/s",
           decode_runs("random:llama3-8b", 1, 512, 128, "--kv-cache-gib", "8"), decode_judge(240),
           ("llama.cpp F16", 212.0)),
    Target("smollm2_b1", "SmolLM2 decode B=1", ">= 3,000 tok/s",
           decode_runs(None, 1, 32, 256), decode_judge(3000), ("llama.cpp Q4_1", 962.0)),
    Target("decode_8b_b128", "8B fp8 + fp8 K/V decode B=128", ">= 25,000 tok/s",
           decode_runs("random:llama3-8b", 128, 512, 128, "--kv-cache-gib", "24", "--quantization", "fp8",
                       "--kv-cache-dtype", "fp8"), decode_judge(25000), ("llama.cpp F16", 9461.0)),
    Target("prefill_8b_2048", "8B 2,048-token prefill", "<= 1.4x the GEMM floor",
           lambda args: [["prefill.py", "--model", "random:llama3-8b", "--device", args.device, "--lengths", "2048",
                          "--repeats", "5"]], prefill_judge, ("llama.cpp F16", 25083.0)),
    Target("serve_8b", "serve 8B, 256 streams, 512 + 128", ">= 12,000 tok/s, TTFT p50 <= 150 ms",
           lambda args: [["serve.py", "--serve", args.serve_flags, "--loads", str(args.loads), *SERVE_LOAD,
                          "--goal", ",".join(f"{v:g}" for v in SERVE_GOAL)]], serve_judge),
    Target("http_b1", "HTTP against the engine at B=1", "<= 5 % lost",
           lambda args: [["serve.py", "--serve", args.serve_flags, *ONE_STREAM],
                         ["serve.py", "--engine", *engine_flags(args.serve_flags), "--device", args.device,
                          "--engine-process", *ONE_STREAM]], http_judge),
]


def engine_flags(serve_flags: str) -> list[str]:
    """serve.py --engine's arguments for a server's flags: --model's value first (the --engine
    MODEL), --max-model-len dropped (the engine mode sizes its own)."""
    words, out, model = shlex.split(serve_flags), [], None
    it = iter(words)
    for w in it:
        if w == "--model":
            model = next(it)
        elif w == "--max-model-len":
            next(it)
        else:
            out.append(w)
    if model is None:
        raise ValueError(f"--serve-flags needs --model: {serve_flags!r}")
    return [model, *out]


def describe_run() -> str:
    """The device (nvidia-smi's name and UUID, where there is one), the date and the commit."""
    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,uuid", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20).stdout.strip().splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        gpu = "no GPU found by nvidia-smi"
    git = ["git", "-C", str(ROOT)]
    try:
        commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True).stdout.strip()
        commit = (commit or "unknown") + (" with uncommitted changes" if dirty else "")
    except OSError:
        commit = "unknown"
    return f"{gpu}; {datetime.date.today().isoformat()}; commit {commit}"


def run_logged(cmd: list[str], log: Path, timeout: float | None) -> str | None:
    """cmd with its stdout and stderr to log, in a session of its own; None where it exits 0, else
    what went wrong. Past `timeout` seconds the whole session is killed: a benchmark's server and
    client processes as well as the benchmark (their GPU memory with them)."""
    with open(log, "w") as f:
        f.write(shlex.join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return f"timed out after {timeout:g} s"
        finally:
            try:  # whatever the benchmark left behind in its session
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return None if rc == 0 else f"rc {rc}"


def run_target(target: Target, args, out: Path) -> dict:
    """The target's runs in turn (stdout and stderr to OUT/NAME-i.log, JSON to OUT/NAME-i.json;
    each within args.timeout seconds where that is set), then its row."""
    outs, start = [], time.monotonic()
    for i, argv in enumerate(target.runs(args)):
        log, js = out / f"{target.name}-{i}.log", out / f"{target.name}-{i}.json"
        cmd = [sys.executable, str(BENCH / argv[0]), *argv[1:], "--json", str(js)]
        failed = run_logged(cmd, log, getattr(args, "timeout", None) or None)
        if failed is None and not js.exists():
            failed = f"no JSON written ({js.name})"
        if failed:
            return {"target": target.name, "label": target.label, "goal": target.goal, "met": False,
                    "figure": f"error: {failed} (log {log})", "seconds": time.monotonic() - start}
        outs.append(json.loads(js.read_text()))
    figure, met, rate = target.judge(outs)
    if target.peer and rate:
        figure += f"; {rate / target.peer[1]:.2f}x {target.peer[0]} ({target.peer[1]:,.0f} tok/s)"
    return {"target": target.name, "label": target.label, "goal": target.goal, "met": bool(met), "figure": figure,
            "seconds": time.monotonic() - start}


def table(rows: list[dict], header: str) -> list[str]:
    width = max(len(r["label"]) for r in rows)
    goal = max(len(r["goal"]) for r in rows)
    lines = [f"issue 6's targets: {header}"]
    for r in rows:
        lines.append(f"  {r['label']:<{width}}  {r['goal']:<{goal}}  {'yes' if r['met'] else 'NO ':3}  {r['figure']}  "
                     f"[{r['seconds']:.0f} s]")
    lines.append(f"  met: {sum(r['met'] for r in rows)} of {len(rows)}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    names = [t.name for t in TARGETS]
    ap.add_argument("--only", help=f"comma-separated targets, of: {', '.join(names)} (default: all)")
    ap.add_argument("--device", default="cuda", help="the engine-level benchmarks' device (default cuda)")
    ap.add_argument("--smollm2", default="SmolLM2-135M-Instruct",
                    help="smollm2_b1's model: the GGUF (a path, or the name the engine resolves) or "
                         "random:smollm2-135m (the same shape with random weights)")
    ap.add_argument("--serve-flags", default=SERVE_FLAGS, help="the server's flags for serve_8b and http_b1")
    ap.add_argument("--loads", type=int, default=3, help="serve_8b's loads against its server (default 3)")
    ap.add_argument("--timeout", type=float, default=900.0,
                    help="seconds each benchmark run may take before it and its processes are killed and its "
                         "row reads error (default 900; 0: no limit)")
    ap.add_argument("--out", help="the benchmarks' logs and JSON (default: a new temporary folder)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    chosen = names if not args.only else [n.strip() for n in args.only.split(",")]
    unknown = sorted(set(chosen) - set(names))
    if unknown:
        ap.error(f"--only: unknown targets {unknown}; they are {names}")
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="cuserve-targets-"))
    out.mkdir(parents=True, exist_ok=True)
    header = describe_run()
    print(f"{header}; logs in {out}", flush=True)
    rows = []
    for target in (t for t in TARGETS if t.name in chosen):
        rows.append(run_target(target, args, out))
        print(f"{target.name}: {'met' if rows[-1]['met'] else 'not met'}: {rows[-1]['figure']}", flush=True)
    print("\n".join(table(rows, header)))
    if args.json:
        Path(args.json).write_text(json.dumps({"run": header, "rows": rows}, indent=1))
    return 0 if all(r["met"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
