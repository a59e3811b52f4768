"""One generation request's state: its tokens, sampler, stop conditions, streamed text and timings.

Sequences are made by the front door (kiln.engine.request.prepare) and driven by the scheduler through
two calls, `sample(logits)` then `append(token)`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from kiln.engine.sampler import Sampler, log_softmax
from kiln.sampling import SamplingParams
from kiln.errors import ContextLengthError, Field, RequestError

if TYPE_CHECKING:
    from kiln.engine.grammar import Constraint
    from kiln.engine.speculative import Speculation
    from kiln.tokenizer import Tokenizer


@dataclass
class Timings:
    """Milliseconds unless named otherwise; every response carries these."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    queue_ms: float = 0.0
    load_ms: float = 0.0
    prefill_ms: float = 0.0  # prompt processing, up to the logits of the first token
    ttft_ms: float = 0.0  # from the start of processing to the first token sampled (queue wait excluded)
    decode_ms: float = 0.0  # from the first token to the last
    total_ms: float = 0.0
    decode_passes: int = 0  # target passes after the first token (one per token without speculation)
    draft_tokens: int = 0  # tokens proposed by speculative decoding
    draft_accepted: int = 0  # of those, accepted by the target

    @property
    def prefill_tps(self) -> float:
        computed = self.prompt_tokens - self.cached_tokens
        return computed / (self.prefill_ms / 1e3) if self.prefill_ms > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        steps = self.completion_tokens - 1  # the first token comes from prefill
        return steps / (self.decode_ms / 1e3) if steps > 0 and self.decode_ms > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "completion_tokens": self.completion_tokens,
            "queue_ms": round(self.queue_ms, 3),
            "load_ms": round(self.load_ms, 3),
            "prefill_ms": round(self.prefill_ms, 3),
            "ttft_ms": round(self.ttft_ms, 3),
            "decode_ms": round(self.decode_ms, 3),
            "total_ms": round(self.total_ms, 3),
            "prefill_tps": round(self.prefill_tps, 2),
            "decode_tps": round(self.decode_tps, 2),
            "decode_passes": self.decode_passes,
            "draft_tokens": self.draft_tokens,
            "draft_accepted": self.draft_accepted,
        }


def plan_budget(prompt_len: int, max_tokens: int | None, n_ctx: int) -> int:
    """How many tokens may be generated: `max_tokens`, or as many as the context has room for when that is
    fewer (the sequence then ends with finish_reason "length", as OpenAI's and llama-server's do). A prompt
    that does not fit is an error — kiln never truncates a prompt silently."""
    if max_tokens is not None and max_tokens < 0:
        raise RequestError((Field("max_tokens"), f" must be >= 0, got {max_tokens}"), param="max_tokens")
    if prompt_len >= n_ctx:
        raise ContextLengthError(
            f"the prompt is {prompt_len} tokens but the context holds {n_ctx} (at least one must be left to generate)"
        )
    return min(n_ctx - prompt_len, n_ctx if max_tokens is None else max_tokens)


