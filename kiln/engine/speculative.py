"""Speculative decoding: a cheap drafter proposes the next few tokens, the target model checks them all in
one pass, and an accept/reject rule keeps a prefix of them without changing what the target would sample.

On a memory-bound CPU a pass over 1 + k rows reads the weights once, so checking k draft tokens costs far
less than generating them one by one; every accepted draft token is a pass saved.

Drafters (each has `propose(jobs) -> drafts` for a list of (sequence, most tokens) jobs):

- `LookupDrafter`, prompt lookup: the tokens that followed the most recent earlier occurrence of the
  context's last n tokens (n = ngram down to 1). No second model; it pays off when the output repeats its
  input (code edits, quoting). One per sequence: it indexes that sequence's n-grams as they arrive.
- `ModelDrafter`: a smaller model with the same vocabulary drafts token by token on its own KV cache (one
  slot per target slot), greedily for greedy requests, else sampling from its own distribution q (the
  request's penalties and filters applied to its logits). One per loaded target; it batches the
  sequences it drafts for.

How many tokens to draft adapts per sequence (`Speculation`): long drafts while they are accepted, short
ones after a rejection, since every extra row of a pass costs something on a CPU.

The accept rule (`verify`, Leviathan et al. / Chen et al. 2023). Row i of the target's pass gives p_i, the
distribution the sampler would draw from after the context plus draft[:i]: penalties over that history,
then temperature, top-k, top-p and min-p (`filtered_probs`). A greedy request accepts draft x_i while it
is the argmax. A sampled one accepts x_i with probability min(1, p_i(x_i) / q_i(x_i)); on rejection it
draws from the residual max(0, p_i − q_i), normalized; after a full acceptance it draws a bonus token from
the last row. Each emitted token is then distributed exactly as p (q is one-hot for prompt lookup and
greedy drafts). Greedy output is identical to decoding without speculation, because the native engine's
logits for a row do not depend on which other rows share its pass. Sampled output has the same
distribution, but a seeded request consumes its random stream differently, so it is not the same text.

Not speculated: sequences under a grammar (structured output, forced tool calls), whose token mask would
have to advance over the draft and rewind on rejection.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence as Seq

import numpy as np

from kiln.engine.kv import common_prefix
from kiln.engine.sampler import apply_penalties, candidates, filtered_probs
from kiln.errors import Field, KilnError, RequestError

MODES = ("none", "lookup", "model")
MAX_DRAFT = 32  # a pass over more rows costs more than the tokens it can save on a CPU
MAX_NGRAM = 8


@dataclass(frozen=True)
class SpecOptions:
    """How a request speculates: `mode` none, lookup (prompt lookup) or model (the draft model), at most
    `max` draft tokens per pass (fewer when one engine pass cannot return logits for that many rows),
    prompt lookup matching up to `ngram` tokens."""

    mode: str = "none"
    max: int = 8
    ngram: int = 4

    def replace(self, names: Seq[str] = ("mode", "max", "ngram"), **changes) -> "SpecOptions":
        """These options with `changes` (None: keep) applied and checked; `names` are the parameters to
        blame (a CLI flag, a request field) for mode, max and ngram."""
        mode, max_, ngram = (changes.get(k) if changes.get(k) is not None else getattr(self, k)
                             for k in ("mode", "max", "ngram"))
        if mode not in MODES:
            raise RequestError((Field(names[0]), f" must be one of {', '.join(MODES)}, got {mode!r}"), names[0])
        if isinstance(max_, bool) or not isinstance(max_, int) or not 1 <= max_ <= MAX_DRAFT:
            raise RequestError((Field(names[1]), f" must be an integer from 1 to {MAX_DRAFT}, got {max_!r}"), names[1])
        if isinstance(ngram, bool) or not isinstance(ngram, int) or not 1 <= ngram <= MAX_NGRAM:
            raise RequestError((Field(names[2]), f" must be an integer from 1 to {MAX_NGRAM}, got {ngram!r}"), names[2])
        return SpecOptions(mode, max_, ngram)


@dataclass
class Speculation:
    """One sequence's speculative decoding: who drafts, and how many tokens per pass. A pass over more
    rows costs more (on a 2-core CPU each extra row ~0.2-0.3 of a one-row pass), so the draft length
    adapts: it doubles after a fully accepted draft, up to `max_draft`, and drops to one more than was
    accepted after a rejection. Long drafts while the output copies its context, short ones otherwise."""

    drafter: LookupDrafter | ModelDrafter
    max_draft: int
    length: int = 0  # tokens to draft next pass; 0: start at max_draft

    def __post_init__(self):
        self.length = self.length or self.max_draft

    def adapt(self, drafted: int, accepted: int) -> None:
        if drafted:
            self.length = min(self.max_draft, 2 * self.length) if accepted == drafted else accepted + 1


def speculation(options: SpecOptions, drafter: "ModelDrafter | None", param: str = "mode") -> Speculation | None:
    """The Speculation a sequence gets under `options`; `drafter` is the loaded draft model, if any."""
    if options.mode == "none":
        return None
    if options.mode == "lookup":
        return Speculation(LookupDrafter(options.ngram), options.max)
    if drafter is None:
        raise RequestError((Field(param), " 'model' needs a draft model, and none is loaded (give --draft-model)"), param)
    return Speculation(drafter, options.max)


@dataclass
class Draft:
    tokens: list[int]
    # Per token, the draft model's distribution (ids, probs) it was sampled from; None: every token was
    # chosen outright (prompt lookup, greedy drafting), i.e. q is one-hot.
    q: list[tuple[np.ndarray, np.ndarray]] | None = None

    def prob(self, i: int, token: int) -> float:
        if self.q is None:
            return 1.0
        ids, probs = self.q[i]
        return float(probs[ids == token].sum())


def draft_limit(seq) -> int:
    """How many tokens may be drafted for `seq` this pass: its current draft length, and one less than
    it may still generate (the pass adds one token of the target's own); none when a grammar or a bias
    adjusts its logits."""
    spec = seq.speculation
    if spec is None or seq.adjusts_logits:
        return 0
    return max(0, min(spec.length, seq.max_tokens - len(seq.output_ids) - 1))


def propose(jobs: list[tuple[object, int]]) -> list[Draft]:
    """Drafts for (sequence, most tokens) jobs, in order; each drafter is asked once for all its jobs."""
    groups: dict[int, tuple[object, list[int]]] = {}
    for i, (seq, _) in enumerate(jobs):
        groups.setdefault(id(seq.speculation.drafter), (seq.speculation.drafter, []))[1].append(i)
    drafts: list[Draft] = [None] * len(jobs)
    for drafter, members in groups.values():
        for i, draft in zip(members, drafter.propose([jobs[i] for i in members])):
            drafts[i] = draft
    return drafts


def verify(seq, draft: Draft, rows: np.ndarray, own: int | None = None) -> list[int]:
    """The tokens one target pass yields for `seq`: the accepted prefix of `draft`, then one token of the
    target's own (the correction after a rejection, the bonus after a full acceptance). `rows[i]` are the
    logits after the context plus draft.tokens[:i]. The caller appends the tokens one by one (a stop may
    discard the rest); their logprob records are noted here. `own`: the target's token of an empty draft,
    drawn already with the step's other rows."""
    params, rng, t = seq.sampler.params, seq.sampler.rng, seq.timings
    t.decode_passes += 1
    t.draft_tokens += len(draft.tokens)
    history, out = seq.all_ids, []
    for i, x in enumerate(draft.tokens):
        logits = apply_penalties(rows[i], history + out, params)
        if params.temperature == 0.0:
            token = int(np.argmax(logits))
        else:
            p = filtered_probs(logits, params)
            if rng.random() * draft.prob(i, x) < p[x]:  # u < p(x) / q(x)
                token = x
            else:
                token = _resample(p, draft, i, x, rng)
        seq.note_logprob(rows[i], token)
        out.append(token)
        if token != x:
            _accepted(seq, len(draft.tokens), i)
            return out
    _accepted(seq, len(draft.tokens), len(draft.tokens))
    out.append(seq.sample(rows[len(out)], ahead=out, token=own))
    return out


def _accepted(seq, drafted: int, accepted: int) -> None:
    seq.timings.draft_accepted += accepted
    if seq.speculation is not None:
        seq.speculation.adapt(drafted, accepted)


def _resample(p: np.ndarray, draft: Draft, i: int, x: int, rng) -> int:
    """A draw from max(0, p − q), normalized: what makes a rejection leave the output distributed as p."""
    residual = p.copy()
    if draft.q is None:
        residual[x] = 0.0
    else:
        ids, probs = draft.q[i]
        residual[ids] = np.maximum(residual[ids] - probs, 0.0)
    total = residual.sum()
    if total <= 0.0:  # p == q up to rounding, where a rejection has probability ~0: p itself is exact
        residual, total = p, p.sum()
    ids = np.flatnonzero(residual)
    return int(rng.choice(ids, p=residual[ids] / total))


class LookupDrafter:
    """Prompt lookup for one sequence. Every n-gram (n ≤ ngram) of its context that has a token after it
    maps to where its most recent occurrence ends; a proposal is what followed the context's own last
    n tokens there, trying the longest n first."""

    def __init__(self, ngram: int):
        self.ngram = ngram
        self._ends: dict[tuple[int, ...], int] = {}
        self._indexed = 1  # n-grams ending before this position are indexed

    def propose(self, jobs: list[tuple[object, int]]) -> list[Draft]:
        return [Draft(self._lookup(seq.all_ids, k)) for seq, k in jobs]

    def _lookup(self, ids: list[int], k: int) -> list[int]:
        for end in range(self._indexed, len(ids)):  # only n-grams followed by a token: never the suffix itself
            for n in range(1, min(self.ngram, end) + 1):
                self._ends[tuple(ids[end - n : end])] = end
        self._indexed = max(self._indexed, len(ids))
        for n in range(min(self.ngram, len(ids)), 0, -1):
            end = self._ends.get(tuple(ids[-n:]))
            if end is not None:
                return ids[end : end + k]
        return []


def vocabulary_mismatch(draft, target) -> str | None:
    """What makes `draft`'s token ids mean something else than `target`'s, or None when they agree: the
    logits' width, the token strings, the special tokens."""
    dt, tt = draft.tokenizer, target.tokenizer
    if draft.config.vocab_size != target.config.vocab_size or dt.vocab_size != tt.vocab_size:
        return (f"vocabulary sizes differ ({dt.vocab_size} tokens, {draft.config.vocab_size} logits vs "
                f"{tt.vocab_size} tokens, {target.config.vocab_size} logits)")
    if _token_hash(dt) != _token_hash(tt):
        i = next(i for i in range(tt.vocab_size) if dt.id_to_token(i) != tt.id_to_token(i))
        return f"token strings differ (first at id {i}: {dt.id_to_token(i)!r} vs {tt.id_to_token(i)!r})"
    for name in ("bos_id", "eos_id", "stop_ids"):
        if getattr(dt, name) != getattr(tt, name):
            return f"special tokens differ ({name} {_show(getattr(dt, name))} vs {_show(getattr(tt, name))})"
    return None


def _token_hash(tokenizer) -> str:
    h = hashlib.sha256()
    for i in range(tokenizer.vocab_size):
        h.update(tokenizer.id_to_token(i).encode("utf-8", "surrogatepass") + b"\0")
    return h.hexdigest()


def _show(value) -> str:
    return str(sorted(value)) if isinstance(value, frozenset) else str(value)


class ModelDrafter:
    """A draft model drafting for a target: the same vocabulary, its own KV cache with a slot per target
    slot. It remembers which tokens each slot holds, so a slot is only fed what changed since its last
    draft: the target's correction, or a new prompt past the shared prefix."""

    def __init__(self, draft, target):
        problem = vocabulary_mismatch(draft, target)
        if problem:
            raise KilnError(f"draft model {draft.tag} cannot draft for {target.tag}: {problem}")
        if draft.engine.n_slots < target.engine.n_slots:
            raise KilnError(f"draft model {draft.tag} has {draft.engine.n_slots} KV slots, the target "
                            f"{target.tag} {target.engine.n_slots}; load it with as many")
        self.model = draft
        self.engine = draft.engine
        self.slot_tokens: list[list[int]] = [[] for _ in range(draft.engine.n_slots)]

    def propose(self, jobs: list[tuple[object, int]]) -> list[Draft]:
        """Batched over the jobs: one pass feeds every slot what it lacks, then one pass per draft token."""
        work = []  # (seq, k, context ids, draft tokens, q or None)
        tokens, slots, positions, out_rows = [], [], [], []
        for seq, k in jobs:
            ids = seq.all_ids
            k = min(k, self.engine.n_ctx - len(ids))  # the draft's context may be the shorter one
            if k <= 0:
                continue
            # a hybrid draft's recurrent state may no longer reach back there
            fed = self.engine.resume_point(seq.slot, min(common_prefix(self.slot_tokens[seq.slot], ids), len(ids) - 1))
            self.slot_tokens[seq.slot] = ids[:fed]  # until the passes below succeed
            tokens += ids[fed:]
            slots += [seq.slot] * (len(ids) - fed)
            positions += range(fed, len(ids))
            out_rows.append(len(tokens) - 1)
            work.append((seq, k, ids, [], None if seq.sampler.params.temperature == 0.0 else []))
        drafts, first = {}, True
        while work:
            logits = self._step(tokens, slots, positions, out_rows)
            if first:  # a draft state that cannot rewind keeps the context's end, where the next draft starts
                for seq, _, ids, _, _ in work:
                    self.engine.checkpoint(seq.slot, len(ids))
                first = False
            tokens, slots, positions, out_rows, going = [], [], [], [], []
            for (seq, k, ids, chosen, q), row in zip(work, logits):
                chosen.append(self._choose(seq, ids + chosen, row, q))
                if len(chosen) < k:
                    tokens.append(chosen[-1])
                    slots.append(seq.slot)
                    positions.append(len(ids) + len(chosen) - 1)
                    out_rows.append(len(tokens) - 1)
                    going.append((seq, k, ids, chosen, q))
                else:
                    self.slot_tokens[seq.slot] = ids + chosen[:-1]  # the last draft token was never fed
                    drafts[id(seq)] = Draft(chosen, q)
            work = going
        return [drafts.get(id(seq), Draft([])) for seq, _ in jobs]

    @staticmethod
    def _choose(seq, history: list[int], row: np.ndarray, q: list | None) -> int:
        params = seq.sampler.params
        logits = apply_penalties(row, history, params)
        if q is None:
            return int(np.argmax(logits))
        ids, probs = candidates(logits, params)
        q.append((ids, probs))
        return int(seq.sampler.rng.choice(ids, p=probs))

    def _step(self, tokens, slots, positions, out_rows) -> np.ndarray:
        """engine.step over any number of rows, in pieces the engine's plans can take."""
        e = self.engine
        most, most_out = e.limits.rows, e.limits.out_rows
        pieces, start, done = [], 0, 0  # done: out rows already handed to a piece
        while start < len(tokens):
            end = min(start + most, len(tokens))
            mine = [r for r in out_rows[done:] if r < end][:most_out]
            if len(mine) == most_out:
                end = mine[-1] + 1
            pieces.append(e.step(tokens[start:end], slots[start:end], positions[start:end],
                                 [r - start for r in mine]))
            done += len(mine)
            start = end
        return np.concatenate(pieces)
