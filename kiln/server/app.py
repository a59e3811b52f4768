"""The HTTP app: OpenAI (/v1), Anthropic (/v1/messages) and Ollama (/api) routers over one Runtime, plus
/health and /metrics.

Errors leave in the shape of the caller's API: Ollama's `{"error": message}` under /api, Anthropic's
`{"type": "error", "error": {type, message}}` under /v1/messages, OpenAI's
`{"error": {message, type, param, code}}` everywhere else. No client ever gets a traceback.
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
from contextlib import asynccontextmanager
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from kiln import __version__
from kiln.chat import ChatTemplateError
from kiln.engine.scheduler import QueueFullError, UnloadedError
from kiln.errors import ContextLengthError, KilnError, ModelNotFoundError, RequestError
from kiln.server import anthropic, llamacpp, ollama, openai, responses
from kiln.server.runtime import Runtime, Settings

log = logging.getLogger("kiln.server")


def create_app(settings: Settings, *, api_key: str | None = None, cors: list[str] | None = None,
               preload: str | None = None, store=None, on_fatal: Callable[[Exception], None] | None = None) -> FastAPI:
    """`preload` is loaded at startup (/health answers 503 meanwhile); if that fails, `on_fatal` is told."""
    runtime = Runtime(settings, store)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        tasks = [asyncio.create_task(runtime.reap())]
        if preload:
            tasks.append(asyncio.create_task(_preload(runtime, preload, on_fatal)))
        yield
        for task in tasks:
            task.cancel()
        await runtime.close()

    app = FastAPI(title="kiln", version=__version__, lifespan=lifespan,
                  description="A local LLM runtime: OpenAI- and Ollama-compatible APIs over continuous batching.")
    app.state.runtime = runtime
    app.openapi = lambda: _openapi(app)
    _install_error_handlers(app)
    app.include_router(openai.router)
    app.include_router(responses.router)
    app.include_router(ollama.router)
    app.include_router(anthropic.router)
    app.include_router(llamacpp.router)

    @app.api_route("/", methods=["GET", "HEAD"], response_class=PlainTextResponse, include_in_schema=False)
    async def root():
        return "kiln is running"  # what Ollama tools probe for

    @app.get("/health", summary="200 when ready, 503 while a model is loading; needs no API key")
    async def health():
        if runtime.loading:
            return JSONResponse({"status": "loading", "model": runtime.loading}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics", summary="Prometheus metrics", response_class=PlainTextResponse)
    async def metrics():
        return Response(runtime.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    app.add_middleware(JSONBodies)
    if api_key:
        app.add_middleware(BearerAuth, key=api_key)
    if cors:  # added last, so it is outermost: preflight requests carry no API key
        app.add_middleware(CORSMiddleware, allow_origins=cors, allow_methods=["*"], allow_headers=["*"])
    return app


def _openapi(app: FastAPI) -> dict:
    """FastAPI's spec, less the 422 it lists for invalid bodies: kiln answers those 400, as OpenAI and Ollama do."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        for operation in (op for path in schema["paths"].values() for op in path.values()):
            operation["responses"].pop("422", None)
        app.openapi_schema = schema
    return app.openapi_schema


async def _preload(runtime: Runtime, name: str, on_fatal) -> None:
    try:
        await runtime.preload(name, allow_path=True)
    except Exception as e:  # reported to the command, which stops the server with the message
        log.error("could not load %s: %s", name, e)
        if on_fatal:
            on_fatal(e)


