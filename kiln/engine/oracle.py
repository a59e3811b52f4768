"""The oracle: a family's graph executed eagerly in float32 numpy on dequantized weights.

Slow and obviously right. Every fast path in kiln is tested against it, and it is the fallback when the
native core is not available.
"""

from __future__ import annotations

import numpy as np

from kiln.engine.interface import Limits
from kiln.engine.kv import KVCache, RecurrentState, check_kv_cache_type, check_span
from kiln.gguf import GGUFFile
from kiln.models import Family
from kiln.models.base import Attention, Rope, recurrent_layers


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def l2_normalized(x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """x / sqrt(|x|² + eps) over the last axis (the DeltaNet's q and k heads, as transformers' l2norm)."""
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + np.float32(eps))


def gated_delta_rule(state: np.ndarray, q, k, v, decay, rate) -> np.ndarray:
    """Per row, in order: the matrices (heads, k_dim, v_dim) decay, then move toward v along k at `rate`
    (the delta rule); the row's output is q read through them. Updates `state` in place."""
    out = np.empty(v.shape, np.float32)
    for t in range(len(q)):
        state *= decay[t][:, None, None]
        recalled = np.einsum("hkv,hk->hv", state, k[t])
        state += k[t][:, :, None] * ((v[t] - recalled) * rate[t][:, None])[:, None, :]
        out[t] = np.einsum("hkv,hk->hv", state, q[t])
    return out


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(np.float32(np.sqrt(2.0 / np.pi)) * (x + np.float32(0.044715) * x * x * x)))


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


ACTIVATIONS = {"silu": silu, "gelu_tanh": gelu_tanh}

SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT = np.float32(1.702), np.float32(7.0)  # gpt-oss's (transformers', llama.cpp's)


