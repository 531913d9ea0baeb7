"""Server behaviour that needs a hand on the engine: the app runs in this process."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from engine import Engine, EngineConfig, SchedulerConfig
from server.app import create_app
from server.settings import ServeSettings


@pytest.fixture
def app_and_engine(smollm2, smollm2_path):
    engine = Engine(EngineConfig(model=smollm2_path, device="cpu", served_model_name="m",
                                 scheduler=SchedulerConfig(max_model_len=512)), model=smollm2)
    settings = ServeSettings(model=smollm2_path, served_model_name="m", max_request_bytes=4096)
    app = create_app(settings, engine=engine)
    engine.start()
    yield app, engine
    engine.shutdown()


def run(app, coro_fn):
    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return await coro_fn(client)
    return asyncio.run(main())


def test_error_after_stream_started_is_an_error_event(app_and_engine):
    app, engine = app_and_engine
    real = engine.runner.execute
    calls = {"n": 0}

    def fails_later(out):
        calls["n"] += 1
        if calls["n"] > 3:
            raise RuntimeError("device lost")
        return real(out)
    engine.runner.execute = fails_later

    async def go(client):
        r = await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 20, "stream": True})
        return r.status_code, r.text

    status, text = run(app, go)
    events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert status == 200
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "device lost" in error["message"] and error["type"] == "internal_error"
    assert any("choices" in json.loads(e) for e in events[:-2])  # text arrived before the failure


def test_body_limit_413(app_and_engine):
    app, _ = app_and_engine

    async def go(client):
        big = await client.post("/v1/completions", content=b'{"prompt": "' + b"a" * 10000 + b'"}',
                                headers={"content-type": "application/json"})
        small = await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1})
        return big, small

    big, small = run(app, go)
    assert big.status_code == 413 and "exceeds 4096 bytes" in big.json()["error"]["message"]
    assert small.status_code == 200


def test_health_reports_loading_and_draining(smollm2_path):
    settings = ServeSettings(model=smollm2_path)
    app = create_app(settings)  # no engine: it would load in the lifespan, which is not run here
    state = app.state.cuserve

    async def go(client):
        loading = await client.get("/health")
        models = await client.post("/v1/completions", json={"prompt": "x"})
        state.load_error = None
        return loading, models

    loading, completion = run(app, go)
    assert loading.status_code == 503 and loading.json()["status"] == "loading"
    assert completion.status_code == 503 and completion.json()["error"]["code"] == "loading"
    assert completion.headers["Retry-After"] == "1"


def test_an_extra_http_process_serves_only_once_all_are_up(app_and_engine):
    """--api-server-count: an extra HTTP process has its engine from the start, but answers 503
    (loading) until the first process opens the gate, so that a 200 from /health means all serve."""
    import threading
    app, _ = app_and_engine
    gate = threading.Event()
    app.state.cuserve.gate = gate

    async def go(client):
        shut = await client.get("/health"), await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        gate.set()
        return (*shut, await client.get("/health"))

    health, completion, opened = run(app, go)
    assert health.status_code == 503 and completion.status_code == 503
    assert completion.json()["error"]["code"] == "loading" and opened.status_code == 200


def test_metrics_of_several_http_processes_add_up():
    """Each process adds to its row of the shared table; any process's render gives the sums."""
    from server.metrics import Metrics
    first = Metrics(processes=3)
    others = [Metrics(shared=first.shared, process=i) for i in (1, 2)]
    everyone = [first, *others]
    for m in everyone:
        m.set_paths({"/v1/completions", "/health"})
    for i, m in enumerate(everyone):
        for _ in range(i + 1):
            m.ttft.observe(0.05 * (i + 1))
            m.count_http("/v1/completions", 200)
        m.count_http("/nowhere", 404)
        m.loop_lag.observe(0.001)
    m.count_http("/health", 1000)  # no such status: counted as 500
    texts = {m.render(None) for m in everyone}
    assert len(texts) == 1
    text = texts.pop()
    assert "cuserve_time_to_first_token_seconds_count 6" in text
    assert "cuserve_time_to_first_token_seconds_sum 0.7" in text  # 0.05 + 2 x 0.1 + 3 x 0.15
    assert 'cuserve_time_to_first_token_seconds_bucket{le="0.1"} 3' in text
    assert 'cuserve_http_requests_total{path="/v1/completions",status="200"} 6' in text
    assert 'cuserve_http_requests_total{path="other",status="404"} 3' in text
    assert 'cuserve_http_requests_total{path="/health",status="500"} 1' in text
    assert "cuserve_event_loop_lag_seconds_count 3" in text
    with pytest.raises(ValueError, match="not a row"):
        Metrics(shared=first.shared, process=3)


def test_stream_events_stay_one_line_for_unicode_line_breaks():
    """Text with the characters that JSON leaves raw but line readers split on (U+0085, U+2028,
    U+2029: str.splitlines, httpx's aiter_lines) goes out escaped: each SSE data line is one
    line for such a reader, and decodes to the text. (A load test's stream was cut there.)"""
    from server.openai_serving import _Events
    text = "a\u2028b\x85c\u2029d\n\u00e9"
    event = _Events(id="cmpl-1", object="text_completion", created=1, model="m")(
        choices=[{"index": 0, "text": text}])
    assert event.endswith("\n\n")
    lines = event[:-2].splitlines()
    assert len(lines) == 1 and lines[0].startswith("data: ")
    assert json.loads(lines[0][6:])["choices"][0]["text"] == text
    assert "\u00e9" in event  # other text stays as it is (no ASCII escapes)


@pytest.mark.parametrize("text, logprobs, finish, stop", [
    (" tok", None, None, None),
    ('say "hi"\\ \n\t\x01 \u00e9 \u2028\x85\u2029', None, "stop", "\n\n"),
    ("", {"tokens": [" a"], "token_logprobs": [-0.5], "top_logprobs": [{" a": -0.5}], "text_offset": [0]},
     "length", None),
    ("x", None, "stop", 128009),
])
def test_a_choice_event_is_the_json_of_its_fields(text, logprobs, finish, stop):
    """_Events.choice, which builds the event of one choice from its parts (the streaming hot
    path), writes the same text as serializing the whole event, for completions and chat."""
    from server.openai_serving import _Events, _value
    event = _Events(id="cmpl-1", object="text_completion", created=1, model="m")
    fields = {"logprobs": logprobs, "finish_reason": finish, "stop_reason": stop}
    assert event.choice(3, "text", _value(text), logprobs, finish, stop) == event(
        choices=[{"index": 3, "text": text, **fields}])
    delta = {"content": text}
    assert event.choice(0, "delta", f'{{"content":{_value(text)}}}', logprobs, finish, stop) == event(
        choices=[{"index": 0, "delta": delta, **fields}])
    line = event.choice(3, "text", _value(text), logprobs, finish, stop)[:-2]
    assert len(line.splitlines()) == 1 and json.loads(line[6:])["choices"][0]["text"] == text


def test_on_ready_runs_once_the_model_has_loaded(smollm2_path):
    """create_app's on_ready (the CLI's quiet_collector) runs on the loading thread after the
    engine is up, not before."""
    import time
    seen: list[bool] = []
    settings = ServeSettings(model=smollm2_path, device="cpu", engine_process=False, max_model_len=256)
    app = create_app(settings, on_ready=lambda: seen.append(app.state.cuserve.engine is not None))

    async def go():
        async with app.router.lifespan_context(app):
            deadline = time.monotonic() + 120
            while not seen and time.monotonic() < deadline:
                await asyncio.sleep(0.05)

    asyncio.run(go())
    assert seen == [True]
