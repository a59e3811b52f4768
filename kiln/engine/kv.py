"""The KV cache: preallocated per layer as (slots, positions, kv_heads, head_dim), written by position."""

from __future__ import annotations

import numpy as np

from kiln.errors import ContextLengthError


def check_span(start: int, count: int, n_ctx: int) -> None:
    if count <= 0:
        raise ValueError("a forward pass needs at least one token")
    if start < 0 or start + count > n_ctx:
        raise ContextLengthError(
            f"positions {start}..{start + count - 1} do not fit the context of {n_ctx} tokens"
        )


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two lists share: how much of a slot's KV a new prompt can reuse."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class KVCache:
    def __init__(self, n_layers: int, n_slots: int, n_ctx: int, n_kv_heads: int, head_dim: int, dtype=np.float32):
        shape = (n_slots, n_ctx, n_kv_heads * head_dim)
        self.k = [np.zeros(shape, dtype) for _ in range(n_layers)]
        self.v = [np.zeros(shape, dtype) for _ in range(n_layers)]
        self.head_dim = head_dim

    def write(self, layer: int, slot: int, start: int, k: np.ndarray, v: np.ndarray, n_kv_heads: int):
        """Store k, v (tokens, kv_dim) at `start`; return this slot's whole cache as (ctx, kv_heads, head_dim)."""
        end = start + k.shape[0]
        self.k[layer][slot, start:end] = k
        self.v[layer][slot, start:end] = v
        shape = (-1, n_kv_heads, self.head_dim)
        return self.k[layer][slot].reshape(shape), self.v[layer][slot].reshape(shape)

    def copy(self, src: int, dst: int, length: int) -> None:
        for cache in (*self.k, *self.v):
            cache[dst, :length] = cache[src, :length]

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in (*self.k, *self.v))
