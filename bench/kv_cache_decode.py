"""Decode of one sequence deep in its context, per KV cache type, alternating the types.

    python bench/kv_cache_decode.py MODEL [--depth 4096] [--steps 48] [--rounds 2]

Prefills `depth` random ids, then times `steps` one-token steps; prints each round's median t/s."""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from kiln.engine.model import load


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--depth", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--types", default="f16,q8_0")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    for _ in range(a.rounds):
        for kv in a.types.split(","):
            m = load(a.model, backend="native", n_ctx=a.depth + a.steps, threads=a.threads, progress=False,
                     kv_cache=kv)
            rng = np.random.default_rng(0)
            vocab = m.config.vocab_size
            m.engine.forward([int(i) for i in rng.integers(3, vocab, a.depth)])
            times = []
            for i in range(a.steps):
                t0 = time.perf_counter()
                m.engine.forward([int(rng.integers(3, vocab))], 0, a.depth + i)
                times.append(time.perf_counter() - t0)
            m.close()
            print(json.dumps({"kv_cache": kv, "depth": a.depth, "decode_ts": 1 / float(np.median(times))}), flush=True)


if __name__ == "__main__":
    main()
