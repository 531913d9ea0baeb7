"""The FastAPI app: routes, auth, body limits, readiness and draining."""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from engine import Engine
from engine.engine import EngineAPI
from engine.engine_process import EngineProcess

from .errors import APIError, error_response, install_error_handlers
from .metrics import Metrics
from .openai_serving import OpenAIServing
from .protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from .settings import ServeSettings

if TYPE_CHECKING:
    from .launch import ApiServers

log = logging.getLogger("cuserve.server")
# One event of a streamed response, as documented (schema tools read `schema` of text/event-stream
# as one event before OpenAPI 3.2): data is a JSON chunk of the response, or [DONE] last.
SSE_EVENT = {"type": "object", "required": ["data"],
             "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"},
                            "retry": {"type": "integer", "minimum": 0}}}


class ServerState:
    """What the routes share: settings, the engine once loaded, readiness and draining."""

    def __init__(self, settings: ServeSettings, engine: EngineAPI | None = None, metrics: Metrics | None = None,
                 api_servers: ApiServers | None = None) -> None:
        self.settings = settings
        self.engine = engine
        self.metrics = metrics if metrics is not None else Metrics(processes=settings.api_servers_at_most())
        self.api_servers = api_servers  # the other HTTP processes, started with the engine (launch.py)
        self.gate = None  # in one of those: set once all are up (/health and requests answer 503 till then)
        self.load_error: str | None = None
        self.draining = False
        self.created = int(time.time())
        self.in_flight = 0  # HTTP requests being handled (draining waits for them)
        self.model_names = {settings.model_name, settings.model}
        if engine is not None:
            self._attach(engine)

    @property
    def ready(self) -> bool:
        return self.engine is not None and not self.draining and self._open()

    def _open(self) -> bool:
        """An extra HTTP process serves once the first says all are up (`gate`, an Event)."""
        if self.gate is not None and self.gate.is_set():
            self.gate = None
        return self.gate is None

    def _attach(self, engine: EngineAPI) -> None:
        engine.observer = self.metrics
        if self.settings.chat_template:
            engine.tokenizer.chat_template = Path(self.settings.chat_template).read_text(encoding="utf-8")

    def load(self) -> None:
        """Build and start the engine (on a thread, while /health answers 503)."""
        config = self.settings.engine_config()
        if self.settings.engine_process:
            engine = EngineProcess(config, links=self.settings.api_servers_at_most())
        else:
            engine = Engine(config)
        self._attach(engine)
        engine.start()
        if self.api_servers is not None:
            self.api_servers.start(engine)
        self.engine = engine
        if self.api_servers is not None:
            self.api_servers.open()  # then the others serve too

    def require_engine(self) -> EngineAPI:
        if self.engine is None or not self._open():
            raise APIError(503, self.load_error or "the model is still loading",
                           code="loading", headers={"Retry-After": str(self.settings.retry_after)})
        if self.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        if self.engine.dead is not None:
            raise APIError(503, f"the engine stopped: {self.engine.dead}", code="engine_dead")
        return self.engine


class JsonBodyMiddleware:
    """Every POST here takes a JSON body, so one sent with another Content-Type (curl -d's form
    type, text/plain) is read as JSON, as llama-server reads it, instead of failing FastAPI's
    validation with a message about dictionaries; a body that is not JSON still gets the JSON
    error."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope.get("method") == "POST":
            headers = scope.get("headers", [])
            kind = next((v for k, v in headers if k == b"content-type"), None)
            if kind is None or not _is_json(kind):  # a JSON request (the usual one) passes as it is
                scope = {**scope, "headers": [(k, v) for k, v in headers if k != b"content-type"]
                         + [(b"content-type", b"application/json")]}
        return await self.app(scope, receive, send)


def _is_json(content_type: bytes) -> bool:
    kind = content_type.split(b";", 1)[0].strip().lower()
    return kind == b"application/json" or kind.endswith(b"+json")


class BodyLimitMiddleware:
    """413 for bodies over the limit: by Content-Length before reading, or (chunked
    uploads without one) by reading the body up to the limit first, then replaying it."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = None
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    length = None
        too_big = error_response(413, f"request body exceeds {self.max_bytes} bytes")
        if length is not None:
            if length > self.max_bytes:
                return await too_big(scope, receive, send)
            return await self.app(scope, receive, send)
        if scope.get("method") in ("GET", "HEAD", "OPTIONS", "DELETE"):
            return await self.app(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await too_big(scope, receive, send)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)


