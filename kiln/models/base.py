"""What every model family shares: the config, and the small set of operations a family's graph is
written in.

A family writes its forward pass once, against `Ops`. The numpy oracle executes those calls eagerly;
the native core records the same calls into a plan that C runs in one call per step. One description,
two executors — so the fast path can never drift from the reference by construction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from kiln.errors import ModelFileError, UnsupportedModelError
from kiln.gguf import GGUFFile, describe, is_int


@dataclass(frozen=True)
class Yarn:
    """YaRN scaling (ggml's rope_yarn, transformers' "yarn" rope type): each frequency is a mix of itself
    (extrapolated) and itself / `factor` (interpolated), by a ramp over the frequencies that complete
    between `beta_slow` and `beta_fast` turns within `original_context` positions; cos and sin are scaled
    by `magnitude`, so q·k is scaled by its square."""

    factor: float
    original_context: int
    magnitude: float
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True  # the ramp's ends rounded to whole frequencies (gpt-oss does not)

    def mix(self, inv: np.ndarray, theta: float, dim: int) -> np.ndarray:
        def turns_at(rotations: float) -> float:  # the pair index whose frequency turns `rotations` times
            return dim * math.log(self.original_context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = turns_at(self.beta_fast), turns_at(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        ramp = np.clip((np.arange(len(inv), dtype=np.float64) - low) / max(high - low, 0.001), 0.0, 1.0)
        return inv / self.factor * ramp + inv * (1.0 - ramp)


@dataclass(frozen=True)
class Rope:
    """Rotary embedding of one attention layer. `neox` rotates the two halves of a head against each
    other; otherwise adjacent pairs rotate (llama.cpp's "normal" mode, which llama GGUFs are permuted for)."""

    theta: float
    dim: int
    neox: bool
    freq_factors: str | None = None  # tensor holding per-frequency divisors (Llama 3 scaling)
    position_scale: float = 1.0  # linear scaling: positions are multiplied by this
    yarn: Yarn | None = None
    # LongRoPE (Phi-3): a context longer than `original_context` divides by `long_factors` instead of
    # `freq_factors` (llama.cpp chooses by the context a sequence is given, not by its current length)
    long_factors: str | None = None
    original_context: int = 0
    attn_factor: float = 1.0  # cos and sin are multiplied by this (LongRoPE's attention factor)

    def factors_for(self, n_ctx: int) -> str | None:
        if self.long_factors is not None and n_ctx > self.original_context:
            return self.long_factors
        return self.freq_factors

    def inv_freq(self, weights_lookup=None, n_ctx: int = 0) -> np.ndarray:
        inv = 1.0 / (self.theta ** (np.arange(0, self.dim, 2, dtype=np.float64) / self.dim))
        factors = self.factors_for(n_ctx)
        if factors is not None:
            inv = inv / np.asarray(weights_lookup(factors), dtype=np.float64)
        if self.yarn is not None:
            inv = self.yarn.mix(inv, self.theta, self.dim)
        return inv

    @property
    def magnitude(self) -> float:
        """What cos and sin are multiplied by: YaRN's attention scaling and LongRoPE's attention factor."""
        return (self.yarn.magnitude if self.yarn is not None else 1.0) * self.attn_factor


@dataclass(frozen=True)
class Attention:
    """Shape and kind of one layer's attention."""

    n_heads: int
    n_kv_heads: int
    head_dim: int
    scale: float
    rope: Rope | None  # None: the layer's positions come from the causal mask alone (NoPE)
    window: int | None = None  # sliding window: a query sees at most this many positions, itself included
    softcap: float = 0.0  # scores become softcap * tanh(score / softcap) before the softmax (Gemma 2); 0: none
    # a tensor of one learned logit per query head that joins each softmax's denominator only (gpt-oss's
    # attention sinks): a query may give some of its attention to no position
    sinks: str | None = None


@dataclass(frozen=True)
class ShortConv:
    """A layer that mixes positions by a causal depthwise convolution over its last `length` inputs
    (LFM2's gated short convolution): its state is the `length - 1` inputs before the current one."""

    width: int  # channels
    length: int  # taps, the current position included


@dataclass(frozen=True)
class DeltaNet:
    """A Gated DeltaNet layer (Qwen3.5's linear attention): a causal depthwise convolution of `length` taps
    over the fused q, k, v projection (`width` channels), then the gated delta rule, whose state is one
    [k_dim x v_dim] matrix per value head. Value head j reads key head j % n_k_heads (llama.cpp's tiled
    order, which its converter writes the value heads in)."""

    n_k_heads: int
    n_v_heads: int
    k_dim: int  # a query or key head's width
    v_dim: int
    length: int  # the convolution's taps, the current position included
    eps: float  # the output norm's

    @property
    def width(self) -> int:
        return 2 * self.n_k_heads * self.k_dim + self.n_v_heads * self.v_dim

    @property
    def matrix_floats(self) -> int:
        """The floats of the recurrent matrices one slot holds for this layer."""
        return self.n_v_heads * self.k_dim * self.v_dim


@dataclass(frozen=True)
class DeltaNetWeights:
    """A DeltaNet layer's own tensors, by GGUF name: the convolution's taps (channels x taps), the per-head
    decay rate A (-exp(A_log), as llama.cpp stores it), the time step's bias, and the output norm."""

    conv: str
    decay: str
    dt_bias: str
    norm: str


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


@dataclass(frozen=True)
class Experts:
    """One layer's mixture-of-experts feed-forward block. A router scores every expert for each row; the
    row's `n_used` best experts each run a GLU, and their outputs are summed with the router's weights.
    The expert tensors are 3-D as GGUF stores them: gate and up [n_experts, ff_dim, dim], down
    [n_experts, dim, ff_dim]. A shared expert (Qwen2-MoE) is a GLU every row runs, its output scaled by
    sigmoid(x · shared_scale) when the file has that gate.

    `gating` says how router logits (plus `router_bias`) become weights: "softmax" over all experts, then
    the top `n_used` (renormalized to sum to 1 when `normalize`); "softmax_selected" (gpt-oss, llama.cpp's
    SOFTMAX_WEIGHT): the top `n_used` logits, then a softmax over those alone. `act` is the experts' GLU:
    "silu" (silu(gate) * up) or "swiglu_oai" (gpt-oss: gate clamped above at 7, up to [-7, 7], then
    (up + 1) * gate * sigmoid(1.702 gate)). Expert biases are [n_experts, ff_dim] (gate, up) and
    [n_experts, dim] (down) tables, one row per expert."""

    router: str  # [n_experts, dim]
    gate: str
    up: str
    down: str
    n_experts: int
    n_used: int
    ff_dim: int
    normalize: bool
    gating: str = "softmax"
    act: str = "silu"
    shared_gate: str | None = None
    shared_up: str | None = None
    shared_down: str | None = None
    shared_ff_dim: int = 0
    shared_scale: str | None = None  # a [dim] vector
    router_bias: str | None = None  # [n_experts]
    gate_bias: str | None = None
    up_bias: str | None = None
    down_bias: str | None = None


class Ops(Protocol):
    """The operations model graphs are written in. `x` values are opaque to the family: arrays in the
    oracle, buffer handles in the native plan. Weights are named by their GGUF tensor names. Rows of
    `x` are tokens; positions, sequence slots and the KV cache belong to the executor."""

    def embed(self, table: str, scale: float = 1.0) -> Any: ...
    def rmsnorm(self, x: Any, weight: str, eps: float, heads: int = 1) -> Any: ...
    def linear(self, x: Any, weight: str, bias: str | None = None) -> Any: ...
    def rope(self, x: Any, rope: Rope, heads: int) -> Any: ...
    def attention(self, layer: int, q: Any, k: Any, v: Any, attn: Attention) -> Any: ...
    def glu(self, x: Any, gate: str, up: str, act: str, gate_bias: str | None = None,
            up_bias: str | None = None) -> Any: ...
    def add(self, a: Any, b: Any, scale: float = 1.0) -> Any: ...  # a + scale * b
    def logits(self, x: Any, weight: str, bias: str | None = None, scale: float = 1.0,
               softcap: float = 0.0) -> Any: ...  # scale * (W · x + bias), then soft-capped
    def layernorm(self, x: Any, weight: str, bias: str, eps: float) -> Any: ...
    def activation(self, x: Any, act: str) -> Any: ...
    # b, c, x = thirds of `bcx`; c * conv(b * x) with the depthwise causal kernel `weight` (channels x taps)
    def shortconv(self, layer: int, bcx: Any, weight: str, conv: ShortConv) -> Any: ...
    def moe(self, x: Any, experts: Experts) -> Any: ...
    # the gated delta rule over a slot's state (DeltaNet): conv + SiLU of qkv, L2-normalized q and k, per head
    # decay exp(A softplus(alpha + dt_bias)) and rate sigmoid(beta); the output RMS-normalized per value
    # head and gated by silu(z)
    def delta_net(self, layer: int, qkv: Any, z: Any, alpha: Any, beta: Any, weights: DeltaNetWeights,
                  net: DeltaNet) -> Any: ...
    def gate(self, x: Any, gate: Any) -> Any: ...  # x * sigmoid(gate)


MAX_LAYERS = 512  # llama.cpp's LLAMA_MAX_LAYERS
MAX_CONTEXT = 1 << 24  # positions are int32 in the plans; no model trains on more than 16M
_REQUIRED = object()


class Meta:
    """Typed, range-checked reads of a file's `<architecture>.*` metadata. Every key read is noted, so a
    family can refuse the switches it never reads instead of silently computing another model."""

    def __init__(self, gguf: GGUFFile):
        self.gguf, self.arch, self.read = gguf, gguf.architecture, set()

    def fail(self, key: str, value, expected: str) -> ModelFileError:
        return ModelFileError(f"{self.gguf.path}: metadata key {self.arch + '.' + key!r} is {describe(value)}, "
                              f"expected {expected}")

    def raw(self, key: str, default=_REQUIRED):
        full = f"{self.arch}.{key}"
        self.read.add(full)
        if full in self.gguf.metadata:
            return self.gguf.metadata[full]
        if default is _REQUIRED:
            raise ModelFileError(f"{self.gguf.path}: required metadata key {full!r} is missing")
        return default

    def integer(self, key: str, default=_REQUIRED, lo: int = 1, hi: int = 1 << 31) -> int:
        value = self.raw(key, default)
        if isinstance(value, np.ndarray) and value.ndim == 1 and key.startswith("attention.head_count"):
            raise self.fail(key, value, "one count for every layer (per-layer counts are not supported)")
        if not is_int(value) or not lo <= value <= hi:
            raise self.fail(key, value, f"an integer in {lo}..{hi}")
        return int(value)

    def number(self, key: str, default=_REQUIRED, lo: float = 0.0, hi: float = 1e30) -> float:
        value = self.raw(key, default)
        if not (is_int(value) or isinstance(value, (float, np.floating))) or not lo <= value <= hi:
            raise self.fail(key, value, f"a number in {lo:g}..{hi:g}")
        return float(value)

    def string(self, key: str, default=_REQUIRED, choices: tuple[str, ...] = ()) -> str:
        value = self.raw(key, default)
        if not isinstance(value, str) or (choices and value not in choices):
            raise self.fail(key, value, "one of " + ", ".join(map(repr, choices)) if choices else "a string")
        return value

    def absent(self, key: str, why: str) -> None:
        """Refuse a switch this family does not implement."""
        full = f"{self.arch}.{key}"
        self.read.add(full)
        if full in self.gguf.metadata:
            raise UnsupportedModelError(f"{self.gguf.path}: metadata key {full!r} is set "
                                        f"({describe(self.gguf.metadata[full])}): {why}")

    def refuse_unread(self) -> None:
        """Every `<architecture>.*` key the family did not read is a switch it does not know."""
        unread = sorted(k for k in self.gguf.metadata if k.startswith(self.arch + ".") and k not in self.read)
        if unread:
            more = f" (and {len(unread) - 1} more)" if len(unread) > 1 else ""
            raise UnsupportedModelError(f"{self.gguf.path}: metadata key {unread[0]!r}{more} is not one kiln's "
                                        f"{self.arch} family reads; refusing the file rather than ignoring it")


def rope_scale(m: Meta) -> float:
    """The position scale of RoPE scaling as llama.cpp reads it: linear unless the file says otherwise, by
    `rope.scaling.factor` (or the older `rope.scale_linear`); 0 means unscaled. YaRN is refused: a family
    that implements it reads `rope_scaling` instead."""
    kind = m.string("rope.scaling.type", "linear", choices=("none", "linear", "yarn", "longrope"))
    if kind in ("yarn", "longrope"):
        raise UnsupportedModelError(f"{m.gguf.path}: metadata key {m.arch + '.rope.scaling.type'!r} is {kind!r}: "
                                    f"kiln's {m.arch} family runs unscaled or linearly scaled RoPE only")
    for key in YARN_KEYS:
        m.absent(key, "it is a YaRN setting, and the file's RoPE is not YaRN-scaled")
    # only llama.cpp's bookkeeping: linear scaling uses neither
    m.integer("rope.scaling.original_context_length", 0, lo=0)
    m.raw("rope.scaling.finetuned", False)
    factor = _scaling_factor(m)
    return 1.0 if kind == "none" or factor == 0.0 else 1.0 / factor


YARN_KEYS = ("rope.scaling.attn_factor", "rope.scaling.yarn_log_multiplier", "rope.scaling.yarn_ext_factor",
             "rope.scaling.yarn_attn_factor", "rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow")


def _scaling_factor(m: Meta) -> float:
    factor = m.number("rope.scaling.factor", 0.0, hi=1e6)
    return factor if factor != 0.0 else m.number("rope.scale_linear", 0.0, hi=1e6)


def rope_scaling(m: Meta, context_length: int) -> dict:
    """`Rope`'s scaling fields for the file's RoPE scaling: linear (`position_scale`, as `rope_scale`) or
    YaRN (`yarn`). YaRN's keys are read as the model's own config means them (transformers' "yarn" rope
    type, which llama.cpp's converter writes them from): the ramp's `yarn_beta_fast` / `yarn_beta_slow`
    (32 and 1 by default, llama.cpp's), and cos and sin scaled by `yarn_attn_factor` where the file has
    one, else by llama.cpp's 1 + 0.1 ln(factor), times llama.cpp's own `rope.scaling.attn_factor`."""
    if m.string("rope.scaling.type", "linear", choices=("none", "linear", "yarn", "longrope")) != "yarn":
        return {"position_scale": rope_scale(m)}
    factor = _scaling_factor(m) or 1.0
    m.raw("rope.scaling.finetuned", False)
    # llama.cpp reads these only for DeepSeek (a mscale ratio) and Grok; neither the model's config nor
    # llama.cpp's llama-like families apply them, so any other value would be a model no one ran
    m.absent("rope.scaling.yarn_log_multiplier", "kiln's YaRN has no mscale_all_dim ratio")
    m.number("rope.scaling.yarn_ext_factor", 1.0, lo=1.0, hi=1.0)
    default_magnitude = 1.0 + 0.1 * math.log(factor) if factor > 1.0 else 1.0
    yarn = Yarn(
        factor=factor,
        original_context=m.integer("rope.scaling.original_context_length", context_length, hi=MAX_CONTEXT),
        magnitude=m.number("rope.scaling.yarn_attn_factor", default_magnitude, hi=1e3)
        * m.number("rope.scaling.attn_factor", 1.0, hi=1e3),
        beta_fast=m.number("rope.scaling.yarn_beta_fast", 32.0, lo=1e-3, hi=1e6),
        beta_slow=m.number("rope.scaling.yarn_beta_slow", 1.0, lo=1e-3, hi=1e6),
    )
    return {"yarn": yarn}


def softcap(m: Meta, key: str, default: float) -> float:
    """A soft cap c (values become c tanh(x / c)): 0 for none, else at least 1e-3, so x / c stays finite."""
    value = m.number(key, default, hi=1e6)
    if 0.0 < value < 1e-3:
        raise m.fail(key, value, "0 (no cap) or a cap from 0.001")
    return value


def base_config(m: Meta, moe: bool = False, **overrides) -> dict:
    """The fields every family reads the same way from llama.cpp's metadata keys (and its defaults). A dense
    family's file is refused if it names experts; `moe=True`: the caller's family reads those keys itself."""
    gguf = m.gguf
    if not moe:
        refuse_experts(m)
    n_layers = m.integer("block_count", hi=MAX_LAYERS)
    dim = m.integer("embedding_length")
    n_heads = m.integer("attention.head_count", hi=dim)
    # a hybrid family reads its per-layer counts itself and passes the attention layers' count
    n_kv = overrides["n_kv_heads"] if "n_kv_heads" in overrides else m.integer("attention.head_count_kv", n_heads, hi=n_heads)
    if n_heads % n_kv:
        raise m.fail("attention.head_count_kv", n_kv, f"a divisor of attention.head_count ({n_heads})")
    head_dim = m.integer("attention.key_length", max(dim // n_heads, 1), hi=1 << 16)
    m.integer("attention.value_length", head_dim, lo=head_dim, hi=head_dim)  # kiln's attention: keys and values alike
    vocab = gguf.info("token_embd.weight").shape[0]
    m.integer("vocab_size", vocab, lo=vocab, hi=vocab)
    tokens = gguf.get("tokenizer.ggml.tokens")
    if tokens is not None and len(tokens) != vocab:
        raise ModelFileError(f"{gguf.path}: vocabulary has {len(tokens)} tokens but token_embd.weight has {vocab} rows")
    cfg = dict(
        architecture=m.arch,
        n_layers=n_layers,
        dim=dim,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        ffn_dim=m.integer("feed_forward_length"),
        vocab_size=vocab,
        context_length=m.integer("context_length", hi=MAX_CONTEXT),
        norm_eps=overrides["norm_eps"] if "norm_eps" in overrides else m.number("attention.layer_norm_rms_epsilon", hi=1.0),
        tied_embeddings="output.weight" not in gguf.tensors,
        name=str(gguf.get("general.name", gguf.path.stem)),
    )
    cfg.update(overrides)
    return cfg


def refuse_experts(m: Meta) -> None:
    """A dense family's file may name no experts (mixture-of-experts files say 0 when they are dense)."""
    for key in ("expert_count", "expert_used_count"):
        m.integer(key, 0, lo=0, hi=0)


def check_rope(m: Meta, rope: Rope, head_dim: int) -> None:
    if rope.dim % 2 or not 0 < rope.dim <= head_dim:
        raise m.fail("rope.dimension_count", rope.dim, f"an even number in 2..{head_dim} (the head size)")
    if rope.yarn is not None and rope.theta <= 1.0:  # YaRN's ramp is measured in log(theta)
        raise m.fail("rope.freq_base", rope.theta, "a base above 1 for YaRN")


def output_weight(cfg: ModelConfig) -> str:
    return "token_embd.weight" if cfg.tied_embeddings else "output.weight"


def attention_layers(cfg: ModelConfig) -> list[int]:
    """The layers that keep a KV cache; the others (ShortConv) keep a fixed-size recurrent state."""
    return [i for i, layer in enumerate(cfg.layers) if isinstance(layer, Attention)]


def recurrent_layers(cfg: ModelConfig) -> dict[int, ShortConv | DeltaNet]:
    """The layers with a recurrent state, by index: a ring of recent inputs (ShortConv; a DeltaNet's
    convolution too) and a DeltaNet's matrices."""
    return {i: layer for i, layer in enumerate(cfg.layers) if isinstance(layer, (ShortConv, DeltaNet))}


def active_parameters(gguf: GGUFFile, cfg: ModelConfig) -> int:
    """Parameters one token computes with: all of them, less the experts a mixture-of-experts layer's router
    does not choose for it ((n_experts - n_used) of each 3-D expert tensor and each expert bias table)."""
    total = sum(t.n_elements for t in gguf.tensors.values())
    for e in getattr(cfg, "experts", ()):
        unused = (e.n_experts - e.n_used) / e.n_experts
        per_expert = (e.gate, e.up, e.down, e.gate_bias, e.up_bias, e.down_bias)
        total -= round(unused * sum(gguf.info(name).n_elements for name in per_expert if name is not None))
    return total
