"""bench/gpu_clocks.py: the SM clock and power samples a benchmark reports (nvidia-smi), read
from a stand-in nvidia-smi on the CPU."""

from __future__ import annotations

import os
import stat
import time

from bench import gpu_clocks
from bench.gpu_clocks import GpuClocks, describe, parse_identity, parse_samples, summarize_samples


def test_samples_parse_and_summarize():
    lines = ["1620, 692.51, 0x0000000000000004\n", "[N/A], 80.0, 0x0\n", "1980, 180.25, 0x0000000000000000\n",
             "clocks.sm [MHz], power.draw [W], clocks_throttle_reasons.active\n", "1575, 699.0, 0x4\n"]
    samples = parse_samples(lines)
    assert samples == [(1620.0, 692.51, 4), (1980.0, 180.25, 0), (1575.0, 699.0, 4)]
    gpu = summarize_samples(samples)
    assert gpu["samples"] == 3
    assert gpu["sm_clock_mhz"] == {"p50": 1620.0, "min": 1575.0, "max": 1980.0}
    assert gpu["power_w"]["p50"] == 692.51 and gpu["power_w"]["max"] == 699.0
    assert abs(gpu["power_capped"] - 2 / 3) < 1e-9
    assert "p50 1620 MHz" in describe(gpu) and "67 % of samples" in describe(gpu)
    assert summarize_samples([]) is None and describe(None) is None


def test_sampler_reads_nvidia_smi_while_the_load_runs(tmp_path, monkeypatch):
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\n"
                    "case \"$*\" in *uuid*) echo 'NVIDIA H200, GPU-bfd0ceb1-a7d4, 1653924042814, 700.00, 96.00.A5'; "
                    "exit 0;; *clocks.sm,power.draw*-lms=*) ;; *) exit 3;; esac\n"
                    "echo '1620, 692.5, 0x0000000000000004'\necho '1980, 180.0, 0x0000000000000000'\nexec sleep 30\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    with GpuClocks() as clocks:
        deadline = time.monotonic() + 10
        while len(clocks.lines) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
    gpu = clocks.summary()
    assert gpu["samples"] == 2 and gpu["power_capped"] == 0.5 and gpu["sm_clock_mhz"]["p50"] == 1800.0
    assert gpu["devices"] == [{"name": "NVIDIA H200", "uuid": "GPU-bfd0ceb1-a7d4", "serial": "1653924042814",
                               "power_limit_w": 700.0, "vbios": "96.00.A5"}]
    assert describe(gpu).endswith(", GPU-bfd0ceb1")
    assert clocks._proc is None  # stopped at the end of the load


def test_identity_lines_parse():
    lines = ["NVIDIA H200, GPU-b0481433-9d2f, 1654024199778, 700.00, 96.00.A5.00.1A\n",
             "name, uuid, serial, power.limit [W], vbios_version\n", "NVIDIA H200, GPU-61b39fed, [N/A], [N/A], 96.00\n"]
    assert parse_identity(lines) == [
        {"name": "NVIDIA H200", "uuid": "GPU-b0481433-9d2f", "serial": "1654024199778", "power_limit_w": 700.0,
         "vbios": "96.00.A5.00.1A"},
        {"name": "NVIDIA H200", "uuid": "GPU-61b39fed", "serial": "[N/A]", "power_limit_w": None, "vbios": "96.00"}]


def test_no_nvidia_smi_no_samples(monkeypatch):
    monkeypatch.setattr(gpu_clocks.shutil, "which", lambda name: None)
    with GpuClocks() as clocks:
        pass
    assert not clocks.enabled and clocks.summary() is None
    with GpuClocks(enabled=False) as clocks:
        pass
    assert clocks.summary() is None
