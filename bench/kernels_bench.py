"""Microbenchmark of the matmul kernels on one thread.

GEMV (n_tok = 1): GB/s of packed weights streamed from DRAM (matrices are replicated past the L3
cache and cycled), next to a plain read loop over a buffer of the same size in the same run.
Batched decode (n_tok = 8): aggregate speedup over 8 single-token calls. Prefill (n_tok = 512): GOPS
(2 * rows * cols * tokens / time) with weights in cache. Weights are random GGUF blocks on huge pages.

    python bench/kernels_bench.py [--isa avx2] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT

from kiln import _native
from kiln.native import kernels as K

SMOL = [(576, 1536), (1536, 576), (49152, 576)]
QWEN = [(1024, 3072), (3072, 1024), (151936, 1024)]
STREAM_BYTES = 192 << 20  # well past a 32 MiB L3


def random_raw(t: QT, rows: int, cols: int, rng) -> np.ndarray:
    if t == QT.F16:
        return rng.standard_normal((rows, cols)).astype(np.float16)
    block, size = GGML_QUANT_SIZES[t]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    off = 208 if t == QT.Q6_K else 0
    raw[:, :, off : off + 2] = np.full((rows, cols // block), 0.01, np.float16).view(np.uint8).reshape(rows, -1, 2)
    return raw.reshape(rows, -1)


def timed(fn, reps: int) -> float:
    """Median seconds of `reps` calls after one warm-up."""
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


class Copies:
    """A packed matrix replicated back to back on huge pages, so that one pass over all copies streams
    from DRAM."""

    def __init__(self, t: QT, rows: int, cols: int, rng, min_bytes: int):
        size = K.pack_size(t, rows, cols)
        self.n = max(1, -(-min_bytes // size))
        self.buf = K.huge_empty(self.n * size)
        first = K.pack(t, random_raw(t, rows, cols, rng), rows, cols, out=self.buf[:size])
        for i in range(1, self.n):
            self.buf[i * size : (i + 1) * size] = self.buf[:size]
        self.mats = [K.PackedMatrix(first.fmt, rows, cols, first.rows_padded, first.tile_bytes, self.buf[i * size : (i + 1) * size])
                     for i in range(self.n)]
        self.bytes = first.tiles * first.tile_bytes

    def run_all(self, act, n_tok: int, y) -> None:
        for m in self.mats:
            _native.matmul(int(m.fmt), m.rows, m.cols, m.tile_bytes, m.data, act, n_tok, y, m.rows, 0, m.tiles)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--isa", choices=K.ISAS, help="force an instruction set (default: the best this CPU runs)")
    ap.add_argument("--quick", action="store_true", help="fewer shapes and repetitions")
    args = ap.parse_args()
    if args.isa:
        K.force_isa(args.isa)
    reps = 3 if args.quick else 5
    rng = np.random.default_rng(0)
    print(f"ISA {K.active_isa()}, 1 thread")

    buf = K.huge_empty(STREAM_BYTES)
    buf[:] = 1
    read_s = timed(lambda: K.mem_read(buf), reps)
    read_gbs = STREAM_BYTES / read_s / 1e9
    print(f"plain read loop: {read_gbs:.1f} GB/s over {STREAM_BYTES >> 20} MiB\n")

    gemv = [(t, s) for t in (QT.Q4_0, QT.Q4_1, QT.Q8_0) for s in SMOL + QWEN]
    gemv += [(t, s) for t in (QT.Q5_0, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.F16) for s in QWEN[:2]]
    if args.quick:
        gemv = [(t, s) for t, s in gemv if s in (SMOL[2], QWEN[0], QWEN[1])]
    print(f"{'type':6} {'rows x cols':>13} {'MiB':>6} {'GEMV GB/s':>9} {'of read':>7} {'x8 speedup':>10}")
    for t, (rows, cols) in gemv:
        c = Copies(t, rows, cols, rng, STREAM_BYTES)
        fmt = c.mats[0].fmt
        x = rng.standard_normal((8, cols)).astype(np.float32)
        a1, a8 = K.quantize_act(fmt, x[:1]), K.quantize_act(fmt, x)
        y1, y8 = np.empty((1, rows), np.float32), np.empty((8, rows), np.float32)
        t1 = timed(lambda: c.run_all(a1, 1, y1), reps)
        gbs = c.n * c.bytes / t1 / 1e9
        line = f"{t.name:6} {rows:>6} x {cols:<5} {c.bytes / 2**20:6.2f} {gbs:9.1f} {gbs / read_gbs:6.0%}"
        if rows < 100000:
            t8 = timed(lambda: c.run_all(a8, 8, y8), reps)
            line += f" {8 * t1 / t8:10.2f}"
        print(line)
        del c

    print(f"\n{'type':6} {'rows x cols':>13} {'tokens':>6} {'GOPS':>6} {'quantize ms':>11}")
    for t in (QT.Q4_0, QT.Q4_1, QT.Q8_0, QT.Q5_0, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.F16)[: 3 if args.quick else None]:
        rows, cols, n = 1024, 3072, 512
        pm = K.pack(t, random_raw(t, rows, cols, rng), rows, cols, out=K.huge_empty(K.pack_size(t, rows, cols)))
        x = rng.standard_normal((n, cols)).astype(np.float32)
        act = K.quantize_act(pm.fmt, x)
        y = np.empty((n, rows), np.float32)
        tq = timed(lambda: K.quantize_act(pm.fmt, x, out=act), reps)
        tg = timed(lambda: _native.matmul(int(pm.fmt), rows, cols, pm.tile_bytes, pm.data, act, n, y, rows, 0, pm.tiles), reps)
        print(f"{t.name:6} {rows:>6} x {cols:<5} {n:6} {2 * rows * cols * n / tg / 1e9:6.0f} {tq * 1e3:11.2f}")


if __name__ == "__main__":
    main()
