"""Servers for the reliability tests: real `cuserve serve` processes on SmolLM2 (CPU), loopback only."""

from __future__ import annotations

import pytest

from tests.server_process import ServerProcess, start_server

MODEL = "SmolLM2-135M-Instruct"


def start(smollm2_path: str, tmp_path_factory, name: str, *args: str, env: dict | None = None) -> ServerProcess:
    return start_server(tmp_path_factory, name, "--model", smollm2_path, "--served-model-name", MODEL,
                        "--device", "cpu", "--kv-cache-gib", "1", *args, env=env)


@pytest.fixture(scope="module")
def busy_server(smollm2_path, tmp_path_factory):
    """Room for the load test: 64 sequences at once, a short context."""
    proc = start(smollm2_path, tmp_path_factory, "busy", "--max-num-seqs", "64", "--max-model-len", "256",
                 "--max-num-batched-tokens", "512")
    yield proc
    proc.stop()
