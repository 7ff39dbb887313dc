"""The FastAPI application: routes, authentication, CORS, lifecycle.

The routes are thin: validate (pydantic), call :class:`OpenAIServing`, return JSON or SSE.  The
engine's background thread starts with the app (lifespan) and is shut down gracefully with it.
``/health`` answers 503 until the engine's core is built, so a load balancer (or ``__main__``,
which starts HTTP first and loads the models in the background) sees the server as not ready.

Besides the OpenAI routes: ``/tokenize`` and ``/detokenize`` (vLLM's shapes; they need the tokenizer,
not the engine thread, and are 503 while loading), ``/version`` and ``/v1/models/{id}``.  With an API
key, ``/v1/*``, ``/tokenize`` and ``/detokenize`` need it; ``/health``, ``/metrics`` (unless their
``*_auth`` setting says otherwise) and ``/version`` are open.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import secrets
import sys
from contextlib import asynccontextmanager
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Optional

import uvicorn
from fastapi import APIRouter, Body, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel

from engine.async_engine import AsyncEngine, EngineState, EngineUnavailable
from server.errors import APIError, BodySizeLimit, install_error_handlers
from server.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from server.protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, DetokenizeResponse, ErrorResponse, ModelCard,
    ModelList, TokenizeRequest, TokenizeResponse, VersionResponse,
)
from server.serving import OpenAIServing
from server.settings import Settings

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


class ApiKeyAuth:
    """Pure ASGI middleware: ``Authorization: Bearer <key>`` on the protected paths.

    It runs before the body is parsed, so an unauthenticated client learns nothing about request
    validation; CORS preflight (OPTIONS) requests pass, as browsers send them without credentials.
    """

    def __init__(self, app, api_key: str, protected: tuple[str, ...]) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.protected = protected

    def _needs_key(self, scope) -> bool:
        path = scope.get("path", "")
        return (scope["type"] == "http" and scope.get("method") != "OPTIONS"
                and any(path == p or path.startswith(p.rstrip("/") + "/") for p in self.protected))

    async def __call__(self, scope, receive, send) -> None:
        if self._needs_key(scope):
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                message = ("Missing API key: send 'Authorization: Bearer <key>'." if not given
                           else "Incorrect API key provided.")
                response = APIError(401, message, code="invalid_api_key").to_json_response()
                response.headers["WWW-Authenticate"] = "Bearer"
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _json(model: BaseModel, status: int = 200) -> JSONResponse:
    return JSONResponse(model.model_dump(mode="json"), status_code=status)


def _protected_paths(settings: Settings) -> tuple[str, ...]:
    paths = ["/v1", "/tokenize", "/detokenize"]
    if settings.metrics_auth:
        paths.append("/metrics")
    if settings.health_auth:
        paths.append("/health")
    return tuple(paths)


def create_app(settings: Settings, engine: AsyncEngine, metrics: Optional[ServerMetrics] = None) -> FastAPI:
    """The app for one engine.  The app owns the engine's lifecycle: it starts the engine thread on
    startup and shuts it down (``settings.shutdown_grace`` seconds for in-flight requests) on exit."""
    metrics = metrics or ServerMetrics()
    engine.listener = metrics
    serving = OpenAIServing(engine, settings)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        engine.start()
        yield
        await engine.shutdown(settings.shutdown_grace)

    app = FastAPI(title="MCSD OpenAI-compatible server", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.engine, app.state.settings, app.state.metrics = engine, settings, metrics
    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_request_bytes, read_timeout=settings.body_read_timeout)
    if settings.api_key:
        app.add_middleware(ApiKeyAuth, api_key=settings.api_key, protected=_protected_paths(settings))
    if settings.cors_origins:  # outermost, so preflight answers come before authentication
        app.add_middleware(CORSMiddleware, allow_origins=settings.cors_origins, allow_methods=["*"],
                           allow_headers=["*"], allow_credentials="*" not in settings.cors_origins)
    app.include_router(_v1_router(serving))
    app.include_router(_tokenizer_router(serving))
    app.include_router(_ops_router(engine, metrics))
    app.openapi = _openapi_without_422(app)
    return app


def _require_ready(engine: AsyncEngine) -> None:
    if engine.state is not EngineState.READY:
        raise EngineUnavailable(engine.unavailable_reason())


_ERRORS = {
    400: "Invalid request (OpenAI error object; `param` names the field)",
    401: "Missing or wrong API key",
    404: "Unknown model",
    413: "Request body too large",
    429: "Queue full; retry after `Retry-After` seconds",
    503: "Loading or shutting down; retry after `Retry-After` seconds",
}


def _error_responses(*codes: int) -> dict:
    return {code: {"model": ErrorResponse, "description": _ERRORS[code]} for code in codes}


GENERATION_RESPONSES = {
    200: {"description": "The completion (JSON), or with `stream: true` server-sent events ending in "
                         "`data: [DONE]`", "content": {"text/event-stream": {}}},
    **_error_responses(*_ERRORS),
}
TOKENIZER_RESPONSES = _error_responses(400, 401, 404, 413, 503)  # no queue: never a 429


@lru_cache(maxsize=1)
def server_version() -> str:
    """The installed package's version; from ``pyproject.toml`` when run from a checkout that is not installed."""
    try:
        return importlib.metadata.version("mcsd-server")
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        with open(Path(__file__).resolve().parents[1] / "pyproject.toml", "rb") as f:
            return str(tomllib.load(f)["project"]["version"])
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return "unknown"


