"""The batching scheduler against a scripted engine: every step it runs is recorded and checked."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kiln.engine.interface import Limits
from kiln.engine.sampler import SamplingParams
from kiln.engine.scheduler import Finished, QueueFullError, Request, Scheduler, Token
from kiln.engine.sequence import Sequence

VOCAB = 64


class ScriptedEngine:
    """Each row's logits favour (its token + 1) % VOCAB, so greedy decoding counts upwards."""

    threads = None  # no native threads: the calling thread alone

    def __init__(self, n_slots=4, n_ctx=256, max_batch=4, prefill_rows=8, max_out=None):
        self.n_slots, self.n_ctx, self.max_batch, self.prefill_rows = n_slots, n_ctx, max_batch, prefill_rows
        if max_out is not None:
            self.max_out = max_out
        self.limits = Limits(rows=prefill_rows, batch=max_batch, out_rows=prefill_rows if max_out is None else max_out)
        self.steps: list[dict] = []
        self.copies: list[tuple[int, int, int]] = []
        self.kv: list[list[int]] = [[] for _ in range(n_slots)]  # the token each position of a slot was fed
        self.fail_next = False

    def copy_slot(self, src, dst, length):
        self.copies.append((src, dst, length))
        self.kv[dst] = self.kv[src][:length]

    def resume_point(self, slot, position):
        return position

    def snapshot(self, slot, position):
        pass

    def checkpoint(self, slot, position):
        pass

    def step(self, tokens, slots, positions, out_rows):
        self.steps.append({"tokens": list(tokens), "slots": list(slots), "positions": list(positions),
                           "out_rows": list(out_rows)})
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("simulated kernel fault")
        assert len(tokens) <= self.prefill_rows and len(out_rows) <= getattr(self, "max_out", self.prefill_rows)
        for token, slot, pos in zip(tokens, slots, positions):
            assert pos <= len(self.kv[slot]), f"slot {slot} fed position {pos} before {len(self.kv[slot])}"
            self.kv[slot][pos:] = [token]
        logits = np.zeros((len(out_rows), VOCAB), np.float32)
        for i, row in enumerate(out_rows):
            logits[i, (tokens[row] + 1) % VOCAB] = 1.0
        return logits


class Letters:
    """A tokenizer whose token i is the letter chr(64 + i)."""

    vocab_size = VOCAB

    class _Stream:
        def feed(self, i):
            return chr(64 + i)

        def flush(self):
            return ""

    def stream(self, skip_special=True):
        return self._Stream()

    def decode(self, ids, skip_special=True):
        return "".join(chr(64 + i) for i in ids)


class Client:
    """A request plus what its sink received."""

    def __init__(self, prompt, max_tokens=4, stop_ids=frozenset()):
        self.seq = Sequence(list(prompt), SamplingParams.greedy(), Letters(), max_tokens, stop_ids=stop_ids)
        self.text, self.finished, self.done = "", None, threading.Event()
        self.request = Request(self.seq, self.sink)

    def sink(self, event):
        if isinstance(event, Token):
            self.text += event.text
        else:
            self.finished = event
            self.done.set()


def run_steps(s: Scheduler, n: int | None = None) -> None:
    """Drive the loop by hand: n steps, or until nothing is left."""
    count = 0
    while (n is None or count < n) and (s.running or s.waiting):
        assert s.step()
        count += 1


def test_a_request_decodes_and_frees_its_slot():
    engine = ScriptedEngine()
    s = Scheduler(engine, n_slots=2, max_queue=4)
    c = Client([1, 2, 3], max_tokens=4)
    s.submit(c.request)
    run_steps(s)
    assert c.seq.output_ids == [4, 5, 6, 7] and c.text == "DEFG"
    assert c.seq.finish_reason == "length" and c.finished.error is None
    assert engine.steps[0]["positions"] == [0, 1, 2] and engine.steps[0]["out_rows"] == [2]
    assert [st["positions"] for st in engine.steps[1:]] == [[3], [4], [5]]  # the last token is never fed
    assert s.free == {0, 1} and not s.running
    assert s.slot_tokens[c.seq.slot] == [1, 2, 3, 4, 5, 6]


