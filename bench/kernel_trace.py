"""The device's kernels over a window of engine steps, in place: each step's span, how much of it
the kernels kept the device busy, what ran, and where it stood idle between kernels.

torch.profiler (CUPTI) records every kernel of the engine's process: CuPy's, cuBLAS(Lt)'s, the
nodes of captured graphs, and memsets. bench/serve.py's engine mode starts it at a step of the
load and stops it some steps later (--kernel-trace DIR --kernel-trace-steps START,COUNT); this
module then reads the trace and prints the summary (or, for a trace already written):

    python bench/serve.py --engine random:llama3-8b --quantization fp8 --kv-cache-dtype fp8 \\
        --max-num-batched-tokens 2048 --num-prompts 1024 --input-len 512 --output-len 128 \\
        --concurrency 256 --engine-process --kernel-trace out/ --kernel-trace-steps 250,30
    python bench/kernel_trace.py out/kernels-2048.json  # DIR/kernels-BUDGET.json

Steps are cut at each `embedding` kernel (every step of the CUDA runner starts with one); a
step with a prompt attention kernel (flash_prefill*) is "with prompts", else "decode". The
kernels before the window's first step, and its last step (which the window may cut off), are
left out. A kernel launched with programmatic dependent launch starts before the one it waits
for ends, so its duration here includes that wait: per-kernel times are spans, and the union
of them is the busy time.
Needs PyTorch (a test dependency here); the load's throughput is disturbed while it records.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections import defaultdict
from itertools import accumulate
from pathlib import Path

STEP_START = "embedding"
PROMPT_ATTENTION = "flash_prefill"


def start() -> object:
    """A running torch.profiler: the device's kernels where CUDA is there, else the host's ops."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CUDA] if torch.cuda.is_available() else [ProfilerActivity.CPU]
    prof = profile(activities=activities)
    prof.start()
    return prof


def stop(prof) -> None:
    """Stop recording once the device has run everything launched so far."""
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    prof.stop()


def family(name: str) -> str:
    """A kernel's name without its template and argument lists, at most 60 characters."""
    return re.sub(r"[(<].*", "", name)[:60]


def _union(intervals: list[tuple[float, float]]) -> float:
    busy, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return busy + (cur_e - cur_s if cur_e is not None else 0.0)


