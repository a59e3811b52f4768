"""LFM2 (Liquid): a hybrid of gated short convolutions and grouped-query attention, each followed by a
SwiGLU MLP. Which layers attend is the file's per-layer `attention.head_count_kv`: 0 marks a
convolution layer (llama.cpp's reading).

    x = embed(tokens)
    for each layer:
        h = norm(x)
        if attention:   x = x + o(attention(rope(qnorm(q(h))), rope(knorm(k(h))), v(h)))
        else:           b, c, u = thirds of in_proj(h)
                        x = x + out_proj(c * conv(b * u))      # depthwise, causal, over l_cache positions
        x = x + down(silu(gate(norm(x))) * up(norm(x)))
    logits = lm_head(norm(x))                                  # the final norm is token_embd_norm

A convolution layer's state is its last l_cache - 1 inputs b * u: fixed in size whatever the context.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kiln.gguf import is_int
from kiln.models.base import (MAX_LAYERS, Attention, Meta, ModelConfig, Ops, Rope, ShortConv, base_config,
                              check_rope, output_weight, rope_scale)

MAX_CONV_LENGTH = 64  # taps; LFM2's are 3


@dataclass
class Lfm2Config(ModelConfig):
    conv_length: int = 3


def _kv_heads_per_layer(m: Meta, n_layers: int, n_heads: int) -> list[int]:
    """`attention.head_count_kv`, one count per layer (a single count: every layer attends)."""
    value = m.raw("attention.head_count_kv")
    counts = [value] * n_layers if is_int(value) else value
    if not (isinstance(counts, (list, np.ndarray)) and len(counts) == n_layers and all(is_int(c) for c in counts)):
        raise m.fail("attention.head_count_kv", value, f"one integer, or one per layer ({n_layers})")
    counts = [int(c) for c in counts]
    attending = sorted({c for c in counts if c})
    if len(attending) > 1 or any(c < 0 for c in counts) or (attending and n_heads % attending[0]):
        raise m.fail("attention.head_count_kv", value,
                     f"0 (a convolution layer) or one divisor of attention.head_count ({n_heads}) per layer")
    return counts


def config_from_gguf(m: Meta) -> Lfm2Config:
    n_layers = m.integer("block_count", hi=MAX_LAYERS)
    n_heads = m.integer("attention.head_count")
    per_layer = _kv_heads_per_layer(m, n_layers, n_heads)
    n_kv = max(per_layer) or n_heads
    cfg = Lfm2Config(**base_config(m, n_kv_heads=n_kv), conv_length=m.integer("shortconv.l_cache", hi=MAX_CONV_LENGTH))
    m.absent("attention.sliding_window", "kiln's lfm2 family attends over the whole context")
    rope = Rope(theta=m.number("rope.freq_base", 10000.0, lo=1.0), dim=m.integer("rope.dimension_count", cfg.head_dim),
                neox=True, position_scale=rope_scale(m))
    check_rope(m, rope, cfg.head_dim)
    attn = Attention(n_heads, n_kv, cfg.head_dim, 1.0 / math.sqrt(cfg.head_dim), rope)
    conv = ShortConv(cfg.dim, cfg.conv_length)
    cfg.layers = [attn if kv else conv for kv in per_layer]
    return cfg


def attention_block(op: Ops, cfg: Lfm2Config, i: int, h):
    p, attn = f"blk.{i}.", cfg.layers[i]
    q, k, v = (op.linear(h, p + f"attn_{n}.weight") for n in "qkv")
    q = op.rope(op.rmsnorm(q, p + "attn_q_norm.weight", cfg.norm_eps, heads=attn.n_heads), attn.rope, attn.n_heads)
    k = op.rope(op.rmsnorm(k, p + "attn_k_norm.weight", cfg.norm_eps, heads=attn.n_kv_heads), attn.rope, attn.n_kv_heads)
    return op.linear(op.attention(i, q, k, v, attn), p + "attn_output.weight")


def conv_block(op: Ops, cfg: Lfm2Config, i: int, h):
    p = f"blk.{i}.shortconv."
    bcx = op.linear(h, p + "in_proj.weight")
    return op.linear(op.shortconv(i, bcx, p + "conv.weight", cfg.layers[i]), p + "out_proj.weight")


def forward(op: Ops, cfg: Lfm2Config):
    x = op.embed("token_embd.weight")
    for i in range(cfg.n_layers):
        h = op.rmsnorm(x, f"blk.{i}.attn_norm.weight", cfg.norm_eps)
        mix = attention_block if isinstance(cfg.layers[i], Attention) else conv_block
        x = op.add(x, mix(op, cfg, i, h))
        h = op.rmsnorm(x, f"blk.{i}.ffn_norm.weight", cfg.norm_eps)
        x = op.add(x, op.linear(op.glu(h, f"blk.{i}.ffn_gate.weight", f"blk.{i}.ffn_up.weight", "silu"),
                                f"blk.{i}.ffn_down.weight"))
    return op.logits(op.rmsnorm(x, "token_embd_norm.weight", cfg.norm_eps), output_weight(cfg))
