"""The KV cache: preallocated per layer as (slots, positions, kv_heads, head_dim), written by position."""

from __future__ import annotations

import os

import numpy as np

from kiln.errors import ContextLengthError, KilnError
from kiln.models.base import DeltaNet, ModelConfig, recurrent_layers

try:
    from kiln import _native
except ImportError:  # the extension did not build: the oracle runs on an fp16 cache only
    _native = None

# The types, in the order of kiln_op.kv_type, and their layouts are the native core's (csrc/attn_quant.h).
KV_CACHE_TYPES = _native.kv_cache_types() if _native else ("f16",)
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
    """Bytes of one KV head's keys (or values) over n_ctx positions: fp16, or a quantized type's blocks
    of 32 (q8_0 34 bytes, q4_0 18; csrc/attn_quant.c lays them out)."""
    if _native is None:
        return n_ctx * head_dim * 2
    return n_ctx * _native.kv_row_bytes(KV_CACHE_TYPES.index(kv_type), head_dim)


def _blocks(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float32)
    return x.reshape(*x.shape[:-1], -1, KV_BLOCK)


def round_q8_0(x: np.ndarray) -> np.ndarray:
    """x (..., width) as a q8_0 cache holds it: per block of 32, d = amax / 127 stored as fp16 and
    q = roundf(x / d) (ggml's quantize_row_q8_0_ref, which the native store follows), read back as d * q."""
    blocks = _blocks(x)
    d = np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(127)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    v = (blocks * inv).astype(np.float64)  # exact: roundf's half away from zero, not numpy's half to even
    q = (np.sign(v) * np.floor(np.abs(v) + 0.5)).astype(np.float32)
    return (d.astype(np.float16).astype(np.float32) * q).reshape(np.shape(x))


def round_q4_0(x: np.ndarray) -> np.ndarray:
    """x (..., width) as a q4_0 cache holds it: per block of 32, d = max / -8 (max the value of largest
    magnitude, the first of equals) stored as fp16 and q = min(15, trunc(x / d + 8.5)) (ggml's
    quantize_row_q4_0_ref, which the native store follows), read back as d * (q - 8)."""
    blocks = _blocks(x)
    peak = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=-1)[..., None], axis=-1)
    d = peak / np.float32(-8)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    q = np.minimum(np.trunc(blocks * inv + np.float32(8.5)), 15) - 8
    return (d.astype(np.float16).astype(np.float32) * q).reshape(np.shape(x))


ROUNDING = {"q8_0": round_q8_0, "q4_0": round_q4_0}  # how each quantized type rounds a stored row

_WHT_NORM = np.float32(0.17677669529663688)  # 1 / sqrt(32)


