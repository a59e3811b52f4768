"""`kiln bench TAG`: llama-bench's measurement of the engine alone.

Tests: `pp N` (prefill of N random tokens from an empty cache, or after `-d` tokens of depth) and
`tg N` (N decode steps, one token each; with `-b B`, B sequences decode side by side and the rate is
their aggregate). Random token ids: no tokenization, no sampling, as llama-bench; each figure is the
mean ± sd over `-r` repetitions after one warm-up. Random ids make flat next-token distributions, the
output head's refinement at its most expensive (csrc/op_logits.c); `--tokens greedy` feeds each sequence its
own greedy continuation instead (from a random first token, the argmax not timed), whose peaked
distributions are what generation sees. The JSON also says how much of each decode step was
spent outside the native call (host time), the bytes a decode step reads (packed weights, embedding rows,
the KV cache up to each position) as GB/s next to a plain read measured in the same run, and what the
process holds resident against the packed weights and KV cache it needs.
"""

from __future__ import annotations

import gc
import re
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

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
    step_bytes: float | None = None  # decode only: mean bytes one step reads (weights, embedding rows, KV)
    token_macs: int | None = None  # prefill only: multiply-accumulates of a token's matrix products
    pair_macs: float | None = None  # prefill only, a token's mean: those the second rows of its precise activations add

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
            "step_bytes": self.step_bytes,
            "gb_s": None if self.step_bytes is None else self.step_bytes * self.n_tokens / (statistics.median(ns) / 1e9) / 1e9,
            "token_macs": self.token_macs,
            "gmacs": None if self.token_macs is None else self.token_macs * statistics.median(ts) / 1e9,
            "pair_macs": self.pair_macs,
            "run_gmacs": None if self.token_macs is None else
            (self.token_macs + self.pair_macs) * statistics.median(ts) / 1e9,
        }


def _sd(values) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


def _label(kind: str, n: int, depth: int, batch: int) -> str:
    return f"{kind}{n}" + (f" b{batch}" if batch > 1 else "") + (f" @ d{depth}" if depth else "")


def bench_engine(engine, vocab: int, n_prompt: int, n_gen: int, depth: int, batch: int, reps: int,
                 rng: np.random.Generator, after_decode=None, tokens: str = "random") -> list[PerfResult]:
    """The pp and tg tests; `after_decode` runs after each timed decode repetition (a plain-read pass,
    so the bandwidth reference sees the same machine load as the decode it is compared to). `tokens`:
    what the tg test feeds, "random" ids or each sequence's "greedy" continuation."""
    results = []

    def fill_depth():
        for slot in range(batch):
            if depth:
                engine.forward(rng.integers(0, vocab, depth).tolist(), slot, 0)

    if n_prompt and batch == 1:
        r = PerfResult(_label("pp", n_prompt, depth, 1), engine.threads, depth, 1, n_prompt,
                       token_macs=token_macs(engine, vocab), pair_macs=pair_macs(engine, n_prompt))
        for rep in range(reps + 1):
            fill_depth()
            tokens = rng.integers(0, vocab, n_prompt).tolist()
            t0 = time.perf_counter_ns()
            engine.forward(tokens, 0, depth)
            if rep:
                r.samples_ns.append(time.perf_counter_ns() - t0)
        results.append(r)
    if n_gen:
        label = _label("tg", n_gen, depth, batch) + (" greedy" if tokens == "greedy" else "")
        r = PerfResult(label, engine.threads, depth, batch, n_gen)
        slots, rows = list(range(batch)), list(range(batch))
        native_ns = wall_ns = 0
        for rep in range(reps + 1):
            fill_depth()
            ids = rng.integers(0, vocab, (n_gen, batch)).tolist()
            before = engine.stats.native_ns
            if tokens == "greedy":
                elapsed, fed = 0, ids[0]
                for i in range(n_gen):
                    t0 = time.perf_counter_ns()
                    logits = engine.step(fed, slots, [depth + i] * batch, rows)
                    elapsed += time.perf_counter_ns() - t0
                    fed = logits.argmax(axis=-1).tolist()
            else:
                t0 = time.perf_counter_ns()
                for i in range(n_gen):
                    engine.step(ids[i], slots, [depth + i] * batch, rows)
                elapsed = time.perf_counter_ns() - t0
            if rep:
                r.samples_ns.append(elapsed)
                wall_ns += elapsed
                native_ns += engine.stats.native_ns - before
                if after_decode is not None:
                    after_decode()
        r.host_fraction = 1.0 - native_ns / wall_ns
        r.step_bytes = step_bytes(engine, batch, range(depth, depth + n_gen))
        results.append(r)
    return results


