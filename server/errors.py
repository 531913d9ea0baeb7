"""OpenAI error objects: {"error": {"message", "type", "param", "code"}} with the right status."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("cuserve.server")

_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
    405: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
    429: "rate_limit_error", 500: "internal_error", 503: "service_unavailable",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def sse_error(status: int, message: str, code: str | None = None) -> str:
    """An error as an SSE event, for failures after a stream has started."""
    return f"data: {json.dumps(error_body(status, message, code=code))}\n\n"


# what a field accepts, for fields whose type is a union (pydantic reports one error per member)
_EXPECTED = {
    "prompt": "a string, a list of strings, a list of token ids, or a list of token-id lists",
    "stop": "a string or a list of strings",
    "content": "a string or a list of content parts",
}


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if not loc and first.get("type") == "missing":  # no body at all
        return "the request has no body: send a JSON object", None
    # drop pydantic's union-member tags ("str", "list[int]", ...) from the location
    fields = [p for p in loc if not (p.startswith(("str", "list[", "dict[", "int", "float")) or "[" in p)]
    param = ".".join(fields) or None
    leaf = fields[-1] if fields else None
    if leaf in _EXPECTED and len(loc) > len(fields):
        return f"{param}: expected {_EXPECTED[leaf]}", param
    msg = first.get("msg", "invalid value")
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return (f"{param}: {msg}{more}" if param else f"{msg}{more}"), param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        if exc.status_code == 404:
            message = "no such endpoint" if message == "Not Found" else message
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return error_response(500, f"internal server error: {type(exc).__name__}")
