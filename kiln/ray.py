"""kiln on Ray Serve: replicas of the engine behind one endpoint, with prefix-affinity routing and failover.

Each replica (`KilnReplica`) runs kiln's own app (server/app.py: its Runtime, scheduler and one model set)
and answers requests handed to it as ASGI calls, so the APIs, streaming, errors and /metrics are the
single-machine server's. The ingress (`KilnIngress`) forwards each request to a replica chosen by
`PrefixAffinityRouter` and streams the response back; it answers /health (replicas ready) and /metrics
(every replica's, labelled, plus the router's decisions) itself.

`kiln serve --ray [ADDRESS]` deploys the replicas (`build_replicas`) and runs the ingress's code in its own
process as an HTTP server (`KilnFront`): one Ray hop per request and per chunk. `serve run kiln.ray:app
model=TAG replicas=2 ...` (and `kiln serve --ray --ray-proxy`) deploys the ingress as a replica behind Ray
Serve's HTTP proxy (`build`), for clusters where Ray's proxies answer HTTP; the arguments are `RayOptions`'
fields.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from dataclasses import asdict, dataclass, field, fields

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

log = logging.getLogger("kiln.ray")

MIN_AFFINITY_CHARS = 32  # a shorter shared prefix saves less prefill than an idle replica saves waiting
MAX_FORWARD_BYTES = 64 << 20  # a body the ingress holds in memory and hands a replica whole: JSON, not model uploads
ROUTE_ATTEMPTS = 3  # a request whose replica died before answering goes to another; nothing was sent yet
STATS_PERIOD_S = 1.0  # how often each replica reports its metrics and health to the router


@dataclass
class RayOptions:
    """What `kiln serve --ray` and `serve run kiln.ray:app key=value ...` configure."""

    model: str = ""  # an installed tag, a catalog tag to pull, or a .gguf path every node can read
    replicas: int = 1  # fixed replica count; with max_replicas it must stay 1 (autoscaling sets it)
    min_replicas: int | None = None  # autoscaling bounds: both set (or max alone, min then 1) enable it
    max_replicas: int | None = None
    target_ongoing: float = 2.0  # autoscaling: ongoing requests per replica it aims for
    threads: int | None = None  # native threads per replica (also the CPUs Ray reserves for it)
    parallel: int = 4  # KV slots per replica
    ctx_len: int | None = None
    max_queue: int = 64
    keep_alive: float | None = None  # replicas keep their model loaded
    kv_cache: str | None = None  # the KV cache's type (None: KILN_KV_CACHE_TYPE on the replica's node, else f16)
    max_loaded: int = 3  # models a replica holds at once (its model and others requests name)
    max_body_bytes: int | None = None  # the app's request-body limits (None: kiln serve's defaults)
    max_upload_bytes: int | None = None
    backend: str = "auto"
    prefill_chunk: int | None = None
    store: str | None = None  # a store every replica shares (a network path); None: each node's own KILN_HOME
    pull: bool = True  # a replica whose store lacks the model pulls it from the catalog (sha256-verified)
    affinity: bool = True  # route by prompt prefix; False: least loaded only
    stream_interval: float = 0.04  # seconds: with several responses streaming from a replica, each sends at most
    # one message to the ingress this often (a lone one sends every chunk at once); 0: every chunk at once
    api_key: str | None = None
    cors: list[str] = field(default_factory=list)
    allowed_hosts: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = 8000

    @classmethod
    def from_args(cls, args: dict) -> "RayOptions":
        """From `serve run` arguments: strings, converted by each field's type; an unknown key is an error."""
        from kiln.errors import KilnError

        known = {f.name: f for f in fields(cls)}
        values = {}
        for key, value in args.items():
            if key not in known:
                raise KilnError(f"kiln.ray:app has no argument {key!r}; it takes {', '.join(known)}")
            values[key] = _convert(known[key].type, value, key)
        options = cls(**values)
        options.check()
        return options

    def check(self) -> None:
        from kiln.errors import KilnError

        if not self.model:
            raise KilnError("a model is required: kiln serve MODEL --ray, or serve run kiln.ray:app model=TAG")
        for name in ("replicas", "parallel", "threads", "min_replicas", "max_replicas", "max_loaded"):
            value = getattr(self, name)
            if value is not None and value < (0 if name == "min_replicas" else 1):
                raise KilnError(f"--{name.replace('_', '-')} must be at least {0 if name == 'min_replicas' else 1}")
        if self.max_replicas is None and self.min_replicas is not None:
            raise KilnError("--min-replicas bounds autoscaling, which --max-replicas turns on: give both")
        if self.max_replicas is not None and self.replicas != 1:
            raise KilnError(f"--replicas ({self.replicas}) fixes the count and --max-replicas autoscales: give one")
        if self.max_replicas is not None and (self.min_replicas or 1) > self.max_replicas:
            raise KilnError(f"--min-replicas ({self.min_replicas}) is more than --max-replicas ({self.max_replicas})")
        if self.target_ongoing <= 0:
            raise KilnError("--target-ongoing must be positive")
        if not 0 <= self.stream_interval <= 1:
            raise KilnError(f"--stream-interval must be between 0 and 1000 ms, not {self.stream_interval * 1e3:g}")
        if self.kv_cache is not None:
            from kiln.engine.kv import kv_cache_type

            kv_cache_type(self.kv_cache)  # a bad type fails here, not in every replica


