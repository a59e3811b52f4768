"""What every model family shares: the config, and the small set of operations a family's graph is
written in.

A family writes its forward pass once, against `Ops`. The numpy oracle executes those calls eagerly;
the native core records the same calls into a plan that C runs in one call per step. One description,
two executors — so the fast path can never drift from the reference by construction.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from kiln.errors import ModelFileError
from kiln.gguf import GGUFFile


@dataclass(frozen=True)
class Rope:
    """Rotary embedding of one attention layer. `neox` rotates the two halves of a head against each
    other; otherwise adjacent pairs rotate (llama.cpp's "normal" mode, which llama GGUFs are permuted for)."""

    theta: float
    dim: int
    neox: bool
    freq_factors: str | None = None  # tensor holding per-frequency divisors (Llama 3 scaling)
    position_scale: float = 1.0  # linear scaling: positions are multiplied by this

    def inv_freq(self, weights_lookup=None) -> np.ndarray:
        inv = 1.0 / (self.theta ** (np.arange(0, self.dim, 2, dtype=np.float64) / self.dim))
        if self.freq_factors is not None:
            inv = inv / np.asarray(weights_lookup(self.freq_factors), dtype=np.float64)
        return inv


@dataclass(frozen=True)
class Attention:
    """Shape and kind of one layer's attention."""

    n_heads: int
    n_kv_heads: int
    head_dim: int
    scale: float
    rope: Rope
    window: int | None = None  # sliding window: a query sees at most this many positions, itself included


@dataclass
class ModelConfig:
    architecture: str
    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    context_length: int
    norm_eps: float
    tied_embeddings: bool
    layers: list[Attention] = field(default_factory=list, repr=False)
    name: str = ""

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim


class Ops(Protocol):
    """The operations model graphs are written in. `x` values are opaque to the family: arrays in the
    oracle, buffer handles in the native plan. Weights are named by their GGUF tensor names. Rows of
    `x` are tokens; positions, sequence slots and the KV cache belong to the executor."""

    def embed(self, table: str, scale: float = 1.0) -> Any: ...
    def rmsnorm(self, x: Any, weight: str, eps: float, heads: int = 1) -> Any: ...
    def linear(self, x: Any, weight: str, bias: str | None = None) -> Any: ...
    def rope(self, x: Any, rope: Rope, heads: int) -> Any: ...
    def attention(self, layer: int, q: Any, k: Any, v: Any, attn: Attention) -> Any: ...
    def glu(self, x: Any, gate: str, up: str, act: str) -> Any: ...
    def add(self, a: Any, b: Any) -> Any: ...
    def logits(self, x: Any, weight: str) -> Any: ...


def meta(gguf: GGUFFile, key: str, default: Any = ModelFileError) -> Any:
    """Metadata value `<architecture>.<key>`; missing required keys name the file and the key."""
    full = f"{gguf.architecture}.{key}"
    if full in gguf.metadata:
        return gguf.metadata[full]
    if default is ModelFileError:
        raise ModelFileError(f"{gguf.path}: required metadata key {full!r} is missing")
    return default


def base_config(gguf: GGUFFile, **overrides) -> dict:
    """The fields every family reads the same way from llama.cpp's metadata keys."""
    n_heads = int(meta(gguf, "attention.head_count"))
    dim = int(meta(gguf, "embedding_length"))
    n_kv = meta(gguf, "attention.head_count_kv", n_heads)
    if isinstance(n_kv, np.ndarray):
        raise ModelFileError(f"{gguf.path}: per-layer attention.head_count_kv is not supported")
    head_dim = int(meta(gguf, "attention.key_length", dim // n_heads))
    tokens = gguf.get("tokenizer.ggml.tokens")
    vocab = gguf.info("token_embd.weight").shape[0]
    if tokens is not None and len(tokens) != vocab:
        raise ModelFileError(f"{gguf.path}: vocabulary has {len(tokens)} tokens but token_embd.weight has {vocab} rows")
    cfg = dict(
        architecture=gguf.architecture,
        n_layers=int(meta(gguf, "block_count")),
        dim=dim,
        n_heads=n_heads,
        n_kv_heads=int(n_kv),
        head_dim=head_dim,
        ffn_dim=int(meta(gguf, "feed_forward_length")),
        vocab_size=vocab,
        context_length=int(meta(gguf, "context_length")),
        norm_eps=float(meta(gguf, "attention.layer_norm_rms_epsilon")),
        tied_embeddings="output.weight" not in gguf.tensors,
        name=str(gguf.get("general.name", gguf.path.stem)),
    )
    cfg.update(overrides)
    return cfg


def output_weight(cfg: ModelConfig) -> str:
    return "token_embd.weight" if cfg.tied_embeddings else "output.weight"
