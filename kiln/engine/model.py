"""Loading a model: resolve the tag through the store, parse the GGUF, build tokenizer and engine."""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass, field
from pathlib import Path

from kiln.engine.interface import Engine
from kiln.errors import KilnError
from kiln.gguf import GGUFFile
from kiln.models import family_for
from kiln.models.base import ModelConfig
from kiln.tokenizer import Tokenizer

DEFAULT_CTX = 4096
BACKENDS = ("auto", "native", "oracle")


@dataclass
class Model:
    tag: str
    path: Path
    sha256: str
    gguf: GGUFFile
    config: ModelConfig
    tokenizer: Tokenizer
    engine: Engine
    n_ctx: int
    load_ms: float
    cache_dir: Path | None = None
    defaults: dict = field(default_factory=dict)  # sampling defaults: the catalog's, then the model's own
    system: str | None = None  # a created model's system message, used when a chat brings none
    stop: list[str] = field(default_factory=list)  # a created model's stop strings, used when a request has none

    def close(self) -> None:
        self.engine.close()
        self.gguf.close()


def load(ref: str, *, backend: str = "auto", n_ctx: int | None = None, n_slots: int = 1,
         threads: int | None = None, store=None, progress: bool = True, pool=None) -> Model:
    """Load a model by tag or GGUF path, pulling catalog tags that are not installed yet. `pool`: a native
    thread pool shared with other loaded models (the server's), instead of one of the engine's own."""
    from kiln.store import Store

    if backend not in BACKENDS:
        raise KilnError(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")
    t0 = time.perf_counter()
    store = store or Store()
    record = store.ensure(ref, progress=progress)
    cache_dir = store.cache_dir(record)
    gguf = GGUFFile(record.path)
    family = family_for(gguf)
    cfg = family.config
    n_ctx = min(cfg.context_length, DEFAULT_CTX) if n_ctx is None else n_ctx
    if not 1 <= n_ctx <= cfg.context_length:
        raise KilnError(f"context length {n_ctx} is outside 1..{cfg.context_length}, the most {record.tag} supports")
    tokenizer = Tokenizer.from_gguf(gguf, cache_dir=cache_dir)
    engine = make_engine(gguf, family, backend, n_ctx, n_slots, threads, cache_dir, record.sha256, pool)
    release_free_heap()
    load_ms = (time.perf_counter() - t0) * 1e3
    return Model(record.tag, Path(record.path), record.sha256, gguf, cfg, tokenizer, engine, n_ctx, load_ms,
                 cache_dir, record.sampling_defaults(), record.system, list(record.parameters.get("stop", [])))


def release_free_heap() -> None:
    """Hand freed heap pages back to the OS. Deserializing a tokenizer leaves freed buffers that glibc
    keeps resident, as much as a small model's KV cache (docs/PERF.md, "Host overhead, loading, memory")."""
    try:
        ctypes.CDLL(None).malloc_trim(0)  # the process's own symbols: libc's, without a library search
    except (OSError, AttributeError, TypeError):  # not glibc: nothing to trim
        pass


def make_engine(gguf, family, backend, n_ctx, n_slots, threads, cache_dir, gguf_sha256, pool=None) -> Engine:
    """The native core when it is built (or asked for), else the numpy oracle."""
    from kiln.engine import native
    from kiln.engine.oracle import OracleEngine

    if backend == "oracle" or (backend == "auto" and not native.available()):
        return OracleEngine(gguf, family, n_ctx=n_ctx, n_slots=n_slots)
    return native.NativeEngine(gguf, family, n_ctx=n_ctx, n_slots=n_slots, threads=threads, cache_dir=cache_dir,
                               gguf_sha256=gguf_sha256, pool=pool)
