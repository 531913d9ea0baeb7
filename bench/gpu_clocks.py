"""The GPU's SM clock and power draw while a benchmark runs (nvidia-smi, sampled every 200 ms).

A long run of many-row steps holds an H200 at its power limit: a step of 248 decode rows and
1,792 prompt tokens (8B fp8) took 32.2 ms back to back at a median SM clock of 1,620 MHz and
692 W of its 700 W, against 29.5 ms at 1,965 MHz with pauses between steps (twenty-eighth
session, docs/performance.md). A serving figure is then a figure at that clock, and a kernel
timed alone (cool) gains less in the load than alone; the benchmarks report what the clock
was, so the two are not mixed up.

    with GpuClocks() as clocks:
        ...  # the load
    clocks.summary()  # {"sm_clock_mhz": {...}, "power_w": {...}, "power_capped": 0.85, ...} or None

The summary also names the GPUs it sampled ("devices": name, UUID, serial, power limit, VBIOS),
read once when sampling starts: the device tool lends a different H200 from run to run, and the
same code serves a few percent apart on two of them (docs/performance.md), so a figure says
which board it came from.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import threading

QUERY = "clocks.sm,power.draw,clocks_throttle_reasons.active"
SAMPLE_MS = 200
POWER_CAP_BIT = 0x4  # clocks_throttle_reasons.active: the software power cap holds the clocks down
IDENTITY_QUERY = "name,uuid,serial,power.limit,vbios_version"


def parse_samples(lines: list[str]) -> list[tuple[float, float, int]]:
    """(SM MHz, watts, throttle reasons) of each `nvidia-smi --format=csv,noheader,nounits`
    line of QUERY; lines that do not parse (a header, "[N/A]") are left out."""
    samples = []
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3:
            continue
        try:
            samples.append((float(parts[0]), float(parts[1]), int(parts[2], 16)))
        except ValueError:
            continue
    return samples


def parse_identity(lines: list[str]) -> list[dict]:
    """Each GPU's name, UUID, serial, power limit (W) and VBIOS from `nvidia-smi
    --query-gpu=IDENTITY_QUERY --format=csv,noheader,nounits` lines; lines that do not parse
    are left out."""
    devices = []
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 5 or not parts[1].startswith("GPU-"):
            continue
        try:
            limit = float(parts[3])
        except ValueError:
            limit = None
        devices.append({"name": parts[0], "uuid": parts[1], "serial": parts[2], "power_limit_w": limit,
                        "vbios": parts[4]})
    return devices


def summarize_samples(samples: list[tuple[float, float, int]]) -> dict | None:
    """Median / min / max of the SM clock and of the power draw, and the share of samples in
    which the power cap held the clocks down; None without samples."""
    if not samples:
        return None
    clocks, watts = [s[0] for s in samples], [s[1] for s in samples]
    return {"samples": len(samples),
            "sm_clock_mhz": {"p50": statistics.median(clocks), "min": min(clocks), "max": max(clocks)},
            "power_w": {"p50": statistics.median(watts), "min": min(watts), "max": max(watts)},
            "power_capped": sum(1 for s in samples if s[2] & POWER_CAP_BIT) / len(samples)}


class GpuClocks:
    """Samples nvidia-smi (one process, -lms) from __enter__ to __exit__; does nothing where
    nvidia-smi is missing or `enabled` is False. With several GPUs, every GPU's lines count."""

    def __init__(self, enabled: bool = True, interval_ms: int = SAMPLE_MS) -> None:
        self.enabled = enabled and shutil.which("nvidia-smi") is not None
        self.interval_ms = interval_ms
        self.lines: list[str] = []
        self.devices: list[dict] = []  # parse_identity's, read at __enter__
        self._proc: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None

    def __enter__(self) -> GpuClocks:
        if self.enabled:
            try:
                found = subprocess.run(["nvidia-smi", f"--query-gpu={IDENTITY_QUERY}", "--format=csv,noheader,nounits"],
                                       capture_output=True, text=True, timeout=10)
                self.devices = parse_identity(found.stdout.splitlines())
            except (OSError, subprocess.TimeoutExpired):
                self.devices = []
            try:
                self._proc = subprocess.Popen(
                    ["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", f"-lms={self.interval_ms}"],
                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            except OSError:
                self._proc = None
            else:
                self._reader = threading.Thread(target=self._read, name="gpu-clocks", daemon=True)
                self._reader.start()
        return self

    def _read(self) -> None:
        for line in self._proc.stdout:
            self.lines.append(line)

    def __exit__(self, *exc) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
            self._reader.join(timeout=5)
            self._proc = None

    def summary(self) -> dict | None:
        summary = summarize_samples(parse_samples(self.lines))
        if summary is not None and self.devices:
            summary["devices"] = self.devices
        return summary


def describe(gpu: dict | None) -> str | None:
    """One line for a report: the clock and power over the run, or None."""
    if not gpu:
        return None
    c, p = gpu["sm_clock_mhz"], gpu["power_w"]
    return (f"gpu ({gpu['samples']} samples): SM clock p50 {c['p50']:.0f} MHz (min {c['min']:.0f}, max "
            f"{c['max']:.0f}), power p50 {p['p50']:.0f} W (max {p['max']:.0f}), power-capped in "
            f"{100 * gpu['power_capped']:.0f} % of samples"
            + "".join(f", {d['uuid'][:12]}" for d in gpu.get("devices", [])))
