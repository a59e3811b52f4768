"""`kiln serve`: the OpenAI and Ollama HTTP APIs, with continuous batching over --parallel KV slots."""

from __future__ import annotations

import logging
import os
import re
import sys

from kiln.commands.run import add_draft_args, spec_from_args

DEFAULT_PORT = 11500
GRACE_S = 2  # seconds running requests get to finish once the server is told to stop
# A local Ray instance's Serve controller and replicas wake less often (their defaults: every 100 ms): on a
# machine whose cores run the replicas, their idle work is taken from decoding (docs/PERF.md).
QUIET_LOCAL_RAY = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5", "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000"}


def register(sub) -> None:
    p = sub.add_parser("serve", help="serve OpenAI- and Ollama-compatible HTTP APIs",
                       description="Serve the OpenAI (/v1) and Ollama (/api) APIs, /health and /metrics. Models load "
                                   "on first request (or MODEL at startup), up to --max-loaded at once, and "
                                   "unload after --keep-alive idle.")
    p.add_argument("model", nargs="?", help="load this model at startup, pulling it if needed (tag or .gguf path)")
    env = os.environ.get
    p.add_argument("--host", default=env("KILN_HOST", "127.0.0.1"), help="address to bind (env KILN_HOST; default 127.0.0.1)")
    p.add_argument("--port", type=int, default=env("KILN_PORT", str(DEFAULT_PORT)),
                   help=f"port (env KILN_PORT; default {DEFAULT_PORT})")
    p.add_argument("--api-key", default=env("KILN_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health (env KILN_API_KEY)")
    p.add_argument("--cors", action="append", metavar="ORIGIN", default=_listed(env("KILN_ORIGINS")),
                   help="allow browser requests from ORIGIN besides loopback ones (repeatable or comma-separated; "
                        "* matches anything; env KILN_ORIGINS)")
    p.add_argument("--allowed-hosts", action="append", metavar="HOST", default=_listed(env("KILN_ALLOWED_HOSTS")),
                   help="answer requests whose Host is HOST besides loopback names and --host (repeatable or "
                        "comma-separated; * for any; env KILN_ALLOWED_HOSTS)")
    p.add_argument("--max-body-bytes", default=env("KILN_MAX_BODY_BYTES", "8M"),
                   help="largest JSON request body, in bytes or with K, M, G (env KILN_MAX_BODY_BYTES; default 8M)")
    p.add_argument("--max-upload-bytes", default=env("KILN_MAX_UPLOAD_BYTES", "256G"),
                   help="largest model upload to /api/blobs (env KILN_MAX_UPLOAD_BYTES; default 256G)")
    p.add_argument("--parallel", "-np", type=int, default=env("KILN_NUM_PARALLEL", "4"),
                   help="KV slots: requests decoded together (env KILN_NUM_PARALLEL; default 4)")
    p.add_argument("--ctx-len", "-c", type=int, default=env("KILN_CONTEXT_LENGTH"),
                   help="context length of each slot, and the most a request's num_ctx may ask for "
                        "(env KILN_CONTEXT_LENGTH; default: min(model's, 4096), and up to the model's own)")
    p.add_argument("--kv-cache",
                   help="KV cache type: f16, q8_0 or q4_0 (env KILN_KV_CACHE_TYPE; default f16)")
    p.add_argument("--max-queue", type=int, default=env("KILN_MAX_QUEUE", "64"),
                   help="requests that may wait for a slot; more get 503 (env KILN_MAX_QUEUE; default 64)")
    p.add_argument("--keep-alive", default=env("KILN_KEEP_ALIVE", "5m"),
                   help="how long an idle model stays loaded: 5m, 1h, 0, -1 for forever (env KILN_KEEP_ALIVE; default 5m)")
    p.add_argument("--prefill-chunk", type=int, help="most prompt tokens computed per step (default: the engine's prefill batch)")
    p.add_argument("-t", "--threads", type=int, help="native threads (default: physical cores)")
    p.add_argument("--backend", default="auto", choices=["auto", "native", "oracle"], help="compute backend")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--max-loaded", type=int, default=env("KILN_MAX_LOADED_MODELS", "3"),
                   help="models loaded at once; loading one more evicts the least recently used idle one "
                        "(env KILN_MAX_LOADED_MODELS; default 3)")
    p.add_argument("--max-memory", default=env("KILN_MAX_MEMORY"),
                   help="most memory the loaded models may take together, by `kiln validate`'s footprint of "
                        "each, in bytes or with K, M, G; a model that would exceed it evicts idle ones "
                        "(env KILN_MAX_MEMORY; default: no cap but the memory available)")
    add_draft_args(p)  # the defaults; a request may choose its own mode, max and ngram
    ray = p.add_argument_group("Ray Serve", "replicas of the model on a Ray cluster behind one endpoint (docs/RAY.md)")
    ray.add_argument("--ray", nargs="?", const="local", metavar="ADDRESS",
                     help="serve MODEL from replicas on Ray: on a new local Ray instance, or the cluster at ADDRESS "
                          "(HOST:PORT, auto, ray://HOST:PORT); name MODEL before this flag")
    ray.add_argument("--replicas", type=int, help="replicas, each with its own model set (default 1)")
    ray.add_argument("--min-replicas", type=int, help="autoscale: the fewest replicas (default 1 with --max-replicas)")
    ray.add_argument("--max-replicas", type=int, help="autoscale up to this many replicas (instead of --replicas)")
    ray.add_argument("--target-ongoing", type=float,
                     help="autoscale: the ongoing requests per replica to aim for (default 2)")
    ray.add_argument("--store", help="a model store every replica reads (a shared path); default: each node's KILN_HOME")
    ray.add_argument("--no-pull", dest="pull", action="store_false",
                     help="replicas do not pull a model their store lacks from the catalog")
    ray.add_argument("--no-affinity", dest="affinity", action="store_false",
                     help="route to the least loaded replica only, not to the one holding the prompt's prefix")
    ray.add_argument("--stream-interval", type=float, metavar="MS",
                     help="while several responses stream from a replica, each sends its chunks to the endpoint at "
                          "most once per MS milliseconds, together (a lone response streams every chunk at once); "
                          "0: every chunk at once (default 40)")
    ray.add_argument("--ray-proxy", action="store_true",
                     help="answer HTTP through Ray Serve's proxy and an ingress replica (the `serve run kiln.ray:app` "
                          "application) instead of in this process: one hop more per request and per chunk")
    p.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    import uvicorn

    from kiln.engine.kv import kv_cache_type
    from kiln.errors import KilnError
    from kiln.server.app import create_app
    from kiln.server.runtime import Settings, favour_engine_thread, parse_keep_alive
    from kiln.store import Store

    for name in ("parallel", "max_queue", "port", "max_loaded"):
        if getattr(args, name) < (1 if name != "max_queue" else 0):
            raise KilnError(f"--{name.replace('_', '-')} must be {'at least 1' if name != 'max_queue' else '>= 0'}")
    if args.port > 65535:  # the socket layer would take it modulo 65536 and bind somewhere else
        raise KilnError(f"--port must be 1..65535, not {args.port}")
    if args.prefill_chunk is not None and args.prefill_chunk < 1:
        raise KilnError("--prefill-chunk must be at least 1")
    keep_alive = parse_keep_alive(args.keep_alive, "--keep-alive")
    unused = unused_flags(args)
    if unused:
        raise KilnError(f"{', '.join(unused)}: not used {'with' if args.ray is not None else 'without'} --ray")
    if args.ray is not None:
        return serve_on_ray(args)
    max_body = parse_size(args.max_body_bytes, "--max-body-bytes")
    max_upload = parse_size(args.max_upload_bytes, "--max-upload-bytes")
    max_memory = None if args.max_memory is None else parse_size(args.max_memory, "--max-memory")
    settings = Settings(parallel=args.parallel, ctx_len=args.ctx_len, max_queue=args.max_queue, keep_alive=keep_alive,
                        threads=args.threads, backend=args.backend, prefill_chunk=args.prefill_chunk,
                        speculative=spec_from_args(args), draft_model=args.draft_model, max_loaded=args.max_loaded,
                        max_memory=max_memory, kv_cache=kv_cache_type(args.kv_cache))
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    store = Store()
    for blob in store.prune():  # uploads (POST /api/blobs) that no /api/create took
        logging.getLogger("kiln.server").info("removed %s: no model uses it", blob)
    for ref in (args.model, args.draft_model):  # pull before binding the port, so a bad tag fails here
        if ref:
            store.ensure(ref, progress=True)
    failures: list[Exception] = []

    def fatal(error: Exception) -> None:
        failures.append(error)
        server.should_exit = True

    app = create_app(settings, api_key=args.api_key, cors=args.cors, allowed_hosts=args.allowed_hosts,
                     bind_host=args.host, max_body_bytes=max_body, max_upload_bytes=max_upload, preload=args.model,
                     store=store, on_fatal=fatal)
    # On SIGTERM, requests still running after the grace period are cancelled, so the server always stops.
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           timeout_graceful_shutdown=GRACE_S))
    favour_engine_thread()
    print(f"kiln serving on http://{args.host}:{args.port} (OpenAI: /v1, Anthropic: /v1/messages, Ollama: /api, docs: /docs)", file=sys.stderr)
    server.run()
    if failures:
        raise KilnError(f"could not load {args.model}: {failures[0]}")
    return 0 if server.started else 1


