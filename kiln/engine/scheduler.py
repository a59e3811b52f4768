"""Continuous batching over the engine's KV slots, in nano-vllm's shape: one engine thread loops
schedule → run → postprocess.

- schedule: drop cancelled requests, admit waiting ones into free slots, then build one batch: a decode
  row for every running sequence (up to the engine's decode batch, least recently stepped first), each
  followed by the draft tokens of a speculating sequence while the step has rows for them, plus a chunk
  of the oldest prompt still being prefilled (and any later ones that fit whole in a decode-sized step).
  A long prompt advances a chunk per step while the other streams keep decoding, so it never freezes them.
- run: one `engine.step` for the whole batch.
- postprocess: sample the rows that return logits (a speculating sequence takes the draft tokens the
  target accepts, then one of its own), retire finished sequences and remember what their slots now
  hold; then hand the step's events (released text token by token, the ends) to the requests' sinks.
  An embedding request is a prompt alone: at its last row it gets the final hidden state and retires.

Prompt cache: every slot remembers the tokens its KV holds. A new request takes the free slot whose
tokens share the longest prefix with its prompt (chat clients and agents resend their history) and
prefills only the rest; the last prompt token is always recomputed, since its logits are needed. When a
running request's slot shares more of the prompt (a system prompt that many clients send), that prefix's
KV is copied into the new request's slot instead. Rejected draft tokens leave KV behind them, which a
slot never counts as held (later passes overwrite it). A hybrid's recurrent state reaches back only so far
(kiln/engine/kv.py, StateWindow): a prefix is reused from where `engine.resume_point` says the slot can
continue, the snapshot kept at each prompt's end included, and otherwise the prompt starts over.

Requests arrive from other threads through `submit` (bounded: a full queue raises QueueFullError) and
leave through `cancel`, which the loop honours at its next step, freeing the slot.

Several schedulers (one per model the server holds) may share one native thread pool: each takes its
steps through a `Turns` they share, which gives a model alone with work the whole pool and divides the
threads between models while several have work.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from kiln.engine.interface import Engine
from kiln.engine.kv import common_prefix
from kiln.engine.sampler import sample_rows
from kiln.engine.sequence import Sequence
from kiln.engine.speculative import Draft, draft_limit, propose, verify
from kiln.errors import KilnError

try:
    from kiln import _native
except ImportError:  # the oracle alone: no pool to divide
    _native = None

log = logging.getLogger("kiln.scheduler")


class QueueFullError(KilnError):
    """Every slot is busy and the waiting queue is at its limit."""


class UnloadedError(KilnError):
    """The model is being unloaded, so it takes no more requests."""


@dataclass
class Token:
    text: str  # released text, maybe empty (held back for a possible stop string, or a partial character)
    logprob: dict | None  # the sampled token's logprob record when the request asked for logprobs


@dataclass
class Embedded:
    vector: np.ndarray  # the prompt's last final hidden state (the output head's normalized input)


@dataclass
class Finished:
    error: str | None = None  # why the request failed; None when it ended normally or was cancelled


_request_ids = itertools.count()


@dataclass(eq=False)
class Request:
    seq: Sequence
    sink: Callable[[Token | Embedded | Finished], None]  # called on the engine thread; must not block
    embed: bool = False  # wants the prompt's final hidden state, not generated tokens
    submitted: float = field(default_factory=time.perf_counter)
    cancelled: bool = False
    fed: int = 0  # how many of seq.all_ids have their KV in the slot
    last_step: int = -1
    id: int = field(default_factory=lambda: next(_request_ids))  # what /slots says a slot serves

    @property
    def prefilling(self) -> bool:
        return self.fed < len(self.seq.prompt_ids)


@dataclass
class Batch:
    tokens: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    out_rows: list[int] = field(default_factory=list)
    # Whose logits come back, in out_rows order: a prompt's last row (no draft), or a decode step's last
    # token and draft, one row each.
    out: list[tuple[Request, Draft | None]] = field(default_factory=list)
    fed: list[tuple[Request, int]] = field(default_factory=list)  # tokens each request feeds this step

    def add(self, req: Request, tokens: list[int], n_out: int, draft: Draft | None = None) -> None:
        """Feed `tokens` for `req`; the last `n_out` of them return logits."""
        start = req.fed
        self.tokens += tokens
        self.slots += [req.seq.slot] * len(tokens)
        self.positions += range(start, start + len(tokens))
        self.fed.append((req, len(tokens)))
        if n_out:
            self.out_rows += range(len(self.tokens) - n_out, len(self.tokens))
            self.out.append((req, draft))

    def out_spans(self) -> list[tuple[Request, Draft | None, int, int]]:
        """Each entry of `out` with its first row in the step's logits and its number of rows."""
        spans, start = [], 0
        for req, draft in self.out:
            n = 1 if draft is None else 1 + len(draft.tokens)
            spans.append((req, draft, start, n))
            start += n
        return spans


