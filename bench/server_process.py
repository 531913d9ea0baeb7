"""Run `cuserve serve` as a real process on a free local port: bench/serve.py --serve and the
integration tests (tests/server_process.py) start their servers with it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, *args: str, env: dict[str, str] | None = None, log_path: Path | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "server.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port), *args]
        self.log_path = log_path
        self.log = open(log_path, "wb") if log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **(env or {})},
                                     stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.logs()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not ready after {timeout}s: {self.logs()}")

    def logs(self) -> str:
        if self.log_path and self.log_path.exists():
            return self.log_path.read_text(errors="replace")[-4000:]
        return ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.log not in (None, subprocess.DEVNULL):
            self.log.close()
        return self.proc.returncode


def start_server(*args: str, log_path: Path | None = None, env: dict[str, str] | None = None,
                 timeout: float = 120.0) -> ServerProcess:
    """A ready `cuserve serve` process with these flags (stopped again if it does not come up)."""
    proc = ServerProcess(*args, env=env, log_path=log_path)
    try:
        proc.wait_ready(timeout)
    except BaseException:
        proc.stop()
        raise
    return proc
