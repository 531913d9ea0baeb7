"""Integration tests: a real `cuserve serve` process on SmolLM2 (CPU), driven with
httpx and with the official `openai` client."""

from __future__ import annotations

import asyncio
import json
import os
import time

import httpx
import pytest

from tests.server_process import start_server

MODEL = "SmolLM2-135M-Instruct"
KEY = "sk-test-7d1c"
# the same tests run against the GPU runner with CUSERVE_TEST_DEVICE=cuda
DEVICE = os.environ.get("CUSERVE_TEST_DEVICE", "cpu")


def serve(smollm2_path, tmp_path_factory, name, *args, env=None):
    return start_server(tmp_path_factory, name, "--model", smollm2_path, "--served-model-name", MODEL,
                        "--device", DEVICE, "--kv-cache-gib", "1", *args, env=env)


@pytest.fixture(scope="module")
def server(smollm2_path, tmp_path_factory):
    proc = serve(smollm2_path, tmp_path_factory, "server", "--max-model-len", "2048", "--max-num-seqs", "16")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def guarded(smollm2_path, tmp_path_factory):
    """A server with an API key, one running sequence and a waiting queue of one."""
    proc = serve(smollm2_path, tmp_path_factory, "guarded", "--max-model-len", "1024", "--max-num-seqs", "1",
                 "--max-waiting", "1", "--max-num-batched-tokens", "64", env={"CUSERVE_API_KEY": KEY})
    yield proc
    proc.stop()


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def sse_events(response: httpx.Response) -> list:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def metric(client: httpx.Client, name: str, headers=None) -> float:
    text = client.get("/metrics", headers=headers).text
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def wait_idle(client: httpx.Client, headers=None, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (metric(client, "cuserve_num_requests_running", headers) == 0
                and metric(client, "cuserve_num_requests_waiting", headers) == 0):
            return
        time.sleep(0.1)
    raise AssertionError("server did not become idle")


# ---------------------------------------------------------------- basic endpoints


def test_idle_keep_alive_connection_outlives_the_client_pools(server):
    """A connection idle for longer than httpx keeps one (5 s, uvicorn's default timeout
    too) still takes the next request: with both at 5 s, a client could send on a connection
    the server was closing, and get a ReadError (seen with 128 streams from one client)."""
    import http.client
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)

    def health() -> tuple:
        conn.request("GET", "/health")
        reply = conn.getresponse()
        return reply.status, reply.read()
    try:
        assert health() == (200, b'{"status":"ok"}')
        sock = conn.sock
        time.sleep(6.0)
        assert health() == (200, b'{"status":"ok"}')  # at 5 s: RemoteDisconnected
        assert conn.sock is sock  # on the same connection
    finally:
        conn.close()


def test_health_models_tokenize(client):
    assert client.get("/health").json() == {"status": "ok"}
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == MODEL
    assert models["data"][0]["max_model_len"] == 2048
    assert client.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    assert client.get("/v1/models/other").status_code == 404
    tok = client.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert tok["count"] == 2 and tok["max_model_len"] == 2048
    assert client.post("/detokenize", json={"tokens": tok["tokens"]}).json() == {"prompt": "Hello world"}
    chat_tok = client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat_tok["count"] > 10
    assert client.post("/detokenize", json={"tokens": [10**8]}).status_code == 400


def test_completion_forms_of_prompt(client):
    ids = client.post("/tokenize", json={"prompt": "The capital of France is"}).json()["tokens"]
    for prompt in ("The capital of France is", [ids], ids):
        body = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 3,
                                                     "temperature": 0}).json()
        assert body["object"] == "text_completion" and body["choices"][0]["text"].startswith(" Paris")
        assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    multi = client.post("/v1/completions", json={"prompt": ["The capital of France is", "1, 2, 3,"],
                                                 "max_tokens": 4, "n": 2, "temperature": 0}).json()
    assert [c["index"] for c in multi["choices"]] == [0, 1, 2, 3]
    assert multi["choices"][0]["text"] == multi["choices"][1]["text"]  # greedy: both the same
    assert multi["usage"]["completion_tokens"] == 16
    default = client.post("/v1/completions", json={"prompt": "Once upon a time", "ignore_eos": True}).json()
    assert default["usage"]["completion_tokens"] == 16  # OpenAI's default max_tokens


