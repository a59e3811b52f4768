"""The KV cache: preallocated per layer as (slots, positions, kv_heads, head_dim), written by position."""

from __future__ import annotations

import numpy as np

from kiln.errors import ContextLengthError
from kiln.models.base import ModelConfig, ShortConv


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


class StateWindow:
    """Where each slot's recurrent state can continue from. A convolution layer keeps its recent inputs in
    a ring indexed by position: the `length - 1` a position reads and `window` more, so that a slot
    resumes anywhere from `window` positions behind the furthest it has written (past rejected draft
    tokens, or a prompt that shares less than the slot holds) up to that furthest position. Both engines
    note every step's rows here."""

    def __init__(self, n_slots: int, length: int, window: int):
        self.window, self.ring = window, window + length - 1
        self.end = [0] * n_slots  # one past the furthest position written, per slot

    def note(self, slots, positions) -> None:
        end = self.end
        for s, p in zip(slots, positions):
            if p >= end[s]:
                end[s] = p + 1

    def resumable(self, slot: int, position: int) -> bool:
        return position == 0 or self.end[slot] - self.window <= position <= self.end[slot]

    def copy(self, src: int, dst: int) -> None:
        self.end[dst] = self.end[src]


class ConvState:
    """The oracle's rings (see StateWindow): per convolution layer, (slots, ring, width) float32."""

    def __init__(self, layers: dict, n_slots: int, window: int):
        length = max(c.length for c in layers.values())
        self.positions = StateWindow(n_slots, length, window)
        self.rings = {i: np.zeros((n_slots, self.positions.ring, c.width), np.float32) for i, c in layers.items()}

    def convolve(self, layer: int, slot: int, start: int, bx: np.ndarray, taps: np.ndarray) -> np.ndarray:
        """The causal depthwise convolution of `bx` (rows at positions start.., width) with `taps`
        (width, length), over the inputs before `start` the ring holds (zeros before position 0); the
        rows are then stored."""
        ring, length = self.rings[layer][slot], taps.shape[1]
        past = np.arange(start - (length - 1), start)
        history = np.concatenate([np.where((past >= 0)[:, None], ring[past % len(ring)], 0), bx])
        out = sum(taps[:, j] * history[j : j + len(bx)] for j in range(length))
        at = np.arange(start, start + len(bx))[-len(ring):]
        ring[at % len(ring)] = bx[-len(ring):]
        return out.astype(np.float32, copy=False)

    def copy(self, src: int, dst: int) -> None:
        for ring in self.rings.values():
            ring[dst] = ring[src]
        self.positions.copy(src, dst)

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.rings.values())


def recurrent_state_bytes(cfg: ModelConfig, n_slots: int, window: int) -> int:
    """What the convolution layers' rings hold for `n_slots` slots (float32; see StateWindow): fixed, whatever
    the context."""
    convs = [layer for layer in cfg.layers if isinstance(layer, ShortConv)]
    if not convs:
        return 0
    ring = window + max(c.length for c in convs) - 1
    return 4 * n_slots * ring * sum(c.width for c in convs)