def test_new_requests_join_between_steps_and_decode_together():
    engine = ScriptedEngine()
    s = Scheduler(engine, n_slots=4, max_queue=4)
    a, b = Client([1, 2], max_tokens=6), Client([10, 11], max_tokens=3)
    s.submit(a.request)
    run_steps(s, 2)
    s.submit(b.request)
    run_steps(s)
    joint = [st for st in engine.steps if set(st["slots"]) == {a.seq.slot, b.seq.slot}]
    assert joint, "b never ran in the same step as a"
    assert any(len(st["out_rows"]) == 2 for st in joint)  # one step sampled both
    assert a.seq.output_ids == [3, 4, 5, 6, 7, 8] and b.seq.output_ids == [12, 13, 14]


def test_a_long_prompt_is_prefilled_in_chunks_between_decode_steps():
    engine = ScriptedEngine(max_batch=4, prefill_rows=8)
    s = Scheduler(engine, n_slots=4, max_queue=4)
    a = Client([1], max_tokens=20)
    s.submit(a.request)
    run_steps(s, 2)
    b = Client(list(range(30)), max_tokens=2)
    s.submit(b.request)
    while b.seq.output_ids == [] and not b.finished:
        before = len(a.seq.output_ids)
        run_steps(s, 1)
        step = engine.steps[-1]
        assert len(step["tokens"]) <= 8
        assert a.seq.slot in step["slots"] and len(a.seq.output_ids) == before + 1  # a kept streaming
    chunks = [st for st in engine.steps if b.seq.slot in st["slots"]]
    assert len(chunks) >= 5  # 30 prompt tokens, at most 7 per step beside a's decode row
    fed = [p for st in chunks for p, slot in zip(st["positions"], st["slots"]) if slot == b.seq.slot]
    assert fed == list(range(30))


def test_prompt_cache_picks_the_slot_with_the_longest_prefix():
    engine = ScriptedEngine()
    s = Scheduler(engine, n_slots=3, max_queue=4)
    first = Client([5, 9, 9, 9, 9], max_tokens=3)
    other = Client([7, 7, 7], max_tokens=1)
    s.submit(first.request)
    s.submit(other.request)
    run_steps(s)
    history = first.seq.all_ids[:-1]  # what first's slot holds: prompt + output, less the unfed last token
    follow = Client(history + [first.seq.output_ids[-1], 30, 31], max_tokens=1)
    s.submit(follow.request)
    n_steps = len(engine.steps)
    run_steps(s)
    assert follow.seq.slot == first.seq.slot
    assert follow.seq.timings.cached_tokens == len(history)
    assert engine.steps[n_steps]["positions"] == list(range(len(history), len(follow.seq.prompt_ids)))

    same = Client(follow.seq.prompt_ids, max_tokens=1)  # an identical prompt: only its last token is recomputed
    s.submit(same.request)
    n_steps = len(engine.steps)
    run_steps(s)
    assert same.seq.timings.cached_tokens == len(same.seq.prompt_ids) - 1
    assert engine.steps[n_steps]["positions"] == [len(same.seq.prompt_ids) - 1]


def test_a_prefix_held_by_a_running_request_is_copied_not_prefilled():
    engine = ScriptedEngine()
    s = Scheduler(engine, n_slots=3, max_queue=4)
    system = list(range(1, 7))  # a system prompt two clients share
    first = Client(system + [20, 21], max_tokens=8)
    s.submit(first.request)
    run_steps(s, 3)
    second = Client(system + [30], max_tokens=2)
    s.submit(second.request)
    n_steps = len(engine.steps)
    run_steps(s, 1)
    assert first.request in s.running and second.seq.slot != first.seq.slot
    assert engine.copies == [(first.seq.slot, second.seq.slot, len(system))]
    assert second.seq.timings.cached_tokens == len(system)
    fed = [p for p, slot in zip(engine.steps[n_steps]["positions"], engine.steps[n_steps]["slots"]) if slot == second.seq.slot]
    assert fed == [len(system)]
    run_steps(s)
    assert second.seq.output_ids == [31, 32]
    assert engine.kv[second.seq.slot][: len(second.seq.all_ids) - 1] == second.seq.all_ids[:-1]

    third = Client(system + [30, 31, 40], max_tokens=1)  # second's slot, now free, holds the most: no copy
    s.submit(third.request)
    run_steps(s)
    assert third.seq.slot == second.seq.slot and third.seq.timings.cached_tokens == len(system) + 2
    assert len(engine.copies) == 1


