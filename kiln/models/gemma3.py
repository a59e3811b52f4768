"""Gemma 3 (text): Llama-like blocks with four norms each, a GeGLU MLP, per-head q/k RMSNorm, scaled
embeddings, and attention that is local (sliding window) on five layers out of six.

    x = embed(tokens) * sqrt(dim)
    for each layer:
        h = attention(rope(qnorm(q(norm(x)))), rope(knorm(k(norm(x)))), v(norm(x)))
        x = x + post_attention_norm(o(h))
        x = x + post_ffw_norm(down(gelu(gate(norm(x))) * up(norm(x))))
    logits = lm_head(norm(x))                                           # tied to the embedding

GGUF stores Gemma's norm weights with the +1 of `x * (1 + w)` already added, so every norm here is a
plain RMSNorm.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kiln.gguf import is_int
from kiln.models.base import (MAX_CONTEXT, Attention, Meta, ModelConfig, Ops, Rope, base_config, check_rope,
                              output_weight, rope_scale)

# llama.cpp's defaults where the file does not say: every sixth layer attends over the whole context, and
# the local layers' RoPE base
GLOBAL_EVERY = 6
LOCAL_ROPE_THETA = 10000.0


@dataclass
class Gemma3Config(ModelConfig):
    sliding_window: int = 0


def config_from_gguf(m: Meta) -> Gemma3Config:
    cfg = Gemma3Config(**base_config(m), sliding_window=m.integer("attention.sliding_window", hi=MAX_CONTEXT))
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        m.absent(key, "kiln's gemma3 family does not soft-cap")
    # Queries are scaled by 1/sqrt(query_pre_attn_scalar), which GGUF does not store; it equals the head
    # size for every Gemma 3 except the 62-layer 27B, where it is dim / heads (llama.cpp does the same).
    scale = 1.0 / math.sqrt(cfg.dim / cfg.n_heads if cfg.n_layers == 62 else cfg.head_dim)
    rope_dim = m.integer("rope.dimension_count", cfg.head_dim)
    # RoPE scaling stretches the global layers' positions only, as in llama.cpp and transformers
    local = Rope(m.number("rope.freq_base_swa", LOCAL_ROPE_THETA, lo=1.0), rope_dim, neox=True)
    global_ = Rope(m.number("rope.freq_base", 10000.0, lo=1.0), rope_dim, neox=True, position_scale=rope_scale(m))
    check_rope(m, global_, cfg.head_dim)
    for sliding in sliding_layers(m, cfg.n_layers):
        rope, window = (local, cfg.sliding_window) if sliding else (global_, None)
        cfg.layers.append(Attention(cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, scale, rope, window))
    return cfg


def sliding_layers(m: Meta, n_layers: int) -> list[bool]:
    """Which layers attend through the sliding window: `attention.sliding_window_pattern` is a period p
    (layer i is local unless i % p == p - 1; 0 makes every layer local) or one flag per layer."""
    pattern = m.raw("attention.sliding_window_pattern", GLOBAL_EVERY)
    if is_int(pattern) and pattern >= 0:
        return [pattern == 0 or i % pattern < pattern - 1 for i in range(n_layers)]
    if isinstance(pattern, np.ndarray) and pattern.shape == (n_layers,) and pattern.dtype.kind in "biu":
        return [bool(v) for v in pattern]
    raise m.fail("attention.sliding_window_pattern", pattern,
                 f"a period (an integer from 0) or {n_layers} per-layer flags")


def block(op: Ops, cfg: Gemma3Config, i: int, x):
    p, attn, eps = f"blk.{i}.", cfg.layers[i], cfg.norm_eps
    h = op.rmsnorm(x, p + "attn_norm.weight", eps)
    q = op.rmsnorm(op.linear(h, p + "attn_q.weight"), p + "attn_q_norm.weight", eps, heads=attn.n_heads)
    k = op.rmsnorm(op.linear(h, p + "attn_k.weight"), p + "attn_k_norm.weight", eps, heads=attn.n_kv_heads)
    v = op.linear(h, p + "attn_v.weight")
    q = op.rope(q, attn.rope, attn.n_heads)
    k = op.rope(k, attn.rope, attn.n_kv_heads)
    h = op.linear(op.attention(i, q, k, v, attn), p + "attn_output.weight")
    x = op.add(x, op.rmsnorm(h, p + "post_attention_norm.weight", eps))

    h = op.rmsnorm(x, p + "ffn_norm.weight", eps)
    h = op.linear(op.glu(h, p + "ffn_gate.weight", p + "ffn_up.weight", "gelu_tanh"), p + "ffn_down.weight")
    return op.add(x, op.rmsnorm(h, p + "post_ffw_norm.weight", eps))


def forward(op: Ops, cfg: Gemma3Config):
    x = op.embed("token_embd.weight", scale=math.sqrt(cfg.dim))
    for i in range(cfg.n_layers):
        x = block(op, cfg, i, x)
    return op.logits(op.rmsnorm(x, "output_norm.weight", cfg.norm_eps), output_weight(cfg))
