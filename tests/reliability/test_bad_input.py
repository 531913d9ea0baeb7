"""Hand-made bad requests: each gets a 4xx OpenAI error, and a request streaming beside
them finishes untouched."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from tests.reliability.conftest import start

LONG = "lorem ipsum dolor sit amet " * 200  # > 256 tokens


@pytest.fixture(scope="module")
def server(smollm2_path, tmp_path_factory):
    proc = start(smollm2_path, tmp_path_factory, "bad-input", "--max-model-len", "256", "--max-num-seqs", "8",
                 "--max-request-bytes", str(1 << 20))
    yield proc
    proc.stop()


def json_body(obj) -> bytes:
    return json.dumps(obj).encode()


CASES = [
    ("/v1/completions", b'{"prompt": "x",', 400),  # malformed JSON
    ("/v1/completions", b'{"prompt": "\xff\xfe\xfd"}', 400),  # invalid UTF-8
    ("/v1/completions", b"[" * 50000 + b"]" * 50000, 400),  # nesting deep enough to break a recursive parser
    ("/v1/completions", b"not json at all", 400),
    ("/v1/completions", json_body({"prompt": "x", "max_tokens": "ten"}), 400),  # wrong types
    ("/v1/completions", json_body({"prompt": {"text": "x"}}), 400),
    ("/v1/completions", json_body({"prompt": ["a", 1]}), 400),
    ("/v1/completions", json_body({"prompt": "x", "temperature": "hot"}), 400),
    ("/v1/completions", json_body({"prompt": "x", "stream": "maybe"}), 400),
    ("/v1/completions", json_body({"prompt": ""}), 400),  # empty prompts
    ("/v1/completions", json_body({"prompt": []}), 400),
    ("/v1/completions", json_body({"prompt": [[]]}), 400),
    ("/v1/completions", json_body({"prompt": LONG}), 400),  # over the context length
    ("/v1/completions", json_body({"prompt": "x", "max_tokens": -5}), 400),
    ("/v1/completions", json_body({"prompt": "x", "max_tokens": 10**12}), 400),
    ("/v1/completions", json_body({"prompt": "x", "n": 1000}), 400),
    ("/v1/completions", json_body({"prompt": "x", "logprobs": 1000}), 400),
    ("/v1/completions", json_body({"prompt": "x", "logit_bias": {"999999999": 5}}), 400),
    ("/v1/completions", json_body({"prompt": "x", "logit_bias": {"-3": 5}}), 400),
    ("/v1/completions", json_body({"prompt": "x", "logit_bias": {"abc": 5}}), 400),
    ("/v1/completions", json_body({"prompt": "x", "logit_bias": {"5": 1e9}}), 400),
    ("/v1/completions", json_body({"prompt": "x", "stop": ["s"] * 1000}), 400),
    ("/v1/completions", json_body({"prompt": [2**70]}), 400),
    ("/v1/completions", json_body({"prompt": [[5, -2**80]], "echo": True}), 400),  # found by schemathesis
    ("/v1/completions", b'{"prompt": "x", "temperature": NaN}', 400),
    ("/v1/completions", b'{"prompt": "x", "top_p": Infinity}', 400),
    ("/v1/completions", json_body({"prompt": "x", "stop_token_ids": [-1]}), 400),
    ("/v1/chat/completions", json_body({"messages": "hi"}), 400),
    ("/v1/chat/completions", json_body({"messages": [{"content": "no role"}]}), 400),
    ("/v1/chat/completions", json_body({"messages": [{"role": "user", "content": LONG}]}), 400),
    ("/v1/chat/completions", json_body({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 50,
                                        "logprobs": True}), 400),
    ("/v1/chat/completions", json_body({"messages": [{"role": "user", "content": "x"}],
                                        "response_format": {"type": "json_schema"}}), 400),
    ("/tokenize", json_body({}), 400),
    ("/detokenize", json_body({"tokens": [10**9]}), 400),
    ("/v1/completions", json_body({"prompt": "x", "model": "other"}), 404),
]


def test_bad_requests_get_4xx_and_spare_the_running_one(server):
    done = {}

    def long_stream():
        tokens = 0
        with httpx.stream("POST", server.url + "/v1/completions", timeout=120,
                          json={"prompt": "Once upon a time", "max_tokens": 60, "ignore_eos": True, "stream": True,
                                "stream_options": {"include_usage": True}}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    assert "error" not in chunk
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
        done["tokens"] = tokens

    runner = threading.Thread(target=long_stream)
    runner.start()
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for path, body, status in CASES:
            r = client.post(path, content=body, headers={"content-type": "application/json"})
            assert r.status_code == status, (body[:80], r.status_code, r.text[:300])
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"], body[:80]
    runner.join(120)
    assert done.get("tokens") == 60  # untouched by everything above
    assert server.proc.poll() is None


def test_oversized_bodies_are_refused(server):
    big = b'{"prompt": "' + b"a" * (50 << 20) + b'"}'  # 50 MB, with Content-Length
    with httpx.Client(base_url=server.url, timeout=60) as client:
        r = client.post("/v1/completions", content=big, headers={"content-type": "application/json"})
        assert r.status_code == 413 and "exceeds" in r.json()["error"]["message"]

        def chunks():  # the same without Content-Length: counted while it arrives
            yield b'{"prompt": "'
            for _ in range(50):
                yield b"a" * (1 << 20)
            yield b'"}'
        try:
            r = client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
            assert r.status_code == 413
        except httpx.HTTPError:
            pass  # the server may close the connection before the client finished sending
        assert client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200