def summarize(trace: dict) -> dict:
    """A Chrome trace (torch.profiler's export) -> {"kernels": count, "kinds": {kind: {"steps",
    "span_us_p50", "busy_p50", "kernels_p50", "idle_before_us_p50" (the device idle from the last
    kernel before the step to its first), "families": {name: [us a step, launches a step]},
    "after": {"name < the family launched before it": [us a step, launches a step]}}}, "gaps":
    [[before, after, us a step, count a step], ...] (idle time between a kernel and the next, by
    the pair, largest first; over all whole steps)}. Times in microseconds. "after" tells apart the
    launches of one family by what precedes them (the o product from the down product, the norm
    after attention from the one after the MLP)."""
    events = sorted((e for e in trace.get("traceEvents", [])
                     if e.get("cat") in ("kernel", "gpu_memset") and "dur" in e), key=lambda e: e["ts"])
    starts = [i for i, e in enumerate(events) if e["name"].startswith(STEP_START)]
    # whole steps: those that began in the window, but the last (the window may end in it)
    steps = [(a, events[a:b]) for a, b in zip(starts, starts[1:])]
    ends = list(accumulate((e["ts"] + e["dur"] for e in events), max))  # the device's last end so far
    kinds: dict[str, list[dict]] = defaultdict(list)
    gaps: dict[tuple[str, str], list[float]] = defaultdict(list)
    for a, ks in steps:
        t0, t1 = ks[0]["ts"], max(k["ts"] + k["dur"] for k in ks)
        fams: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
        after: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
        end, last, prev = None, None, None
        for k in ks:
            name = "memset" if k.get("cat") == "gpu_memset" else family(k["name"])
            for table, key in ((fams, name), (after, f"{name} < {prev or '-'}")):
                table[key][0] += k["dur"]
                table[key][1] += 1
            prev = name
            if end is not None and k["ts"] > end:
                gaps[(last, name)].append(k["ts"] - end)
            if end is None or k["ts"] + k["dur"] > end:
                end, last = k["ts"] + k["dur"], name
        kind = "with prompts" if any(n.startswith(PROMPT_ATTENTION) for n in fams) else "decode"
        kinds[kind].append({"span": t1 - t0, "busy": _union([(k["ts"], k["ts"] + k["dur"]) for k in ks]),
                            "n": len(ks), "fams": fams, "after": after,
                            "idle_before": max(0.0, t0 - ends[a - 1]) if a else None})
    whole = sum(len(v) for v in kinds.values())
    out = {"kernels": len(events), "kinds": {}, "gaps": []}
    for kind, ss in kinds.items():
        out["kinds"][kind] = {
            "steps": len(ss), "span_us_p50": statistics.median(s["span"] for s in ss),
            "busy_p50": statistics.median(s["busy"] / s["span"] if s["span"] else 1.0 for s in ss),
            "kernels_p50": statistics.median(s["n"] for s in ss),
            "idle_before_us_p50": _median_or_none([s["idle_before"] for s in ss if s["idle_before"] is not None]),
            "families": _per_step(ss, "fams"), "after": _per_step(ss, "after")}
    out["gaps"] = sorted(([a, b, sum(v) / whole, len(v) / whole] for (a, b), v in gaps.items()),
                         key=lambda g: -g[2]) if whole else []
    return out


def _median_or_none(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _per_step(steps: list[dict], field: str) -> dict[str, list[float]]:
    """The steps' {name: [us, launches]} tables (field) as the mean a step, largest first."""
    table = defaultdict(lambda: [0.0, 0.0])
    for s in steps:
        for name, (us, count) in s[field].items():
            table[name][0] += us / len(steps)
            table[name][1] += count / len(steps)
    return dict(sorted(table.items(), key=lambda f: -f[1][0]))


def report(summary: dict, families: int = 12, gaps: int = 8, after: bool = False) -> list[str]:
    """The summary as text; after: the kernels by the family launched before them too."""
    lines = [f"kernel trace: {summary['kernels']} kernels and memsets"]
    if not summary["kinds"]:
        return lines + ["  no whole step in the window (no device kernels, or fewer than two steps)"]
    for kind, k in summary["kinds"].items():
        idle = k.get("idle_before_us_p50")
        lines.append(f"  {kind}: {k['steps']} steps, span p50 {k['span_us_p50']:.0f} us, kernels busy "
                     f"{100 * k['busy_p50']:.1f} % of it, {k['kernels_p50']:.0f} kernels a step"
                     + (f", the device idle {idle:.1f} us before one (p50)" if idle is not None else ""))
        tables = [("", k["families"])] + ([("  by the kernel launched before: ", k["after"])] if after else [])
        for title, table in tables:
            if title:
                lines.append(f"    {title.strip()}")
            for name, (us, count) in list(table.items())[:families]:
                lines.append(f"    {name:60s} {us:9.1f} us a step, x{count:5.1f} ({us / count:7.2f} us each)")
    lines.append("  idle between kernels, a step, by the pair (largest first):")
    for before, after, us, count in summary["gaps"][:gaps]:
        lines.append(f"    {before[:36]:36s} -> {after[:36]:36s} {us:7.1f} us, x{count:5.1f}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", help="a Chrome trace from torch.profiler "
                                  "(bench/serve.py --kernel-trace's DIR/kernels-BUDGET.json)")
    ap.add_argument("--json", help="write the summary here")
    args = ap.parse_args()
    summary = summarize(json.loads(Path(args.trace).read_text()))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    print("\n".join(report(summary)))


if __name__ == "__main__":
    main()