@dataclass
class Sequence:
    prompt_ids: list[int]
    params: SamplingParams
    tokenizer: Tokenizer
    max_tokens: int
    stop: list[str] = field(default_factory=list)
    stop_ids: frozenset[int] = frozenset()
    slot: int = 0
    logprobs: int | None = None  # top alternatives to report per token; None: no logprobs
    constraint: Constraint | None = None  # structured output: the grammar the tokens must follow
    speculation: Speculation | None = None  # who drafts tokens, how many
    logit_bias: dict[int, float] | None = None  # added to those tokens' logits before sampling (OpenAI's)
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    timings: Timings = field(default_factory=Timings)
    token_logprobs: list[dict] = field(default_factory=list)

    def __post_init__(self):
        self.sampler = Sampler(self.params)
        self.decoder = self.tokenizer.stream()
        self.text = ""  # text released to the client
        self._held = ""  # decoded text withheld because it may be the start of a stop string
        self.stop_string: str | None = None  # the stop string that ended the text, if one did
        self.timings.prompt_tokens = len(self.prompt_ids)
        self.started = time.perf_counter()
        self._last = self.started
        if self.max_tokens == 0:
            self.finish_reason = "length"

    def start_clock(self) -> None:
        """Time from now: a queued sequence starts when it gets a KV slot, not when it was made."""
        self.started = self._last = time.perf_counter()

    @property
    def adjusts_logits(self) -> bool:
        """A grammar or a logit bias changes this sequence's logits before sampling: its rows are sampled
        here, one by one, not with a step's others, and it is not drafted for (verification samples the
        unadjusted distributions)."""
        return self.constraint is not None or bool(self.logit_bias)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def sample(self, logits: np.ndarray, ahead: list[int] = (), token: int | None = None) -> int:
        """The next token; `ahead` are tokens a speculative pass accepted but not yet appended, which the
        penalties must see. `token`: drawn already with the step's other rows (sampler.sample_rows)."""
        if token is None and self.logit_bias:
            logits = logits.copy()
            ids = np.fromiter(self.logit_bias, dtype=np.int64, count=len(self.logit_bias))
            logits[ids] += np.fromiter(self.logit_bias.values(), dtype=np.float32, count=len(ids))
        if token is None:
            allowed = self.constraint.allowed() if self.constraint is not None else None
            token = self.sampler(logits, self.all_ids + list(ahead) if ahead else self.all_ids, allowed)
        self.note_logprob(logits, token)
        return token

    def note_logprob(self, logits: np.ndarray, token: int) -> None:
        if self.logprobs is not None:
            self.token_logprobs.append(_logprob_record(logits, token, self.logprobs, self.tokenizer))

    def append(self, token: int) -> str:
        """Record a sampled token; return the text it releases (maybe empty)."""
        now = time.perf_counter()
        if not self.output_ids:
            self.timings.ttft_ms = (now - self.started) * 1e3
        else:
            self.timings.decode_ms += (now - self._last) * 1e3
        self._last = now
        self.output_ids.append(token)
        self.timings.completion_tokens = len(self.output_ids)
        if self.constraint is not None:
            self.constraint.consume(token)
        if token in self.stop_ids:
            self.finish_reason = "stop"
            return self._release(self._held + self.decoder.flush(), final=True)
        piece = self._release(self._held + self.decoder.feed(token), final=False)
        if self.finished:
            return piece
        if self.constraint is not None and self.constraint.done():
            self.finish_reason = "stop"
        elif len(self.output_ids) >= self.max_tokens:
            self.finish_reason = "length"
        else:
            return piece
        return piece + self._release(self._held + self.decoder.flush(), final=True)

    def _release(self, text: str, final: bool) -> str:
        self._held = ""
        for s in self.stop:
            at = text.find(s)
            if at != -1:
                self.finish_reason, self.stop_string = "stop", s
                text, final = text[:at], True
        if not final:
            keep = max((_overlap(text, s) for s in self.stop), default=0)
            text, self._held = text[: len(text) - keep], text[len(text) - keep :]
        self.text += text
        return text

    def finish(self, reason: str) -> None:
        if not self.finished:
            self.finish_reason = reason
        del self.token_logprobs[len(self.output_ids):]  # a speculative pass noted tokens a stop then dropped
        self.timings.total_ms = (time.perf_counter() - self.started) * 1e3


def _overlap(text: str, stop: str) -> int:
    """Length of the longest end of `text` that begins `stop`."""
    for n in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0


def _logprob_record(logits: np.ndarray, token: int, top: int, tokenizer) -> dict:
    lp = log_softmax(logits)
    best = np.argsort(-lp)[:top] if top > 0 else []
    return {
        "id": token,
        "token": tokenizer.decode([token], skip_special=False),
        "logprob": float(lp[token]),
        "top": [{"id": int(i), "token": tokenizer.decode([int(i)], skip_special=False), "logprob": float(lp[i])} for i in best],
    }
