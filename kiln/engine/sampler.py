"""Sampling: pure functions from logits (and the tokens so far) to the next token."""

from __future__ import annotations

from collections import Counter
from typing import Sequence

import numpy as np

from kiln.sampling import SamplingParams

try:
    from kiln import _native
except ImportError:  # without the native core, top-k falls back to numpy's sort
    _native = None


def penalty_window(history: Sequence[int], p: SamplingParams) -> Sequence[int]:
    """The tokens the penalties count: the last `repeat_last_n` (-1: all)."""
    if p.repeat_last_n == -1:
        return history
    return history[len(history) - p.repeat_last_n :] if p.repeat_last_n else []


def penalized(logits: np.ndarray, history: Sequence[int], p: SamplingParams) -> tuple[np.ndarray, np.ndarray] | None:
    """The ids llama.cpp's repetition penalty (divide positive logits, multiply negative ones) and OpenAI's
    presence and frequency penalties touch, over the last `repeat_last_n` tokens (-1: all), and their
    new values; None when nothing changes."""
    if p.repeat_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0:
        return None
    window = penalty_window(history, p)
    if len(window) == 0:
        return None
    counted = Counter(window)
    ids = np.fromiter(counted.keys(), dtype=np.int64, count=len(counted))
    counts = np.fromiter(counted.values(), dtype=np.float64, count=len(counted))
    seen = logits[ids]
    values = np.where(seen > 0, seen / p.repeat_penalty, seen * p.repeat_penalty)
    return ids, (values - (p.presence_penalty + p.frequency_penalty * counts)).astype(logits.dtype)


def apply_penalties(logits: np.ndarray, history: Sequence[int], p: SamplingParams) -> np.ndarray:
    """`logits` with the penalties of `penalized` applied (a copy when any applies)."""
    change = penalized(logits, history, p)
    if change is None:
        return logits
    out = logits.copy()
    out[change[0]] = change[1]
    return out


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - np.max(x))
    return e / e.sum()


def log_softmax(x: np.ndarray) -> np.ndarray:
    shifted = x.astype(np.float64) - np.max(x)
    return shifted - np.log(np.exp(shifted).sum())


NUCLEUS_PROBE = 1024  # top-p without top-k first looks for the nucleus among this many best tokens


def top_indices(x: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest values, largest first (ties: lower index first)."""
    if _native is not None and k <= x.size // 8 and x.dtype == np.float32 and x.flags.c_contiguous:
        return np.frombuffer(_native.topk(x, k), dtype=np.int32).astype(np.int64)
    order = np.argsort(-x, kind="stable")
    return order[:k]


def candidates(logits: np.ndarray, p: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and probabilities a non-greedy sample is drawn from: temperature, then top-k, top-p and
    min-p, best first. Only the best few logits are ever sorted, which keeps sampling off the critical path."""
    logits = np.ascontiguousarray(logits, dtype=np.float32)
    n = logits.size
    if 0 < p.top_k < n:
        ids = top_indices(logits, p.top_k)
    elif p.top_p < 1.0:
        ids = top_indices(logits, min(n, NUCLEUS_PROBE))
        scaled = logits.astype(np.float64) / p.temperature
        top = scaled[ids[0]]
        if np.exp(scaled[ids] - top).sum() < p.top_p * np.exp(scaled - top).sum():
            ids = top_indices(logits, n)  # the nucleus is wider than the probe
    else:
        ids = None  # every token stays a candidate: no order needed
    scaled = (logits if ids is None else logits[ids]).astype(np.float64) / p.temperature
    probs = softmax(scaled)
    if ids is None:
        ids = np.arange(n)
    if p.top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(probs), p.top_p)) + 1
        ids, probs = ids[:keep], probs[:keep]
    if p.min_p > 0.0:
        keep = probs >= p.min_p * probs.max()
        ids, probs = ids[keep], probs[keep]
    return ids, probs / probs.sum()


def filtered_probs(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """The same distribution as `candidates`, over the whole vocabulary."""
    ids, probs = candidates(logits, p)
    out = np.zeros(logits.size)
    out[ids] = probs
    return out


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def native_spec(self, row: int, logits: np.ndarray, history: Sequence[int]) -> tuple | None:
        """Row `row` of a step's logits as the native sampler's spec (see csrc/sample.c), drawing the row's
        uniform; None where this module samples it instead: whole-vocabulary candidates (top_k 0), penalty
        windows longer than the native sampler takes, logits it cannot read in place."""
        p, n = self.params, logits.shape[-1]
        if _native is None or logits.dtype != np.float32 or not logits.flags.c_contiguous:
            return None
        if p.temperature != 0.0 and not 0 < p.top_k < n:
            return None
        window = penalty_window(history, p)
        if len(window) > _native.SAMPLE_MAX_WINDOW:
            return None
        u = self.rng.random() if p.temperature != 0.0 else 0.0  # the draw _choose would make
        return (row, np.asarray(window, dtype=np.int32).tobytes(), p.top_k, p.temperature, p.top_p, p.min_p,
                p.repeat_penalty, p.presence_penalty, p.frequency_penalty, u)

    def __call__(self, logits: np.ndarray, history: Sequence[int] = (), allowed: np.ndarray | None = None) -> int:
        """Next token id. `allowed` (bool per token) restricts the choice, e.g. to a JSON grammar."""
        spec = self.native_spec(0, logits, history) if allowed is None else None
        if spec is not None:
            return _native.sample_rows(None, logits, logits.size, [spec])[0]
        return self.reference(logits, history, allowed)

    def reference(self, logits: np.ndarray, history: Sequence[int] = (), allowed: np.ndarray | None = None) -> int:
        """The numpy sampler, the native one's reference: the same draws from the generator, the same token."""
        change = penalized(logits, history, self.params)
        if change is None:
            return self._choose(logits, allowed)
        ids, values = change
        if not logits.flags.writeable:  # a read-only view: penalize a copy
            logits = logits.copy()
            logits[ids] = values
            return self._choose(logits, allowed)
        # Penalize the few ids in place and put them back after, instead of copying the whole vocabulary's
        # logits for every token (a visible share of a serving engine thread: docs/PERF.md, "Sampling").
        saved = logits[ids]
        logits[ids] = values
        try:
            return self._choose(logits, allowed)
        finally:
            logits[ids] = saved

    def _choose(self, logits: np.ndarray, allowed: np.ndarray | None) -> int:
        if allowed is not None:
            logits = np.where(allowed[: logits.size], logits, -np.inf)
        if self.params.temperature == 0.0:
            return int(np.argmax(logits))
        ids, probs = candidates(logits, self.params)
        cumulative = np.cumsum(probs)
        return int(ids[min(int(np.searchsorted(cumulative, self.rng.random() * cumulative[-1], side="right")), ids.size - 1)])


def sample_rows(pool, logits: np.ndarray, rows: list[tuple[Sampler, int, Sequence[int]]]) -> list[int | None]:
    """A step's rows sampled natively at once, on `pool`'s threads: (sampler, row of `logits`, history) in,
    a token each out, or None for a row the caller samples itself (see Sampler.native_spec)."""
    if _native is None or logits.dtype != np.float32 or not logits.flags.c_contiguous:
        return [None] * len(rows)
    specs = [sampler.native_spec(row, logits[row], history) for sampler, row, history in rows]
    todo = [spec for spec in specs if spec is not None]
    if not todo:
        return [None] * len(rows)
    done = iter(_native.sample_rows(pool, logits, logits.shape[-1], todo))
    return [None if spec is None else next(done) for spec in specs]
