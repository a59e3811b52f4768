"""A generation request on the server: the Job an API translates its request into, and the Generation
that streams the engine's events back as `Delta`s and one `Final`."""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from kiln.chat import ChatTemplateError
from kiln.engine.request import GenerationRequest, prepare
from kiln.engine.scheduler import Finished, Request, Token
from kiln.engine.sequence import Sequence
from kiln.errors import without_paths
from kiln.server.runtime import DEFAULT, Loaded, Runtime
from kiln.tools import OutputParser, Reasoning, ToolCall

log = logging.getLogger("kiln.server")


@dataclass
class Job:
    """A generation request on the server: what to generate (in kiln's terms), with which model, and for
    whom; openai.py, responses.py and ollama.py translate into this."""

    api: str  # "openai", "ollama", "anthropic" or "llamacpp", for metrics
    model: str
    request: GenerationRequest
    keep_alive: float | None | str = DEFAULT  # seconds; None: forever
    n_ctx: int | None = None  # the context length to run at (the model is reloaded at it); None: as loaded


@dataclass
class Delta:
    text: str = ""
    thinking: str = ""  # reasoning, when the model thinks
    tool_calls: list[ToolCall] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)


@dataclass
class Final:
    model: str
    seq: Sequence
    finish_reason: str  # stop, length, tool_calls, invalid_tool_call, cancelled, error
    text: str  # all content released (tool-call text excluded)
    thinking: str  # all reasoning released
    reasoning_tokens: int  # the tokens generated inside the reasoning block
    tool_calls: list[ToolCall]
    tool_error: str | None
    error: str | None  # the engine failed this request

    @property
    def timings(self):
        return self.seq.timings


@asynccontextmanager
async def borrowed(runtime: Runtime, name: str):
    """The loaded model `name`, held (loaded or swapped in) while a request reads its tokenizer or template."""
    loaded = await runtime.acquire(name)
    try:
        yield loaded
    finally:
        await runtime.release(loaded, DEFAULT)


async def start(runtime: Runtime, job: Job) -> Generation:
    """Load the model `job` names (or swap it in), prepare its sequence and queue it: anything wrong with
    the request raises here, before a response starts."""
    t0 = time.perf_counter()
    loaded = await runtime.acquire(job.model, n_ctx=job.n_ctx)
    try:
        load_ms = (time.perf_counter() - t0) * 1e3
        seq, parser = await asyncio.to_thread(prepare, loaded.model, job.request, loaded.drafter,
                                              runtime.settings.speculative)
        seq.timings.load_ms = load_ms
        generation = Generation(runtime, loaded, job, seq, parser)
        loaded.scheduler.submit(generation.request)
    except BaseException as e:
        runtime.metrics.rejected.labels(type(e).__name__).inc()
        await runtime.release(loaded, job.keep_alive)
        if isinstance(e, ChatTemplateError):  # the file's own name is the blob's; the client knows the tag
            raise ChatTemplateError(f"{loaded.tag}: {e}") from None
        raise
    return generation


async def until_disconnect(http_request) -> None:
    """Returns when the client disconnects. The body is read by now, so the next ASGI message that
    arrives is the disconnect (or the one sent once the response is complete)."""
    while (await http_request.receive())["type"] != "http.disconnect":
        pass


class Generation:
    """One request in flight: engine events in, `Delta`s and a `Final` out. Accounting (metrics, releasing
    the model) happens when the engine retires the request, whether or not anyone still reads the events."""

    def __init__(self, runtime: Runtime, loaded: Loaded, job: Job, seq: Sequence, parser: OutputParser | None):
        self.runtime, self.loaded, self.job, self.seq, self.parser = runtime, loaded, job, seq, parser
        self.request = Request(seq, self._sink)
        self._loop = asyncio.get_running_loop()
        self._events: asyncio.Queue = asyncio.Queue()
        self._done = False
        self._text: list[str] = []
        self._thinking: list[str] = []
        self._reasoning_tokens = 0
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
        """Cancel when the client disconnects."""
        await until_disconnect(http_request)
        self.cancel()

    async def events(self, http_request=None):
        """Deltas as text is released, then the Final. Leaving early (the client is gone) cancels."""
        watcher = asyncio.create_task(self.watch(http_request)) if http_request is not None else None
        try:
            while True:
                event = await self._events.get()
                if isinstance(event, Token):
                    delta = self._delta(self.parser.feed(event.text) if self.parser else [event.text])
                    if delta.thinking or (self.parser is not None and self.parser.in_reasoning):
                        self._reasoning_tokens += 1
                    if event.logprob is not None:
                        delta.logprobs.append(event.logprob)
                    if delta.text or delta.thinking or delta.tool_calls or delta.logprobs:
                        yield delta
                    continue
                if self.parser is not None:
                    delta = self._delta(self.parser.close())
                    if delta.text or delta.thinking or delta.tool_calls:
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
            elif isinstance(item, Reasoning):
                delta.thinking += item.text
            else:
                delta.text += item
        self._text.append(delta.text)
        self._thinking.append(delta.thinking)
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
        return Final(self.loaded.tag, self.seq, reason, "".join(self._text), "".join(self._thinking),
                     self._reasoning_tokens, self._calls, "; ".join(errors) or None,
                     event.error and without_paths(event.error))  # it goes to the client

    async def _account(self) -> None:
        t = self.seq.timings
        self.runtime.metrics.observe(self.job.api, self.seq.finish_reason, t)
        await self.runtime.release(self.loaded, self.job.keep_alive)
        log.info("%s %s: %d prompt tokens (%d cached), %d generated; queue %.0f ms, TTFT %.0f ms, "
                 "decode %.1f tok/s; %s", self.job.api, self.loaded.tag, t.prompt_tokens, t.cached_tokens,
                 t.completion_tokens, t.queue_ms, t.ttft_ms, t.decode_tps, self.seq.finish_reason)
