"""`kiln bench TAG`: llama-bench's measurement of the engine alone.

Tests: `pp N` (prefill of N random tokens from an empty cache, or after `-d` tokens of depth) and
`tg N` (N decode steps, one token each; with `-b B`, B sequences decode side by side and the rate is
their aggregate). Random token ids: no tokenization, no sampling, as llama-bench; each figure is the
mean ± sd over `-r` repetitions after one warm-up. The JSON also says how much of each decode step was
spent outside the native call (host time).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field

import numpy as np


@dataclass
class PerfResult:
    test: str
    threads: int
    depth: int
    batch: int
    n_tokens: int
    samples_ns: list[int] = field(default_factory=list)
    host_fraction: float | None = None  # decode only: share of wall time outside the native call

    @property
    def samples_ts(self) -> list[float]:
        return [self.n_tokens * self.batch / (ns / 1e9) for ns in self.samples_ns]

    def summary(self) -> dict:
        ts, ns = self.samples_ts, self.samples_ns
        return {
            "test": self.test, "threads": self.threads, "depth": self.depth, "batch": self.batch,
            "n_tokens": self.n_tokens, "avg_ns": statistics.mean(ns), "stddev_ns": _sd(ns),
            "avg_ts": statistics.mean(ts), "stddev_ts": _sd(ts), "median_ts": statistics.median(ts),
            "samples_ns": ns, "samples_ts": ts, "host_fraction": self.host_fraction,
        }


def _sd(values) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


def _label(kind: str, n: int, depth: int, batch: int) -> str:
    return f"{kind}{n}" + (f" b{batch}" if batch > 1 else "") + (f" @ d{depth}" if depth else "")


def bench_engine(engine, vocab: int, n_prompt: int, n_gen: int, depth: int, batch: int, reps: int,
                 rng: np.random.Generator) -> list[PerfResult]:
    results = []

    def fill_depth():
        for slot in range(batch):
            if depth:
                engine.forward(rng.integers(0, vocab, depth).tolist(), slot, 0)

    if n_prompt and batch == 1:
        r = PerfResult(_label("pp", n_prompt, depth, 1), engine.threads, depth, 1, n_prompt)
        for rep in range(reps + 1):
            fill_depth()
            tokens = rng.integers(0, vocab, n_prompt).tolist()
            t0 = time.perf_counter_ns()
            engine.forward(tokens, 0, depth)
            if rep:
                r.samples_ns.append(time.perf_counter_ns() - t0)
        results.append(r)
    if n_gen:
        r = PerfResult(_label("tg", n_gen, depth, batch), engine.threads, depth, batch, n_gen)
        slots, rows = list(range(batch)), list(range(batch))
        native_ns = wall_ns = 0
        for rep in range(reps + 1):
            fill_depth()
            tokens = rng.integers(0, vocab, (n_gen, batch)).tolist()
            before = engine.stats.native_ns
            t0 = time.perf_counter_ns()
            for i in range(n_gen):
                engine.step(tokens[i], slots, [depth + i] * batch, rows)
            elapsed = time.perf_counter_ns() - t0
            if rep:
                r.samples_ns.append(elapsed)
                wall_ns += elapsed
                native_ns += engine.stats.native_ns - before
        r.host_fraction = 1.0 - native_ns / wall_ns
        results.append(r)
    return results


def run(model_ref: str, n_prompt: int, n_gen: int, threads: list[int], depths: list[int], batches: list[int],
        reps: int, seed: int = 0, progress=None) -> dict:
    from kiln.engine.model import load
    from kiln.machine import facts

    results, about = [], {}
    n_ctx = max(depths) + max(n_prompt, n_gen) + 1
    for t in threads:
        model = load(model_ref, backend="native", n_ctx=n_ctx, n_slots=max(batches), threads=t, progress=False)
        cfg = model.config
        about = {"model": model.tag, "model_sha256": model.sha256, "model_name": cfg.name,
                 "architecture": cfg.architecture, "model_size": model.gguf.file_size(),
                 "n_params": sum(t.n_elements for t in model.gguf.tensors.values())}
        rng = np.random.default_rng(seed)
        for depth in depths:
            for batch in batches:
                if progress:
                    progress(f"threads {t}, depth {depth}, batch {batch}")
                results += bench_engine(model.engine, cfg.vocab_size, n_prompt, n_gen, depth, batch, reps, rng)
        model.close()
    return {
        **about, "backend": "native", "method": "random token ids; tokenization and sampling are not timed; "
        f"mean ± sd over {reps} repetitions after one warm-up",
        "machine": facts(), "results": [r.summary() for r in results],
    }
