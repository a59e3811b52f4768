"""The HTTP app: OpenAI (/v1), Anthropic (/v1/messages) and Ollama (/api) routers over one Runtime, plus
/health and /metrics.

Errors leave in the shape of the caller's API: Ollama's `{"error": message}` under /api, Anthropic's
`{"type": "error", "error": {type, message}}` under /v1/messages, OpenAI's
`{"error": {message, type, param, code}}` everywhere else. No client ever gets a traceback.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import math
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
from kiln.errors import ContextLengthError, KilnError, ModelNotFoundError, RequestError, describe_os_error, without_paths
from kiln.server import anthropic, llamacpp, ollama, openai, responses
from kiln.server.runtime import Runtime, Settings

log = logging.getLogger("kiln.server")

MAX_BODY_BYTES = 8 << 20  # a JSON request: a long context's prompt is well under this, escaped
MAX_UPLOAD_BYTES = 256 << 30  # a GGUF file sent to POST /api/blobs


def create_app(settings: Settings, *, api_key: str | None = None, cors: list[str] | None = None,
               allowed_hosts: list[str] | None = None, bind_host: str = "127.0.0.1",
               max_body_bytes: int = MAX_BODY_BYTES, max_upload_bytes: int = MAX_UPLOAD_BYTES,
               preload: str | None = None, store=None, on_fatal: Callable[[Exception], None] | None = None) -> FastAPI:
    """`preload` is loaded at startup (/health answers 503 meanwhile); if that fails, `on_fatal` is told.
    `cors` and `allowed_hosts` add to the loopback origins and names always allowed ("*": any)."""
    runtime = Runtime(settings, store)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await asyncio.to_thread(runtime.store.clean_stale)  # what killed pulls and repacks left
        tasks = [asyncio.create_task(runtime.reap())]
        if preload:
            runtime.loading = preload  # from the start: /health is 503 until it is loaded
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

    # The last added is outermost: a foreign Host or Origin is refused before anything else runs, and
    # preflight requests (which carry no API key) are answered before the key is checked.
    app.add_middleware(RequestBodies, max_json=max_body_bytes, max_upload=max_upload_bytes)
    if api_key:
        app.add_middleware(BearerAuth, key=api_key)
    origins = OriginAllowlist.compile(cors or [])
    app.add_middleware(CORSMiddleware, allow_origin_regex=origins.pattern, allow_methods=["*"], allow_headers=["*"])
    app.add_middleware(OriginAllowlist, allowed=origins)
    app.add_middleware(HostAllowlist, allowed=HostAllowlist.names(bind_host, allowed_hosts or []))
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
        runtime.loading = None
        log.error("could not load %s: %s", name, e)
        if on_fatal:
            on_fatal(e)


_LOOPBACK_ORIGIN = r"https?://(localhost|127\.0\.0\.1|\[::1\]|0\.0\.0\.0)(:\d+)?"  # as Ollama allows by default
_SAFE_METHODS = ("GET", "HEAD")


def _header(scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


def _host_name(host: str) -> str:
    """A Host header's name, lowercased and without its port: "[::1]:8080" → "::1"."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class HostAllowlist:
    """403 for a Host header that is not a loopback name, the address kiln is bound to, or one the user
    allowed: a web page that rebinds its own DNS name to 127.0.0.1 still sends its name as the Host
    (Ollama's answer to CVE-2024-28224). A wildcard bind (0.0.0.0) allows no more names than loopback."""

    def __init__(self, app, allowed: frozenset[str] | None):
        self.app, self.allowed = app, allowed

    @staticmethod
    def names(bind_host: str, extra: list[str]) -> frozenset[str] | None:
        """The allowed host names; None when "*" allows any."""
        names = {_host_name(n) for entry in extra for n in entry.split(",") if n.strip()}
        if "*" in names:
            return None
        names |= {"localhost", "127.0.0.1", "::1"}
        if bind_host not in ("", "0.0.0.0", "::", "[::]"):
            names.add(_host_name(bind_host))
        return frozenset(names)

    def allows(self, host: str) -> bool:
        name = _host_name(host)
        if self.allowed is None or name in self.allowed or name.endswith(".localhost"):
            return True
        try:
            return ipaddress.ip_address(name).is_loopback
        except ValueError:
            return False

    async def __call__(self, scope, receive, send):
        host = _header(scope, b"host") if scope["type"] in ("http", "websocket") else None
        if host is None or self.allows(host):
            return await self.app(scope, receive, send)
        message = (f"Host {host[:100]!r} is not allowed: kiln answers loopback names and the hosts given with "
                   "--allowed-hosts or KILN_ALLOWED_HOSTS")
        await error_response(scope["path"], 403, message, code="host_not_allowed")(scope, receive, send)


