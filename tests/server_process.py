"""`cuserve serve` as a real process for the integration tests (bench/server_process.py)."""

from __future__ import annotations

from bench.server_process import ServerProcess, start_server as _start

__all__ = ["ServerProcess", "start_server"]


def start_server(tmp_path_factory, name: str, *args: str, env: dict[str, str] | None = None) -> ServerProcess:
    """A ready `cuserve serve` process with these flags, logging to a temporary file."""
    return _start(*args, env=env, log_path=tmp_path_factory.mktemp("logs") / f"{name}.log")
