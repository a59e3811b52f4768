"""The single-sequence loop: prefill, then sample → append → decode until the sequence finishes."""

from __future__ import annotations

import time
from typing import Iterator

from kiln.engine.sequence import Sequence


def generate(engine, seq: Sequence, cached: int = 0) -> Iterator[str]:
    """Yield text as it is released. `cached` prompt tokens already sit in the slot's KV cache; at least
    the last prompt token is always recomputed, since its logits are needed. A speculating sequence feeds
    its last token and a draft in one pass, and takes what the target accepts (kiln.engine.speculative)."""
    from kiln.engine.speculative import Draft, draft_limit, pass_room, propose, verify

    cached = min(cached, len(seq.prompt_ids) - 1)
    seq.timings.cached_tokens = cached
    if seq.finished:
        seq.finish(seq.finish_reason)
        return
    t0 = time.perf_counter()
    logits = engine.forward(seq.prompt_ids[cached:], seq.slot, cached)
    seq.timings.prefill_ms = (time.perf_counter() - t0) * 1e3
    try:
        tokens = [seq.sample(logits)]
        while True:
            for token in tokens:
                piece = seq.append(token)
                if piece:
                    yield piece
                if seq.finished:
                    return
            limit = min(draft_limit(seq), pass_room(engine))
            draft = propose([(seq, limit)])[0] if limit else Draft([])
            rows = [token, *draft.tokens]
            position = len(seq.all_ids) - 1  # the last token is the first not in the KV cache
            logits = engine.step(rows, [seq.slot] * len(rows), range(position, position + len(rows)),
                                 range(len(rows)))
            tokens = verify(seq, draft, logits)
    finally:
        seq.finish("cancelled")
