"""KL divergence of quantized KV caches against the fp16 cache, at a long context, over several texts.

    python bench/kv_cache_kld.py MODEL [--kv-cache q8_0,q4_0] [--ctx 4096] [--rows 128]
                                 [--texts docs,python,c,tests]

Each text (kiln's docs, its Python package, its C core, its tests: each repeated to fill the context) is
prefilled into one native engine per cache type, and the logits of its last `rows` positions compared:
mean and max KL(fp16 || quantized) and top-1 agreement, a line per text and type, then a summary per
type over the texts (the mean of their means, and their spread). Only those rows return logits, so the
vocabulary's width times the context never materializes."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from kiln.engine.model import load

ROOT = Path(__file__).resolve().parent.parent
TEXTS = {"docs": ("docs", "*.md"), "python": ("kiln", "**/*.py"), "c": ("csrc", "*.c"), "tests": ("tests", "test_*.py")}


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64) - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def text_of(name: str) -> str:
    folder, pattern = TEXTS[name]
    return "\n\n".join(p.read_text() for p in sorted((ROOT / folder).glob(pattern)))


def last_logits(engine, ids: list[int], rows: int) -> np.ndarray:
    head = len(ids) - rows
    engine.forward(ids[:head])
    return np.concatenate([engine.forward(ids[i : i + 16], 0, i, all_logits=True) for i in range(head, len(ids), 16)])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--kv-cache", default="q8_0,q4_0", help="quantized types to compare with fp16, comma-separated")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--texts", default=",".join(TEXTS))
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    types, texts = a.kv_cache.split(","), a.texts.split(",")
    unknown = [t for t in texts if t not in TEXTS]
    if unknown:
        ap.error(f"unknown text {unknown[0]!r}; choose from {', '.join(TEXTS)}")
    logits: dict[str, dict[str, np.ndarray]] = {t: {} for t in texts}
    for kv in ["f16", *types]:
        m = load(a.model, backend="native", n_ctx=a.ctx, threads=a.threads, progress=False, kv_cache=kv)
        for t in texts:
            ids = m.tokenizer.encode(text_of(t)[: 8 * a.ctx])  # a token is fewer than 8 characters of these
            while len(ids) < a.ctx:
                ids = ids + ids
            logits[t][kv] = last_logits(m.engine, ids[: a.ctx], a.rows)
        m.close()
    for kv in types:
        means = []
        for t in texts:
            lp, lq = log_softmax(logits[t]["f16"]), log_softmax(logits[t][kv])
            kl = (np.exp(lp) * (lp - lq)).sum(-1)
            means.append(float(kl.mean()))
            print(json.dumps({"model": a.model, "kv_cache": kv, "text": t, "ctx": a.ctx, "rows": a.rows,
                              "kld_mean": means[-1], "kld_max": float(kl.max()),
                              "top1": float((lp.argmax(-1) == lq.argmax(-1)).mean())}), flush=True)
        print(json.dumps({"model": a.model, "kv_cache": kv, "texts": len(texts), "kld_mean": float(np.mean(means)),
                          "kld_text_min": min(means), "kld_text_max": max(means)}), flush=True)


if __name__ == "__main__":
    main()