def rotate(x: np.ndarray) -> np.ndarray:
    """x (..., width) in the basis a quantized cache stores its rows in: per block of 32 the orthonormal
    Walsh-Hadamard transform, its own inverse, by the native store's butterflies (strides 16 down to 1) in
    float32, then the normalization (csrc/attn_quant.h)."""
    a = _blocks(x).copy()
    s = KV_BLOCK // 2
    while s >= 1:
        pairs = a.reshape(*a.shape[:-1], KV_BLOCK // (2 * s), 2, s)
        u, v = pairs[..., 0, :].copy(), pairs[..., 1, :].copy()
        pairs[..., 0, :], pairs[..., 1, :] = u + v, u - v
        s //= 2
    return (a * _WHT_NORM).reshape(np.shape(x))


def stored(kv_type: str, x: np.ndarray) -> np.ndarray:
    """A row as a quantized cache of `kv_type` holds it, seen in the model's basis: rotated, rounded and
    rotated back. The native engine keeps the rotated rows and rotates the queries and the attention output
    instead, which gives the same scores and output (q . H r = Hq . r; sum p H r = H sum p r)."""
    return rotate(ROUNDING[kv_type](rotate(x)))


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
        """A quantized `kv_type` (q8_0, q4_0) stores every head row as the native cache of that type rounds
        it in its rotated basis (`stored`, in float32)."""
        shape = (n_slots, n_ctx, n_kv_heads * head_dim)
        self.k = [np.zeros(shape, dtype) for _ in range(n_layers)]
        self.v = [np.zeros(shape, dtype) for _ in range(n_layers)]
        self.head_dim = head_dim
        self.rounding = (lambda x: stored(kv_type, x)) if kv_type in ROUNDING else None

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


class StateWindow:
    """Where each slot's recurrent state can continue from. A convolution layer keeps its recent inputs in
    a ring indexed by position: the `length - 1` a position reads and `window` more, so that a slot
    resumes anywhere from `window` positions behind the furthest it has written (past rejected draft
    tokens, or a prompt that shares less than the slot holds) up to where it stopped. A DeltaNet's
    matrices hold no history, so with them the window is 0: a slot continues only where it stopped. Besides
    the state, each slot keeps one snapshot: the state before one position (the end of its last prompt), so
    a later turn that extends that prompt resumes there however far the reply ran on. Both engines run
    every step's rows through `advance`."""

    def __init__(self, n_slots: int, length: int, window: int):
        self.window, self.ring, self.length = window, window + length - 1, length
        self.end = [0] * n_slots  # one past the last position written
        self.top = [0] * n_slots  # one past the furthest position written since `floor` was set
        self.floor = [0] * n_slots  # no position below it (but 0) is resumable: the ring before it is stale
        self.snapshot = [-1] * n_slots  # the position whose preceding inputs the snapshot holds; -1: none

    def _live(self, slot: int, position: int) -> bool:
        """Whether the rings themselves still hold the inputs before `position`."""
        return max(self.floor[slot], self.top[slot] - self.window) <= position <= self.end[slot]

    def resume_point(self, slot: int, position: int) -> int:
        """The furthest position at or before `position` from which the slot can continue."""
        if self._live(slot, position):
            return position
        return self.snapshot[slot] if 0 < self.snapshot[slot] <= position else 0

    def advance(self, slots, positions, restore) -> None:
        """Note a step's rows; `restore(slot, position)` puts a slot's snapshot back into its state first
        when the slot continues from it (from 0: a DeltaNet's matrices start from zeros). A row that
        continues where the state cannot is a kiln bug."""
        seen = set()
        for s, p in zip(slots, positions):
            if s not in seen:
                seen.add(s)
                if p != self.resume_point(s, p):
                    raise KilnError(f"slot {s}'s recurrent state cannot continue at position {p}")
                if not self._live(s, p):  # from the snapshot, or from 0: the state holds nothing newer
                    restore(s, p)
                    self.floor[s] = self.top[s] = p
            self.end[s] = p + 1
            self.top[s] = max(self.top[s], p + 1)

    def positions_before(self, position: int) -> list[int]:
        """The ring rows of the inputs a position reads before its own (those at positions ≥ 0)."""
        return [q % self.ring for q in range(max(0, position - self.length + 1), position)]

    def take_snapshot(self, slot: int, position: int) -> bool:
        """Whether the state itself holds what comes before `position` (then the caller copies it); a
        snapshot already at `position` is kept when it no longer does."""
        if not self._live(slot, position):
            return False
        self.snapshot[slot] = position
        return True

    def needs_checkpoint(self) -> bool:
        """Whether a step that is undone (rejected draft rows) leaves the slot able to continue only from a
        snapshot: a state that holds no history."""
        return self.window == 0

    def copy(self, src: int, dst: int) -> None:
        for field in (self.end, self.top, self.floor, self.snapshot):
            field[dst] = field[src]


def state_window(layers: dict, rows: int) -> int:
    """How far a slot's state rewinds: a step's rows for convolution rings alone, none with a DeltaNet."""
    return 0 if any(isinstance(layer, DeltaNet) for layer in layers.values()) else rows


class RecurrentState:
    """The oracle's recurrent state (see StateWindow): per recurrent layer a ring of its convolution's
    inputs, (slots, ring, width) float32, and per DeltaNet layer its matrices, (slots, v heads, k_dim,
    v_dim) float32, each with its slot's snapshot."""

    def __init__(self, layers: dict, n_slots: int, rows: int):
        length = max(c.length for c in layers.values())
        self.positions = StateWindow(n_slots, length, state_window(layers, rows))
        self.rings = {i: np.zeros((n_slots, self.positions.ring, c.width), np.float32) for i, c in layers.items()}
        self.snapshots = {i: np.zeros((n_slots, length - 1, c.width), np.float32) for i, c in layers.items()}
        self.matrices = {i: np.zeros((n_slots, c.n_v_heads, c.k_dim, c.v_dim), np.float32)
                         for i, c in layers.items() if isinstance(c, DeltaNet)}
        self.matrix_snapshots = {i: np.zeros_like(m) for i, m in self.matrices.items()}

    def snapshot(self, slot: int, position: int) -> None:
        if self.positions.take_snapshot(slot, position):
            rows = self.positions.positions_before(position)
            for i, ring in self.rings.items():
                self.snapshots[i][slot, : len(rows)] = ring[slot, rows]
            for i, m in self.matrices.items():
                self.matrix_snapshots[i][slot] = m[slot]

    def restore(self, slot: int, position: int) -> None:
        rows = self.positions.positions_before(position)
        for i, ring in self.rings.items():
            ring[slot, rows] = self.snapshots[i][slot, : len(rows)]
        for i, m in self.matrices.items():
            m[slot] = self.matrix_snapshots[i][slot] if position else 0.0

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
        for arrays in (*self.rings.values(), *self.snapshots.values(), *self.matrices.values(),
                       *self.matrix_snapshots.values()):
            arrays[dst] = arrays[src]
        self.positions.copy(src, dst)

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in (*self.rings.values(), *self.matrices.values()))


def recurrent_state_bytes(cfg: ModelConfig, n_slots: int, rows: int) -> int:
    """What the recurrent layers' state holds for `n_slots` slots (float32; see StateWindow): the rings, and
    a DeltaNet's matrices with each slot's snapshot of them, fixed whatever the context."""
    layers = recurrent_layers(cfg)
    if not layers:
        return 0
    ring = state_window(layers, rows) + max(c.length for c in layers.values()) - 1
    matrices = sum(c.matrix_floats for c in layers.values() if isinstance(c, DeltaNet))
    return 4 * n_slots * (ring * sum(c.width for c in layers.values()) + 2 * matrices)
