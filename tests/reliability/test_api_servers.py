"""--api-server-count: several HTTP processes on one port, one engine process. Connections spread
over the processes, /metrics answers for all of them from any, a SIGTERM drains them all, and a
process that dies takes only its own connections with it."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

import httpx
import pytest

from tests.reliability.conftest import start

STREAMS = 12


def _sockets(port: int, state: str) -> set[int]:
    """Inodes of this host's TCP sockets on local `port` in `state` ("0A" listening, "01" established)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == state:
                    inodes.add(int(fields[9]))
    return inodes


def _owners(inodes: set[int]) -> dict[int, int]:
    """pid -> how many of these socket inodes it holds."""
    owners: dict[int, int] = {}
    wanted = {f"socket:[{i}]" for i in inodes}
    for pid in (int(n) for n in os.listdir("/proc") if n.isdigit()):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # gone, or not ours to read
            continue
        held = 0
        for fd in fds:
            try:
                held += os.readlink(f"/proc/{pid}/fd/{fd}") in wanted
            except OSError:  # closed since the listing
                pass
        if held:
            owners[pid] = held
    return owners


def _alive(pid: int) -> bool:
    """Running (not gone, not a zombie that no one reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _http_processes(port: int) -> set[int]:
    return set(_owners(_sockets(port, "0A")))


def _stream(url: str, i: int, out: dict, started: threading.Barrier | None, max_tokens: int = 40) -> None:
    result = {"tokens": None, "error": None}
    try:
        with httpx.stream("POST", url + "/v1/completions", timeout=120,
                          json={"prompt": f"Story number {i}:", "max_tokens": max_tokens, "ignore_eos": True,
                                "stream": True, "stream_options": {"include_usage": True}}) as r:
            first = True
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if first and started is not None:
                    first = False
                    started.wait(60)
                if "error" in chunk:
                    result["error"] = chunk["error"]["message"]
                if chunk.get("usage"):
                    result["tokens"] = chunk["usage"]["completion_tokens"]
    except (httpx.HTTPError, threading.BrokenBarrierError) as exc:
        result["error"] = repr(exc)
    out[i] = result


def _metric(url: str, line_start: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text  # a new connection: any of the processes
    (line,) = [line for line in text.splitlines() if line.startswith(line_start)]
    return float(line.rsplit(" ", 1)[1])


def test_streams_spread_over_the_processes_metrics_count_them_all_and_sigterm_drains_both(
        smollm2_path, tmp_path_factory):
    proc = start(smollm2_path, tmp_path_factory, "api-servers", "--api-server-count", "2", "--max-model-len", "256",
                 "--max-num-seqs", "16", "--shutdown-timeout", "60")
    try:
        http = _http_processes(proc.port)
        assert len(http) == 2 and proc.proc.pid in http, proc.logs()
        results: dict[int, dict] = {}
        started = threading.Barrier(STREAMS + 1)
        threads = [threading.Thread(target=_stream, args=(proc.url, i, results, started)) for i in range(STREAMS)]
        for t in threads:
            t.start()
        started.wait(60)  # every stream has its first token: its connection is up
        serving = _owners(_sockets(proc.port, "01"))
        # the client's ends are established sockets on the port too (this process holds them)
        counts = {pid: n for pid, n in serving.items() if pid in http}
        assert set(counts) == http and sum(counts.values()) == STREAMS, (counts, serving)
        proc.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(90)
        assert all(out["tokens"] == 40 for out in results.values()), results
        assert len(results) == STREAMS
        deadline = time.monotonic() + 60
        while proc.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert proc.proc.returncode == 0, proc.logs()
        assert not _http_processes(proc.port) and not any(_alive(pid) for pid in http)
    finally:
        proc.stop()


def test_metrics_from_any_process_count_every_process(smollm2_path, tmp_path_factory):
    proc = start(smollm2_path, tmp_path_factory, "api-servers-metrics", "--api-server-count", "3",
                 "--max-model-len", "256", "--max-num-seqs", "16")
    try:
        assert len(_http_processes(proc.port)) == 3  # /health says ok only once all three accept
        results: dict[int, dict] = {}
        threads = [threading.Thread(target=_stream, args=(proc.url, i, results, None, 4)) for i in range(STREAMS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert all(out["tokens"] == 4 for out in results.values()) and len(results) == STREAMS
        # each scrape comes on a new connection, which may reach any process: all give the same totals
        done = 'cuserve_http_requests_total{path="/v1/completions",status="200"}'
        for _ in range(6):
            assert _metric(proc.url, done) == STREAMS
            assert _metric(proc.url, "cuserve_time_to_first_token_seconds_count") == STREAMS
            assert _metric(proc.url, "cuserve_generation_tokens_total") == 4 * STREAMS
        # every process's loop samples its lag every 10 ms into its row: three loops, ~300 a second
        lag = _metric(proc.url, "cuserve_event_loop_lag_seconds_count")
        time.sleep(2.0)
        assert _metric(proc.url, "cuserve_event_loop_lag_seconds_count") - lag > 2.0 * 150
    finally:
        assert proc.stop() == 0, proc.logs()


def test_a_dead_http_process_takes_only_its_connections_with_it(smollm2_path, tmp_path_factory):
    proc = start(smollm2_path, tmp_path_factory, "api-servers-die", "--api-server-count", "2",
                 "--max-model-len", "256", "--max-num-seqs", "16")
    try:
        (other,) = _http_processes(proc.port) - {proc.proc.pid}
        results: dict[int, dict] = {}
        started = threading.Barrier(STREAMS + 1)
        threads = [threading.Thread(target=_stream, args=(proc.url, i, results, started, 120))
                   for i in range(STREAMS)]
        for t in threads:
            t.start()
        started.wait(60)
        on_other = _owners(_sockets(proc.port, "01")).get(other, 0)
        assert 0 < on_other < STREAMS
        os.kill(other, signal.SIGKILL)
        for t in threads:
            t.join(90)
        cut = [out for out in results.values() if out["tokens"] is None]
        assert len(cut) == on_other and all(out["error"] for out in cut), results
        assert sum(out["tokens"] == 120 for out in results.values()) == STREAMS - on_other
        assert _http_processes(proc.port) == {proc.proc.pid}
        assert httpx.get(proc.url + "/health", timeout=10).status_code == 200
        for _ in range(4):  # new connections all reach the process left
            r = httpx.post(proc.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 3}, timeout=30)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        deadline = time.monotonic() + 10
        while "cuserve-http-1 exited" not in proc.logs() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "cuserve-http-1 exited" in proc.logs()
    finally:
        assert proc.stop() == 0, proc.logs()


def test_the_other_processes_end_when_the_first_is_killed(smollm2_path, tmp_path_factory):
    proc = start(smollm2_path, tmp_path_factory, "api-servers-orphans", "--api-server-count", "2",
                 "--max-model-len", "256")
    (other,) = _http_processes(proc.port) - {proc.proc.pid}
    proc.proc.kill()
    proc.proc.wait(10)
    deadline = time.monotonic() + 20
    while _alive(other) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(other), "the extra HTTP process outlived the server"
    proc.stop()


def test_a_port_in_use_fails_before_the_model_loads():
    from server.launch import listen_socket

    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)  # as another server's HTTP process
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError):
            listen_socket("127.0.0.1", port, check_free=True)
        listen_socket("127.0.0.1", port).close()  # without the check it would have joined that server
