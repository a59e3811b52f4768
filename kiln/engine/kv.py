"""The KV cache: preallocated per layer as (slots, positions, kv_heads, head_dim), written by position."""

from __future__ import annotations

import os

import numpy as np

from kiln.errors import ContextLengthError, KilnError

KV_CACHE_TYPES = ("f16", "q8_0")  # in the order of C's KV_* (csrc/attn_quant.h)
KV_BLOCK = 32  # values per block of a quantized cache's head row


def kv_cache_type(value: str | None = None) -> str:
    """The KV cache type asked for: `value` (--kv-cache), else KILN_KV_CACHE_TYPE, else f16."""
    source = "--kv-cache"
    if value is None:
        value, source = os.environ.get("KILN_KV_CACHE_TYPE") or "f16", "KILN_KV_CACHE_TYPE"
    if value not in KV_CACHE_TYPES:
        raise KilnError(f"{source} {value!r} is not a KV cache type; choose one of {', '.join(KV_CACHE_TYPES)}")
    return value


def check_kv_cache_type(kv_type: str, head_dim: int) -> None:
    if kv_type not in KV_CACHE_TYPES:
        raise KilnError(f"KV cache type {kv_type!r} is not one of {', '.join(KV_CACHE_TYPES)}")
    if kv_type != "f16" and head_dim % KV_BLOCK:
        raise KilnError(f"a {kv_type} KV cache needs a head dim that is whole blocks of {KV_BLOCK}; "
                        f"this model's is {head_dim}")


def kv_head_bytes(kv_type: str, n_ctx: int, head_dim: int) -> int:
    """Bytes of one KV head's keys (or values) over n_ctx positions: fp16, or q8_0's 34 bytes a block
    of 32 (csrc/attn_quant.c lays them out)."""
    if kv_type == "q8_0":
        return n_ctx * (head_dim // KV_BLOCK) * (2 + KV_BLOCK)
    return n_ctx * head_dim * 2


def round_q8_0(x: np.ndarray) -> np.ndarray:
    """x (..., width) as a q8_0 cache holds it: per block of 32, d = amax / 127 stored as fp16 and
    q = roundf(x / d) (ggml's quantize_row_q8_0_ref, which the native store follows), read back as d * q."""
    x = np.asarray(x, np.float32)
    blocks = x.reshape(*x.shape[:-1], -1, KV_BLOCK)
    d = np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(127)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    v = (blocks * inv).astype(np.float64)  # exact: roundf's half away from zero, not numpy's half to even
    q = (np.sign(v) * np.floor(np.abs(v) + 0.5)).astype(np.float32)
    return (d.astype(np.float16).astype(np.float32) * q).reshape(x.shape)


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
    def __init__(self, n_layers: int, n_slots: int, n_ctx: int, n_kv_heads: int, head_dim: int, dtype=np.float32,
                 kv_type: str | None = None):
        """`kv_type` q8_0 stores every head row as the native q8_0 cache rounds it (in float32)."""
        shape = (n_slots, n_ctx, n_kv_heads * head_dim)
        self.k = [np.zeros(shape, dtype) for _ in range(n_layers)]
        self.v = [np.zeros(shape, dtype) for _ in range(n_layers)]
        self.head_dim = head_dim
        self.rounding = round_q8_0 if kv_type == "q8_0" else None

    def write(self, layer: int, slot: int, start: int, k: np.ndarray, v: np.ndarray, n_kv_heads: int):
        """Store k, v (tokens, kv_dim) at `start`; return this slot's whole cache as (ctx, kv_heads, head_dim)."""
        end = start + k.shape[0]
        if self.rounding is not None:
            k, v = self.rounding(k), self.rounding(v)
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
