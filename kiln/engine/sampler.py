"""Sampling: pure functions from logits (and the tokens so far) to the next token."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Sequence

import numpy as np

from kiln.errors import RequestError


@dataclass
class SamplingParams:
    """Defaults follow Ollama's; temperature 0 means greedy."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.9
    min_p: float = 0.0
    repeat_penalty: float = 1.1
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None

    def __post_init__(self):
        checks = {
            "temperature": self.temperature >= 0,
            "top_k": self.top_k >= 0,
            "top_p": 0 < self.top_p <= 1,
            "min_p": 0 <= self.min_p <= 1,
            "repeat_penalty": self.repeat_penalty > 0,
            "repeat_last_n": self.repeat_last_n >= -1,
        }
        for name, ok in checks.items():
            if not ok:
                raise RequestError(f"invalid sampling parameter {name}={getattr(self, name)!r}", param=name)

    @classmethod
    def greedy(cls) -> "SamplingParams":
        return cls(temperature=0.0, top_k=0, top_p=1.0, repeat_penalty=1.0)

    def replace(self, **changes) -> "SamplingParams":
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update({k: v for k, v in changes.items() if v is not None})
        return SamplingParams(**values)


def apply_penalties(logits: np.ndarray, history: Sequence[int], p: SamplingParams) -> np.ndarray:
    """llama.cpp's repetition penalty (divide positive logits, multiply negative ones) over the last
    `repeat_last_n` tokens (-1: all), then OpenAI's presence and frequency penalties over the same window."""
    if p.repeat_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0:
        return logits
    window = history if p.repeat_last_n == -1 else history[len(history) - p.repeat_last_n :] if p.repeat_last_n else []
    if len(window) == 0:
        return logits
    ids, counts = np.unique(np.asarray(window, dtype=np.int64), return_counts=True)
    out = logits.copy()
    seen = out[ids]
    out[ids] = np.where(seen > 0, seen / p.repeat_penalty, seen * p.repeat_penalty)
    out[ids] -= p.presence_penalty + p.frequency_penalty * counts
    return out


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - np.max(x))
    return e / e.sum()


def log_softmax(x: np.ndarray) -> np.ndarray:
    shifted = x.astype(np.float64) - np.max(x)
    return shifted - np.log(np.exp(shifted).sum())


def candidates(logits: np.ndarray, p: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and probabilities a non-greedy sample is drawn from: temperature, then top-k, top-p
    and min-p. With top-k set only k logits are sorted, which keeps sampling off the critical path."""
    if 0 < p.top_k < logits.size:
        ids = np.argpartition(-logits, p.top_k - 1)[: p.top_k]
    else:
        ids = np.arange(logits.size)
    scaled = logits[ids].astype(np.float64) / p.temperature
    order = np.argsort(-scaled, kind="stable")
    ids, probs = ids[order], softmax(scaled[order])
    if p.top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(probs), p.top_p)) + 1
        ids, probs = ids[:keep], probs[:keep]
    if p.min_p > 0.0:
        keep = probs >= p.min_p * probs[0]
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

    def __call__(self, logits: np.ndarray, history: Sequence[int] = (), allowed: np.ndarray | None = None) -> int:
        """Next token id. `allowed` (bool per token) restricts the choice, e.g. to a JSON grammar."""
        logits = apply_penalties(logits, history, self.params)
        if allowed is not None:
            logits = np.where(allowed[: logits.size], logits, -np.inf)
        if self.params.temperature == 0.0:
            return int(np.argmax(logits))
        ids, probs = candidates(logits, self.params)
        return int(self.rng.choice(ids, p=probs))
