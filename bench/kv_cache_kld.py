"""KL divergence of a quantized KV cache against the fp16 cache, at a long context.

    python bench/kv_cache_kld.py MODEL [--kv-cache q8_0] [--ctx 4096] [--rows 128]

Prefills the same text (kiln's own docs, repeated to fill the context) into two native engines, one per
cache type, and compares the logits of the last `rows` positions: mean and max KL(fp16 || quantized) and
top-1 agreement. Only those rows return logits, so the vocabulary's width times the context never
materializes."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from kiln.engine.model import load


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64) - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--kv-cache", default="q8_0")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    docs = Path(__file__).resolve().parent.parent / "docs"
    text = "\n\n".join(p.read_text() for p in sorted(docs.glob("*.md")))
    logits = {}
    for kv in ("f16", a.kv_cache):
        m = load(a.model, backend="native", n_ctx=a.ctx, threads=a.threads, progress=False, kv_cache=kv)
        ids = m.tokenizer.encode(text)
        while len(ids) < a.ctx:
            ids = ids + ids
        ids = ids[: a.ctx]
        head = a.ctx - a.rows
        m.engine.forward(ids[:head])
        logits[kv] = np.concatenate([m.engine.forward(ids[i : i + 16], 0, i, all_logits=True)
                                     for i in range(head, a.ctx, 16)])
        m.close()
    lp, lq = log_softmax(logits["f16"]), log_softmax(logits[a.kv_cache])
    kl = (np.exp(lp) * (lp - lq)).sum(-1)
    top1 = float((lp.argmax(-1) == lq.argmax(-1)).mean())
    print(json.dumps({"model": a.model, "kv_cache": a.kv_cache, "ctx": a.ctx, "rows": a.rows,
                      "kld_mean": float(kl.mean()), "kld_max": float(kl.max()), "top1": top1}))


if __name__ == "__main__":
    main()