def test_a_copied_prefix_decodes_as_its_own_prefill_would(tmp_path):
    """The native engine: a request that copies a running request's prefix gets the logits a full prefill
    of its prompt gives (a prefix of 21 tokens: two whole key groups of 8 and part of a third)."""
    from kiln.engine.native import NativeEngine
    from kiln.gguf import GGUFFile
    from kiln.models import family_for
    from kiln.synth import write_random_gguf

    gguf = GGUFFile(write_random_gguf(tmp_path / "m.gguf", "tiny-llama", seed=3))
    engine = NativeEngine(gguf, family_for(gguf), n_ctx=64, n_slots=2, threads=2)
    rng = np.random.default_rng(4)
    system, question = [int(t) for t in rng.integers(3, 500, 21)], [int(t) for t in rng.integers(3, 500, 5)]
    alone = engine.forward(system + question, slot=1).reshape(-1)
    engine.forward([int(t) for t in rng.integers(3, 500, 30)], slot=1)  # the slot the copy goes to, overwritten
    s = Scheduler(engine, n_slots=2, max_queue=2)
    first = Client(system + [7, 8, 9], max_tokens=6)
    s.submit(first.request)
    run_steps(s, 2)
    logits = []
    s.run = lambda batch: logits.append(out := Scheduler.run(s, batch)) or out
    second = Client(system + question, max_tokens=1)
    s.submit(second.request)
    run_steps(s, 1)
    assert second.seq.timings.cached_tokens == len(system) and first.request in s.running
    np.testing.assert_allclose(logits[0][-1], alone, rtol=1e-5, atol=1e-5)


def test_short_prompts_join_a_step_while_it_stays_decode_sized():
    engine = ScriptedEngine(n_slots=4, max_batch=4, prefill_rows=8)
    s = Scheduler(engine, n_slots=4, max_queue=4)
    long = Client(list(range(10, 20)), max_tokens=1)
    short = [Client([i], max_tokens=2) for i in (30, 40, 50)]
    for c in (long, *short):
        s.submit(c.request)
    run_steps(s, 2)
    assert engine.steps[0]["tokens"] == list(range(10, 18))  # the oldest prompt's chunk fills the step
    # its last 2 rows, then whole prompts while the step has at most 4 rows
    assert engine.steps[1]["tokens"] == [18, 19, 30, 40] and engine.steps[1]["out_rows"] == [1, 2, 3]
    run_steps(s)
    assert long.seq.output_ids == [20] and [c.seq.output_ids for c in short] == [[31, 32], [41, 42], [51, 52]]


def test_a_prompt_end_is_not_starved_of_logits_rows():
    engine = ScriptedEngine(n_slots=4, max_batch=8, prefill_rows=8, max_out=2)
    s = Scheduler(engine, n_slots=4, max_queue=4)
    clients = [Client([i, i + 1], max_tokens=2) for i in (10, 20, 30)]
    for c in clients:
        s.submit(c.request)
    run_steps(s, 1)
    # 2 logits rows: two prompts end in the first step; the third waits
    assert engine.steps[0]["positions"] == [0, 1, 0, 1] and engine.steps[0]["out_rows"] == [1, 3]
    run_steps(s, 1)
    # one of the two decoding requests waits, leaving the third prompt's end a logits row
    assert engine.steps[1]["tokens"] == [12, 30, 31] and engine.steps[1]["out_rows"] == [0, 2]
    run_steps(s)
    assert [c.seq.output_ids for c in clients] == [[12, 13], [22, 23], [32, 33]]


def test_cancel_frees_the_slot_at_the_next_step():
    engine = ScriptedEngine()
    s = Scheduler(engine, n_slots=1, max_queue=4)
    a, b, c = Client([1, 2], max_tokens=50), Client([3], max_tokens=2), Client([4], max_tokens=2)
    for client in (a, b, c):
        s.submit(client.request)
    run_steps(s, 3)
    assert list(s.waiting) == [b.request, c.request]  # one slot, held by a
    s.cancel(c.request)  # a client that gives up while queued
    run_steps(s, 1)
    assert list(s.waiting) == [b.request] and c.seq.finish_reason == "cancelled" and c.finished is not None
    s.cancel(a.request)
    run_steps(s, 1)
    assert a.finished is not None and a.finished.error is None and a.seq.finish_reason == "cancelled"
    assert b.seq.slot == 0 and b.request in s.running
    run_steps(s)
    assert b.seq.output_ids == [4, 5]