def token_macs(engine, vocab: int) -> int:
    """Multiply-accumulates of one prompt token's matrix products: every packed matrix but the output head
    (rows = the vocabulary), which a prompt runs for its last token only, and of a 3-D expert tensor the
    experts a token uses. Attention is not counted."""
    used = {name: e.n_used for e in getattr(engine.config, "experts", ()) for name in (e.gate, e.up, e.down)}
    return sum(lay["rows"] * lay["cols"] * used.get(name, 1) for name, lay in engine.weights.layouts.items()
               if lay["rows"] != vocab)


def pair_macs(engine, n_prompt: int) -> float:
    """Multiply-accumulates the second rows of a prompt token's precise activations add (csrc/ops.h), a mean
    over the prompt's steps: the integer matrices of the q/k/v projections and of the down projections (a
    MOE op's experts a token uses and its shared expert) take each token as two rows. Where the prefill's
    time goes beside token_macs. On AMX a step of amx_min_tokens rows or more runs its QKV and MATMUL ops
    on bf16 tiles, which sum each pair into one row (kiln_job_tiles in csrc/plan.c): no second rows there."""
    from kiln.native import kernels as K
    from kiln.trace import kind_names

    mats = {m.address: m.layout for m in engine.weights.mats.values()}
    experts = {id(t): engine.weights.matrix(name).layout for name, t in engine.weights.expert_tables.items()}
    names = kind_names()

    def q8(layout) -> bool:
        return K.act_kind(layout["fmt"]) == K.ActKind.Q8

    def products(layout, times: int = 1) -> int:
        return layout["rows"] * layout["cols"] * times if q8(layout) else 0

    def on_tiles(kind: str, op) -> bool:
        if kind == "MATMUL":
            return op.get("w") in mats and q8(mats[op["w"]])
        if kind == "QKV" and op["q_act"] == op["k_act"] == op["v_act"]:
            ws = [mats[op[key]] for key in ("wq", "wk", "wv")]
            return all(q8(w) and w["cols"] == ws[0]["cols"] for w in ws)
        return False

    every = tiled = 0
    for op in engine.prefill_plan.ops:
        kind = names[op["kind"]]
        if not op.get("precise") or kind not in ("QKV", "MATMUL", "MOE"):
            continue
        if kind == "MOE":
            n = products(experts[id(op["exp_down"])], op["n_used"])
            n += products(mats[op["sh_down"]]) if op.get("sh_down") in mats else 0
        else:
            n = sum(products(mats[op[key]]) for key in ("w", "wq", "wk", "wv") if op.get(key) in mats)
        every += n
        tiled += n if on_tiles(kind, op) else 0
    least = K.amx_min_tokens()
    if not tiled or K.active_isa() != "amx" or least is None or n_prompt < 1:
        return float(every)
    # the prompt's steps as NativeEngine.forward takes them; a step of `batch` rows or fewer runs the decode plan
    rows, batch = engine.limits.rows, engine.limits.batch
    steps = [min(rows, n_prompt - i) for i in range(0, n_prompt, rows)]
    on_amx = sum(s for s in steps if s > batch and s >= least)
    return every - tiled * on_amx / n_prompt


# The int8 unit each kernel variant's prefill runs on (kiln validate's peaks).
PEAK_UNIT = {"amx": "amx", "avx512": "avx512_vnni", "avx2": "avx2"}


def step_bytes(engine, batch: int, positions) -> float:
    """Mean bytes a decode step of `batch` sequences reads: every packed matrix once (a split output head's
    first pass: its low bits are read only near the best logits), an embedding row and the KV cache up to
    its position per sequence (kiln trace counts the same way). Of a MOE op, one row's experts: a batch
    reads the union of its rows' choices, so for a batch of several this is a lower bound."""
    from kiln.trace import dispatch_figures, kv_read_bytes

    d = dispatch_figures(engine)
    kv = statistics.fmean(kv_read_bytes(engine.decode_plan, p) for p in positions)
    return d["weight_bytes"] + batch * (d["embedding_row_bytes"] + kv)