class Turns:
    """How the schedulers that share a thread pool share its cores. A model alone with work steps on all of
    them; while two or more have work, each steps on one thread of its own (the pool's jobs kept on the
    stepping thread: `_native.pool_alone`), as many at once as the pool has threads. So the steps lose the
    pool's per-op barriers and one model's Python work runs beside another's native step (docs/PERF.md,
    "Eight rows a step, two models at once"). Steps start in the order asked (a ticket queue): a scheduler
    that finished a step and asks again queues behind the others that wait, so none starves."""

    def __init__(self, divide: bool = True):
        """`divide` False: models with work alternate step by step on the whole pool (docs/PERF.md compares)."""
        self.divide = divide
        self._cv = threading.Condition()
        self._queue: deque[int] = deque()  # tickets waiting to start, oldest first
        self._tickets = itertools.count()
        self._whole = False  # a step on the whole pool is in flight
        self._alone = 0  # steps on a thread each in flight
        self._busy: set = set()  # the schedulers with work

    def acquire(self, owner: "Scheduler | None" = None, threads: int = 1) -> bool:
        """Wait for `owner`'s turn (None: the whole pool, with no step beside it); True when it steps alone."""
        with self._cv:
            if owner is not None:
                self._busy.add(owner)
            ticket = next(self._tickets)
            self._queue.append(ticket)
            while True:
                alone = self.divide and owner is not None and threads > 1 and len(self._busy) > 1
                free = not self._whole and (self._alone < threads if alone else self._alone == 0)
                if self._queue[0] == ticket and free:
                    break
                self._cv.wait()
            self._queue.popleft()
            if alone:
                self._alone += 1
            else:
                self._whole = True
            self._cv.notify_all()  # the next ticket may start beside this one
        if alone and _native is not None:
            _native.pool_alone(True)
        return alone

    def release(self, owner: "Scheduler | None", alone: bool) -> None:
        if alone and _native is not None:
            _native.pool_alone(False)
        with self._cv:
            if alone:
                self._alone -= 1
            else:
                self._whole = False
            if owner is not None and not owner.has_work():
                self._busy.discard(owner)
            self._cv.notify_all()

    def __enter__(self) -> None:
        self.acquire()

    def __exit__(self, *exc) -> None:
        self.release(None, False)


