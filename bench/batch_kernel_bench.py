"""The integer kernels at 1 and 8 tokens on one thread, weights in cache, timed in the thread's CPU time
(descheduled time is not counted, which is what lets a busy machine give readable figures).

    python bench/batch_kernel_bench.py [--rounds 7] [--isa avx512]

A 1024 x 1024 matrix per format (0.5-1.1 MiB, cache-resident); for each format and token count, the best
of `rounds` runs of 20 calls. Q6_K is in the list as a control for builds that change the other formats:
compare each format's time against it within one process.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT

from kiln.native import kernels as K

ROWS = COLS = 1024
TYPES = (QT.Q4_0, QT.Q4_1, QT.Q8_0, QT.Q4_K, QT.Q6_K)


def random_raw(t: QT, rng) -> np.ndarray:
    """Random GGUF blocks with every fp16 scale 0.01 (the bits of the quants do not change the timing)."""
    block, size = GGML_QUANT_SIZES[t]
    raw = rng.integers(0, 256, (ROWS, COLS // block, size), dtype=np.uint8)
    off = 208 if t == QT.Q6_K else 0
    raw[:, :, off : off + 2] = np.full((ROWS, COLS // block), 0.01, np.float16).view(np.uint8).reshape(ROWS, -1, 2)
    return raw.reshape(ROWS, -1)


def best_us(pm, act, n: int, rounds: int) -> float:
    y = np.empty((n, ROWS), np.float32)
    K.matmul(pm, act, n, y)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.thread_time_ns()
        for _ in range(20):
            K.matmul(pm, act, n, y)
        best = min(best, (time.thread_time_ns() - t0) / 20 / 1e3)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--isa", choices=K.ISAS, help="force an instruction set (default: the best this CPU runs)")
    args = ap.parse_args()
    if args.isa:
        K.force_isa(args.isa)
    rng = np.random.default_rng(0)
    print(f"ISA {K.active_isa()}, 1 thread, {ROWS} x {COLS}, best of {args.rounds} x 20 calls, thread CPU time")
    print(f"{'type':6} {'1 token us':>10} {'8 tokens us':>11} {'8 / Q6_K':>8}")
    times = {}
    for t in TYPES:
        pm = K.pack(t, random_raw(t, rng), ROWS, COLS)
        x = rng.standard_normal((8, COLS)).astype(np.float32)
        times[t] = (best_us(pm, K.quantize_act(pm.fmt, x[:1]), 1, args.rounds), best_us(pm, K.quantize_act(pm.fmt, x), 8, args.rounds))
    for t, (t1, t8) in times.items():
        print(f"{t.name:6} {t1:10.1f} {t8:11.1f} {t8 / times[QT.Q6_K][1]:8.3f}")


if __name__ == "__main__":
    main()
