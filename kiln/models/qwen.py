"""Qwen2 and Qwen3: the Llama block (llama.py) with NeoX-style rotary embeddings.

Qwen2 adds biases to the q, k and v projections. Qwen3 drops them and instead RMS-normalizes every
query and key head before the rotation.
"""

from __future__ import annotations

from kiln.models import llama
from kiln.models.base import Meta
from kiln.models.llama import LlamaConfig, forward  # noqa: F401  (the family's forward pass)


def config_from_gguf(m: Meta) -> LlamaConfig:
    if m.arch == "qwen3":
        return llama.config_from_gguf(m, neox=True, qk_norm=True)
    return llama.config_from_gguf(m, neox=True, qkv_bias=True)
