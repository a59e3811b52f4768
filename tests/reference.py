"""transformers as the reference implementation: models load once per test session (they are slow)."""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

import numpy as np


@functools.lru_cache(maxsize=4)
def hf_model(path: Path):
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval()


def hf_logits(path: Path, ids: list[int]) -> np.ndarray:
    """Logits for every position, (len(ids), vocab), float32."""
    import torch

    with torch.no_grad():
        return hf_model(path)(torch.tensor([ids])).logits[0].numpy()


def hf_greedy(path: Path, ids: list[int], n: int) -> list[int]:
    """n greedy tokens, never stopping early (end-of-sequence tokens are just tokens here)."""
    import torch

    model = hf_model(path)
    out, past, inputs = [], None, torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            res = model(inputs, past_key_values=past, use_cache=True)
            past = res.past_key_values
            token = int(res.logits[0, -1].argmax())
            out.append(token)
            inputs = torch.tensor([[token]])
    return out


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    """Largest absolute difference relative to the reference's largest magnitude."""
    return float(np.abs(a - b).max() / np.abs(b).max())
