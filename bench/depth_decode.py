"""Decode of one sequence at depth 0 against one at `depth`, alternating in one process.

    python bench/depth_decode.py MODEL [--depth 8192] [--steps 16] [--rounds 4]

Two slots of one engine: slot 0 is prefilled with `depth` random ids once, slot 1 starts empty. Each round
times `steps` one-token steps in slot 1 (near depth 0), then `steps` in slot 0 (past `depth`), and prints
both medians and their ratio, so the machine's load changes the two alike."""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from kiln.engine.model import load


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--depth", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    m = load(a.model, backend="native", n_ctx=a.depth + a.steps * a.rounds, n_slots=2, threads=a.threads,
             progress=False)
    rng = np.random.default_rng(0)
    vocab = m.config.vocab_size
    t0 = time.perf_counter()
    m.engine.forward([int(i) for i in rng.integers(3, vocab, a.depth)], 0, 0)
    print(json.dumps({"prefill_s": time.perf_counter() - t0}), flush=True)
    at = {0: a.depth, 1: 0}
    for r in range(a.rounds):
        rates = {}
        for slot in (1, 0):
            times = []
            for _ in range(a.steps):
                t = time.perf_counter()
                m.engine.forward([int(rng.integers(3, vocab))], slot, at[slot])
                times.append(time.perf_counter() - t)
                at[slot] += 1
            rates[slot] = 1 / float(np.median(times))
        print(json.dumps({"round": r, "depth0_ts": rates[1], f"depth{a.depth}_ts": rates[0],
                          "ratio": rates[0] / rates[1]}), flush=True)
    m.close()


if __name__ == "__main__":
    main()