def _convert(kind: str, value, key: str):
    from kiln.errors import KilnError

    if not isinstance(value, str):
        return value
    try:
        if "list" in kind:
            return [v.strip() for v in value.split(",") if v.strip()]
        if value.lower() == "none" and "None" in kind:
            return None
        if kind.startswith("bool"):
            if value.lower() not in ("true", "false", "1", "0"):
                raise ValueError(value)
            return value.lower() in ("true", "1")
        if kind.startswith("int"):
            return int(value)
        if kind.startswith("float"):
            return float(value)
    except ValueError:
        raise KilnError(f"kiln.ray:app argument {key}={value!r}: expected {kind.split(' ')[0]}") from None
    return value


# --- routing ----------------------------------------------------------------------------------------------
ROUTER_REGISTRY = CollectorRegistry()
ROUTES = Counter("kiln_ray_routes", "Requests routed, by decision: affinity (to the replica holding the prompt's "
                 "prefix), fallback (its holder was saturated), balanced (no replica held enough of it), "
                 "unkeyed (no prompt)", ["decision"], registry=ROUTER_REGISTRY)
STREAM_FAILURES = Counter("kiln_ray_streams_failed", "Responses cut off because their replica died",
                          registry=ROUTER_REGISTRY)
RETRIES = Counter("kiln_ray_retries", "Requests sent again because their replica died before answering",
                  registry=ROUTER_REGISTRY)
ROUTERS: list = []  # this process's PrefixAffinityRouters (kiln/ray_router.py), for /metrics and /health


def routing_key(path: str, body: bytes) -> str | None:
    """The text a request's prompt starts with, as its API sends it: the model, tools, then the system
    prompt and the conversation in order. Two requests whose keys share a long prefix share the prompt
    prefix the replica's slots cache. None for requests with no prompt."""
    if not body or not path.startswith(("/v1/", "/api/", "/infill", "/completion")):
        return None
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    parts = [json.dumps(str(data.get("model", "")))]  # one line, whatever the name holds
    for name in ("tools", "functions"):
        if data.get(name):
            parts.append(json.dumps(data[name], sort_keys=True))
    for name in ("system", "instructions"):
        if data.get(name):
            parts.append(_text(data[name]))
    for message in data.get("messages") or []:
        if isinstance(message, dict):
            parts.append(f"{message.get('role', '')}: {_text(message.get('content'))}")
    for name in ("prompt", "input", "input_prefix"):
        if data.get(name):
            parts.append(_text(data[name]))
    return "\n".join(parts) if len(parts) > 1 else None