class Scheduler:
    def __init__(self, engine: Engine, n_slots: int, max_queue: int, prefill_chunk: int | None = None,
                 turns: Turns | None = None):
        """`turns`: shared with the schedulers of other engines on the same thread pool (None: alone)."""
        self.engine = engine
        self.turns = turns or Turns()
        limits = engine.limits
        self.max_rows, self.max_decode, self.max_out = limits.rows, limits.batch, limits.out_rows
        self.chunk = min(prefill_chunk or self.max_rows, self.max_rows)
        self.n_slots, self.n_ctx, self.max_queue = n_slots, engine.n_ctx, max_queue
        self.slot_tokens: list[list[int]] = [[] for _ in range(n_slots)]
        self.slot_used = [0.0] * n_slots
        self.free = set(range(n_slots))
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._turns = 0
        self._outbox: list[tuple[Request, Token | Embedded | Finished]] | None = None  # events held during postprocess
        self._cv = threading.Condition()  # guards waiting, running and free; wakes the idle loop
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="kiln-engine", daemon=True)

    # --- other threads ------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, req: Request) -> None:
        with self._cv:
            if self._stopping:
                raise UnloadedError("the model is being unloaded; retry the request")
            if len(self.waiting) >= self.max_queue + len(self.free):
                raise QueueFullError(f"the request queue is full ({self.n_slots} running, {self.max_queue} "
                                     f"waiting); retry later or start the server with a larger --max-queue")
            self.waiting.append(req)
            self._cv.notify()

    def cancel(self, req: Request) -> None:
        with self._cv:
            req.cancelled = True
            self._cv.notify()

    def stop(self) -> None:
        """Finish the step in flight, then fail whatever is left."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join()
        with self._cv:
            for req in [*self.running]:
                self._retire(req, "cancelled", "the model was unloaded")
            while self.waiting:
                req = self.waiting.popleft()
                req.seq.finish("cancelled")
                req.sink(Finished("the model was unloaded"))

    def abandon(self, req: Request) -> None:
        """Drop `req` at once, from the thread that steps the scheduler (kiln.engine.generate), whatever
        the step it was part of had done: its slot's contents are forgotten."""
        with self._cv:
            if req in self.running:
                self._retire(req, "cancelled", "abandoned")
            elif req in self.waiting:
                self.waiting.remove(req)
                req.seq.finish("cancelled")

    def stats(self) -> dict:
        with self._cv:
            return {"running": len(self.running), "waiting": len(self.waiting),
                    "kv_used": sum(r.fed for r in self.running), "kv_capacity": self.n_slots * self.n_ctx,
                    "kv_cached": sum(len(self.slot_tokens[s]) for s in self.free)}

    def slots(self) -> list[dict]:
        """Each slot: the id of the request it serves (None when free) and how many tokens of KV it holds."""
        with self._cv:
            serving = {r.seq.slot: r for r in self.running}
            return [{"id": s, "request": serving[s].id if s in serving else None,
                     "cached": serving[s].fed if s in serving else len(self.slot_tokens[s])}
                    for s in range(self.n_slots)]

    # --- the engine thread ----------------------------------------------------------------------------
    def _loop(self) -> None:
        while self.step():
            pass

    def step(self) -> bool:
        """schedule → run → postprocess, once, in this scheduler's turn; False when it is stopping."""
        self._wait_for_work()  # outside the turn: an idle model holds no other up
        alone = self.turns.acquire(self, self.engine.threads or 1)
        try:
            if (batch := self._take_batch()) is None:
                return False
            if batch.tokens and (logits := self.run(batch)) is not None:
                self.postprocess(batch, logits)
        finally:
            self.turns.release(self, alone)
        return True

    def _wait_for_work(self) -> None:
        with self._cv:
            while not (self._stopping or self.waiting or self.running):
                self._cv.wait()

    def has_work(self) -> bool:
        return not self._stopping and bool(self.waiting or self.running)

    def _take_batch(self) -> Batch | None:
        """The next step's batch (empty when cancellations left nothing to run); None when stopping."""
        with self._cv:
            if self._stopping:
                return None
            for req in [r for r in self.running if r.cancelled]:
                self._retire(req, "cancelled")
            for req in [r for r in self.waiting if r.cancelled]:
                self.waiting.remove(req)
                req.seq.finish("cancelled")
                req.sink(Finished())
            while self.waiting and self.free:
                self._admit(self.waiting.popleft())
        batch = Batch()
        decoding = sorted((r for r in self.running if not r.prefilling), key=lambda r: r.last_step)
        prefilling = [r for r in self.running if r.prefilling]
        # a prompt's last row needs logits too: decode rows leave it one, else a full batch starves it
        decoding = decoding[: min(self.max_decode, self.max_out - 1) if prefilling else self.max_decode]
        for req, draft in zip(decoding, self._drafts(decoding)):
            if draft is not None:
                if draft.tokens:  # a state that cannot rewind past rejected rows keeps where they start
                    self.engine.checkpoint(req.seq.slot, req.fed)
                # what the slot lacks: the last token, and the accepted ones a state without history re-feeds
                batch.add(req, [*req.seq.all_ids[req.fed :], *draft.tokens], 1 + len(draft.tokens), draft)
        # The oldest prompt takes up to a chunk; later ones join whole while the step stays within the
        # decode batch's rows, where a row costs far less than its share (the weights are read once for
        # all). Beyond that a row costs the same in any step, and prompts one after another give the
        # lower mean time to first token.
        outs = self.max_out - len(batch.out_rows)
        for i, req in enumerate(prefilling):
            prompt = req.seq.prompt_ids
            if i == 0:
                end = min(len(prompt), req.fed + min(self.chunk, self.max_rows - len(batch.tokens)))
                if end == len(prompt) and outs == 0:
                    end -= 1  # its last row needs logits this step has no room for
            elif outs > 0 and len(batch.tokens) + len(prompt) - req.fed <= self.max_decode:
                end = len(prompt)
            else:
                continue
            if end > req.fed:
                batch.add(req, prompt[req.fed : end], int(end == len(prompt)))
                outs -= end == len(prompt)
        return batch

    def _drafts(self, decoding: list[Request]) -> list[Draft | None]:
        """Each decoding request's draft (empty when it does not speculate), sized to the rows and logits
        one step can take with a prompt's last row to spare; None for one whose drafter failed."""
        rows = self.max_rows - sum(len(r.seq.all_ids) - r.fed for r in decoding)
        outs = self.max_out - len(decoding) - 1
        jobs = []
        for i, req in enumerate(decoding):
            k = min(draft_limit(req.seq), rows, outs)
            if k > 0:
                jobs.append((i, k))
                rows, outs = rows - k, outs - k
        drafts: list[Draft | None] = [Draft([]) for _ in decoding]
        try:
            for (i, _), draft in zip(jobs, propose([(decoding[i].seq, k) for i, k in jobs])):
                drafts[i] = draft
        except Exception as e:  # a failed draft model fails the requests it drafts for, not the others
            log.exception("drafting failed")
            with self._cv:
                for i, _ in jobs:
                    self._retire(decoding[i], "error", f"drafting failed: {type(e).__name__}: {e}")
                    drafts[i] = None
        return drafts

    def run(self, batch: Batch) -> np.ndarray | None:
        try:
            return self.engine.step(batch.tokens, batch.slots, batch.positions, batch.out_rows)
        except Exception as e:  # the loop must outlive a failed step; its requests get the error
            log.exception("engine step failed")
            with self._cv:
                for req, _ in batch.fed:
                    self._retire(req, "error", f"the engine failed: {type(e).__name__}: {e}")
            return None

    def postprocess(self, batch: Batch, logits: np.ndarray) -> None:
        """Sample every row, then hand out the step's events: a sink wakes the server's event loop, which
        would compete for the GIL with the sampling of the rows after it (docs/PERF.md, "Batched step and
        serving, a second look")."""
        self._outbox = []
        try:
            self._sample(batch, logits)
        finally:
            outbox, self._outbox = self._outbox, None
            for req, event in outbox:
                req.sink(event)

    def _send(self, req: Request, event: Token | Embedded | Finished) -> None:
        if self._outbox is not None:
            self._outbox.append((req, event))
        else:
            req.sink(event)

    def _sample(self, batch: Batch, logits: np.ndarray) -> None:
        for req, n in batch.fed:
            req.fed += n
            if req.fed == len(req.seq.prompt_ids) and n:  # the next turn may continue from the prompt's end
                self.engine.snapshot(req.seq.slot, req.fed)
            self._turns += 1  # a distinct turn per request, so the least recently stepped go first: round robin
            req.last_step = self._turns
        spans = batch.out_spans()
        hidden = self.engine.hidden(len(batch.out_rows)) if any(req.embed for req, *_ in spans) else None
        for (req, draft, start, n), own in zip(spans, self._sample_single_rows(spans, logits)):
            seq = req.seq
            if req.embed:
                seq.timings.prefill_ms = (time.perf_counter() - seq.started) * 1e3
                self._send(req, Embedded(hidden[start]))
                with self._cv:
                    self._retire(req, "stop")
                continue
            rows = logits[start : start + n]
            try:
                if draft is None:  # a prompt's last row: the first token
                    seq.timings.prefill_ms = (time.perf_counter() - seq.started) * 1e3
                    tokens = [seq.sample(rows[0], token=own)]
                else:
                    tokens = verify(seq, draft, rows, own)
            except Exception as e:  # e.g. a grammar that allows no token: fail this request, not the batch
                log.exception("sampling failed")
                with self._cv:
                    self._retire(req, "error", f"sampling failed: {type(e).__name__}: {e}")
                continue
            appended = 0
            for token in tokens:  # one by one, so stop strings, stop tokens and max_tokens cut the draft short
                text = seq.append(token)
                appended += 1
                record = seq.token_logprobs[len(seq.output_ids) - 1] if seq.logprobs is not None else None
                self._send(req, Token(text, record))
                if seq.finished:
                    break
            if draft is not None:  # the slot holds the KV of the accepted draft tokens, not the rejected ones
                req.fed -= len(draft.tokens) - min(appended, len(tokens) - 1)
                # a recurrent state without history continues from the draft's checkpoint: the accepted
                # tokens are fed again with the next step
                req.fed = self.engine.resume_point(seq.slot, req.fed)
            if seq.finished:
                with self._cv:
                    self._retire(req, seq.finish_reason)

    def _sample_single_rows(self, spans: list[tuple[Request, Draft | None, int, int]], logits: np.ndarray) -> list[int | None]:
        """The tokens of the requests with one row this step (a prompt's end, a decode step without a draft)
        and no grammar or logit bias, drawn at once on the engine's threads; None for the others, which are
        sampled one by one (in Python, a served step's rows cost a share of it worth saving: docs/PERF.md,
        "Sampling, the QKV op's end, the embedding table")."""
        jobs, where = [], []
        for i, (req, _, start, n) in enumerate(spans):
            if n == 1 and not req.seq.adjusts_logits and not req.embed:
                jobs.append((req.seq.sampler, start, req.seq.all_ids))
                where.append(i)
        tokens: list[int | None] = [None] * len(spans)
        try:
            for i, token in zip(where, sample_rows(self.engine.pool, logits, jobs) if jobs else []):
                tokens[i] = token
        except Exception:  # the rows are then sampled one by one, where a failure is the request's own
            log.exception("batched sampling failed")
            return [None] * len(spans)
        return tokens

    # --- slots (callers hold the lock) ---------------------------------------------------------------
    def _admit(self, req: Request) -> None:
        seq, now = req.seq, time.perf_counter()
        seq.timings.queue_ms = (now - req.submitted) * 1e3
        seq.start_clock()
        if seq.finished:  # max_tokens 0: nothing to compute
            seq.finish(seq.finish_reason)
            req.sink(Finished())
            return
        prompt = seq.prompt_ids
        longest = len(prompt) - 1  # the last prompt token is always recomputed: its logits are needed

        def reusable(slot: int, held: list[int]) -> int:
            # a recurrent state continues only from positions it still reaches, or its snapshot
            return self.engine.resume_point(slot, min(common_prefix(held, prompt), longest))

        # Longest shared prefix first; among equals, the least recently used slot, so fresh caches live on.
        # A slot that would keep less than half of what it caches (another system prompt, sharing only the
        # template's opening) is not reused while a slot is free that loses less: a later request may
        # bring that prompt back (llama-server's slot similarity does the same). What a slot keeps is what
        # its state can continue from.
        shares = {s: common_prefix(self.slot_tokens[s], prompt) for s in self.free}
        similar = [s for s in self.free if 2 * self.engine.resume_point(s, shares[s]) >= len(self.slot_tokens[s])]
        if similar:
            slot = max(similar, key=lambda s: (reusable(s, self.slot_tokens[s]), shares[s], -self.slot_used[s]))
        else:
            slot = min(self.free, key=lambda s: self.slot_used[s])
        cached = reusable(slot, self.slot_tokens[slot])
        # A busy slot may hold more of it (clients that send the same system prompt at once): then that
        # prefix's KV is copied into the least recently used free slot, for a fraction of a prefill's cost.
        shared, source = max(((reusable(r.seq.slot, r.seq.all_ids[: r.fed]), r.seq.slot) for r in self.running),
                             default=(0, None))
        if shared > cached:
            slot = min(self.free, key=lambda s: self.slot_used[s])
            self.engine.copy_slot(source, slot, shared)
            cached = shared
        self.free.remove(slot)
        seq.slot = slot
        req.fed = seq.timings.cached_tokens = cached
        self.running.append(req)

    def _retire(self, req: Request, reason: str, error: str | None = None) -> None:
        seq = req.seq
        seq.finish(reason)
        self.running.remove(req)
        # The slot holds the KV of what was fed (the last sampled token never was); after a failed step
        # its contents are unknown.
        self.slot_tokens[seq.slot] = [] if error else seq.all_ids[: req.fed]
        self.slot_used[seq.slot] = time.perf_counter()
        self.free.add(seq.slot)
        self._send(req, Finished(error))
