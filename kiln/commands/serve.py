"""`kiln serve`: the OpenAI and Ollama HTTP APIs, with continuous batching over --parallel KV slots."""

from __future__ import annotations

import logging
import os
import sys

from kiln.commands.run import add_draft_args, spec_from_args

DEFAULT_PORT = 11500


def register(sub) -> None:
    p = sub.add_parser("serve", help="serve OpenAI- and Ollama-compatible HTTP APIs",
                       description="Serve the OpenAI (/v1) and Ollama (/api) APIs, /health and /metrics. Models load "
                                   "on first request (or MODEL at startup) and unload after --keep-alive idle.")
    p.add_argument("model", nargs="?", help="load this model at startup, pulling it if needed (tag or .gguf path)")
    env = os.environ.get
    p.add_argument("--host", default=env("KILN_HOST", "127.0.0.1"), help="address to bind (env KILN_HOST; default 127.0.0.1)")
    p.add_argument("--port", type=int, default=env("KILN_PORT", str(DEFAULT_PORT)),
                   help=f"port (env KILN_PORT; default {DEFAULT_PORT})")
    p.add_argument("--api-key", default=env("KILN_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health (env KILN_API_KEY)")
    p.add_argument("--cors", action="append", metavar="ORIGIN", help="allow browser requests from ORIGIN (repeatable; * for any)")
    p.add_argument("--parallel", "-np", type=int, default=env("KILN_NUM_PARALLEL", "4"),
                   help="KV slots: requests decoded together (env KILN_NUM_PARALLEL; default 4)")
    p.add_argument("--ctx-len", "-c", type=int, default=env("KILN_CONTEXT_LENGTH"),
                   help="context length of each slot, and the most a request's num_ctx may ask for "
                        "(env KILN_CONTEXT_LENGTH; default: min(model's, 4096), and up to the model's own)")
    p.add_argument("--max-queue", type=int, default=env("KILN_MAX_QUEUE", "64"),
                   help="requests that may wait for a slot; more get 503 (env KILN_MAX_QUEUE; default 64)")
    p.add_argument("--keep-alive", default=env("KILN_KEEP_ALIVE", "5m"),
                   help="how long an idle model stays loaded: 5m, 1h, 0, -1 for forever (env KILN_KEEP_ALIVE; default 5m)")
    p.add_argument("--prefill-chunk", type=int, help="most prompt tokens computed per step (default: the engine's prefill batch)")
    p.add_argument("-t", "--threads", type=int, help="native threads (default: physical cores)")
    p.add_argument("--backend", default="auto", choices=["auto", "native", "oracle"], help="compute backend")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_draft_args(p)  # the defaults; a request may choose its own mode, max and ngram
    p.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    import uvicorn

    from kiln.errors import KilnError
    from kiln.server.app import create_app
    from kiln.server.runtime import Settings, parse_keep_alive
    from kiln.store import Store

    for name in ("parallel", "max_queue", "port"):
        if getattr(args, name) < (1 if name != "max_queue" else 0):
            raise KilnError(f"--{name.replace('_', '-')} must be {'at least 1' if name != 'max_queue' else '>= 0'}")
    if args.port > 65535:  # the socket layer would take it modulo 65536 and bind somewhere else
        raise KilnError(f"--port must be 1..65535, not {args.port}")
    if args.prefill_chunk is not None and args.prefill_chunk < 1:
        raise KilnError("--prefill-chunk must be at least 1")
    keep_alive = parse_keep_alive(args.keep_alive, "--keep-alive")
    settings = Settings(parallel=args.parallel, ctx_len=args.ctx_len, max_queue=args.max_queue, keep_alive=keep_alive,
                        threads=args.threads, backend=args.backend, prefill_chunk=args.prefill_chunk,
                        speculative=spec_from_args(args), draft_model=args.draft_model)
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

    app = create_app(settings, api_key=args.api_key, cors=args.cors, preload=args.model, store=store, on_fatal=fatal)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level))
    # The engine thread needs the GIL for a moment between native steps; with the default switch
    # interval (5 ms) it can wait that long behind the event loop, a large share of a token's time.
    sys.setswitchinterval(0.0005)
    print(f"kiln serving on http://{args.host}:{args.port} (OpenAI: /v1, Anthropic: /v1/messages, Ollama: /api, docs: /docs)", file=sys.stderr)
    server.run()
    if failures:
        raise KilnError(f"could not load {args.model}: {failures[0]}")
    return 0 if server.started else 1
