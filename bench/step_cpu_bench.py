"""CPU time of decode steps in-process, which a busy machine leaves readable where wall time is not
(descheduled time is not counted). Rows feed consecutive ids at position ~100, one slot each.

    python bench/step_cpu_bench.py MODEL rows [--blocks 8]     # one thread: 1, 8 and 16 rows
    python bench/step_cpu_bench.py MODEL divide [--blocks 12]  # two threads: 16 rows on the pool, 8 rows
                                                               # with the pool's jobs on the caller, 8 on the pool

`rows` times the stepping thread; `divide` the whole process (the pool's worker and its spin-waits
included), so CPU(16 on the pool) / 2 CPU(8 alone) is what two models dividing the threads get against one
model with every stream, on a machine where every CPU second is one the models could have had.
Blocks of each case are interleaved; medians.
"""

from __future__ import annotations

import argparse
import statistics
import time

from kiln import _native
from kiln.engine.model import load


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("mode", choices=("rows", "divide"))
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--steps", type=int, default=8, help="steps per block")
    args = p.parse_args()
    threads = 1 if args.mode == "rows" else 2
    engine = load(args.model, n_ctx=512, n_slots=16, threads=threads, progress=False).engine
    clock = time.thread_time if args.mode == "rows" else time.process_time

    def block(n: int, alone: bool, steps: int) -> float:
        _native.pool_alone(alone)
        rows = list(range(n))
        c0 = clock()
        for i in range(steps):
            engine.step([100 + r for r in rows], rows, [100 + i] * n, rows)
        _native.pool_alone(False)
        return (clock() - c0) / steps * 1e3

    cases = {"1": (1, False), "8": (8, False), "16": (16, False)} if args.mode == "rows" else \
        {"16 pool": (16, False), "8 alone": (8, True), "8 pool": (8, False)}
    for n, alone in cases.values():
        block(n, alone, 2)
    got: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(args.blocks):
        for k, (n, alone) in cases.items():
            got[k].append(block(n, alone, args.steps))
    med = {k: statistics.median(v) for k, v in got.items()}
    print(", ".join(f"{k} rows {v:.2f} ms" for k, v in med.items()), end="; ")
    if args.mode == "rows":
        print(f"8 rows / 1: {8 * med['1'] / med['8']:.2f}x the tok/s, 16 rows / 1: {16 * med['1'] / med['16']:.2f}x, "
              f"T(16) / 2 T(8) {med['16'] / (2 * med['8']):.3f}")
    else:
        ratio = [a / (2 * b) for a, b in zip(got["16 pool"], got["8 alone"])]
        print(f"CPU(16 pool) / 2 CPU(8 alone) median {statistics.median(ratio):.3f} ({min(ratio):.3f}-{max(ratio):.3f}), "
              f"CPU(16 pool) / 2 CPU(8 pool) {med['16 pool'] / (2 * med['8 pool']):.3f}")


if __name__ == "__main__":
    main()