def _openapi_without_422(app: FastAPI):
    """The schema FastAPI builds, minus its 422 responses: validation errors are 400s here."""
    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = FastAPI.openapi(app)
            for ops in schema.get("paths", {}).values():
                for op in ops.values():
                    op.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema
    return openapi


def _v1_router(serving: OpenAIServing) -> APIRouter:
    router = APIRouter(prefix="/v1")

    @router.post("/completions", responses=GENERATION_RESPONSES)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        _require_ready(serving.engine)
        result = await serving.completions(body, request)
        return result if isinstance(result, Response) else _json(result)

    @router.post("/chat/completions", responses=GENERATION_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        _require_ready(serving.engine)
        result = await serving.chat(body, request)
        return result if isinstance(result, Response) else _json(result)

    def card() -> ModelCard:
        ready = serving.engine.state is EngineState.READY
        return ModelCard(id=serving.settings.model_id,
                         max_model_len=serving.engine.core.max_model_len if ready else None)

    @router.get("/models", response_model=ModelList, responses=_error_responses(401))
    async def models() -> Response:
        return _json(ModelList(data=[card()]))

    @router.get("/models/{model_id:path}", response_model=ModelCard,
                responses=_error_responses(401, 404))
    async def model(model_id: str) -> Response:
        """The served model (as in ``/v1/models``) for its id, or for any name the generation endpoints
        accept as ``model``; 404 ``model_not_found`` for any other id (which may contain ``/``)."""
        serving.check_model(model_id)
        return _json(card())

    return router


def _tokenizer_router(serving: OpenAIServing) -> APIRouter:
    router = APIRouter()

    @router.post("/tokenize", response_model=TokenizeResponse, responses=TOKENIZER_RESPONSES)
    async def tokenize(body: Annotated[TokenizeRequest, Body()]) -> Response:
        """vLLM's ``/tokenize``: the token ids of a ``prompt`` (completion form: as ``/v1/completions``
        tokenizes it, ``add_special_tokens`` true by default) or of chat ``messages`` (chat form: exactly the
        ids ``/v1/chat/completions`` gives the engine for the same messages and tools; options
        ``add_generation_prompt``, ``continue_final_message``, ``add_special_tokens`` (false by default),
        ``chat_template_kwargs``).  ``return_token_strs`` adds the tokenizer's own token strings.  A text of
        any length (within the request size limit) is counted, also one longer than ``max_model_len``; an
        empty prompt counts 0 tokens (plus the special tokens the tokenizer adds, if any)."""
        _require_ready(serving.engine)
        return _json(await serving.tokenize(body))

    @router.post("/detokenize", response_model=DetokenizeResponse, responses=TOKENIZER_RESPONSES)
    async def detokenize(body: DetokenizeRequest) -> Response:
        """vLLM's ``/detokenize``: the text of token ids (special tokens included); ids at or above the
        vocabulary size are a 400 ``token_id_out_of_range`` naming ``tokens``."""
        _require_ready(serving.engine)
        return _json(await serving.detokenize(body))

    @router.get("/version", response_model=VersionResponse)
    async def version() -> Response:
        """The server's version; open like ``/health``, and answered while the model loads."""
        return _json(VersionResponse(version=server_version()))

    return router


def _ops_router(engine: AsyncEngine, metrics: ServerMetrics) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health() -> Response:
        """200 with the engine's queue state when ready; 503 while loading, failed or stopping."""
        if not engine.accepting:
            return APIError(503, engine.unavailable_reason(), code="engine_unavailable").to_json_response()
        g = engine.gauges
        return JSONResponse({"status": "ok", "running": g.num_running, "waiting": g.num_waiting,
                             "unfinished": engine.num_unfinished, "kv_cache_usage": g.kv_cache_usage})

    @router.get("/metrics", response_class=PlainTextResponse, responses={200: {
        "description": "Prometheus text exposition format", "content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def prometheus() -> Response:
        return Response(metrics.render(engine), media_type=CONTENT_TYPE_LATEST)

    return router


class GracefulServer(uvicorn.Server):
    """uvicorn that drains the engine as soon as SIGTERM (or Ctrl-C) arrives.

    uvicorn stops listening and waits for open connections, then runs the app's lifespan shutdown; by
    then it has cancelled whatever was still running, so the engine's own end of those requests never
    reached their clients.  Here the engine's shutdown starts with the signal: it stops admitting
    (503 with ``Retry-After`` on a kept-alive connection, and ``/health`` says so), lets running requests
    finish for ``grace`` seconds, then ends the rest with a shutdown error that each handler still
    delivers: an OpenAI-style error event and ``[DONE]`` for a stream, a 503 for a plain request.  Set
    uvicorn's ``timeout_graceful_shutdown`` a few seconds above ``grace`` so those answers get written."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, grace: float) -> None:
        super().__init__(config)
        self.engine, self.grace = engine, grace
        self.drain: Optional[asyncio.Task] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)

    def handle_exit(self, sig, frame) -> None:
        if self._loop is not None and self.drain is None:
            self._loop.call_soon_threadsafe(self._begin_drain)
        super().handle_exit(sig, frame)

    def _begin_drain(self) -> None:
        if self.drain is None:
            self.drain = asyncio.ensure_future(self.engine.shutdown(self.grace))