def test_queue_limit():
    s = Scheduler(ScriptedEngine(), n_slots=1, max_queue=1)
    s.submit(Client([1]).request)  # takes the free slot at the next step
    s.submit(Client([1]).request)  # waits
    with pytest.raises(QueueFullError, match="queue is full"):
        s.submit(Client([1]).request)
    run_steps(s, 1)
    with pytest.raises(QueueFullError):
        s.submit(Client([1]).request)


def test_more_sequences_than_the_decode_batch_take_turns():
    engine = ScriptedEngine(n_slots=6, max_batch=4, prefill_rows=8)
    s = Scheduler(engine, n_slots=6, max_queue=8)
    clients = [Client([i], max_tokens=30) for i in range(6)]
    for c in clients:
        s.submit(c.request)
    run_steps(s, 6)  # every prompt prefilled by then
    counts = [len(c.seq.output_ids) for c in clients]
    run_steps(s, 6)
    assert all(len(st["tokens"]) <= 4 for st in engine.steps[-6:])
    assert [len(c.seq.output_ids) - n for c, n in zip(clients, counts)] == [4] * 6  # 24 rows shared fairly


def test_an_engine_failure_fails_its_requests_and_the_loop_goes_on():
    engine = ScriptedEngine()
    s = Scheduler(engine, n_slots=2, max_queue=4)
    a = Client([1, 2], max_tokens=5)
    s.submit(a.request)
    run_steps(s, 1)
    engine.fail_next = True
    run_steps(s, 1)
    assert a.finished.error and "simulated kernel fault" in a.finished.error
    assert a.seq.finish_reason == "error" and s.free == {0, 1} and s.slot_tokens[a.seq.slot] == []
    b = Client([1, 2], max_tokens=2)
    s.submit(b.request)
    run_steps(s)
    assert b.seq.output_ids == [3, 4] and b.seq.timings.cached_tokens == 0


def test_the_engine_thread_serves_and_stops():
    s = Scheduler(ScriptedEngine(), n_slots=2, max_queue=4)
    s.start()
    clients = [Client([i, i + 1], max_tokens=5, stop_ids=frozenset({i + 4})) for i in (1, 10)]
    for c in clients:
        s.submit(c.request)
    assert all(c.done.wait(10) for c in clients)
    assert [c.seq.output_ids for c in clients] == [[3, 4, 5], [12, 13, 14]]  # the stop token ends each
    assert all(c.seq.finish_reason == "stop" and c.seq.timings.queue_ms >= 0 for c in clients)
    waiting = Client([1], max_tokens=5)
    s.stop()
    with pytest.raises(Exception, match="unloaded"):
        s.submit(waiting.request)
    assert s.stats()["running"] == 0 and s.stats()["kv_cached"] > 0
    assert isinstance(clients[0].finished, Finished)


def test_generate_steps_the_scheduler_on_this_thread_and_forgets_an_abandoned_slot():
    from kiln.engine.generate import generate

    engine = ScriptedEngine(n_slots=1)
    s = Scheduler(engine, n_slots=1, max_queue=0)
    first = Client([1, 2, 3], max_tokens=4).seq
    assert "".join(generate(s, first)) == "DEFG" and first.finish_reason == "length"
    assert s.slot_tokens[0] == [1, 2, 3, 4, 5, 6]  # the prompt cache a next turn reuses
    again = Client([1, 2, 3, 4, 5, 6, 9], max_tokens=2).seq
    assert "".join(generate(s, again)) == "JK" and again.timings.cached_tokens == 6
    left = Client([1, 2], max_tokens=8).seq
    stream = generate(s, left)
    assert next(stream) == "C"
    stream.close()  # the caller stopped reading (an interrupt): the request is dropped, its KV forgotten
    assert left.finish_reason == "cancelled" and not s.running and s.free == {0} and s.slot_tokens[0] == []
    assert "".join(generate(s, Client([5], max_tokens=2).seq)) == "FG"