def test_completion_streaming_matches_non_streaming(client):
    req = {"prompt": "Write a list of fruits:", "max_tokens": 24, "temperature": 0}
    whole = client.post("/v1/completions", json=req).json()["choices"][0]
    with client.stream("POST", "/v1/completions",
                       json={**req, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 24
    chunks = events[:-2]
    assert "".join(e["choices"][0]["text"] for e in chunks) == whole["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(e["choices"][0]["finish_reason"] is None for e in chunks[:-1])


def test_n_and_seeds(client):
    req = {"prompt": "My favourite animal is", "max_tokens": 12, "temperature": 1.0, "n": 3, "seed": 11}
    first = client.post("/v1/completions", json=req).json()
    again = client.post("/v1/completions", json=req).json()
    texts = [c["text"] for c in first["choices"]]
    assert texts == [c["text"] for c in again["choices"]]
    assert len(set(texts)) > 1


def test_stop_strings_and_tokens(client):
    body = client.post("/v1/completions", json={"prompt": "Count: 1, 2, 3, 4,", "max_tokens": 30,
                                                "temperature": 0, "stop": [" 7"]}).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == " 7"
    assert " 7" not in choice["text"] and "6" in choice["text"]
    with client.stream("POST", "/v1/completions", json={"prompt": "Count: 1, 2, 3, 4,", "max_tokens": 30,
                                                        "temperature": 0, "stop": " 7", "stream": True}) as r:
        streamed = "".join(e["choices"][0]["text"] for e in sse_events(r)[:-1])
    assert streamed == choice["text"]
    ids = client.post("/tokenize", json={"prompt": " 6"}).json()["tokens"]
    by_id = client.post("/v1/completions", json={"prompt": "Count: 1, 2, 3, 4,", "max_tokens": 30,
                                                 "temperature": 0, "stop_token_ids": ids[-1:]}).json()
    assert by_id["choices"][0]["finish_reason"] == "stop" and by_id["choices"][0]["stop_reason"] == ids[-1]


def test_logprobs_and_echo(client):
    body = client.post("/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 2,
                                                "temperature": 0, "logprobs": 3, "echo": True}).json()
    choice = body["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"].startswith("The capital of France is Paris")
    assert lp["tokens"][:2] == ["The", " capital"] and len(lp["tokens"]) == 7
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    # each entry holds the 3 most likely tokens and the chosen one (up to logprobs + 1, as OpenAI documents)
    assert all(len(t) in (3, 4) and tok in t for tok, t in zip(lp["tokens"][1:], lp["top_logprobs"][1:]))
    assert lp["text_offset"] == [0, 3, 11, 14, 21, 24, 30]
    assert lp["tokens"][5] == " Paris" and lp["token_logprobs"][5] == max(lp["top_logprobs"][5].values())
    prompt_only = client.post("/v1/completions", json={"prompt": "Hello there", "max_tokens": 0,
                                                       "echo": True}).json()
    assert prompt_only["choices"][0]["text"] == "Hello there"
    assert prompt_only["usage"]["completion_tokens"] == 0
    with_lp = client.post("/v1/completions", json={"prompt": "Hello there", "max_tokens": 0, "echo": True,
                                                   "logprobs": 1}).json()
    assert len(with_lp["choices"][0]["logprobs"]["token_logprobs"]) == 2
    zero = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "logprobs": 0, "temperature": 1.5,
                                                "seed": 7}).json()["choices"][0]["logprobs"]
    assert zero["top_logprobs"] == [{t: v} for t, v in zip(zero["tokens"], zero["token_logprobs"])]


