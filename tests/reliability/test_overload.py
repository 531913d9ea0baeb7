"""A burst beyond the waiting queue: 503 + Retry-After for the excess, the rest finish."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.reliability.conftest import start


@pytest.fixture(scope="module")
def small_queue(smollm2_path, tmp_path_factory):
    proc = start(smollm2_path, tmp_path_factory, "small-queue", "--max-num-seqs", "2", "--max-waiting", "3",
                 "--max-model-len", "256", "--retry-after", "2")
    yield proc
    proc.stop()


def test_burst_gets_503_then_serves_normally(small_queue):
    body = {"prompt": "Tell me a story about a dragon:", "max_tokens": 40, "ignore_eos": True}

    async def burst():
        async with httpx.AsyncClient(base_url=small_queue.url, timeout=120) as client:
            return await asyncio.gather(*[client.post("/v1/completions", json=body) for _ in range(20)])

    responses = asyncio.run(burst())
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 503}, codes
    admitted = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code == 503]
    assert 5 <= len(admitted) < 20 and refused  # 2 running + 3 waiting (+ what finished meanwhile)
    for r in refused:
        assert r.headers["Retry-After"] == "2"
        assert r.json()["error"]["code"] == "overloaded" and r.json()["error"]["type"] == "service_unavailable"
    for r in admitted:
        assert r.json()["usage"]["completion_tokens"] == 40
    with httpx.Client(base_url=small_queue.url, timeout=60) as client:
        assert client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3}).status_code == 200
        assert client.get("/health").status_code == 200
