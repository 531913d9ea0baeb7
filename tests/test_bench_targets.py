"""bench/targets.py: issue 6's targets in one command (the GPU runs are the device's; here a CPU
run of one target end to end, a failing benchmark's row, and each judge on the JSON shapes the
benchmarks write)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import targets


def test_a_target_runs_its_benchmark_and_judges_it(tmp_path):
    out = tmp_path / "out"
    rc = targets.main(["--only", "smollm2_b1", "--smollm2", "random:smollm2-135m", "--device", "cpu",
                       "--out", str(out), "--json", str(tmp_path / "rows.json")])
    rows = json.loads((tmp_path / "rows.json").read_text())["rows"]
    assert [r["target"] for r in rows] == ["smollm2_b1"]
    result = json.loads((out / "smollm2_b1-0.json").read_text())["results"][0]
    assert result["batch"] == 1 and result["decode_tok_s"] > 0
    assert rows[0]["figure"].startswith(f"{result['decode_tok_s']:,.1f} tok/s")
    assert rows[0]["figure"].endswith(f"; {result['decode_tok_s'] / 962:.2f}x llama.cpp Q4_1 (962 tok/s)")
    assert rows[0]["met"] is (result["decode_tok_s"] >= 3000) and rc == (0 if rows[0]["met"] else 1)


def test_a_failing_benchmark_gives_an_error_row_and_the_rest_run(tmp_path):
    broken = targets.Target("broken", "broken", "-", lambda args: [["decode.py", "--model", "no-such-model"]],
                            targets.decode_judge(1))
    row = targets.run_target(broken, targets.argparse.Namespace(), tmp_path)
    assert row["met"] is False and row["figure"].startswith("error: rc ")
    assert "no-such-model" in (tmp_path / "broken-0.log").read_text()


def test_unknown_targets_are_refused():
    with pytest.raises(SystemExit):
        targets.main(["--only", "decode_8b_b1,nope"])


def summary(tok_s: float, ttft_p50: float) -> dict:
    return {"output_throughput": tok_s, "ttft_ms": {"p50": ttft_p50}}


def test_judges():
    met, missed = summary(12400.0, 97.0), summary(11990.0, 97.0)
    figure, ok, _ = targets.serve_judge([[met, summary(12100.0, 140.0)]])
    assert ok and "both in 2 of 2 loads" in figure
    figure, ok, _ = targets.serve_judge([[met, missed]])
    assert not ok and "both in 1 of 2 loads" in figure
    assert not targets.serve_judge([[summary(12400.0, 151.0)]])[1]
    assert targets.serve_judge([met])[1]  # one load: serve.py writes the summary itself, not a list
    figure, ok, _ = targets.http_judge([summary(324.8, 10.9), summary(326.0, 8.4)])
    assert ok and figure.endswith("alone: 0.4 % lost")
    assert not targets.http_judge([summary(300.0, 10.0), summary(326.0, 8.0)])[1]
    decode = {"results": [{"decode_tok_s": 241.0, "step_ms_median": 4.15, "roofline_pct": 87.1}]}
    assert targets.decode_judge(240)([decode]) == ("241.0 tok/s (4.15 ms a step, 87.1 % of the roofline)", True, 241.0)
    assert not targets.decode_judge(3000)([decode])[1]
    prefill = {"gemm_tflops": 730.0, "rows": [{"ttft_ms": 58.06, "ratio": 1.332, "floor_ms": 43.59,
                                               "prefill_tok_s": 35272.0}]}
    assert targets.prefill_judge([prefill]) == ("58.06 ms, 1.33x the floor (43.59 ms at 730 TFLOP/s)", True, 35272.0)


def test_engine_flags_from_the_server_flags():
    assert targets.engine_flags(targets.SERVE_FLAGS) == [
        "random:llama3-8b", "--max-num-seqs", "256", "--quantization", "fp8", "--kv-cache-dtype", "fp8",
        "--dtype", "bfloat16", "--kv-cache-gib", "40"]
    with pytest.raises(ValueError):
        targets.engine_flags("--max-num-seqs 8")


def test_every_target_builds_its_runs():
    args = targets.argparse.Namespace(device="cuda", smollm2="x.gguf", serve_flags=targets.SERVE_FLAGS, loads=3)
    for target in targets.TARGETS:
        for argv in target.runs(args):
            assert (targets.BENCH / argv[0]).is_file()
    assert targets.TARGETS[1].runs(args)[0][2] == "x.gguf"


def test_a_benchmark_past_its_timeout_is_killed_with_what_it_started(tmp_path, monkeypatch):
    """--timeout: the run and the processes it started (serve.py's server and clients) are killed
    and the row reads error; a run within it is judged as before."""
    import time
    bench = tmp_path / "bench"
    bench.mkdir()
    (bench / "sleepy.py").write_text(
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "open(sys.argv[1], 'w').write(str(child.pid))\n"
        "time.sleep(60)\n")
    monkeypatch.setattr(targets, "BENCH", bench)
    pid_file = tmp_path / "child.pid"
    slow = targets.Target("slow", "slow", "-", lambda args: [["sleepy.py", str(pid_file)]], targets.decode_judge(1))
    start = time.monotonic()
    row = targets.run_target(slow, targets.argparse.Namespace(timeout=2.0), tmp_path)
    assert time.monotonic() - start < 30
    assert row["met"] is False and row["figure"].startswith("error: timed out after 2 s (log ")

    def gone(pid: int) -> bool:  # exited (a zombie counts: its parent was killed too)
        try:
            return Path(f"/proc/{pid}/stat").read_text().split(") ")[-1].startswith("Z")
        except FileNotFoundError:
            return True

    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while not gone(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone(child), f"the benchmark's child {child} outlived its timeout"