class JSONBodies:
    """Every body these APIs take is JSON, whatever the client labels it: `curl -d` sends form encoding, and
    Ollama's own server reads such requests as JSON, so its users expect that."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] in ("POST", "DELETE"):
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        return await self.app(scope, receive, send)


class BearerAuth:
    """`Authorization: Bearer KEY` on every request but /health (a pure ASGI middleware, so streaming and
    disconnect detection pass through untouched)."""

    def __init__(self, app, key: str):
        self.app, self.expected, self.key = app, f"Bearer {key}".encode(), key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] == "/health":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        given = headers.get(b"authorization", b"")
        # Anthropic's clients send the key as x-api-key
        if secrets.compare_digest(given, self.expected) or secrets.compare_digest(headers.get(b"x-api-key", b""), self.key):
            return await self.app(scope, receive, send)
        message = "a valid API key is required: send it as 'Authorization: Bearer <key>' (or 'x-api-key: <key>')"
        response = error_response(scope["path"], 401, message, code="invalid_api_key", type_="authentication_error",
                                  headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)


_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
          503: "unavailable_error"}


def error_response(path: str, status: int, message: str, *, param: str | None = None, code: str | None = None,
                   type_: str | None = None, headers: dict | None = None) -> JSONResponse:
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        return anthropic.error_response(status, message, headers)
    if path.startswith("/api/"):
        body: dict = {"error": message}
    else:
        body = {"error": {"message": message, "type": type_ or _TYPES.get(status, "server_error"),
                          "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        message, param = describe_validation_errors(exc.errors())
        return error_response(request.url.path, 400, message, param=param)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        param = None
        if exc.status_code == 404 and message == "Not Found":
            message = f"no such endpoint: {request.method} {request.url.path}"
        elif exc.status_code == 400 and message == "There was an error parsing the body":  # FastAPI's words
            message, param = "the request body is not UTF-8 encoded JSON", "body"
        return error_response(request.url.path, exc.status_code, message, param=param, headers=exc.headers)

    @app.exception_handler(KilnError)
    async def kiln_error(request: Request, exc: KilnError):
        path, message = request.url.path, str(exc)
        if isinstance(exc, ModelNotFoundError):
            return error_response(path, 404, message, param="model", code="model_not_found")
        if isinstance(exc, ContextLengthError):
            return error_response(path, 400, message, param=getattr(exc, "param", None), code="context_length_exceeded")
        if isinstance(exc, RequestError):
            return error_response(path, 400, message, param=exc.param)
        if isinstance(exc, ChatTemplateError):
            return error_response(path, 400, message, param="messages")
        if isinstance(exc, (QueueFullError, UnloadedError)):
            code = "queue_full" if isinstance(exc, QueueFullError) else "model_unloading"
            return error_response(path, 503, message, code=code, headers={"Retry-After": "1"})
        log.error("%s %s failed: %s", request.method, path, message)
        return error_response(path, 500, message)

    @app.exception_handler(Exception)
    async def bug(request: Request, exc: Exception):
        log.exception("%s %s failed", request.method, request.url.path)
        return error_response(request.url.path, 500, f"internal error: {type(exc).__name__}: {exc}")


def describe_validation_errors(errors: list[dict]) -> tuple[str, str | None]:
    """One message naming each field at fault (the first one is the `param`)."""
    if any(e["type"] == "json_invalid" for e in errors):
        e = next(e for e in errors if e["type"] == "json_invalid")
        where = e["loc"][1] if len(e["loc"]) > 1 else "?"
        return f"the request body is not valid JSON ({e.get('ctx', {}).get('error', e['msg'])} at position {where})", "body"
    parts, params = [], []
    for e in errors:
        param = _param(e["loc"]) or "body"
        if param in params:  # one line per field: a union type reports each alternative
            continue
        params.append(param)
        parts.append(f"{param}: {'kiln does not implement this field' if e['type'] == 'extra_forbidden' else e['msg']}")
    return "invalid request: " + "; ".join(parts[:5]), params[0] if params else "body"


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _param(loc) -> str:
    """("body", "messages", 0, "content") → "messages[0].content", dropping pydantic's union-branch names."""
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not re.fullmatch(r"[a-z_][a-z0-9_]*", part) or part in _TYPE_TAGS:
            break
        else:
            out += f".{part}" if out else part
    return out
