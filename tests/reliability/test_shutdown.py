"""SIGTERM under load: streams in flight finish, nothing new is accepted, exit code 0."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx

from tests.reliability.conftest import start


def test_sigterm_drains_in_flight_streams(smollm2_path, tmp_path_factory):
    proc = start(smollm2_path, tmp_path_factory, "shutdown", "--max-model-len", "256", "--shutdown-timeout", "40")
    results: dict[int, dict] = {}
    started = threading.Barrier(7)

    def stream(i: int) -> None:
        out = {"tokens": None, "error": None, "chunks": 0}
        try:
            with httpx.stream("POST", proc.url + "/v1/completions", timeout=120,
                              json={"prompt": f"Story number {i}:", "max_tokens": 60, "ignore_eos": True,
                                    "stream": True, "stream_options": {"include_usage": True}}) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    out["chunks"] += 1
                    if out["chunks"] == 1:
                        started.wait(60)
                    if "error" in chunk:
                        out["error"] = chunk["error"]["message"]
                    if chunk.get("usage"):
                        out["tokens"] = chunk["usage"]["completion_tokens"]
        except httpx.HTTPError as exc:
            out["error"] = repr(exc)
        results[i] = out

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    started.wait(60)  # all six are streaming
    with httpx.Client(base_url=proc.url, timeout=10) as keepalive:
        assert keepalive.get("/health").status_code == 200
        proc.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        # nothing new is accepted: a new connection is refused, or answered 503
        try:
            late = httpx.post(proc.url + "/v1/completions", json={"prompt": "late", "max_tokens": 2}, timeout=5)
            assert late.status_code == 503
        except httpx.HTTPError:
            pass
        try:
            assert keepalive.get("/health").status_code == 503
        except httpx.HTTPError:
            pass  # the server closed the idle connection: also nothing accepted
    for t in threads:
        t.join(90)
    deadline = time.monotonic() + 60
    while proc.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert proc.proc.returncode == 0, proc.logs()
    for i, out in results.items():
        # each stream either finished whole or ended with an error event, never silently cut
        assert out["tokens"] == 60 or out["error"], (i, out)
    assert sum(out["tokens"] == 60 for out in results.values()) == 6


def _engine_process(pid: int, timeout: float = 10.0) -> int:
    """The server's engine process (multiprocessing's spawned child, not its resource tracker): the
    process whose parent is the server (its PPid, the thread group's id whichever of the server's
    threads started it or holds it now) and whose command line is spawn_main's. Read from every
    /proc/<n>/status, not from the server threads' children lists: the kernel does not keep those
    exact while a thread that started a child exits, and two CI runs found no engine there."""
    def read(path: str) -> bytes:  # b"" for a process that ended since /proc was listed
        try:
            with open(path, "rb") as f:
                return f.read()
        except (FileNotFoundError, ProcessLookupError):
            return b""

    parent = f"PPid:\t{pid}\n".encode()
    deadline = time.monotonic() + timeout
    while True:
        spawned = [int(n) for n in os.listdir("/proc") if n.isdigit() and parent in read(f"/proc/{n}/status")
                   and b"spawn_main" in read(f"/proc/{n}/cmdline")]
        if len(spawned) == 1 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    (engine,) = spawned
    return engine


def test_a_dead_engine_process_gets_503s_not_a_dead_server(smollm2_path, tmp_path_factory):
    """The engine runs in a child process (the default): killing it fails the stream in flight
    with an error event, then /health and new requests answer 503; the server stays up and
    exits 0 on SIGTERM."""
    proc = start(smollm2_path, tmp_path_factory, "engine-dies", "--max-model-len", "512")
    try:
        child = _engine_process(proc.proc.pid)
        events = []
        with httpx.stream("POST", proc.url + "/v1/completions", timeout=60,
                          json={"prompt": "Count to a thousand:", "max_tokens": 400, "ignore_eos": True,
                                "stream": True}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 2:
                        os.kill(child, signal.SIGKILL)
        assert events[-1] == "[DONE]"
        errors = [json.loads(e)["error"] for e in events[:-1] if '"error"' in e]
        assert len(errors) == 1 and "exited" in errors[0]["message"], events[-3:]
        health = httpx.get(proc.url + "/health", timeout=10)
        assert health.status_code == 503 and "engine stopped" in health.json()["status"]
        r = httpx.post(proc.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        assert proc.proc.poll() is None
    finally:
        assert proc.stop() == 0