def test_streaming_logprobs(client):
    with client.stream("POST", "/v1/completions", json={"prompt": "Hi", "max_tokens": 5, "temperature": 0,
                                                        "logprobs": 2, "stream": True}) as r:
        chunks = sse_events(r)[:-1]
    tokens = [t for e in chunks for t in e["choices"][0]["logprobs"]["tokens"]]
    assert len(tokens) == 5
    offsets = [o for e in chunks for o in e["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == sorted(offsets) and offsets[0] == 0


# ---------------------------------------------------------------- chat


def test_chat_non_streaming_and_content_parts(client):
    msgs = [{"role": "user", "content": "What is 2+2? Answer briefly."}]
    body = client.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs, "temperature": 0,
                                                     "max_completion_tokens": 40}).json()
    choice = body["choices"][0]
    assert body["object"] == "chat.completion" and choice["message"]["role"] == "assistant"
    assert "4" in choice["message"]["content"] and choice["finish_reason"] == "stop"
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is 2+2? "},
                                          {"type": "text", "text": "Answer briefly."}]}]
    same = client.post("/v1/chat/completions", json={"messages": parts, "temperature": 0, "max_tokens": 40}).json()
    assert same["choices"][0]["message"]["content"] == choice["message"]["content"]
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    err = client.post("/v1/chat/completions", json={"messages": image})
    assert err.status_code == 400 and "image_url" in err.json()["error"]["message"]


def test_chat_streaming_deltas_and_logprobs(client):
    req = {"messages": [{"role": "user", "content": "Name three colors."}], "temperature": 0, "max_tokens": 20,
           "ignore_eos": True}
    whole = client.post("/v1/chat/completions", json=req).json()["choices"][0]["message"]["content"]
    with client.stream("POST", "/v1/chat/completions",
                       json={**req, "stream": True, "logprobs": True, "top_logprobs": 2,
                             "stream_options": {"include_usage": True}}) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 20
    chunks = events[:-2]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert content == whole
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    lps = [e for c in chunks[1:] for e in (c["choices"][0]["logprobs"] or {}).get("content", [])]
    assert len(lps) == 20 and all(len(e["top_logprobs"]) == 2 and isinstance(e["bytes"], list) for e in lps)


def test_chat_context_limit_message(client):
    long = "word " * 3000
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": long}]})
    assert r.status_code == 400
    err = r.json()["error"]
    assert "2048" in err["message"] and err["code"] == "context_length_exceeded"


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize("body,param", [
    ("{not json", None),
    ("[1, 2]", None),
    ('{"prompt": 5}', "prompt"),
    ('{"prompt": "x", "max_tokens": "many"}', "max_tokens"),
    ('{"prompt": "x", "max_tokens": -1}', "max_tokens"),
    ('{"prompt": "x", "temperature": -0.5}', "temperature"),
    ('{"prompt": "x", "n": 0}', "n"),
    ('{"prompt": "x", "logprobs": 1000}', "logprobs"),
    ('{"prompt": "x", "logit_bias": {"abc": 1}}', "logit_bias"),
    ('{"prompt": "x", "stop": 3}', "stop"),
    ('{"prompt": "x", "stop": ["a", "%s"]}' % ("b" * 16384), "stop"),
    ('{"prompt": "x", "top_p": 0}', "top_p"),
    ('{"prompt": "x", "top_k": -5}', "top_k"),
    ('{}', "prompt"),
])
def test_bad_completion_requests_get_400(client, body, param):
    r = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    if param is not None:
        assert err["param"] == param


