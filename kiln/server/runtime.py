"""The loaded models' lifecycle, which every API shares: resolving a name, loading, evicting, keeping
alive and unloading. generation.py runs generation requests on it, embeddings.py embedding requests.

Up to `max_loaded` models stay loaded at once (as Ollama keeps several). A request for a loaded model
takes it at once, whatever the others are doing; one for a model not loaded loads it, first evicting the
least recently used idle models while the count or the memory the loaded ones take (validate's footprint
of each, against `max_memory` and MemAvailable) leaves it no room. A request for another context length
(Ollama's num_ctx) reloads that model once its own requests finish, with its slots planned at that length.
Each idle model is unloaded when its own keep-alive runs out.

The models' engines share one native thread pool and take their steps through one `Turns`: a model alone
with work steps on all the cores; while several have work, each steps on a thread of its own
(docs/ARCHITECTURE.md, "The server").
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kiln.chat import warm as warm_renderer
from kiln.engine.scheduler import QueueFullError, Scheduler, Turns
from kiln.engine.speculative import ModelDrafter, SpecOptions
from kiln.errors import Field, ModelNotFoundError, RequestError
from kiln.server.metrics import Metrics

if TYPE_CHECKING:
    from kiln.engine.model import Model
    from kiln.store import ModelRecord

log = logging.getLogger("kiln.server")

DEFAULT = "default"  # a keep_alive that means the server's --keep-alive
SWAP_WAIT_S = 300.0  # the longest a request waits for other requests to finish before its model can load


def favour_engine_thread() -> None:
    """The engine thread needs the GIL for a moment between native steps; with Python's default 5 ms switch
    interval it can wait that long behind the event loop (or a host's own threads), a large share of a token."""
    sys.setswitchinterval(0.0005)


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
    max_loaded: int = 3  # models loaded at once
    max_memory: int | None = None  # bytes the loaded models' footprints may take together; None: no cap but RAM's


@dataclass(eq=False)
class Loaded:
    model: Model
    scheduler: Scheduler
    record: ModelRecord
    expires_at: float | None = None  # wall clock; None while busy or when kept forever
    active: int = 0
    drafter: ModelDrafter | None = None  # the server's --draft-model, loaded for this model
    stale: bool = False  # its tag now names other weights (kiln create): swapped out at the next request
    footprint: int = 0  # bytes validate's estimate says it takes (its drafter's included)
    last_used: float = 0.0  # monotonic time it was last taken or released: the eviction order
    retiring: bool = False  # being unloaded or reloaded once its requests finish: no new ones take it

    @property
    def tag(self) -> str:
        return self.record.tag


class Runtime:
    def __init__(self, settings: Settings, store=None):
        from kiln.store import Store

        self.settings = settings
        self.store = store or Store()
        self.models: dict[str, Loaded] = {}  # by tag
        self.loading: str | None = None  # the tag being loaded, for /health
        self.metrics = Metrics(self.stats)
        self._switch = asyncio.Lock()  # one load (and the evictions that make its room) at a time
        self._idle = asyncio.Condition()  # notified when a request releases its model, or a model unloads
        self._expiry = asyncio.Event()  # wakes the reaper early (keep_alive 0)
        self._turns = Turns()  # how the loaded models' engine steps share the pool's threads
        self._pool = None  # the native thread pool every engine steps on, made by the first one loaded
        self.pull_lock = asyncio.Lock()  # one pull at a time, as Ollama runs them

    # --- models ----------------------------------------------------------------------------------------
    @property
    def loaded(self) -> Loaded | None:
        """The model used last (what llama-server's one-model endpoints describe); None when none is loaded."""
        return max(self.models.values(), key=lambda m: m.last_used, default=None)

    def stats(self) -> dict:
        """The schedulers' running/waiting/KV numbers, summed over the loaded models."""
        total = {"running": 0, "waiting": 0, "kv_used": 0, "kv_capacity": 0, "kv_cached": 0}
        for loaded in list(self.models.values()):
            for key, value in loaded.scheduler.stats().items():
                total[key] += value
        return total

    async def installed(self) -> list:
        """Usable installed models, plus loaded ones the server was started with as a .gguf path."""
        records = [r for r in await asyncio.to_thread(self.store.installed) if not r.problem]
        tags = {r.tag for r in records}
        records += [m.record for m in self.models.values() if m.tag not in tags]
        return records

    async def resolve(self, name: str, allow_path: bool = False):
        """The store record `name` means: an installed tag, or the model the server was started with."""
        from kiln.store import MAX_TAG_CHARS, looks_like_path

        if len(name) > MAX_TAG_CHARS:
            raise RequestError(f"model: a name of {len(name)} characters is too long (at most {MAX_TAG_CHARS})", "model")

        loaded = self.models.get(name)
        if loaded is not None and not loaded.stale:
            return loaded.record
        if not name.strip():
            raise ModelNotFoundError("model is required: name an installed model (GET /api/tags lists them)")
        if looks_like_path(name) and not allow_path:  # clients may not open files on the server's disk
            raise ModelNotFoundError(f"model {name!r} not found; name an installed model, not a file path")
        return await asyncio.to_thread(self.store.resolve, name)

    async def acquire(self, name: str, allow_path: bool = False, n_ctx: int | None = None) -> Loaded:
        """The loaded model `name` means, loading it (evicting idle ones to make room) when it is not;
        release() it when done. `n_ctx`: the context length its slots must have (reloaded at it when they
        have another); None: as loaded. A loaded model is taken without waiting on anything."""
        record = await self.resolve(name, allow_path)
        if n_ctx is not None:
            await self._check_context(record, n_ctx)
        if (loaded := self._usable(record.tag, n_ctx)) is not None:
            return self._take(loaded)
        async with self._switch:
            if (loaded := self._usable(record.tag, n_ctx)) is not None:  # loaded while this one waited
                return self._take(loaded)
            old = self.models.get(record.tag)
            if old is not None:  # other weights or another context: reloaded once its own requests finish
                await self._retire(old, f"{record.tag} cannot be reloaded yet")
            self.loading = record.tag  # /health: 503 while it loads, not while it waits for room
            try:
                need = await self._footprint(record, n_ctx)
                self.loading = None
                await self._make_room(record.tag, need)
                self.loading = record.tag
                return self._take(await self._load(record, n_ctx, need))
            finally:
                self.loading = None

    def _usable(self, tag: str, n_ctx: int | None) -> Loaded | None:
        loaded = self.models.get(tag)
        if loaded is None or loaded.stale or loaded.retiring or n_ctx is not None and n_ctx != loaded.model.n_ctx:
            return None
        return loaded

    @staticmethod
    def _take(loaded: Loaded) -> Loaded:
        loaded.active += 1
        loaded.expires_at = None
        loaded.last_used = time.monotonic()
        return loaded

    async def release(self, loaded: Loaded, keep_alive) -> None:
        loaded.active -= 1
        loaded.last_used = time.monotonic()
        if loaded.active == 0:
            seconds = self.settings.keep_alive if keep_alive == DEFAULT else keep_alive
            loaded.expires_at = None if seconds is None else time.time() + seconds
            self._expiry.set()
        async with self._idle:
            self._idle.notify_all()

    def refresh(self, record) -> None:
        """A tag was (re)created: when it is loaded, later requests get its new system message, defaults and
        stop strings; the weights are the same file."""
        loaded = self.models.get(record.tag)
        if loaded is None:
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
        """Unload the model `tag` (every model: None) once its requests are done; False if none was loaded."""
        targets = [m for m in self.models.values() if tag is None or m.tag == tag]
        for loaded in targets:
            await self._retire(loaded, "it cannot be unloaded yet")
        return bool(targets)

    async def _retire(self, loaded: Loaded, consequence: str) -> None:
        """Unload `loaded` once its requests finish, no new one taking it meanwhile; if the wait fails
        (SWAP_WAIT_S, or the caller left) it stays loaded and usable."""
        loaded.retiring = True
        try:
            await self._until_idle(loaded, consequence)
        except BaseException:
            loaded.retiring = False
            raise
        await self._unload(loaded)

    async def _until_idle(self, loaded: Loaded, consequence: str) -> None:
        """Wait for `loaded`'s requests to finish, but not for ever: past SWAP_WAIT_S the one waiting is
        told to retry (503)."""
        async with self._idle:
            try:
                await asyncio.wait_for(self._idle.wait_for(lambda: loaded.active == 0), SWAP_WAIT_S)
            except asyncio.TimeoutError:
                raise QueueFullError(f"{loaded.tag} is still answering {loaded.active} request(s) after "
                                     f"{SWAP_WAIT_S:g} s, so {consequence}; try again later") from None

    def _fits(self, need: int) -> bool:
        """Whether a model of footprint `need` may load beside the loaded ones: under --max-loaded, their
        footprints and its own within --max-memory, and its own within what the machine has available."""
        from kiln.machine import mem_available_bytes

        if not self.models:
            return True  # alone it loads whatever the estimate (an upper bound) says, as it always has
        if len(self.models) >= self.settings.max_loaded:
            return False
        budget = self.settings.max_memory
        if budget is not None and sum(m.footprint for m in self.models.values()) + need > budget:
            return False
        available = mem_available_bytes()
        return available is None or need <= available

    async def _make_room(self, tag: str, need: int) -> None:
        """Evict idle models, least recently used first, until a model of footprint `need` fits; while the
        only ones left are busy, wait for one to go idle (at most SWAP_WAIT_S, then 503)."""
        deadline = time.monotonic() + SWAP_WAIT_S
        while not self._fits(need):
            idle = [m for m in self.models.values() if m.active == 0]
            if idle:
                victim = min(idle, key=lambda m: m.last_used)
                log.info("evicting %s (idle, least recently used) to make room for %s", victim.tag, tag)
                await self._unload(victim)
                continue
            async with self._idle:
                try:
                    await asyncio.wait_for(self._idle.wait(), max(deadline - time.monotonic(), 0))
                except asyncio.TimeoutError:
                    busy = ", ".join(f"{m.tag} ({m.active})" for m in self.models.values())
                    raise QueueFullError(f"{tag} does not fit beside the loaded models, which are still answering "
                                         f"requests after {SWAP_WAIT_S:g} s ({busy}); try again later") from None

    async def _footprint(self, record, n_ctx: int | None) -> int:
        """validate's estimate of what loading `record` (and the server's drafter beside it) allocates; the
        GGUF files' sizes where the native core, which the estimate is of, is not built."""
        s = self.settings
        refs = [str(record.path), *([s.draft_model] if s.draft_model else [])]
        total = 0
        for ref in refs:
            total += await asyncio.to_thread(model_footprint, ref, n_ctx or s.ctx_len, s.parallel, self.store, s.kv_cache)
        return total

    async def reap(self) -> None:
        """Unload each idle model whose own keep-alive ran out; runs for the app's lifetime."""
        while True:
            delay = 1.0
            for loaded in list(self.models.values()):
                if loaded.active or loaded.expires_at is None or loaded.retiring:
                    continue
                left = loaded.expires_at - time.time()
                if left <= 0:
                    await self._unload(loaded)
                else:
                    delay = min(delay, left)
            self._expiry.clear()
            try:
                await asyncio.wait_for(self._expiry.wait(), timeout=max(delay, 0.05))
            except asyncio.TimeoutError:
                pass

    async def close(self) -> None:
        for loaded in list(self.models.values()):
            await self._unload(loaded)

    async def _check_context(self, record, n_ctx: int) -> None:
        """A requested context length must fit the server's maximum: --ctx-len, else the model's own."""
        loaded = self.models.get(record.tag)
        if loaded is not None and loaded.record is record:
            trained = loaded.model.config.context_length
        else:
            trained = await asyncio.to_thread(trained_context, record)
        most = min(self.settings.ctx_len or trained, trained)
        if not 1 <= n_ctx <= most:
            where = "the server's --ctx-len" if most < trained else f"the context {record.tag} was trained for"
            raise RequestError((Field("num_ctx"), f" is {n_ctx}, outside 1..{most} ({where})"), "num_ctx")

    async def _load(self, record, n_ctx: int | None, footprint: int) -> Loaded:
        from kiln.engine.model import load

        s = self.settings
        ref = str(record.path) if record.sha256 is None else record.tag
        model = await asyncio.to_thread(load, ref, backend=s.backend, n_ctx=n_ctx or s.ctx_len, n_slots=s.parallel,
                                        threads=s.threads, store=self.store, progress=False, pool=self._pool,
                                        kv_cache=s.kv_cache)
        self._pool = self._pool or model.engine.pool
        drafter = None
        if s.draft_model:
            try:
                drafter = await asyncio.to_thread(load_drafter, s.draft_model, model, s, self.store, self._pool)
            except BaseException:
                model.close()
                raise
        await asyncio.to_thread(warm_renderer)  # the first chat then finds a template worker waiting
        scheduler = Scheduler(model.engine, s.parallel, s.max_queue, s.prefill_chunk, self._turns)
        scheduler.start()
        loaded = self.models[record.tag] = Loaded(model, scheduler, record, drafter=drafter, footprint=footprint)
        self.metrics.loads.labels(record.tag).inc()
        log.info("loaded %s (%s engine, %d slots of %d tokens, ~%.0f MiB) in %.0f ms; %d model(s) loaded",
                 record.tag, model.engine.name, s.parallel, model.n_ctx, footprint / 2**20, model.load_ms,
                 len(self.models))
        if drafter is not None:
            log.info("drafting for %s with %s (%.0f ms to load)", record.tag, drafter.model.tag,
                     drafter.model.load_ms)
        return loaded

    async def _unload(self, loaded: Loaded) -> None:
        if self.models.get(loaded.tag) is not loaded:  # another caller is unloading it already
            return
        del self.models[loaded.tag]  # before any await: no request takes it from here on
        await asyncio.to_thread(loaded.scheduler.stop)
        await asyncio.to_thread(self._close, loaded)
        log.info("unloaded %s", loaded.tag)
        async with self._idle:  # room for a load waiting in _make_room
            self._idle.notify_all()

    def _close(self, loaded: Loaded) -> None:
        # In a turn of its own: freeing a plan waits for the shared pool's workers to leave their job,
        # which another model's steps, run meanwhile, could keep them in.
        with self._turns:
            loaded.model.close()
            if loaded.drafter is not None:
                loaded.drafter.model.close()


def model_footprint(ref: str, n_ctx: int | None, n_slots: int, store, kv_cache: str | None = None) -> int:
    """validate's footprint of `ref` at `n_ctx` x `n_slots` with a `kv_cache` KV cache; its GGUF file's size
    without the native core."""
    from kiln.engine import native
    from kiln.validate import footprint

    if not native.available():
        return store.resolve(ref).path.stat().st_size
    return footprint(ref, n_ctx, n_slots, kv_cache)["total_bytes"]


def trained_context(record) -> int:
    """The context length a model's file says it was trained for."""
    from kiln.gguf import GGUFFile

    gguf = GGUFFile(record.path)
    try:
        return int(gguf.get(f"{gguf.architecture}.context_length", 0))
    finally:
        gguf.close()


def load_drafter(ref: str, target, settings: Settings, store, pool=None) -> ModelDrafter:
    """The draft model `ref`, loaded with the target's context and slots (and its thread pool), checked
    against its vocabulary."""
    from kiln.engine.model import load

    draft = load(ref, backend=settings.backend, n_ctx=target.n_ctx, n_slots=settings.parallel,
                 threads=settings.threads, store=store, progress=False, pool=pool)
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