class OriginAllowlist:
    """403 for a browser request from a foreign Origin that could change state (anything but GET and HEAD)
    or asks to (a preflight). Loopback origins are allowed, as Ollama allows them, and those the user
    gave with --cors or KILN_ORIGINS ("*" for any, "*" inside one for any run of characters)."""

    def __init__(self, app, allowed: re.Pattern):
        self.app, self.allowed = app, allowed

    @staticmethod
    def compile(origins: list[str]) -> re.Pattern:
        patterns = [o.strip().rstrip("/") for entry in origins for o in entry.split(",") if o.strip()]
        if "*" in patterns:
            return re.compile(".*")
        return re.compile("|".join([_LOOPBACK_ORIGIN, *(".*".join(map(re.escape, p.split("*"))) for p in patterns)]))

    async def __call__(self, scope, receive, send):
        origin = _header(scope, b"origin") if scope["type"] == "http" else None
        if origin is None or scope["method"] in _SAFE_METHODS or self.allowed.fullmatch(origin):
            return await self.app(scope, receive, send)
        message = (f"Origin {origin[:100]!r} is not allowed to {scope['method']} here: allow it with --cors or "
                   "KILN_ORIGINS")
        await error_response(scope["path"], 403, message, code="origin_not_allowed")(scope, receive, send)


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int, what: str):
        super().__init__(413, f"the request body is larger than {limit} bytes, the most kiln takes for {what} "
                              f"(kiln serve --max-{'upload' if what == 'an upload' else 'body'}-bytes)")


class RequestBodies:
    """Request bodies are JSON, sent as application/json, and bounded in size as they arrive.

    Browsers send text/plain and form bodies cross-site without asking first, so only application/json
    reads as JSON, except from a client that is not a browser (it sends no Origin): `curl -d`, as Ollama's
    documentation uses it, sends form encoding, which no browser form can make into JSON. A JSON body must
    be strict JSON: NaN, Infinity and lone surrogates, which Python's parser takes, are refused naming the
    field. Uploads to /api/blobs stream through under their own limit."""

    def __init__(self, app, max_json: int, max_upload: int):
        self.app, self.max_json, self.max_upload = app, max_json, max_upload

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in (*_SAFE_METHODS, "OPTIONS"):
            return await self.app(scope, receive, send)
        path = scope["path"]
        upload = path.startswith("/api/blobs/")
        limit, what = (self.max_upload, "an upload") if upload else (self.max_json, "a JSON request")
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return await error_response(path, 413, BodyTooLarge(limit, what).detail)(scope, receive, send)
        if upload:
            return await self.app(scope, _limited(receive, limit, what), send)
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > limit:
                return await error_response(path, 413, BodyTooLarge(limit, what).detail)(scope, receive, send)
            if not message.get("more_body"):
                break
        media = (_header(scope, b"content-type") or "").split(";")[0].strip().lower()
        if body and media != "application/json" and (
                _header(scope, b"origin") is not None or media not in ("", "application/x-www-form-urlencoded")):
            message = ("the request body must be JSON sent as Content-Type: application/json, "
                       f"not {media[:100] or 'untyped'}")
            return await error_response(path, 415, message, param="body")(scope, receive, send)
        problem = _strict_json_problem(bytes(body))
        if problem is not None:
            return await error_response(path, 400, problem[0], param=problem[1])(scope, receive, send)
        headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
        scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        return await self.app(scope, _replay(bytes(body), receive), send)


def _limited(receive, limit: int, what: str):
    """`receive` that fails the request with 413 as soon as the body passes `limit`."""
    seen = 0

    async def limited():
        nonlocal seen
        message = await receive()
        seen += len(message.get("body", b""))
        if seen > limit:
            raise BodyTooLarge(limit, what)
        return message

    return limited


def _replay(body: bytes, receive):
    """`receive` that hands the app the body already read, then the connection's later messages (the
    disconnect that cancels a generation)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay():
        return pending.pop() if pending else await receive()

    return replay


class _NotFinite:
    pass


def _finite(text: str):
    value = float(text)
    return value if math.isfinite(value) else _NotFinite()  # 1e999 parses as inf


def _strict_json_problem(body: bytes) -> tuple[str, str] | None:
    """(message, param) for a value strict JSON cannot hold; None when there is none, or when the body is
    no JSON at all (FastAPI then says where it breaks)."""
    try:
        value = json.loads(body, parse_constant=lambda _: _NotFinite(), parse_float=_finite)
    except ValueError:
        return None
    except RecursionError:
        return "invalid request: the body nests too deeply", "body"
    stack = [("", value)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                if not _valid_text(key):
                    return (f"invalid request: a key in {where or 'the body'} is not valid Unicode (a lone surrogate)",
                            where or "body")
                stack.append((f"{where}.{key}" if where else key, item))
        elif isinstance(value, list):
            stack.extend((f"{where}[{i}]", item) for i, item in enumerate(value))
        elif isinstance(value, _NotFinite):
            return f"invalid request: {where or 'body'} is NaN or infinite; numbers must be finite", where or "body"
        elif isinstance(value, str) and not _valid_text(value):
            return f"invalid request: {where or 'body'} is not valid Unicode (it has a lone surrogate)", where or "body"
    return None


def _valid_text(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


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


_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
          503: "unavailable_error"}


def error_response(path: str, status: int, message: str, *, param: str | None = None, code: str | None = None,
                   type_: str | None = None, headers: dict | None = None) -> JSONResponse:
    message = without_paths(message)  # the server's files are no client's business
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

    @app.exception_handler(OSError)
    async def system_error(request: Request, exc: OSError):  # a full disk during a pull, say
        message = describe_os_error(exc, f"{request.method} {request.url.path} failed")
        log.error("%s", message)
        return error_response(request.url.path, 500, message)

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
