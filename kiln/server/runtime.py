"""The one generation path behind both APIs, and the loaded model's lifecycle.

`Runtime.start(job)` resolves and (re)loads the model, renders and tokenizes the prompt, builds the
sequence and submits it to the scheduler; anything wrong with the request raises there, before a response
starts. The returned `Generation` yields `Delta`s as the engine thread releases text, then one `Final`.
`Runtime.embed` runs texts as prompts through the same scheduler and returns their final hidden states.

One model is loaded at a time. A request for another waits for the running requests to finish, then the
models are swapped (as Ollama does). An idle model is unloaded when its keep-alive runs out.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

import numpy as np

from kiln.engine.scheduler import Embedded, Finished, Request, Scheduler, Token
from kiln.engine.request import GenerationRequest, prepare, token_ids
from kiln.engine.sequence import Sequence
from kiln.engine.speculative import ModelDrafter, SpecOptions
from kiln.errors import ContextLengthError, KilnError, ModelNotFoundError, RequestError
from kiln.server.metrics import Metrics
from kiln.tools import ToolCall, ToolCallParser

if TYPE_CHECKING:
    from kiln.engine.model import Model
    from kiln.store import ModelRecord

log = logging.getLogger("kiln.server")

DEFAULT = "default"  # a keep_alive that means the server's --keep-alive


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
    draft_model: str | None = None  # loaded beside every model, to draft for it (mode "model")


@dataclass
class Job:
    """A generation request on the server: what to generate (in kiln's terms), with which model, and for
    whom; openai.py, responses.py and ollama.py translate into this."""

    api: str  # "openai" or "ollama", for metrics
    model: str
    request: GenerationRequest
    keep_alive: float | None | str = DEFAULT  # seconds; None: forever


@dataclass
class Delta:
    text: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)


@dataclass
class Final:
    model: str
    seq: Sequence
    finish_reason: str  # stop, length, tool_calls, invalid_tool_call, cancelled, error
    text: str  # all content released (tool-call text excluded)
    tool_calls: list[ToolCall]
    tool_error: str | None
    error: str | None  # the engine failed this request

    @property
    def timings(self):
        return self.seq.timings


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
        self.pull_lock = asyncio.Lock()  # one pull at a time: progress is read off the store's staging folder

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
        from kiln.store import looks_like_path

        if self.loaded is not None and name == self.loaded.tag and not self.loaded.stale:
            return self.loaded.record
        if not name.strip():
            raise ModelNotFoundError("model is required: name an installed model (GET /api/tags lists them)")
        if looks_like_path(name) and not allow_path:  # clients may not open files on the server's disk
            raise ModelNotFoundError(f"model {name!r} not found; name an installed model, not a file path")
        return await asyncio.to_thread(self.store.resolve, name)

    async def acquire(self, name: str, allow_path: bool = False) -> Loaded:
        """The loaded model `name` means, loading or swapping it in; release() it when done."""
        record = await self.resolve(name, allow_path)
        async with self._switch:
            if self.loaded is None or self.loaded.tag != record.tag or self.loaded.stale:
                if self.loaded is not None:
                    async with self._idle:
                        await self._idle.wait_for(lambda: self.loaded.active == 0)
                    await self._unload()
                await self._load(record)
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

    async def preload(self, name: str, keep_alive=DEFAULT, allow_path: bool = False) -> Loaded:
        loaded = await self.acquire(name, allow_path)
        await self.release(loaded, keep_alive)
        return loaded

    async def unload(self, tag: str | None = None) -> bool:
        """Unload the model (only if it is `tag`) once its requests are done; False if it was not loaded."""
        async with self._switch:
            if self.loaded is None or (tag is not None and self.loaded.tag != tag):
                return False
            async with self._idle:
                await self._idle.wait_for(lambda: self.loaded.active == 0)
            await self._unload()
            return True

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

    async def _load(self, record) -> None:
        from kiln.engine.model import load

        s = self.settings
        self.loading = record.tag
        try:
            ref = str(record.path) if record.sha256 is None else record.tag
            model = await asyncio.to_thread(load, ref, backend=s.backend, n_ctx=s.ctx_len, n_slots=s.parallel,
                                            threads=s.threads, store=self.store, progress=False)
            drafter = None
            if s.draft_model:
                try:
                    drafter = await asyncio.to_thread(load_drafter, s.draft_model, model, s, self.store)
                except BaseException:
                    model.close()
                    raise
        finally:
            self.loading = None
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

    # --- generation --------------------------------------------------------------------------------------
    async def start(self, job: Job) -> Generation:
        t0 = time.perf_counter()
        loaded = await self.acquire(job.model)
        try:
            load_ms = (time.perf_counter() - t0) * 1e3
            seq, parser = await asyncio.to_thread(prepare, loaded.model, job.request, loaded.drafter,
                                                  self.settings.speculative)
            seq.timings.load_ms = load_ms
            generation = Generation(self, loaded, job, seq, parser)
            loaded.scheduler.submit(generation.request)
        except BaseException as e:
            self.metrics.rejected.labels(type(e).__name__).inc()
            await self.release(loaded, job.keep_alive)
            raise
        return generation

    async def embed(self, api: str, model: str, inputs: list, keep_alive=DEFAULT, param: str = "input") -> Embeddings:
        """Each input's final hidden state, computed as prompts through the scheduler, so embeddings share
        the engine's steps with running generations (and its prompt cache). Inputs go in as many at a
        time as there are KV slots, so a long list never fills the request queue."""
        t0 = time.perf_counter()
        loaded = await self.acquire(model)
        loop, vectors, requests, futures = asyncio.get_running_loop(), [], [], []
        try:
            load_ms = (time.perf_counter() - t0) * 1e3
            ids = await asyncio.to_thread(embedding_ids, loaded.model, inputs, param)
            window = loaded.scheduler.n_slots
            for first in range(0, len(ids), window):
                requests, futures = [], []
                for tokens in ids[first : first + window]:
                    futures.append(loop.create_future())
                    seq, _ = prepare(loaded.model, GenerationRequest(prompt=tokens, embed=True))
                    requests.append(Request(seq, partial(_embedding_sink, loop, futures[-1]), embed=True))
                    loaded.scheduler.submit(requests[-1])
                vectors += await asyncio.gather(*futures)
        except BaseException as e:
            self.metrics.rejected.labels(type(e).__name__).inc()
            raise
        finally:
            for req, future in zip(requests, futures):  # a client gone, or a sibling input rejected: free their slots
                future.cancel()
                loaded.scheduler.cancel(req)
            await self.release(loaded, keep_alive)
        self.metrics.embedding_inputs.labels(api).inc(len(ids))
        self.metrics.prompt_tokens.inc(sum(map(len, ids)))
        return Embeddings(loaded.tag, vectors, sum(map(len, ids)), load_ms, (time.perf_counter() - t0) * 1e3)


def _embedding_sink(loop, future, event) -> None:  # on the engine thread
    def deliver():
        if future.done():
            return
        if isinstance(event, Embedded):
            future.set_result(event.vector)
        elif isinstance(event, Finished):
            future.set_exception(KilnError(event.error or "the embedding request was cancelled"))

    try:
        loop.call_soon_threadsafe(deliver)
    except RuntimeError:  # the event loop has closed: the server is shutting down
        pass


@dataclass
class Embeddings:
    tag: str
    vectors: list[np.ndarray]  # one per input: its last token's final hidden state, not normalized
    prompt_tokens: int
    load_ms: float
    total_ms: float


def unit_vectors(vectors: list[np.ndarray], dimensions: int | None, param: str = "dimensions") -> list[np.ndarray]:
    """Embeddings as both APIs return them: length 1, each first cut to its first `dimensions` values when
    asked (as OpenAI's `dimensions` does)."""
    if dimensions is not None and vectors and dimensions > vectors[0].size:
        raise RequestError(f"{param} is {dimensions} but the model's embeddings have {vectors[0].size}", param)
    out = []
    for v in vectors:
        v = v[:dimensions].astype(np.float32)
        norm = float(np.linalg.norm(v))
        out.append(v / norm if norm > 0 else v)
    return out


def embedding_ids(model, inputs: list, param: str) -> list[list[int]]:
    """Token ids of each input (text, or ids already), checked: none empty, none longer than the context."""
    tok, n_ctx = model.tokenizer, model.n_ctx
    out = []
    for i, item in enumerate(inputs):
        where = f"{param}[{i}]" if len(inputs) > 1 else param
        ids = token_ids(item, tok.vocab_size, where) if isinstance(item, list) else tok.encode(item)
        if not ids:
            raise RequestError(f"{where} is empty", where)
        if len(ids) > n_ctx:
            raise ContextLengthError(f"{where} is {len(ids)} tokens but the context holds {n_ctx}; "
                                     "kiln does not truncate inputs", where)
        out.append(ids)
    return out


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


class Generation:
    """One request in flight: engine events in, `Delta`s and a `Final` out. Accounting (metrics, releasing
    the model) happens when the engine retires the request, whether or not anyone still reads the events."""

    def __init__(self, runtime: Runtime, loaded: Loaded, job: Job, seq: Sequence, parser: ToolCallParser | None):
        self.runtime, self.loaded, self.job, self.seq, self.parser = runtime, loaded, job, seq, parser
        self.request = Request(seq, self._sink)
        self._loop = asyncio.get_running_loop()
        self._events: asyncio.Queue = asyncio.Queue()
        self._done = False
        self._text: list[str] = []
        self._calls: list[ToolCall] = []

    def _sink(self, event: Token | Finished) -> None:  # on the engine thread
        try:
            self._loop.call_soon_threadsafe(self._deliver, event)
        except RuntimeError:  # the event loop has closed: the server is shutting down
            pass

    def _deliver(self, event: Token | Finished) -> None:
        self._events.put_nowait(event)
        if isinstance(event, Finished):
            self._done = True
            self._loop.create_task(self._account())

    def cancel(self) -> None:
        if not self._done:
            self.loaded.scheduler.cancel(self.request)

    async def watch(self, http_request) -> None:
        """Cancel when the client disconnects. The body is read by now, so the next ASGI message that
        arrives is the disconnect (or the one sent once the response is complete)."""
        while (await http_request.receive())["type"] != "http.disconnect":
            pass
        self.cancel()

    async def events(self, http_request=None):
        """Deltas as text is released, then the Final. Leaving early (the client is gone) cancels."""
        watcher = asyncio.create_task(self.watch(http_request)) if http_request is not None else None
        try:
            while True:
                event = await self._events.get()
                if isinstance(event, Token):
                    delta = self._delta(self.parser.feed(event.text) if self.parser else [event.text])
                    if event.logprob is not None:
                        delta.logprobs.append(event.logprob)
                    if delta.text or delta.tool_calls or delta.logprobs:
                        yield delta
                    continue
                if self.parser is not None:
                    delta = self._delta(self.parser.close())
                    if delta.text or delta.tool_calls:
                        yield delta
                yield self._final(event)
                return
        finally:
            if watcher is not None:
                watcher.cancel()
            self.cancel()

    async def collect(self, http_request=None) -> tuple[list[dict], Final]:
        """The whole answer: the logprob records, and the Final with the text and tool calls."""
        logprobs: list[dict] = []
        async for event in self.events(http_request):
            if isinstance(event, Final):
                final = event
            else:
                logprobs += event.logprobs
        return logprobs, final

    def _delta(self, items: list) -> Delta:
        delta = Delta()
        for item in items:
            if isinstance(item, ToolCall):
                delta.tool_calls.append(item)
            else:
                delta.text += item
        self._text.append(delta.text)
        self._calls += delta.tool_calls
        return delta

    def _final(self, event: Finished) -> Final:
        errors = self.parser.errors if self.parser else []
        reason = self.seq.finish_reason
        if event.error:
            reason = "error"
        elif reason != "cancelled" and self._calls:
            reason = "tool_calls"
        elif reason == "stop" and errors:
            reason = "invalid_tool_call"
        return Final(self.loaded.tag, self.seq, reason, "".join(self._text), self._calls,
                     "; ".join(errors) or None, event.error)

    async def _account(self) -> None:
        t = self.seq.timings
        self.runtime.metrics.observe(self.job.api, self.seq.finish_reason, t)
        await self.runtime.release(self.loaded, self.job.keep_alive)
        log.info("%s %s: %d prompt tokens (%d cached), %d generated; queue %.0f ms, TTFT %.0f ms, "
                 "decode %.1f tok/s; %s", self.job.api, self.loaded.tag, t.prompt_tokens, t.cached_tokens,
                 t.completion_tokens, t.queue_ms, t.ttft_ms, t.decode_tps, self.seq.finish_reason)


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
    return None if seconds < 0 else seconds
