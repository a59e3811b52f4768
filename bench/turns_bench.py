"""Two models on one thread pool against one model, in-process (no HTTP): aggregate decode tok/s of
`--streams` back-to-back streams on one model, then split over two models sharing the pool, with the
threads divided between them (scheduler.Turns' default) and with their steps alternating on the whole
pool, in interleaved rounds in one process.

    python bench/turns_bench.py --models smol-a:135m,smol-b:135m --streams 16 --seconds 10 --rounds 3

Each stream sends the same chat again as soon as its reply ends (`--max-tokens` tokens, stop tokens
ignored); the tokens counted are those released inside the window.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

from kiln.engine.model import load
from kiln.engine.request import GenerationRequest, prepare
from kiln.engine.scheduler import Finished, Request, Scheduler, Token, Turns


def run(models, streams_each: list[int], divide: bool, seconds: float, max_tokens: int) -> tuple[float, float]:
    """(tokens per second, tokens per second of the process's CPU time: what a loaded machine leaves readable)"""
    turns = Turns(divide=divide)
    schedulers = [Scheduler(m.engine, n_slots=m.engine.n_slots, max_queue=64, turns=turns) for m in models]
    counted, stop_at, lock = [0], [float("inf")], threading.Lock()
    start_at = [0.0]

    def submit(k: int) -> None:
        m = models[k]
        seq, _ = prepare(m, GenerationRequest(messages=[{"role": "user", "content": "Write a long story about a lighthouse."}],
                                              max_tokens=max_tokens, ignore_eos=True))
        schedulers[k].submit(Request(seq, lambda e, k=k: sink(k, e)))

    def sink(k, event) -> None:
        now = time.perf_counter()
        if isinstance(event, Token):
            if start_at[0] <= now < stop_at[0]:
                with lock:
                    counted[0] += 1
        elif isinstance(event, Finished) and now < stop_at[0]:
            submit(k)

    for k, n in enumerate(streams_each):
        for _ in range(n):
            submit(k)
    for s in schedulers:
        s.start()
    time.sleep(1.0)  # prompts prefilled, steps at full batch
    cpu0 = time.process_time()
    start_at[0] = time.perf_counter()
    stop_at[0] = start_at[0] + seconds
    time.sleep(seconds)
    cpu = time.process_time() - cpu0
    time.sleep(0.05)
    for s in schedulers:
        s.stop()
    return counted[0] / seconds, counted[0] / cpu


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", required=True, help="two comma-separated tags (two engines of one file are fine)")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("--ctx", type=int, default=512)
    args = p.parse_args()
    tags = args.models.split(",")
    first = load(tags[0], n_ctx=args.ctx, n_slots=args.streams, threads=args.threads, progress=False)
    second = load(tags[1], n_ctx=args.ctx, n_slots=args.streams, threads=args.threads, progress=False,
                  pool=first.engine.pool)
    half = args.streams // 2
    cases = {"one": ([first], [args.streams], True), "two divided": ([first, second], [half, half], True),
             "two alternating": ([first, second], [half, half], False)}
    got: dict[str, list[tuple[float, float]]] = {k: [] for k in cases}
    for r in range(args.rounds):
        order = list(cases) if r % 2 == 0 else list(reversed(cases))
        for name in order:
            got[name].append(run(*cases[name][:2], cases[name][2], args.seconds, args.max_tokens))
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1][0]:.1f} ({v[-1][1]:.1f} per CPU s)" for k, v in got.items()) +
              "; " + ", ".join(f"{k}/one {got[k][-1][0] / got['one'][-1][0]:.3f} ({got[k][-1][1] / got['one'][-1][1]:.3f})"
                               for k in ("two divided", "two alternating")), flush=True)
    for i, what in enumerate(("tok/s", "tok per CPU s")):
        ratio = lambda k: statistics.median(a[i] / b[i] for a, b in zip(got[k], got["one"]))  # noqa: E731
        print(f"medians, {what}: " + ", ".join(f"{k} {statistics.median(x[i] for x in v):.1f}" for k, v in got.items()) +
              f"; median ratios: divided/one {ratio('two divided'):.3f}, alternating/one {ratio('two alternating'):.3f}")


if __name__ == "__main__":
    main()