def test_generate_raises_the_error_that_failed_its_request():
    from kiln.engine.generate import generate
    from kiln.errors import KilnError

    engine = ScriptedEngine(n_slots=1)
    s = Scheduler(engine, n_slots=1, max_queue=0)
    engine.fail_next = True
    with pytest.raises(KilnError, match="the engine failed: RuntimeError: simulated kernel fault"):
        list(generate(s, Client([1, 2, 3]).seq))
    assert not s.running and s.free == {0} and s.slot_tokens[0] == []


def test_schedulers_sharing_turns_step_one_at_a_time_and_alternate():
    import time

    from kiln.engine.scheduler import Turns

    order, inside, most = [], [0], [0]

    class Shared(ScriptedEngine):
        pool = None  # rows sampled on the stepping thread

        def __init__(self, name):
            super().__init__()
            self.name = name

        def step(self, tokens, slots, positions, out_rows):
            inside[0] += 1
            most[0] = max(most[0], inside[0])
            # The GIL released, as in a native step. The step lasts until the other scheduler waits for its
            # turn (while it has work), so the order shows the turns' rule, not how the threads were scheduled.
            other = clients["ab".index(self.name) - 1]
            deadline = time.monotonic() + 5
            while not turns._queue and not other.done.is_set() and time.monotonic() < deadline:
                time.sleep(0.0005)
            order.append(self.name)
            inside[0] -= 1
            return super().step(tokens, slots, positions, out_rows)

    turns = Turns()
    schedulers = [Scheduler(Shared(name), n_slots=2, max_queue=4, turns=turns) for name in "ab"]
    clients = [Client([1, 2], max_tokens=20), Client([3, 4], max_tokens=20)]
    for s, c in zip(schedulers, clients):
        s.submit(c.request)
    for s in schedulers:
        s.start()
    try:
        assert all(c.done.wait(10) for c in clients)
    finally:
        for s in schedulers:
            s.stop()
    assert most[0] == 1  # never two steps at once on the shared pool
    assert order.count("a") == order.count("b") == 20  # the prompt (its first token) and 19 decode steps each
    repeats = sum(x == y for x, y in zip(order, order[1:]))
    assert repeats <= 2, order  # one ahead at the start, one left at the end; alternating between


def test_schedulers_with_work_divide_the_threads_and_one_alone_takes_the_pool():
    """On a pool of two threads, two models with work step at once, each with the pool's jobs kept on its own
    thread; a model alone with work steps on the whole pool (its jobs go to the pool's threads)."""
    import time

    from kiln import _native
    from kiln.engine.scheduler import Turns

    inside, most, seen, entries = [0], [0], {"a": [], "b": []}, {"a": 0, "b": 0}

    class Shared(ScriptedEngine):
        pool, threads = None, 2

        def __init__(self, name):
            super().__init__()
            self.name = name

        def step(self, tokens, slots, positions, out_rows):
            inside[0] += 1
            entries[self.name] += 1
            most[0] = max(most[0], inside[0])
            alone = _native.pool_alone(True)  # reads this thread's setting (and puts it back below)
            _native.pool_alone(alone)
            seen[self.name].append(alone)
            name = "ab"["ab".index(self.name) - 1]
            other, start = clients["ab".index(name)], entries[name]
            deadline = time.monotonic() + 5  # the GIL released, as in a native step, until the other starts one
            while entries[name] == start and not other.done.is_set() and time.monotonic() < deadline:
                time.sleep(0.0005)
            inside[0] -= 1
            return super().step(tokens, slots, positions, out_rows)

    turns = Turns()
    schedulers = [Scheduler(Shared(name), n_slots=2, max_queue=4, turns=turns) for name in "ab"]
    clients = [Client([1, 2], max_tokens=20), Client([3, 4], max_tokens=5)]
    for s, c in zip(schedulers, clients):
        s.submit(c.request)
    for s in schedulers:
        s.start()
    try:
        assert all(c.done.wait(10) for c in clients)
    finally:
        for s in schedulers:
            s.stop()
    assert most[0] == 2  # both stepped at once
    assert seen["b"] and all(seen["b"][1:]), seen  # b always had a stepping a beside it (its first may have been before a's)
    assert seen["a"][-1] is False and seen["a"].count(True) >= 4, seen  # a alone once b finished: the whole pool
    assert _native.pool_alone(False) is False  # the schedulers' threads set it, never this one
    assert not turns._busy and turns._alone == 0 and not turns._whole