def resident_bytes() -> int | None:
    """VmRSS of this process (Linux); None elsewhere."""
    try:
        return int(re.search(r"VmRSS:\s+(\d+) kB", Path("/proc/self/status").read_text())[1]) * 1024
    except (OSError, TypeError):
        return None


def memory_figures(engine, rss_before: int | None) -> dict:
    """Resident memory the model added (VmRSS after the tests less before the load) against the packed
    weights and KV cache it needs."""
    need = engine.weights.nbytes + engine.kv_arena.nbytes
    after = resident_bytes()
    grown = None if after is None or rss_before is None else after - rss_before
    return {"weights_bytes": engine.weights.nbytes, "kv_bytes": engine.kv_arena.nbytes, "rss_bytes": after,
            "rss_growth_bytes": grown, "growth_over_weights_kv": None if grown is None else grown / need,
            "method": "VmRSS after the tests less VmRSS before loading (kiln's modules already imported); "
                      "packed weights and the fp16 KV cache as allocated for this run's context"}


def run(model_ref: str, n_prompt: int, n_gen: int, threads: list[int], depths: list[int], batches: list[int],
        reps: int, seed: int = 0, progress=None, tokens: str = "random", kv_cache: str = "f16") -> dict:
    from kiln.engine import native  # noqa: F401  (imported before the baseline of the memory figures)
    from kiln.engine.model import load, release_free_heap
    from kiln.machine import facts
    from kiln.native import kernels as K
    from kiln.validate import ReadLoop, int8_peaks

    results, about, memory, reads = [], {}, {}, {}
    n_ctx = max(depths) + max(n_prompt, n_gen) + 1
    for t in threads:
        read, passes = ReadLoop(t) if n_gen else None, []  # allocated before the memory baseline
        read_pass = (lambda: passes.append(read.pass_gb_s())) if read else None
        gc.collect()
        release_free_heap()  # as load() does at its end: both ends of the difference trimmed alike
        rss_before = resident_bytes()
        model = load(model_ref, backend="native", n_ctx=n_ctx, n_slots=max(batches), threads=t, progress=False,
                     kv_cache=kv_cache)
        cfg = model.config
        about = {"model": model.tag, "model_sha256": model.sha256, "model_name": cfg.name, "kv_cache": kv_cache,
                 "architecture": cfg.architecture, "model_size": model.gguf.file_size(),
                 "n_params": sum(t.n_elements for t in model.gguf.tensors.values())}
        rng = np.random.default_rng(seed)
        for depth in depths:
            for batch in batches:
                if progress:
                    progress(f"threads {t}, depth {depth}, batch {batch}")
                results += bench_engine(model.engine, cfg.vocab_size, n_prompt, n_gen, depth, batch, reps, rng,
                                          after_decode=read_pass, tokens=tokens)
        memory[t] = memory_figures(model.engine, rss_before)
        model.close()
        if read is not None:
            reads[t] = read.figures(passes, "each right after a timed decode repetition")
        del model, read
    summaries = [r.summary() for r in results]
    unit = PEAK_UNIT.get(K.active_isa())
    peak = int8_peaks()["gmacs_per_core"].get(unit) if n_prompt and unit else None
    for r in summaries:
        if r["gb_s"] is not None and r["threads"] in reads:
            r["of_plain_read"] = r["gb_s"] / reads[r["threads"]]["gb_s"]
        if r["gmacs"] is not None and peak:
            r["of_peak"] = r["gmacs"] / (peak * r["threads"])
            r["run_of_peak"] = r["run_gmacs"] / (peak * r["threads"])
    return {
        **about, "backend": "native", "tokens": tokens,
        "method": ("random token ids" if tokens == "random" else "decode: each sequence's greedy continuation "
                   "of a random first token (pp: random token ids)") + "; tokenization and sampling are not "
        f"timed; mean ± sd over {reps} repetitions after one warm-up",
        "machine": facts(), "results": summaries,
        "plain_read": {str(t): f for t, f in reads.items()}, "memory": {str(t): m for t, m in memory.items()},
        "int8_peak": None if not peak else {"unit": unit, "gmacs_per_core": peak,
                                            "method": "kiln validate's int8 peaks: the unit's products alone, one core, "
                                                      "best of 5 passes; x threads"},
    }