def unused_flags(args) -> list[str]:
    """The flags given that the chosen server would not read: Ray's without --ray; with it, the
    single server's that a replica's app does not take (RayOptions)."""
    if args.ray is None:
        given = {"--replicas": args.replicas is not None, "--min-replicas": args.min_replicas is not None,
                 "--max-replicas": args.max_replicas is not None, "--target-ongoing": args.target_ongoing is not None,
                 "--store": args.store is not None, "--no-pull": not args.pull, "--no-affinity": not args.affinity,
                 "--ray-proxy": args.ray_proxy, "--stream-interval": args.stream_interval is not None}
    else:
        given = {"--max-memory": args.max_memory is not None, "--draft": args.draft is not None,
                 "--draft-model": args.draft_model is not None, "--draft-max": args.draft_max is not None,
                 "--ngram": args.ngram is not None}
    return [flag for flag, present in given.items() if present]


def ray_options(args):
    """RayOptions from `kiln serve --ray`'s flags, checked: only the flags given; the others keep its defaults."""
    from kiln.ray import RayOptions

    interval = None if args.stream_interval is None else args.stream_interval / 1e3
    chosen = {name: value for name, value in (("replicas", args.replicas), ("target_ongoing", args.target_ongoing),
                                             ("stream_interval", interval)) if value is not None}
    options = RayOptions(model=args.model or "", min_replicas=args.min_replicas, max_replicas=args.max_replicas,
                         threads=args.threads, parallel=args.parallel, ctx_len=args.ctx_len, max_queue=args.max_queue,
                         backend=args.backend, prefill_chunk=args.prefill_chunk, store=args.store, pull=args.pull,
                         affinity=args.affinity, api_key=args.api_key, cors=args.cors, allowed_hosts=args.allowed_hosts,
                         host=args.host, port=args.port, kv_cache=args.kv_cache, max_loaded=args.max_loaded,
                         max_body_bytes=parse_size(args.max_body_bytes, "--max-body-bytes"),
                         max_upload_bytes=parse_size(args.max_upload_bytes, "--max-upload-bytes"), **chosen)
    options.check()
    return options