def _text(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(_text(c.get("text") if isinstance(c, dict) else c) for c in content)
    return "" if content is None else json.dumps(content, sort_keys=True)


# --- the replica --------------------------------------------------------------------------------------------
class KilnReplica:
    """One model set: kiln's app with its Runtime, loaded at start, answering ASGI calls from the ingress."""

    async def __init__(self, options: dict):
        from kiln.engine.kv import kv_cache_type
        from kiln.server.app import create_app
        from kiln.server.runtime import Settings, favour_engine_thread
        from kiln.store import Store

        o = RayOptions(**options)
        favour_engine_thread()  # beside Ray's own threads as beside the server's event loop
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        self.stream_interval, self.streaming = o.stream_interval, 0
        store = Store(o.store) if o.store else Store()
        if o.pull:
            await asyncio.to_thread(store.ensure, o.model, False)
        settings = Settings(parallel=o.parallel, ctx_len=o.ctx_len, max_queue=o.max_queue, keep_alive=o.keep_alive,
                            threads=o.threads, backend=o.backend, prefill_chunk=o.prefill_chunk,
                            kv_cache=kv_cache_type(o.kv_cache), max_loaded=o.max_loaded)
        limits = {name: value for name, value in (("max_body_bytes", o.max_body_bytes),
                                                  ("max_upload_bytes", o.max_upload_bytes)) if value is not None}
        failures: list[Exception] = []
        self.app = create_app(settings, api_key=o.api_key, cors=o.cors, allowed_hosts=o.allowed_hosts, bind_host=o.host,
                              store=store, preload=o.model, on_fatal=failures.append, **limits)
        self.runtime = self.app.state.runtime
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()
        while self.runtime.loaded is None and not failures:
            await asyncio.sleep(0.05)
        if failures:
            raise failures[0]

    async def __del__(self):
        """Ray stops the replica: its running requests end, its model unloads."""
        await self._lifespan.__aexit__(None, None, None)

    async def forward(self, request: dict, routing_key: str | None = None):
        """Run one HTTP request through the app: yields (status, headers) once, then body chunks. Closing
        the generator early (the client left) is the app's disconnect. `routing_key` is the router's."""
        messages: asyncio.Queue = asyncio.Queue()
        gone = asyncio.Event()
        body = [{"type": "http.request", "body": request["body"], "more_body": False}]

        async def receive():
            if body:
                return body.pop()
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            await messages.put(message)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "scheme": "http",
                 "method": request["method"], "path": request["path"], "raw_path": request["path"].encode(),
                 "query_string": request["query"], "root_path": "", "headers": request["headers"],
                 "client": request["client"], "server": request["server"], "state": {}}
        task = asyncio.create_task(self.app(scope, receive, send))
        loop = asyncio.get_running_loop()
        sent, opening = float("-inf"), 2  # a response's opening messages (a role chunk, the first token) go at once
        self.streaming += 1
        try:
            while True:
                message = await _next(messages, task)
                if message is None:  # the app returned without completing the response
                    task.result()
                    return
                if message["type"] == "http.response.start":
                    headers = [*message.get("headers", []), (b"x-kiln-replica", self.replica_id.encode())]
                    yield message["status"], headers
                elif message["type"] == "http.response.body":
                    chunks, more = [message.get("body", b"")], message.get("more_body", False)
                    # Each Ray message costs this process and the ingress CPU that the replicas' steps need: with
                    # other responses streaming, this one's chunks wait out the interval and cross together.
                    wait = sent + self.stream_interval - loop.time()
                    if more and self.streaming > 1 and wait > 0 and not opening:
                        await asyncio.sleep(wait)
                    while more and not messages.empty():  # after the start, ASGI sends only body messages
                        message = messages.get_nowait()
                        chunks.append(message.get("body", b""))
                        more = message.get("more_body", False)
                    if any(chunks):
                        sent, opening = loop.time(), max(opening - 1, 0)
                        yield b"".join(chunks)
                    if not more:
                        return
        finally:
            self.streaming -= 1
            gone.set()
            try:
                await asyncio.wait_for(task, timeout=5)
            except Exception:  # noqa: BLE001 — the response is over; the app logs its own failures
                task.cancel()

    async def record_routing_stats(self) -> dict:
        """What the ingress shows: this replica's metrics, where it runs, and whether its model is loaded."""
        import ray

        return {"metrics": self.runtime.metrics.render().decode(), "ready": self.runtime.loaded is not None,
                "node": ray.get_runtime_context().get_node_id(), "pid": os.getpid(),
                "model": self.runtime.loaded.tag if self.runtime.loaded else None}


async def _next(messages: asyncio.Queue, task: asyncio.Task):
    """The app's next ASGI message, or None once it has finished with none left."""
    getter = asyncio.ensure_future(messages.get())
    done, _ = await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
    if getter in done:
        return getter.result()
    getter.cancel()
    return None if messages.empty() else messages.get_nowait()


