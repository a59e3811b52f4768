"""Decode of one sequence deep in its context, per KV cache type, the types interleaved.

    python bench/kv_cache_decode.py MODEL [--depth 8192] [--steps 32] [--rounds 5] [--types f16,q8_0,q4_0]

One engine per type is prefilled once with the same `depth` random ids; then each round times `steps`
one-token steps on every engine in turn (the order rotating from round to round), at the same positions
each round (a step overwrites the last round's). Prints each round's median t/s per type, then per type
the median over rounds and the median of the rounds' ratios to the first type."""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from kiln.engine.model import load


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--depth", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--types", default="f16,q8_0,q4_0")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    types = a.types.split(",")
    models = {}
    for kv in types:
        m = models[kv] = load(a.model, backend="native", n_ctx=a.depth + a.steps, threads=a.threads, progress=False,
                              kv_cache=kv)
        vocab = m.config.vocab_size
        m.engine.forward([int(i) for i in np.random.default_rng(0).integers(3, vocab, a.depth)])
    steps = [int(i) for i in np.random.default_rng(1).integers(3, vocab, a.steps)]
    rates = {kv: [] for kv in types}
    for r in range(a.rounds):
        for kv in types[r % len(types):] + types[: r % len(types)]:
            times = []
            for i, tok in enumerate(steps):
                t0 = time.perf_counter()
                models[kv].engine.forward([tok], 0, a.depth + i)
                times.append(time.perf_counter() - t0)
            rates[kv].append(1 / float(np.median(times)))
        print(json.dumps({"round": r, "depth": a.depth, "load": os.getloadavg()[0],
                          **{kv: round(rates[kv][-1], 2) for kv in types}}), flush=True)
    base = types[0]
    for kv in types:
        ratio = float(np.median(np.array(rates[kv]) / np.array(rates[base])))
        print(json.dumps({"kv_cache": kv, "depth": a.depth, "decode_ts_median": float(np.median(rates[kv])),
                          f"ratio_to_{base}": ratio}), flush=True)
    for m in models.values():
        m.close()


if __name__ == "__main__":
    main()