class AuthMiddleware:
    """With an API key set: 401 for every path but /health unless the request carries
    'Authorization: Bearer <key>' (compared in constant time), before any body is read."""

    OPEN_PATHS = frozenset({"/health"})

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") in self.OPEN_PATHS:
            return await self.app(scope, receive, send)
        header = b""
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                header = value
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.expected):
            response = error_response(401, "invalid or missing API key (Authorization: Bearer <key>)",
                                      code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            return await response(scope, receive, send)
        return await self.app(scope, receive, send)


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
            state.metrics.count_http(scope.get("path", ""), status)


def create_app(settings: ServeSettings, engine: EngineAPI | None = None,
               on_fatal: Callable[[str], None] | None = None,
               on_ready: Callable[[], None] | None = None, metrics: Metrics | None = None,
               api_servers: ApiServers | None = None) -> FastAPI:
    """The ASGI app. Without `engine`, the model loads on a thread at startup, and
    `on_ready` runs there once it has (the CLI settles the garbage collector then). `metrics`:
    an extra HTTP process's row of the shared table; `api_servers`: the extra HTTP processes
    this one starts once its engine process is up, and waits for before stopping it."""
    state = ServerState(settings, engine, metrics, api_servers)
    if api_servers is not None:
        api_servers.metrics_table = state.metrics.shared
    serving = OpenAIServing(state)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if state.engine is None:
            def load() -> None:
                try:
                    state.load()
                    log.info("model %s ready (%s)", settings.model_name, state.engine.device)
                    if on_ready is not None:
                        on_ready()
                except Exception as exc:  # noqa: BLE001 - reported on /health and to the CLI
                    log.exception("could not load the model")
                    state.load_error = f"the model failed to load: {exc}"
                    if on_fatal is not None:
                        on_fatal(state.load_error)
            threading.Thread(target=load, name="cuserve-load", daemon=True).start()
        watch = asyncio.create_task(state.metrics.watch_loop())  # cuserve_event_loop_lag_seconds
        yield
        watch.cancel()
        state.draining = True
        deadline = time.monotonic() + settings.shutdown_timeout
        while state.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if state.api_servers is not None:  # their streams need the engine until they end
            await asyncio.to_thread(state.api_servers.stop, max(0.0, deadline - time.monotonic()) + 5.0)
        if state.engine is not None:
            state.engine.shutdown()

    app = FastAPI(title="cuserve", version="0.1.0", lifespan=lifespan)
    app.state.cuserve = state
    install_error_handlers(app)
    # outermost last: count everything, then check the key, then limit the body, then read it as JSON
    app.add_middleware(JsonBodyMiddleware)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_request_bytes)
    if settings.api_key:
        app.add_middleware(AuthMiddleware, api_key=settings.api_key)
    app.add_middleware(CountingMiddleware, state=state)

    def doc(model=None, stream: bool = False, *statuses: int) -> dict:
        """OpenAPI responses of a route: its 200 body and the errors it may return."""
        ok: dict = {"model": model} if model is not None else {}
        if stream:
            ok["content"] = {"text/event-stream": {"schema": SSE_EVENT}}
        return {200: ok, **{code: {"model": ErrorResponse} for code in statuses}}

    @app.get("/health", response_model=None, responses={200: {"model": HealthResponse},
                                                        503: {"model": HealthResponse}})
    async def health() -> Response:
        dead = state.engine.dead if state.engine is not None else None
        if state.ready and dead is None:
            return JSONResponse({"status": "ok"})
        status = "shutting down" if state.draining else (
            f"the engine stopped: {dead}" if dead is not None else state.load_error or "loading")
        return JSONResponse({"status": status}, status_code=503,
                            headers={"Retry-After": str(settings.retry_after)})

    @app.get("/v1/models", response_model=None, responses=doc(ModelList, False))
    async def models() -> Response:
        return JSONResponse({"object": "list", "data": [_model_card(state)]})

    @app.get("/v1/models/{model_id:path}", response_model=None, responses=doc(ModelCard, False, 404))
    async def model(model_id: str) -> Response:
        if model_id not in state.model_names:
            raise APIError(404, f"The model `{model_id}` does not exist.", param="model", code="model_not_found")
        return JSONResponse(_model_card(state))

    @app.post("/v1/completions", response_model=None, responses=doc(CompletionResponse, True, 404, 500))
    async def completions(req: CompletionRequest, raw: Request):
        return await serving.completions(req, raw)

    @app.post("/v1/chat/completions", response_model=None,
              responses=doc(ChatCompletionResponse, True, 404, 500))
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        return await serving.chat(req, raw)

    @app.post("/tokenize", response_model=None, responses=doc(TokenizeResponse, False, 404))
    async def tokenize(req: TokenizeRequest) -> Response:
        engine = state.require_engine()
        serving.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", param="prompt")
        if req.messages is not None:
            text = serving.render_chat(req.messages, req.add_generation_prompt,
                                       continue_final_message=req.continue_final_message)
            ids = engine.tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = engine.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return JSONResponse({"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids})

    @app.post("/detokenize", response_model=None, responses=doc(DetokenizeResponse, False, 404))
    async def detokenize(req: DetokenizeRequest) -> Response:
        engine = state.require_engine()
        serving.check_model(req.model)
        vocab = engine.tokenizer.vocab_size
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary (0..{vocab - 1})", param="tokens")
        return JSONResponse({"prompt": engine.tokenizer.decode(req.tokens, skip_special_tokens=False)})

    @app.get("/metrics", response_model=None,
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def metrics() -> Response:
        return PlainTextResponse(state.metrics.render(state.engine),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    state.metrics.set_paths({route.path for route in app.routes})
    app.openapi = lambda: _openapi(app, settings)
    return app


def _openapi(app: FastAPI, settings: ServeSettings) -> dict:
    """The schema as the server behaves: validation errors are 400 OpenAI errors (not
    FastAPI's 422), every route may answer 401 (with a key), 413 and 503."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    from fastapi.openapi.utils import get_openapi
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    error_ref = {"$ref": "#/components/schemas/ErrorResponse"}
    error = {"description": "OpenAI error object", "content": {"application/json": {"schema": error_ref}}}
    for path, methods in schema.get("paths", {}).items():
        for op in methods.values():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            if path == "/health":
                continue
            for code in ("400", "413", "503") + (("401",) if settings.api_key else ()):
                responses.setdefault(code, error)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components.pop("HTTPValidationError", None)
    components.pop("ValidationError", None)
    if settings.api_key:
        schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        schema["security"] = [{"bearer": []}]
    app.openapi_schema = schema
    return schema


def _model_card(state: ServerState) -> dict:
    card = {"id": state.settings.model_name, "object": "model", "created": state.created, "owned_by": "cuserve",
            "root": state.settings.model, "parent": None}
    if state.engine is not None:
        card["max_model_len"] = state.engine.max_model_len
    return card
