"""Gemma 2: Gemma 3's block (gemma3.py) without the q/k norms, with soft-capped attention scores and
logits, and local (sliding window) attention on every other layer, the even ones.

    x = embed(tokens) * sqrt(dim)
    for each layer:
        h = attention(rope(q(norm(x))), rope(k(norm(x))), v(norm(x)))   # scores: 50 tanh(s / 50)
        x = x + post_attention_norm(o(h))
        x = x + post_ffw_norm(down(gelu(gate(norm(x))) * up(norm(x))))
    logits = 30 tanh(lm_head(norm(x)) / 30)                             # tied to the embedding

As in Gemma 3's files, the norm weights carry their +1 already.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kiln.models.base import (MAX_CONTEXT, Attention, Meta, ModelConfig, Ops, Rope, base_config, check_rope, rope_scale,
                              softcap)
from kiln.models.gemma3 import sliding_layers

# llama.cpp's defaults where the file does not say (Gemma 2's own values)
SLIDING_WINDOW = 4096
ATTN_SOFTCAP = 50.0
FINAL_SOFTCAP = 30.0


@dataclass
class Gemma2Config(ModelConfig):
    final_softcap: float = FINAL_SOFTCAP


def config_from_gguf(m: Meta) -> Gemma2Config:
    # the output head is the embedding table, always (llama.cpp reads no output.weight for gemma2)
    cfg = Gemma2Config(**base_config(m, tied_embeddings=True))
    window = m.integer("attention.sliding_window", SLIDING_WINDOW, hi=MAX_CONTEXT)
    attn_softcap = softcap(m, "attn_logit_softcapping", ATTN_SOFTCAP)
    cfg.final_softcap = softcap(m, "final_logit_softcapping", FINAL_SOFTCAP)
    # 1/sqrt(query_pre_attn_scalar), which GGUF does not store: the head size, but dim / heads for the
    # 46-layer 27B (llama.cpp does the same)
    scale = 1.0 / math.sqrt(cfg.dim / cfg.n_heads if cfg.n_layers == 46 else cfg.head_dim)
    rope_dim = m.integer("rope.dimension_count", cfg.head_dim)
    theta = m.number("rope.freq_base", 10000.0, lo=1.0)
    position_scale = rope_scale(m)  # local and global layers alike, unlike Gemma 3
    global_ = Rope(theta, rope_dim, neox=True, position_scale=position_scale)
    local = Rope(m.number("rope.freq_base_swa", theta, lo=1.0), rope_dim, neox=True, position_scale=position_scale)
    check_rope(m, global_, cfg.head_dim)
    for sliding in sliding_layers(m, cfg.n_layers, period=2):
        rope, layer_window = (local, window) if sliding else (global_, None)
        cfg.layers.append(Attention(cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, scale, rope, layer_window, attn_softcap))
    return cfg


def block(op: Ops, cfg: Gemma2Config, i: int, x):
    p, attn, eps = f"blk.{i}.", cfg.layers[i], cfg.norm_eps
    h = op.rmsnorm(x, p + "attn_norm.weight", eps)
    q = op.rope(op.linear(h, p + "attn_q.weight"), attn.rope, attn.n_heads)
    k = op.rope(op.linear(h, p + "attn_k.weight"), attn.rope, attn.n_kv_heads)
    v = op.linear(h, p + "attn_v.weight")
    h = op.linear(op.attention(i, q, k, v, attn), p + "attn_output.weight")
    x = op.add(x, op.rmsnorm(h, p + "post_attention_norm.weight", eps))

    h = op.rmsnorm(x, p + "ffn_norm.weight", eps)
    h = op.linear(op.glu(h, p + "ffn_gate.weight", p + "ffn_up.weight", "gelu_tanh"), p + "ffn_down.weight")
    return op.add(x, op.rmsnorm(h, p + "post_ffw_norm.weight", eps))


def forward(op: Ops, cfg: Gemma2Config):
    x = op.embed("token_embd.weight", scale=math.sqrt(cfg.dim))
    for i in range(cfg.n_layers):
        x = block(op, cfg, i, x)
    return op.logits(op.rmsnorm(x, "output_norm.weight", cfg.norm_eps), "token_embd.weight", softcap=cfg.final_softcap)