# --- the ingress ------------------------------------------------------------------------------------------
class KilnIngress:
    """Forwards every request to a replica and streams the answer back; /health and /metrics are its own."""

    def __init__(self, replicas, options: dict):
        from kiln.server.app import HostAllowlist

        self.options = RayOptions(**options)
        self.handle = replicas.options(stream=True)
        self.hosts = HostAllowlist(None, HostAllowlist.names(self.options.host, self.options.allowed_hosts))

    async def __call__(self, request: Request) -> Response:
        """/health and /metrics here, under the server's Host and API-key rules; everything else in a
        replica, whose app checks Host, Origin, the key and the body as the single server does."""
        from kiln.server.app import error_response

        path = request.url.path
        if path in ("/health", "/metrics") and request.method == "GET":
            host = request.headers.get("host")
            if host is not None and not self.hosts.allows(host):
                return error_response(path, 403, f"Host {host[:100]!r} is not allowed: kiln answers loopback names "
                                      "and the hosts given with --allowed-hosts", code="host_not_allowed")
            if path == "/health":
                return await self.health()
            if self.options.api_key and not self._authorized(request):
                return error_response(path, 401, "a valid API key is required: send it as 'Authorization: Bearer "
                                      "<key>' (or 'x-api-key: <key>')", code="invalid_api_key",
                                      type_="authentication_error", headers={"WWW-Authenticate": "Bearer"})
            return self.metrics()
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > MAX_FORWARD_BYTES:
            return error_response(path, 413, f"the request body is larger than {MAX_FORWARD_BYTES} bytes, the most "
                                  "the Ray ingress forwards; add models to the replicas' store on their nodes")
        body = await request.body()
        forwarded = {"method": request.method, "path": path, "query": request.url.query.encode(),
                     "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in request.headers.items()],
                     "body": body, "client": tuple(request.client) if request.client else None,
                     "server": (self.options.host, self.options.port)}
        key = routing_key(path, body)
        for attempt in range(ROUTE_ATTEMPTS):
            stream = self.handle.forward.remote(forwarded, routing_key=key)
            try:
                status, headers = await stream.__anext__()
                break
            except (RayActorError, ActorUnavailableError) as e:
                if attempt + 1 == ROUTE_ATTEMPTS:
                    return error_response(path, 503, f"no replica could answer: {e}", code="replica_unavailable",
                                          headers={"Retry-After": "1"})
                RETRIES.inc()
        media = next((v.decode("latin-1") for k, v in headers if k.lower() == b"content-type"), "")
        response = StreamingResponse(_relay(stream, path, media), status_code=status)
        response.raw_headers = [(k, v) for k, v in headers if k.lower() != b"content-length" or
                                not media.startswith(("text/event-stream", "application/x-ndjson"))]
        return response

    def _authorized(self, request: Request) -> bool:
        import secrets

        key = self.options.api_key.encode()
        given = request.headers.get("authorization", "").encode("latin-1")
        return secrets.compare_digest(given, b"Bearer " + key) or \
            secrets.compare_digest(request.headers.get("x-api-key", "").encode("latin-1"), key)

    def _replicas(self) -> dict:
        stats: dict = {}
        for router in ROUTERS:
            stats.update(router.replica_stats())
        return stats

    async def health(self) -> JSONResponse:
        status = await asyncio.to_thread(serve.status)
        states: dict = {}
        for app in status.applications.values():
            deployment = app.deployments.get("KilnReplica")
            if deployment is not None:
                states = {str(k): v for k, v in deployment.replica_states.items()}
        ready = states.get("RUNNING", 0)
        replicas = [{"id": rid, "node": s.get("node"), "pid": s.get("pid"), "model": s.get("model")}
                    for rid, s in sorted(self._replicas().items()) if s]
        body = {"status": "ok" if ready else "unavailable", "ready": ready, "states": states, "replicas": replicas}
        return JSONResponse(body, status_code=200 if ready else 503)

    def metrics(self) -> Response:
        texts = {rid: s["metrics"] for rid, s in self._replicas().items() if s and s.get("metrics")}
        return Response(merge_metrics(texts) + generate_latest(ROUTER_REGISTRY).decode(),
                        media_type=CONTENT_TYPE_LATEST)


async def _relay(stream, path: str, media: str):
    """The replica's body chunks; if it dies part way, an error event in the response's own format."""
    try:
        async for chunk in stream:
            yield chunk
    except (RayActorError, ActorUnavailableError) as e:
        STREAM_FAILURES.inc()
        message = f"the replica answering this request stopped ({type(e).__name__}); the response is incomplete"
        log.warning("%s: %s", path, message)
        yield stream_error(path, media, message)
    finally:
        stream.cancel()  # the client left: the replica's app sees the disconnect and cancels the generation


