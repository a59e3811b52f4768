"""The loaded model's lifecycle, which both APIs share: resolving a name, loading, swapping, keeping
alive and unloading. generation.py runs generation requests on it, embeddings.py embedding requests.

One model is loaded at a time. A request for another waits for the running requests to finish, then the
models are swapped (as Ollama does). A request for another context length (Ollama's num_ctx) reloads
the model the same way, with its slots planned at that length. An idle model is unloaded when its
keep-alive runs out.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kiln.chat import warm as warm_renderer
from kiln.engine.scheduler import QueueFullError, Scheduler
from kiln.engine.speculative import ModelDrafter, SpecOptions
from kiln.errors import Field, ModelNotFoundError, RequestError
from kiln.server.metrics import Metrics

if TYPE_CHECKING:
    from kiln.engine.model import Model
    from kiln.store import ModelRecord

log = logging.getLogger("kiln.server")

DEFAULT = "default"  # a keep_alive that means the server's --keep-alive
SWAP_WAIT_S = 300.0  # the longest a request waits for another model's requests to finish


@dataclass
class Settings:
    parallel: int = 4
    ctx_len: int | None = None
    max_queue: int = 64
    keep_alive: float | None = 300.0  # seconds an idle model stays loaded; None: forever
    threads: int | None = None
    backend: str = "auto"
    prefill_chunk: int | None = None
    speculative: SpecOptions = field(default_factory=SpecOptions)  # what requests that do not say get
    kv_cache: str | None = None  # the KV cache's type (None: KILN_KV_CACHE_TYPE, else f16)
    draft_model: str | None = None  # loaded beside every model, to draft for it (mode "model")


@dataclass(eq=False)
class Loaded:
    model: Model
    scheduler: Scheduler
    record: ModelRecord
    expires_at: float | None = None  # wall clock; None while busy or when kept forever
    active: int = 0
    drafter: ModelDrafter | None = None  # the server's --draft-model, loaded for this model
    stale: bool = False  # its tag now names other weights (kiln create): swapped out at the next request

    @property
    def tag(self) -> str:
        return self.record.tag


class Runtime:
    def __init__(self, settings: Settings, store=None):
        from kiln.store import Store

        self.settings = settings
        self.store = store or Store()
        self.loaded: Loaded | None = None
        self.loading: str | None = None  # the tag being loaded, for /health
        self.metrics = Metrics(self.stats)
        self._switch = asyncio.Lock()  # one load, unload or swap at a time
        self._idle = asyncio.Condition()  # notified when a request releases its model
        self._expiry = asyncio.Event()  # wakes the reaper early (keep_alive 0)
        self.pull_lock = asyncio.Lock()  # one pull at a time, as Ollama runs them

    # --- models ----------------------------------------------------------------------------------------
    def stats(self) -> dict:
        if self.loaded is None:
            return {"running": 0, "waiting": 0, "kv_used": 0, "kv_capacity": 0, "kv_cached": 0}
        return self.loaded.scheduler.stats()

    async def installed(self) -> list:
        """Usable installed models, plus the loaded one when the server was started with a .gguf path."""
        records = [r for r in await asyncio.to_thread(self.store.installed) if not r.problem]
        if self.loaded is not None and self.loaded.tag not in {r.tag for r in records}:
            records.append(self.loaded.record)
        return records

    async def resolve(self, name: str, allow_path: bool = False):
        """The store record `name` means: an installed tag, or the model the server was started with."""
        from kiln.store import MAX_TAG_CHARS, looks_like_path

        if len(name) > MAX_TAG_CHARS:
            raise RequestError(f"model: a name of {len(name)} characters is too long (at most {MAX_TAG_CHARS})", "model")

        if self.loaded is not None and name == self.loaded.tag and not self.loaded.stale:
            return self.loaded.record
        if not name.strip():
            raise ModelNotFoundError("model is required: name an installed model (GET /api/tags lists them)")
        if looks_like_path(name) and not allow_path:  # clients may not open files on the server's disk
            raise ModelNotFoundError(f"model {name!r} not found; name an installed model, not a file path")
        return await asyncio.to_thread(self.store.resolve, name)

    async def acquire(self, name: str, allow_path: bool = False, n_ctx: int | None = None) -> Loaded:
        """The loaded model `name` means, loading or swapping it in; release() it when done. `n_ctx`: the
        context length its slots must have (reloaded at it when they have another); None: as loaded."""
        record = await self.resolve(name, allow_path)
        if n_ctx is not None:
            await self._check_context(record, n_ctx)
        async with self._switch:
            loaded = self.loaded
            if loaded is None or loaded.tag != record.tag or loaded.stale or \
                    n_ctx is not None and n_ctx != loaded.model.n_ctx:
                if loaded is not None:
                    await self._until_idle(f"{record.tag} cannot be loaded yet")
                    await self._unload()
                await self._load(record, n_ctx)
            self.loaded.active += 1
            self.loaded.expires_at = None
            return self.loaded

    async def release(self, loaded: Loaded, keep_alive) -> None:
        loaded.active -= 1
        if loaded.active == 0:
            seconds = self.settings.keep_alive if keep_alive == DEFAULT else keep_alive
            loaded.expires_at = None if seconds is None else time.time() + seconds
            self._expiry.set()
        async with self._idle:
            self._idle.notify_all()

    def refresh(self, record) -> None:
        """A tag was (re)created: when it is the loaded model, later requests get its new system message,
        defaults and stop strings; the weights are the same file."""
        loaded = self.loaded
        if loaded is None or loaded.tag != record.tag:
            return
        if record.sha256 != loaded.record.sha256:  # other weights under the same name: the next request reloads
            loaded.stale = True
            return
        model = loaded.model
        model.defaults, model.system = record.sampling_defaults(), record.system
        model.stop = list(record.parameters.get("stop", []))
        loaded.record = record

    async def preload(self, name: str, keep_alive=DEFAULT, allow_path: bool = False, n_ctx: int | None = None) -> Loaded:
        loaded = await self.acquire(name, allow_path, n_ctx)
        await self.release(loaded, keep_alive)
        return loaded

    async def unload(self, tag: str | None = None) -> bool:
        """Unload the model (only if it is `tag`) once its requests are done; False if it was not loaded."""
        async with self._switch:
            if self.loaded is None or (tag is not None and self.loaded.tag != tag):
                return False
            await self._until_idle("it cannot be unloaded yet")
            await self._unload()
            return True

    async def _until_idle(self, consequence: str) -> None:
        """Wait for the loaded model's requests to finish, but not for ever: a swap holds every other
        request up, so past SWAP_WAIT_S the one waiting is told to retry (503)."""
        async with self._idle:
            try:
                await asyncio.wait_for(self._idle.wait_for(lambda: self.loaded.active == 0), SWAP_WAIT_S)
            except asyncio.TimeoutError:
                raise QueueFullError(f"{self.loaded.tag} is still answering {self.loaded.active} request(s) after "
                                     f"{SWAP_WAIT_S:g} s, so {consequence}; try again later") from None

    async def reap(self) -> None:
        """Unload an idle model whose keep-alive ran out; runs for the app's lifetime."""
        while True:
            loaded = self.loaded
            delay = 1.0
            if loaded is not None and loaded.active == 0 and loaded.expires_at is not None:
                delay = loaded.expires_at - time.time()
                if delay <= 0:
                    async with self._switch:
                        if self.loaded is loaded and loaded.active == 0 and loaded.expires_at is not None \
                                and loaded.expires_at <= time.time():
                            await self._unload()
                    continue
            self._expiry.clear()
            try:
                await asyncio.wait_for(self._expiry.wait(), timeout=min(max(delay, 0.05), 1.0))
            except asyncio.TimeoutError:
                pass

    async def close(self) -> None:
        async with self._switch:
            if self.loaded is not None:
                await self._unload()

    async def _check_context(self, record, n_ctx: int) -> None:
        """A requested context length must fit the server's maximum: --ctx-len, else the model's own."""
        loaded = self.loaded
        if loaded is not None and loaded.record is record:
            trained = loaded.model.config.context_length
        else:
            trained = await asyncio.to_thread(trained_context, record)
        most = min(self.settings.ctx_len or trained, trained)
        if not 1 <= n_ctx <= most:
            where = "the server's --ctx-len" if most < trained else f"the context {record.tag} was trained for"
            raise RequestError((Field("num_ctx"), f" is {n_ctx}, outside 1..{most} ({where})"), "num_ctx")

    async def _load(self, record, n_ctx: int | None = None) -> None:
        from kiln.engine.model import load

        s = self.settings
        self.loading = record.tag
        try:
            ref = str(record.path) if record.sha256 is None else record.tag
            model = await asyncio.to_thread(load, ref, backend=s.backend, n_ctx=n_ctx or s.ctx_len, n_slots=s.parallel,
                                            threads=s.threads, store=self.store, progress=False, kv_cache=s.kv_cache)
            drafter = None
            if s.draft_model:
                try:
                    drafter = await asyncio.to_thread(load_drafter, s.draft_model, model, s, self.store)
                except BaseException:
                    model.close()
                    raise
        finally:
            self.loading = None
        await asyncio.to_thread(warm_renderer)  # the first chat then finds a template worker waiting
        scheduler = Scheduler(model.engine, s.parallel, s.max_queue, s.prefill_chunk)
        scheduler.start()
        self.loaded = Loaded(model, scheduler, record, drafter=drafter)
        log.info("loaded %s (%s engine, %d slots of %d tokens) in %.0f ms", record.tag, model.engine.name,
                 s.parallel, model.n_ctx, model.load_ms)
        if drafter is not None:
            log.info("drafting for %s with %s (%.0f ms to load)", record.tag, drafter.model.tag,
                     drafter.model.load_ms)

    async def _unload(self) -> None:
        loaded, self.loaded = self.loaded, None
        await asyncio.to_thread(loaded.scheduler.stop)
        loaded.model.close()
        if loaded.drafter is not None:
            loaded.drafter.model.close()
        log.info("unloaded %s", loaded.tag)

