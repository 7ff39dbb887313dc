"""OpenAI-style error objects and the exception handlers that produce them.

Every failure leaves the server as ``{"error": {"message", "type", "param", "code"}}`` with a
meaningful status; nothing ever returns a stack trace.  Pydantic validation errors are translated
so that ``param`` is the offending field's path (``messages[0].content``), as OpenAI does.
"""

from __future__ import annotations

import asyncio
import json
import logging
from http import HTTPStatus
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.async_engine import EngineOverloaded, EngineUnavailable
from server.protocol import REQUEST_FORMS, ErrorInfo, ErrorResponse

log = logging.getLogger(__name__)

ERROR_TYPES = {
    400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
    405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error",
    429: "overloaded_error", 500: "server_error", 503: "service_unavailable",
}


RETRY_AFTER_S = 1  # what a 429 (queue full) or a 503 (loading, shutting down) tells clients to wait


class APIError(Exception):
    """An error with everything the OpenAI error object needs; raise it anywhere in a route."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 code: Optional[str] = None, type: Optional[str] = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ERROR_TYPES.get(status, "invalid_request_error")

    def to_response(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param,
                                             code=self.code))

    def to_json_response(self) -> JSONResponse:
        """The error as a response; a 429 or 503 (queue full, loading, shutting down) says when to retry."""
        headers = {"Retry-After": str(RETRY_AFTER_S)} if self.status in (429, 503) else None
        return JSONResponse(self.to_response().model_dump(), status_code=self.status, headers=headers)


def bad_request(message: str, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def _param_path(loc: tuple[Any, ...]) -> Optional[str]:
    """``("body", "messages", 0, "content")`` -> ``"messages[0].content"``."""
    path = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path or None


def from_validation_error(exc: RequestValidationError) -> APIError:
    """The first validation error as an APIError (the count of others is mentioned)."""
    errors = exc.errors()
    if not errors:
        return bad_request("Invalid request.")
    err = errors[0]
    kind, loc, msg = err.get("type", ""), tuple(err.get("loc", ())), str(err.get("msg", ""))
    if len(loc) > 1 and loc[0] == "body" and loc[1] in REQUEST_FORMS:  # which form of a body, not a field
        loc = ("body",) + loc[2:]
    more = f" ({len(errors) - 1} more error(s) in the request)" if len(errors) > 1 else ""
    if kind == "json_invalid":
        detail = (err.get("ctx") or {}).get("error", msg)
        return bad_request(f"The request body is not valid JSON: {detail}", code="invalid_json")
    cause = (err.get("ctx") or {}).get("error")
    if loc == ("body",) and kind in ("missing", "model_attributes_type", "dict_type", "model_type"):
        message = ("The request body must be a JSON object." if kind != "missing"
                   else "The request body is required (a JSON object).")
        return bad_request(message, code="invalid_body")
    param = getattr(cause, "param", None) or _param_path(loc)
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    code = getattr(cause, "code", None) or ("missing_required_parameter" if kind == "missing" else (
        "invalid_type" if kind.endswith("_type") else "invalid_value"))
    where = f"'{param}'" if param else "the request"
    message = f"Missing required parameter {where}." if kind == "missing" else f"Invalid value for {where}: {msg}"
    return bad_request(message + more, param=param, code=code)


async def _api_error(_: Request, exc: APIError) -> JSONResponse:
    return exc.to_json_response()


async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    return from_validation_error(exc).to_json_response()


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    status = exc.status_code
    if isinstance(exc, _TooLarge):
        return APIError(413, exc.detail, code="request_too_large").to_json_response()
    if isinstance(exc, _SlowBody):
        response = APIError(408, exc.detail, code="request_timeout").to_json_response()
        response.headers["Connection"] = "close"
        return response
    phrase = HTTPStatus(status).phrase if status in HTTPStatus._value2member_map_ else "Error"
    detail = exc.detail if isinstance(exc.detail, str) and exc.detail != phrase else ""
    message = f"{phrase}: {request.method} {request.url.path}" + (f" ({detail})" if detail else "")
    code = {404: "not_found", 405: "method_not_allowed"}.get(status)
    response = APIError(status, message, code=code).to_json_response()
    for name, value in (getattr(exc, "headers", None) or {}).items():  # e.g. 405's Allow
        response.headers[name] = value
    return response


async def _overloaded(_: Request, exc: EngineOverloaded) -> JSONResponse:
    return APIError(429, str(exc), code="queue_full").to_json_response()


async def _unavailable(_: Request, exc: EngineUnavailable) -> JSONResponse:
    return APIError(503, str(exc), code="engine_unavailable").to_json_response()


async def _internal(_: Request, exc: Exception) -> JSONResponse:
    log.error("unhandled error", exc_info=exc)
    return APIError(500, "Internal server error; see the server log.", code="internal_error").to_json_response()


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(EngineOverloaded, _overloaded)
    app.add_exception_handler(EngineUnavailable, _unavailable)
    app.add_exception_handler(Exception, _internal)


class BodySizeLimit:
    """Pure ASGI middleware: 413 for a body larger than ``max_bytes``, whatever the transfer encoding.

    A declared ``Content-Length`` over the limit is refused before anything is read; a chunked (or
    under-declared) body is counted as it arrives and refused as soon as it passes the limit, so a huge
    upload never reaches the JSON parser.  Pure ASGI, unlike ``@app.middleware``, so streaming
    responses and disconnect detection are untouched."""

    def __init__(self, app, max_bytes: int, read_timeout: Optional[float] = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.read_timeout = read_timeout  # seconds a client may take between two pieces of its body

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length", b"0")
        if length.isdigit() and int(length) > self.max_bytes:
            await self._refuse(send, f"{int(length)} bytes")
            return
        seen = 0
        started = False
        body_done = False

        async def counted_receive():
            nonlocal seen, body_done
            if body_done or self.read_timeout is None:  # after the body: disconnect polling, no timeout
                message = await receive()
            else:
                try:
                    message = await asyncio.wait_for(receive(), self.read_timeout)
                except asyncio.TimeoutError:
                    raise _SlowBody(self.read_timeout) from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
                if seen > self.max_bytes:
                    raise _TooLarge(self.max_bytes)
            return message

        async def tracked_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except _TooLarge:
            if not started:
                await self._refuse(send, f"more than {self.max_bytes} bytes")

    async def _refuse(self, send, size: str) -> None:
        err = APIError(413, f"Request body too large ({size}; limit {self.max_bytes}).", code="request_too_large")
        body = json.dumps(err.to_response().model_dump()).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


class _SlowBody(StarletteHTTPException):
    """Raised from inside ``receive`` when a client stalls in the middle of its request body."""

    def __init__(self, timeout: float) -> None:
        super().__init__(408, f"The request body did not arrive in time (nothing for {timeout:g} s).")


class _TooLarge(StarletteHTTPException):
    """Raised from inside ``receive`` when a streamed body passes the limit.  An HTTPException, so that
    the framework's body reader passes it on (it turns other errors into a 400) and the handler answers
    413."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"Request body too large (more than {limit} bytes; limit {limit}).")