def test_semantic_errors_are_4xx(client):
    cases = [
        ({"prompt": "x", "model": "nope"}, 404),
        ({"prompt": "x", "max_tokens": 10**9}, 400),
        ({"prompt": "x", "n": 1000}, 400),
        ({"prompt": "x", "logit_bias": {"999999999": 5}}, 400),
        ({"prompt": [10**9]}, 400),
        ({"prompt": ""}, 400),
        ({"prompt": "x", "stop": ["a"] * 1000}, 400),
        ({"prompt": "x", "suffix": "y"}, 400),
    ]
    for body, status in cases:
        r = client.post("/v1/completions", json=body)
        assert r.status_code == status, (body, r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    # token ids outside the vocabulary: the error names the field that holds them
    for route, body in (("/v1/completions", {"prompt": "x"}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        for field, value in (("logit_bias", {"999999999": 5}), ("stop_token_ids", [999999999])):
            r = client.post(route, json={**body, field: value})
            assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        r = client.post(route, json={**body, "max_tokens": 10**9})
        assert r.json()["error"]["param"] == ("prompt" if "prompt" in body else "messages")
    r = client.post("/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                  "top_logprobs": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
    assert client.get("/v1/nothing").status_code == 404
    assert client.put("/v1/completions", json={}).status_code == 405


def test_stream_options_tools_and_a_continued_assistant_message(client):
    user = {"role": "user", "content": "What is the capital of France?"}
    for route, body in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": [user]})):
        r = client.post(route, json={**body, "max_tokens": 1, "stream_options": {"include_usage": True}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options", r.text
    # tools as vLLM takes them without a tool-call parser: only with tool_choice "none"
    tools = [{"type": "function", "function": {"name": "capital", "parameters": {"type": "object"}}}]
    for extra, param in (({}, "tools"), ({"tool_choice": "auto"}, "tool_choice"),
                         ({"tool_choice": {"type": "function", "function": {"name": "capital"}}}, "tool_choice")):
        r = client.post("/v1/chat/completions", json={"messages": [user], "tools": tools, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = client.post("/v1/chat/completions", json={"messages": [user], "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    r = client.post("/v1/chat/completions", json={"messages": [user], "tools": tools, "tool_choice": "none",
                                                  "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    # continue_final_message: the prompt ends where the assistant's text does, and the model goes on from it
    start = "The capital of France is"
    msgs = [user, {"role": "assistant", "content": start}]
    closed = client.post("/tokenize", json={"messages": msgs, "add_generation_prompt": False}).json()["tokens"]
    open_ = client.post("/tokenize", json={"messages": msgs, "add_generation_prompt": False,
                                           "continue_final_message": True}).json()["tokens"]
    assert len(open_) < len(closed) and closed[:len(open_)] == open_
    text = client.post("/detokenize", json={"tokens": open_}).json()["prompt"]
    assert text.endswith(start)
    body = client.post("/v1/chat/completions", json={"messages": msgs, "add_generation_prompt": False,
                                                     "continue_final_message": True, "temperature": 0,
                                                     "max_tokens": 6}).json()
    assert body["usage"]["prompt_tokens"] == len(open_) and "Paris" in body["choices"][0]["message"]["content"]
    for extra, last in (({"add_generation_prompt": True}, msgs), ({"add_generation_prompt": False}, [user])):
        r = client.post("/v1/chat/completions", json={"messages": last, "continue_final_message": True, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message", r.text


def test_a_json_body_is_read_whatever_its_content_type(client):
    body = '{"prompt": "Hi", "max_tokens": 1}'
    for kind in ("application/x-www-form-urlencoded", "text/plain", None):  # curl -d's type; none at all
        headers = {"content-type": kind} if kind else {}
        r = client.post("/v1/completions", content=body, headers=headers)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1, (kind, r.text)
    form = {"content-type": "application/x-www-form-urlencoded"}
    r = client.post("/v1/completions", content="prompt=Hi", headers=form)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = client.post("/v1/completions")
    assert r.status_code == 400 and r.json()["error"]["message"] == "the request has no body: send a JSON object"


def test_unknown_fields_are_ignored(client):
    r = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "frobnicate": {"a": [1]},
                                             "response_format": 7})
    assert r.status_code == 200


# ---------------------------------------------------------------- metrics, disconnects


def test_metrics_exposition(client):
    client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3})
    text = client.get("/metrics").text
    for name in ("cuserve_num_requests_running", "cuserve_num_requests_waiting", "cuserve_kv_cache_usage_perc",
                 "cuserve_prompt_tokens_total", "cuserve_generation_tokens_total",
                 "cuserve_time_to_first_token_seconds_bucket", "cuserve_inter_token_latency_seconds_count",
                 "cuserve_e2e_request_latency_seconds_sum", "cuserve_request_queue_time_seconds_count",
                 "cuserve_request_inbox_time_seconds_count",
                 "cuserve_num_preemptions_total", "cuserve_num_catch_up_steps_total"):
        assert name in text, name
    assert metric(client, "cuserve_generation_tokens_total") >= 3
    assert metric(client, "cuserve_time_to_first_token_seconds_count") >= 1
    assert metric(client, "cuserve_request_inbox_time_seconds_count") >= 1  # the engine's loop took it in
    assert metric(client, "cuserve_event_loop_lag_seconds_count") >= 1  # the server's loop, every 10 ms
    if DEVICE == "cuda":  # the GPU runner times its decode steps against the measured bandwidth
        assert 0.0 < metric(client, "cuserve_decode_roofline_fraction") <= 1.5


def test_disconnect_mid_stream_aborts_the_request(server, client):
    wait_idle(client)
    aborted_before = _finished(client, "abort")

    async def read_a_little():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as ac:
            async with ac.stream("POST", "/v1/completions", json={
                    "prompt": "Count to a thousand:", "max_tokens": 1000, "ignore_eos": True,
                    "stream": True}) as r:
                seen = 0
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        seen += 1
                    if seen == 3:
                        break  # leaving the block closes the connection

    asyncio.run(read_a_little())
    wait_idle(client)
    assert metric(client, "cuserve_kv_cache_usage_perc") == 0.0
    assert _finished(client, "abort") == aborted_before + 1


def test_disconnect_during_non_streaming_request_aborts(server, client):
    wait_idle(client)
    aborted_before = _finished(client, "abort")
    with pytest.raises(httpx.ReadTimeout):  # ~1 s of decoding on an H200 (SmolLM2 B=1: ~2,000 tok/s)
        httpx.post(server.url + "/v1/completions", json={"prompt": "Go:", "max_tokens": 2040, "ignore_eos": True},
                   timeout=0.3)
    wait_idle(client)
    assert _finished(client, "abort") == aborted_before + 1


def _finished(client, reason: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(f'cuserve_request_success_total{{finished_reason="{reason}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


# ---------------------------------------------------------------- auth, overload


def test_api_key_is_required_except_for_health(guarded):
    with httpx.Client(base_url=guarded.url, timeout=60) as c:
        assert c.get("/health").status_code == 200
        for method, path in [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                             ("GET", "/metrics"), ("POST", "/tokenize"), ("POST", "/detokenize")]:
            r = c.request(method, path, json={})
            assert r.status_code == 401, path
            assert r.json()["error"]["type"] == "authentication_error"
        assert c.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert c.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert KEY not in guarded.logs()


def test_queue_full_gets_503_with_retry_after(guarded):
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"prompt": "Tell me a long story:", "max_tokens": 300, "ignore_eos": True}

    async def burst():
        async with httpx.AsyncClient(base_url=guarded.url, timeout=120, headers=headers) as ac:
            return await asyncio.gather(*[ac.post("/v1/completions", json=body) for _ in range(6)])

    responses = asyncio.run(burst())
    codes = sorted(r.status_code for r in responses)
    assert codes.count(200) >= 2 and codes.count(503) >= 1 and set(codes) <= {200, 503}
    for r in responses:
        if r.status_code == 503:
            assert r.headers["Retry-After"] == "1" and r.json()["error"]["code"] == "overloaded"
        else:
            assert r.json()["usage"]["completion_tokens"] == 300
    with httpx.Client(base_url=guarded.url, timeout=60, headers=headers) as c:
        ok = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert ok.status_code == 200  # serves normally right after


# ---------------------------------------------------------------- the official client


def test_openai_client_completions_and_chat(server):
    openai = pytest.importorskip("openai")
    api = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    done = api.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=3, temperature=0)
    assert done.choices[0].text.startswith(" Paris") and done.usage.completion_tokens == 3
    stream = api.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=3, temperature=0,
                                    stream=True)
    assert "".join(c.choices[0].text for c in stream) == done.choices[0].text
    chat = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hello."}],
                                       max_tokens=10, temperature=0)
    assert chat.choices[0].message.content and chat.choices[0].message.role == "assistant"
    stream = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hello."}],
                                         max_tokens=10, temperature=0, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == chat.choices[0].message.content
    models = api.models.list()
    assert [m.id for m in models.data] == [MODEL]
    with pytest.raises(openai.NotFoundError):
        api.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError):
        api.completions.create(model=MODEL, prompt="x", max_tokens=10**6)