def swiglu_oai(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """gpt-oss's clamped SwiGLU: the gate clamped above at 7, up to [-7, 7], (up + 1) * g * sigmoid(1.702 g)."""
    g = np.minimum(g, SWIGLU_OAI_LIMIT)
    u = np.clip(u, -SWIGLU_OAI_LIMIT, SWIGLU_OAI_LIMIT)
    return (u + np.float32(1.0)) * (g / (np.float32(1.0) + np.exp(-SWIGLU_OAI_ALPHA * g)))


# an expert's GLU by its activation's name (Experts.act): silu(gate) * up, or gpt-oss's whole clamped form
GLUS = {"silu": lambda g, u: silu(g) * u, "swiglu_oai": swiglu_oai}


def rope_angles(rope: Rope, positions: np.ndarray, inv_freq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    angles = np.outer(positions.astype(np.float32) * np.float32(rope.position_scale), inv_freq.astype(np.float32))
    if rope.magnitude == 1.0:
        return np.cos(angles), np.sin(angles)
    magnitude = np.float32(rope.magnitude)
    return np.cos(angles) * magnitude, np.sin(angles) * magnitude


def capped(x: np.ndarray, cap: float) -> np.ndarray:
    """cap * tanh(x / cap): Gemma's soft ceiling on attention scores and logits."""
    return x if not cap else np.tanh(x / np.float32(cap)) * np.float32(cap)


def apply_rope(x: np.ndarray, rope: Rope, heads: int, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    t = x.shape[0]
    x = x.reshape(t, heads, -1).copy()
    half = rope.dim // 2
    c, s = cos[:, None, :], sin[:, None, :]
    if rope.neox:
        a, b = x[..., :half].copy(), x[..., half : rope.dim].copy()
        x[..., :half], x[..., half : rope.dim] = a * c - b * s, b * c + a * s
    else:
        a, b = x[..., 0 : rope.dim : 2].copy(), x[..., 1 : rope.dim : 2].copy()
        x[..., 0 : rope.dim : 2], x[..., 1 : rope.dim : 2] = a * c - b * s, b * c + a * s
    return x.reshape(t, -1)


def attend(q: np.ndarray, keys: np.ndarray, values: np.ndarray, positions: np.ndarray, attn: Attention,
           sinks: np.ndarray | None = None) -> np.ndarray:
    """Causal (optionally sliding-window) attention of queries at `positions` over keys 0..max(positions);
    `sinks` (one logit per query head) join each softmax's denominator only."""
    t, n_ctx = q.shape[0], keys.shape[0]
    group = attn.n_heads // attn.n_kv_heads
    qh = q.reshape(t, attn.n_kv_heads, group, attn.head_dim)
    scores = capped(np.einsum("tkgd,skd->kgts", qh, keys) * np.float32(attn.scale), attn.softcap)  # (kv, group, t, s)
    key_pos = np.arange(n_ctx)
    visible = key_pos[None, :] <= positions[:, None]
    if attn.window is not None:
        visible &= key_pos[None, :] > positions[:, None] - attn.window
    scores = np.where(visible, scores, -np.inf)
    top = scores.max(axis=-1, keepdims=True)
    if sinks is not None:
        sink = sinks.astype(np.float32).reshape(attn.n_kv_heads, group, 1, 1)
        top = np.maximum(top, sink)
    p = np.exp(scores - top)
    denominator = p.sum(axis=-1, keepdims=True)
    if sinks is not None:
        denominator = denominator + np.exp(sink - top)
    p /= denominator
    out = np.einsum("kgts,skd->tkgd", p, values)
    return out.reshape(t, attn.n_heads * attn.head_dim)


def route(logits: np.ndarray, e) -> tuple[np.ndarray, np.ndarray]:
    """Each row's chosen experts (best first; ties to the lower index, as csrc/op_moe.c breaks them) and
    their weights: a softmax over every expert, kept for the top `n_used` (or, "softmax_selected", the top
    `n_used` logits and a softmax over those alone), renormalized if the block says."""
    def softmax(x):
        p = np.exp(x - x.max(axis=1, keepdims=True))
        return p / p.sum(axis=1, keepdims=True)

    scores = softmax(logits) if e.gating == "softmax" else logits
    chosen = np.argsort(-scores, axis=1, kind="stable")[:, : e.n_used]
    weights = np.take_along_axis(scores, chosen, axis=1)
    if e.gating == "softmax_selected":
        weights = softmax(weights)
    if e.normalize:
        weights = weights / weights.sum(axis=1, keepdims=True)
    return chosen, weights.astype(np.float32)


class NumpyOps:
    """`Ops` executed eagerly for one sequence's span of tokens."""

    def __init__(self, engine: "OracleEngine", tokens: np.ndarray, slot: int, start: int, all_logits: bool):
        self.e, self.tokens, self.slot, self.all_logits = engine, tokens, slot, all_logits
        self.positions = np.arange(start, start + len(tokens))
        self.hidden: list[np.ndarray] = []  # residual stream after each layer, for diagnosis
        self.final: np.ndarray | None = None  # the rows given to the output head (normalized)

    def embed(self, table, scale=1.0):
        return self.e.weight(table)[self.tokens] * np.float32(scale)

    def rmsnorm(self, x, weight, eps, heads=1):
        t = x.shape[0]
        xh = x.reshape(t, heads, -1)
        inv = 1.0 / np.sqrt(np.mean(xh * xh, axis=-1, keepdims=True) + np.float32(eps))
        return ((xh * inv) * self.e.weight(weight)).reshape(t, -1).astype(np.float32, copy=False)

    def linear(self, x, weight, bias=None):
        y = x @ self.e.weight(weight).T
        return y + self.e.weight(bias) if bias is not None else y

    def rope(self, x, rope, heads):
        cos, sin = rope_angles(rope, self.positions, self.e.inv_freq(rope))
        return apply_rope(x, rope, heads, cos, sin)

    def attention(self, layer, q, k, v, attn):
        keys, values = self.e.kv.write(layer, self.slot, self.positions[0], k, v, attn.n_kv_heads)
        end = self.positions[-1] + 1
        sinks = self.e.weight(attn.sinks) if attn.sinks is not None else None
        out = attend(q, keys[:end].astype(np.float32, copy=False), values[:end].astype(np.float32, copy=False), self.positions,
                     attn, sinks)
        return -out if layer == self.e.negate_layer else out

    def glu(self, x, gate, up, act, gate_bias=None, up_bias=None):
        return ACTIVATIONS[act](self.linear(x, gate, gate_bias)) * self.linear(x, up, up_bias)

    def layernorm(self, x, weight, bias, eps):
        centered = x - x.mean(axis=-1, keepdims=True)
        inv = 1.0 / np.sqrt(np.mean(centered * centered, axis=-1, keepdims=True) + np.float32(eps))
        return ((centered * inv) * self.e.weight(weight) + self.e.weight(bias)).astype(np.float32, copy=False)

    def activation(self, x, act):
        return ACTIVATIONS[act](x)

    def add(self, a, b, scale=1.0):
        self.hidden.append(a + b * np.float32(scale) if scale != 1.0 else a + b)
        return self.hidden[-1]

    def logits(self, x, weight, bias=None, scale=1.0, softcap=0.0):
        rows = x if self.all_logits else x[-1:]
        self.final = rows
        out = self.linear(rows, weight, bias)
        return capped(out * np.float32(scale) if scale != 1.0 else out, softcap)

    def shortconv(self, layer, bcx, weight, conv):
        b, c, x = np.split(bcx, 3, axis=1)
        return c * self.e.state.convolve(layer, self.slot, int(self.positions[0]), b * x, self.e.weight(weight))

    def delta_net(self, layer, qkv, z, alpha, beta, weights, net):
        t, key_width = len(qkv), net.n_k_heads * net.k_dim
        mixed = silu(self.e.state.convolve(layer, self.slot, int(self.positions[0]), qkv, self.e.weight(weights.conv)))
        tiled = net.n_v_heads // net.n_k_heads  # value head j reads key head j % n_k_heads
        q, k = (np.tile(l2_normalized(part.reshape(t, net.n_k_heads, net.k_dim)), (1, tiled, 1))
                for part in (mixed[:, :key_width], mixed[:, key_width : 2 * key_width]))
        v = mixed[:, 2 * key_width :].reshape(t, net.n_v_heads, net.v_dim)
        step = np.logaddexp(np.float32(0), alpha + self.e.weight(weights.dt_bias))  # softplus
        decay = np.exp(self.e.weight(weights.decay) * step).astype(np.float32)
        out = gated_delta_rule(self.e.state.matrices[layer][self.slot], q / np.float32(np.sqrt(net.k_dim)), k, v,
                               decay, sigmoid(beta).astype(np.float32))
        out = self.rmsnorm(out.reshape(t, -1), weights.norm, net.eps, heads=net.n_v_heads)
        return out * silu(z)

    def gate(self, x, gate):
        return x * sigmoid(gate)

    def moe(self, x, e):
        chosen, weights = route(self.linear(x, e.router, e.router_bias), e)
        glu, out = GLUS[e.act], np.zeros((x.shape[0], self.e.weight(e.down).shape[1]), np.float32)

        def project(h, tensor, bias, expert):
            y = h @ self.e.weight(tensor)[expert].T
            return y + self.e.weight(bias)[expert] if bias is not None else y

        for expert in np.unique(chosen):
            rows, slots = np.nonzero(chosen == expert)
            h = glu(project(x[rows], e.gate, e.gate_bias, expert), project(x[rows], e.up, e.up_bias, expert))
            out[rows] += weights[rows, slots][:, None] * project(h, e.down, e.down_bias, expert)
        if e.shared_gate is not None:
            shared = self.linear(GLUS[e.act](self.linear(x, e.shared_gate), self.linear(x, e.shared_up)), e.shared_down)
            if e.shared_scale is not None:
                shared = shared / (1.0 + np.exp(-(x @ self.e.weight(e.shared_scale))))[:, None]
            out += shared
        return out


class OracleEngine:
    """Runs a family's graph with NumpyOps. `forward` prefills or decodes one sequence slot; `decode`
    advances several slots by one token each."""

    name = "oracle"
    processor = "CPU (numpy oracle)"
    pool = None  # no native threads: a step's rows are sampled on the calling thread
    threads = None
    limits = Limits(out_rows=Limits.rows)  # no plans: every row of a step may return logits

    def __init__(self, gguf: GGUFFile, family: Family, n_ctx: int, n_slots: int = 1, kv_dtype=np.float32,
                 kv_type: str | None = None):
        """`kv_dtype=np.float16` stores the cache the way the native engine does, so tests can hold the
        native plan to float32 tolerances on float weights; a quantized `kv_type` (q8_0, q4_0) rounds it as
        the native cache does."""
        self.gguf, self.config, self.forward_fn = gguf, family.config, family.forward
        self.n_ctx, self.n_slots = n_ctx, n_slots
        cfg = self.config
        if kv_type is not None:
            check_kv_cache_type(kv_type, cfg.head_dim)
        self.kv_type = kv_type or "f16"
        self.kv = KVCache(cfg.n_layers, n_slots, n_ctx, cfg.n_kv_heads, cfg.head_dim, kv_dtype, kv_type)
        recurrent = recurrent_layers(cfg)
        # rewinds of up to a step's rows, as the native engine's (see StateWindow)
        self.state = RecurrentState(recurrent, n_slots, self.limits.rows) if recurrent else None
        self._weights: dict[str, np.ndarray] = {}
        self._inv_freq: dict[Rope, np.ndarray] = {}
        self.negate_layer: int | None = None  # debug: flip one layer's attention output
        self.last_hidden: list[np.ndarray] = []
        self.last_final: np.ndarray | None = None
        self._step_hidden = np.zeros((0, self.config.dim), np.float32)

    def weight(self, name: str) -> np.ndarray:
        w = self._weights.get(name)
        if w is None:
            w = self._weights[name] = self.gguf.dequantize(name)
        return w

    def inv_freq(self, rope: Rope) -> np.ndarray:
        if rope not in self._inv_freq:
            self._inv_freq[rope] = rope.inv_freq(self.weight, self.n_ctx)
        return self._inv_freq[rope]

    def forward(self, tokens, slot: int = 0, start: int = 0, all_logits: bool = False) -> np.ndarray:
        """Logits (vocab,) for the last token, or (len(tokens), vocab) with `all_logits`."""
        tokens = np.asarray(tokens, dtype=np.int64)
        check_span(start, len(tokens), self.n_ctx)
        ops = NumpyOps(self, tokens, slot, start, all_logits)
        if self.state is not None:
            self.state.positions.advance([slot] * len(tokens), ops.positions, self.state.restore)
        logits = self.forward_fn(ops, self.config)
        self.last_hidden, self.last_final = ops.hidden, ops.final
        return logits if all_logits else logits[0]

    def decode(self, tokens, slots, positions) -> np.ndarray:
        return np.stack([self.forward([t], s, p) for t, s, p in zip(tokens, slots, positions)])

    def step(self, tokens, slots, positions, out_rows) -> np.ndarray:
        """Any mix of rows (the scheduler's batch): runs of one slot at consecutive positions go
        through one forward pass each. Returns logits for `out_rows`, in order."""
        logits, hidden, start = {}, {}, 0
        for end in range(1, len(tokens) + 1):
            if end < len(tokens) and slots[end] == slots[start] and positions[end] == positions[end - 1] + 1:
                continue
            span = self.forward(tokens[start:end], int(slots[start]), int(positions[start]), all_logits=True)
            logits.update({start + i: row for i, row in enumerate(span)})
            hidden.update({start + i: row for i, row in enumerate(self.last_final)})
            start = end
        if not len(out_rows):
            self._step_hidden = np.zeros((0, self.config.dim), np.float32)
            return np.zeros((0, self.config.vocab_size))
        self._step_hidden = np.stack([hidden[r] for r in out_rows])
        return np.stack([logits[r] for r in out_rows])

    def hidden(self, n_out: int) -> np.ndarray:
        """The last step's final hidden states of its first `n_out` rows with logits (see NativeEngine)."""
        return self._step_hidden[:n_out].copy()

    def set_debug_negate(self, layer: int | None) -> None:
        """Break one layer on purpose (its attention output changes sign), to show accuracy checks fail."""
        self.negate_layer = layer

    def hidden_states(self, tokens, slot: int = 0, start: int = 0) -> list[np.ndarray]:
        """The residual stream after every add (two per block), (len(tokens), dim) each."""
        self.forward(tokens, slot, start)
        return self.last_hidden

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        self.kv.copy(src, dst, length)
        if self.state is not None:
            self.state.copy(src, dst)

    def resume_point(self, slot: int, position: int) -> int:
        return position if self.state is None else self.state.positions.resume_point(slot, position)

    def snapshot(self, slot: int, position: int) -> None:
        if self.state is not None:
            self.state.snapshot(slot, position)

    def checkpoint(self, slot: int, position: int) -> None:
        if self.state is not None and self.state.positions.needs_checkpoint():
            self.state.snapshot(slot, position)

    def close(self) -> None:
        self._weights.clear()