def stream_error(path: str, media: str, message: str) -> bytes:
    """An error as the response's API sends one part way through a stream."""
    if media.startswith("application/x-ndjson"):
        return (json.dumps({"error": message}) + "\n").encode()
    if path.startswith("/v1/messages"):
        data = {"type": "error", "error": {"type": "api_error", "message": message}}
        return f"event: error\ndata: {json.dumps(data)}\n\n".encode()
    if path.startswith("/v1/responses"):
        data = {"type": "error", "code": "server_error", "message": message, "param": None}
        return f"event: error\ndata: {json.dumps(data)}\n\n".encode()
    data = {"error": {"message": message, "type": "server_error", "param": None, "code": "replica_failed"}}
    return f"data: {json.dumps(data)}\n\ndata: [DONE]\n\n".encode()


def merge_metrics(texts: dict[str, str]) -> str:
    """Replicas' Prometheus texts as one: each sample gains a `replica` label, each family stays together."""
    families: dict[str, list[str]] = {}
    for replica, text in sorted(texts.items()):
        family = None
        for line in text.splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                family = line.split(" ", 3)[2]
                lines = families.setdefault(family, [])
                if line not in lines:
                    lines.append(line)
                continue
            if not line.strip() or line.startswith("#") or family is None:
                continue
            name, _, rest = line.partition("{") if "{" in line.split(" ", 1)[0] else (line.split(" ", 1)[0], "", "")
            label = f'replica="{replica}"'
            if rest:
                sample = f"{name}{{{label},{rest}" if not rest.startswith("}") else f"{name}{{{label}{rest}"
            else:
                sample = f"{name}{{{label}}} {line.split(' ', 1)[1]}"
            families[family].append(sample)
    return "".join(line + "\n" for lines in families.values() for line in lines)


class KilnFront:
    """`kiln serve --ray`'s HTTP server, an ASGI app in kiln's own process: the ingress's code, calling the
    replicas' deployment handle directly. Ray's HTTP proxy and the ingress replica are two hops and two
    serializations of every chunk; this is one."""

    def __init__(self, replicas, options: dict):
        self.ingress = KilnIngress(replicas, options)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":  # kiln's APIs are HTTP only; uvicorn refuses the rest
            return
        response = await self.ingress(Request(scope, receive))
        await response(scope, receive, send)


# --- the application ----------------------------------------------------------------------------------------
def build(options: RayOptions):
    """The Ray Serve application behind Ray's HTTP proxy: the ingress bound to the replicas' deployment."""
    config = asdict(options)
    ingress = serve.deployment(KilnIngress, name="KilnIngress", num_replicas=1, max_ongoing_requests=1024,
                               ray_actor_options={"num_cpus": 0})
    return ingress.bind(build_replicas(options), config)


def build_replicas(options: RayOptions):
    """The replicas' deployment, bound: the application KilnFront calls (or the ingress, in `build`)."""
    options.check()
    config = asdict(options)
    scaling: dict = {"num_replicas": options.replicas}
    if options.max_replicas is not None:
        scaling = {"autoscaling_config": {"min_replicas": options.min_replicas if options.min_replicas is not None else 1,
                                          "max_replicas": options.max_replicas,
                                          "target_ongoing_requests": options.target_ongoing}}
    return serve.deployment(
        KilnReplica, name="KilnReplica", **scaling,
        max_ongoing_requests=options.parallel,  # one request per slot; more wait in the router for a free one
        ray_actor_options={"num_cpus": options.threads or 1},
        health_check_period_s=2, health_check_timeout_s=30, graceful_shutdown_timeout_s=5,
        request_router_config={"request_router_class": "kiln.ray_router.PrefixAffinityRouter",
                               "request_router_kwargs": {"affinity": options.affinity, "memory": options.parallel,
                                                         "min_chars": MIN_AFFINITY_CHARS},
                               "request_routing_stats_period_s": STATS_PERIOD_S,
                               "request_routing_stats_timeout_s": 10},
    ).bind(config)


def app(args: dict):
    """`serve run kiln.ray:app model=TAG replicas=2 threads=1 ...`"""
    return build(RayOptions.from_args(args))