def trained_context(record) -> int:
    """The context length a model's file says it was trained for."""
    from kiln.gguf import GGUFFile

    gguf = GGUFFile(record.path)
    try:
        return int(gguf.get(f"{gguf.architecture}.context_length", 0))
    finally:
        gguf.close()


def load_drafter(ref: str, target, settings: Settings, store) -> ModelDrafter:
    """The draft model `ref`, loaded with the target's context and slots, checked against its vocabulary."""
    from kiln.engine.model import load

    draft = load(ref, backend=settings.backend, n_ctx=target.n_ctx, n_slots=settings.parallel,
                 threads=settings.threads, store=store, progress=False)
    try:
        return ModelDrafter(draft, target)
    except BaseException:
        draft.close()
        raise


_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_keep_alive(value, param: str = "keep_alive") -> float | None:
    """Ollama's keep_alive: seconds, or a Go duration ("5m", "1h30m"); negative means forever (None)."""
    if isinstance(value, bool):
        raise RequestError(f"{param} must be a duration such as \"5m\" or a number of seconds", param)
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        text = str(value).strip()
        try:
            seconds = float(text)
        except ValueError:
            body = text.lstrip("+-")
            parts = _DURATION.findall(body)
            if not body or "".join(n + u for n, u in parts) != body:
                raise RequestError(f"{param} {value!r} is not a duration such as \"5m\", \"1h30m\" or \"-1\"",
                                   param) from None
            seconds = sum(float(n) * _UNITS[u] for n, u in parts) * (-1 if text.startswith("-") else 1)
    if not math.isfinite(seconds):
        raise RequestError(f"{param} {value!r} is not a finite duration; a negative one keeps the model loaded", param)
    return None if seconds < 0 else seconds