def serve_on_ray(args) -> int:
    """`kiln serve MODEL --ray [ADDRESS]`: the Ray Serve application, until SIGINT or SIGTERM."""
    import signal
    from dataclasses import asdict

    import ray
    import uvicorn
    from ray import serve

    from kiln.errors import KilnError
    from kiln.ray import KilnFront, build, build_replicas

    address = None if args.ray == "local" else args.ray
    if address is not None and address != "auto" and ":" not in address:
        raise KilnError(f"--ray {address!r} is not a Ray address (HOST:PORT, auto or ray://HOST:PORT); "
                        "name the model before --ray")
    if address is not None and not args.model:
        raise KilnError(f"--ray took {address!r} as the cluster's address, and no model is named: name the model "
                        "before --ray")
    options = ray_options(args)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    loopback = args.host in ("127.0.0.1", "localhost", "::1")
    # a new local instance listens where the server does: only on loopback unless --host says otherwise
    local = {"_node_ip_address": "127.0.0.1"} if address is None and loopback else {}
    if address is None:
        local["_system_config"] = {"enable_metrics_collection": False}  # no dashboard reads Ray's own metrics
        for name, value in QUIET_LOCAL_RAY.items():  # read by the processes ray.init starts
            os.environ.setdefault(name, value)
    ray.init(address=address, include_dashboard=False, logging_level=args.log_level.upper(),
             log_to_driver=args.log_level == "debug", **local)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM stops it as SIGINT does, cleaned up below
    try:
        if args.ray_proxy:
            serve.start(http_options={"host": args.host, "port": args.port})
            serve.run(build(options), name="kiln", route_prefix="/")
        else:  # no Ray HTTP proxy: this process answers HTTP and calls the replicas (kiln.ray.KilnFront)
            serve.start(proxy_location="Disabled")
            replicas = serve.run(build_replicas(options), name="kiln", route_prefix=None)
            server = uvicorn.Server(uvicorn.Config(KilnFront(replicas, asdict(options)), host=args.host,
                                                   port=args.port, log_level=args.log_level, lifespan="off",
                                                   timeout_graceful_shutdown=GRACE_S))
        print(f"kiln serving {options.model} from Ray on http://{args.host}:{args.port} (OpenAI: /v1, "
              "Anthropic: /v1/messages, Ollama: /api)", file=sys.stderr)
        if args.ray_proxy:
            while True:
                signal.pause()  # until SIGINT or SIGTERM
        server.run()  # until SIGINT or SIGTERM, which uvicorn takes over while it runs
    except KeyboardInterrupt:
        pass
    finally:
        if address is not None:  # a cluster kiln did not start keeps running, without kiln's application
            serve.delete("kiln")
        ray.shutdown()  # a local instance stops with it, replicas and all
    return 0


def _listed(value: str | None) -> list[str]:
    return [item.strip() for item in (value or "").split(",") if item.strip()]


_SIZE = re.compile(r"(\d+)\s*([KMG]?)i?B?", re.I)


def parse_size(text: str, option: str) -> int:
    """"8M" → 8 MiB: a byte count, or one with a binary K, M or G."""
    from kiln.errors import KilnError

    match = _SIZE.fullmatch(str(text).strip())
    if not match or int(match.group(1)) < 1:
        raise KilnError(f"{option} must be a positive size such as 8M or 1048576, not {text!r}")
    return int(match.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[match.group(2).upper()]
