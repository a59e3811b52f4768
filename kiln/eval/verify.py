"""`kiln eval verify`: the greedy-decoding gate (as in MLIR-AIR's model checks).

Candidate and reference each greedy-decode `steps` tokens from every prompt on their own, keeping the
top-5 tokens of each step. Identical sequences pass. At the first step where they differ, each side's
token must be in the other's top-5: a near-tie that rounding flipped passes, a wrong computation
does not. After that step the two continue from different text, so nothing later is compared.

`diagnose` feeds the same tokens (prompt + the reference's continuation) to both engines and reports,
for each residual-stream add (two per block: after attention, after the MLP), the cosine similarity
of the two engines' hidden states, so a broken layer shows as the first drop.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kiln.errors import KilnError

PROMPTS = [
    "The capital of France is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Once upon a time, in a small village by the sea, there lived",
    "The three primary colors are",
    "import numpy as np\n\n# Compute the mean of each row of a matrix\n",
    "Water boils at 100 degrees Celsius at sea level because",
    "Q: What is 12 times 7?\nA:",
    "The planets of the solar system, in order from the Sun, are",
]
TOP = 5


@dataclass
class Trace:
    tokens: list[int]
    top: list[np.ndarray]  # per step, the TOP token ids, most probable first


def top_ids(logits: np.ndarray, k: int = TOP) -> np.ndarray:
    """The k largest logits' ids, most probable first; ties go to the lower id, as np.argmax does."""
    idx = np.argpartition(-logits, k - 1)[:k]
    return idx[np.lexsort((idx, -logits[idx]))]


def greedy(engine, ids: list[int], steps: int) -> Trace:
    logits = engine.forward(ids, 0, 0)
    trace = Trace([], [])
    for step in range(steps):
        top = top_ids(logits)
        trace.tokens.append(int(top[0]))
        trace.top.append(top)
        if step + 1 < steps:
            logits = engine.forward([trace.tokens[-1]], 0, len(ids) + step)
    return trace


def rank(token: int, top: np.ndarray) -> int | None:
    hits = np.flatnonzero(top == token)
    return int(hits[0]) + 1 if hits.size else None


def compare(cand: Trace, ref: Trace) -> dict:
    """The verdict for one prompt: where the sequences first differ and whether that difference is a
    near-tie (each token in the other's top-5)."""
    steps = len(ref.tokens)
    first = next((i for i, (a, b) in enumerate(zip(cand.tokens, ref.tokens)) if a != b), None)
    if first is None:
        return {"identical_steps": steps, "first_difference": None, "passed": True}
    c, r = cand.tokens[first], ref.tokens[first]
    c_in_ref, r_in_cand = rank(c, ref.top[first]), rank(r, cand.top[first])
    return {"identical_steps": first, "first_difference": first, "candidate_token": c, "reference_token": r,
            "candidate_rank_in_reference": c_in_ref, "reference_rank_in_candidate": r_in_cand,
            "passed": c_in_ref is not None and r_in_cand is not None}


def residual_names(n: int, n_layers: int) -> list[str]:
    if n == 2 * n_layers:
        return [f"blk.{i // 2} {'attn' if i % 2 == 0 else 'mlp'}" for i in range(n)]
    return [f"add {i}" for i in range(n)]


def cosine_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = a.astype(np.float64), b.astype(np.float64)
    den = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    return np.where(den > 0, (a * b).sum(axis=1) / np.where(den > 0, den, 1.0), 1.0)


def diagnose(cand_engine, ref_engine, sequences: list[list[int]], n_layers: int) -> list[dict]:
    """Per residual add: mean and minimum cosine similarity over every token of every sequence, and the
    mean relative error ‖cand - ref‖ / ‖ref‖."""
    cos, rel = None, None
    for tokens in sequences:
        hc, hr = cand_engine.hidden_states(tokens), ref_engine.hidden_states(tokens)
        if len(hc) != len(hr):
            raise KilnError(f"the engines report {len(hc)} and {len(hr)} residual adds for the same model")
        c = [cosine_rows(a, b) for a, b in zip(hc, hr)]
        r = [np.linalg.norm(a - b, axis=1) / np.maximum(np.linalg.norm(b, axis=1), 1e-30) for a, b in zip(hc, hr)]
        cos = c if cos is None else [np.concatenate(p) for p in zip(cos, c)]
        rel = r if rel is None else [np.concatenate(p) for p in zip(rel, r)]
    names = residual_names(len(cos), n_layers)
    return [{"residual": name, "cos_mean": float(c.mean()), "cos_min": float(c.min()), "rel_err_mean": float(r.mean())}
            for name, c, r in zip(names, cos, rel)]


def run(model, cand_engine, ref_engine, prompts: list[str], steps: int, progress=None) -> dict:
    tok = model.tokenizer
    results, sequences = [], []
    for i, prompt in enumerate(prompts):
        ids = tok.encode(prompt)
        if len(ids) + steps > model.n_ctx:
            raise KilnError(f"prompt {i + 1} is {len(ids)} tokens; with {steps} steps it exceeds the context "
                            f"{model.n_ctx}")
        cand, ref = greedy(cand_engine, ids, steps), greedy(ref_engine, ids, steps)
        verdict = compare(cand, ref)
        verdict.update(prompt=prompt, candidate=tok.decode(cand.tokens), reference=tok.decode(ref.tokens))
        results.append(verdict)
        sequences.append(ids + ref.tokens)
        if progress:
            progress(describe(i + 1, verdict, tok, steps))
    return {"prompts": results, "passed": all(r["passed"] for r in results), "steps": steps, "top": TOP,
            "sequences": sequences}


def describe(n: int, v: dict, tok, steps: int) -> str:
    head = f"[{n}] {'PASS' if v['passed'] else 'FAIL'} "
    prompt = v["prompt"].replace("\n", "\\n")
    if v["first_difference"] is None:
        return head + f"{steps}/{steps} tokens identical   {prompt!s:.60}"

    def where(r):
        return f"#{r} in the other's top-{TOP}" if r else f"not in the other's top-{TOP}"

    c, r = v["candidate_token"], v["reference_token"]
    return (head + f"first difference at step {v['first_difference'] + 1}: candidate {tok.decode([c])!r} "
            f"({where(v['candidate_rank_in_reference'])}), reference {tok.decode([r])!r} "
            f"({where(v['reference_rank_in_candidate'])})   {prompt!s:.40}")
