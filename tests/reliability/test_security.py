"""The API key: required everywhere but /health, compared in constant time, never logged."""

from __future__ import annotations

import inspect

import httpx

from server.app import AuthMiddleware
from tests.reliability.conftest import start

KEY = "sk-reliability-5f2a9c"


def test_api_key_everywhere_but_health(smollm2_path, tmp_path_factory):
    proc = start(smollm2_path, tmp_path_factory, "security", "--max-model-len", "128", "--log-level", "debug",
                 env={"CUSERVE_API_KEY": KEY})
    try:
        with httpx.Client(base_url=proc.url, timeout=60) as client:
            assert client.get("/health").status_code == 200
            paths = [("GET", "/v1/models"), ("GET", "/v1/models/x"), ("POST", "/v1/completions"),
                     ("POST", "/v1/chat/completions"), ("POST", "/tokenize"), ("POST", "/detokenize"),
                     ("GET", "/metrics"), ("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/redoc"),
                     ("GET", "/no/such/path")]
            for header in ({}, {"Authorization": "Bearer nope"}, {"Authorization": KEY},
                           {"Authorization": f"Basic {KEY}"}, {"Authorization": f"Bearer {KEY}x"}):
                for method, path in paths:
                    r = client.request(method, path, headers=header, json={"prompt": "x"})
                    assert r.status_code == 401, (header, path, r.status_code)
                    assert r.json()["error"]["code"] == "invalid_api_key"
            good = {"Authorization": f"Bearer {KEY}"}
            assert client.get("/v1/models", headers=good).status_code == 200
            assert client.get("/openapi.json", headers=good).status_code == 200
            r = client.post("/v1/completions", headers=good, json={"prompt": "Hi", "max_tokens": 2})
            assert r.status_code == 200
    finally:
        proc.stop()
    logs = proc.logs()
    assert "invalid_api_key" not in logs or KEY not in logs
    assert KEY not in logs  # neither the key nor a request echoing it reaches the logs


def test_key_comparison_is_constant_time():
    """The token meets the key only inside hmac.compare_digest (no ==, no startswith)."""
    source = inspect.getsource(AuthMiddleware.__call__)
    assert "hmac.compare_digest(token.strip(), self.expected)" in source
    for leak in ("token ==", "== self.expected", "self.expected ==", "startswith(self.expected"):
        assert leak not in source
