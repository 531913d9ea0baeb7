"""The FastAPI app: routes, auth, body limits, readiness and draining."""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Callable

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from engine import Engine

from .errors import APIError, error_response, install_error_handlers
from .metrics import Metrics
from .openai_serving import OpenAIServing
from .protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from .settings import ServeSettings

log = logging.getLogger("cuserve.server")


class ServerState:
    """What the routes share: settings, the engine once loaded, readiness and draining."""

    def __init__(self, settings: ServeSettings, engine: Engine | None = None) -> None:
        self.settings = settings
        self.engine = engine
        self.metrics = Metrics()
        self.load_error: str | None = None
        self.draining = False
        self.created = int(time.time())
        self.in_flight = 0  # HTTP requests being handled (draining waits for them)
        self.known_paths: set[str] = set()
        self.model_names = {settings.model_name, settings.model}
        if engine is not None:
            self._attach(engine)

    @property
    def ready(self) -> bool:
        return self.engine is not None and not self.draining

    def _attach(self, engine: Engine) -> None:
        engine.observer = self.metrics
        if self.settings.chat_template:
            engine.tokenizer.chat_template = Path(self.settings.chat_template).read_text(encoding="utf-8")

    def load(self) -> None:
        """Build and start the engine (on a thread, while /health answers 503)."""
        engine = Engine(self.settings.engine_config())
        self._attach(engine)
        engine.start()
        self.engine = engine

    def require_engine(self) -> Engine:
        if self.engine is None:
            raise APIError(503, self.load_error or "the model is still loading",
                           code="loading", headers={"Retry-After": str(self.settings.retry_after)})
        if self.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        if self.engine.dead is not None:
            raise APIError(503, f"the engine stopped: {self.engine.dead!r}", code="engine_dead")
        return self.engine


class BodyLimitMiddleware:
    """413 for bodies over the limit, by Content-Length or while reading a chunked body."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    too_big = int(value) > self.max_bytes
                except ValueError:
                    too_big = False
                if too_big:
                    response = error_response(413, f"request body exceeds {self.max_bytes} bytes")
                    return await response(scope, receive, send)
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise APIError(413, f"request body exceeds {self.max_bytes} bytes")
            return message

        return await self.app(scope, limited_receive, send)


class CountingMiddleware:
    """Counts requests in flight and responses by path and status (plain ASGI: it
    neither buffers streaming bodies nor hides client disconnects)."""

    def __init__(self, app, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = self.state
        status = 500

        async def send_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        state.in_flight += 1
        try:
            await self.app(scope, receive, send_status)
        finally:
            state.in_flight -= 1
            path = scope.get("path", "")
            state.metrics.count_http(path if path in state.known_paths else "other", status)


def create_app(settings: ServeSettings, engine: Engine | None = None,
               on_fatal: Callable[[str], None] | None = None) -> FastAPI:
    """The ASGI app. Without `engine`, the model loads on a thread at startup."""
    state = ServerState(settings, engine)
    serving = OpenAIServing(state)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if state.engine is None:
            def load() -> None:
                try:
                    state.load()
                    log.info("model %s ready (%s)", settings.model_name, state.engine.runner.device)
                except Exception as exc:  # noqa: BLE001 - reported on /health and to the CLI
                    log.exception("could not load the model")
                    state.load_error = f"the model failed to load: {exc}"
                    if on_fatal is not None:
                        on_fatal(state.load_error)
            threading.Thread(target=load, name="cuserve-load", daemon=True).start()
        yield
        state.draining = True
        deadline = time.monotonic() + settings.shutdown_timeout
        while state.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if state.engine is not None:
            state.engine.shutdown()

    app = FastAPI(title="cuserve", version="0.1.0", lifespan=lifespan)
    app.state.cuserve = state
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_request_bytes)

    app.add_middleware(CountingMiddleware, state=state)

    expected = settings.api_key.encode() if settings.api_key else None

    async def authorize(request: Request) -> None:
        if expected is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected):
            raise APIError(401, "invalid or missing API key (Authorization: Bearer <key>)",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    auth = [Depends(authorize)]

    @app.get("/health")
    async def health() -> Response:
        if state.ready:
            return JSONResponse({"status": "ok"})
        status = "shutting down" if state.draining else (state.load_error or "loading")
        return JSONResponse({"status": status}, status_code=503,
                            headers={"Retry-After": str(settings.retry_after)})

    @app.get("/v1/models", dependencies=auth)
    async def models() -> Response:
        return JSONResponse({"object": "list", "data": [_model_card(state)]})

    @app.get("/v1/models/{model_id:path}", dependencies=auth)
    async def model(model_id: str) -> Response:
        if model_id not in state.model_names:
            raise APIError(404, f"The model `{model_id}` does not exist.", param="model", code="model_not_found")
        return JSONResponse(_model_card(state))

    @app.post("/v1/completions", dependencies=auth)
    async def completions(req: CompletionRequest, raw: Request):
        return await serving.completions(req, raw)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        return await serving.chat(req, raw)

    @app.post("/tokenize", dependencies=auth)
    async def tokenize(req: TokenizeRequest) -> Response:
        engine = state.require_engine()
        serving.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", param="prompt")
        if req.messages is not None:
            text = serving.render_chat(req.messages, req.add_generation_prompt)
            ids = engine.tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = engine.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return JSONResponse({"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids})

    @app.post("/detokenize", dependencies=auth)
    async def detokenize(req: DetokenizeRequest) -> Response:
        engine = state.require_engine()
        serving.check_model(req.model)
        vocab = engine.tokenizer.vocab_size
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary (0..{vocab - 1})", param="tokens")
        return JSONResponse({"prompt": engine.tokenizer.decode(req.tokens, skip_special_tokens=False)})

    @app.get("/metrics", dependencies=auth)
    async def metrics() -> Response:
        return PlainTextResponse(state.metrics.render(state.engine),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    state.known_paths = {route.path for route in app.routes}
    return app


def _model_card(state: ServerState) -> dict:
    card = {"id": state.settings.model_name, "object": "model", "created": state.created, "owned_by": "cuserve",
            "root": state.settings.model, "parent": None}
    if state.engine is not None:
        card["max_model_len"] = state.engine.max_model_len
    return card
