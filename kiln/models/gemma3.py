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

from kiln.gguf import GGUFFile
from kiln.models.base import Attention, ModelConfig, Ops, Rope, base_config, meta, output_weight

GLOBAL_EVERY = 6  # every sixth layer attends over the whole context
LOCAL_ROPE_THETA = 10000.0


@dataclass
class Gemma3Config(ModelConfig):
    sliding_window: int = 0


def config_from_gguf(gguf: GGUFFile) -> Gemma3Config:
    cfg = Gemma3Config(**base_config(gguf), sliding_window=int(meta(gguf, "attention.sliding_window")))
    factor = float(meta(gguf, "rope.scaling.factor", 1.0))
    # Queries are scaled by 1/sqrt(query_pre_attn_scalar), which GGUF does not store; it equals the head
    # size for every Gemma 3 except the 62-layer 27B, where it is dim / heads (llama.cpp does the same).
    scale = 1.0 / math.sqrt(cfg.dim / cfg.n_heads if cfg.n_layers == 62 else cfg.head_dim)
    local = Rope(LOCAL_ROPE_THETA, cfg.head_dim, neox=True)
    global_ = Rope(float(meta(gguf, "rope.freq_base", 1e6)), cfg.head_dim, neox=True, position_scale=1.0 / factor)
    for i in range(cfg.n_layers):
        if (i + 1) % GLOBAL_EVERY == 0:
            cfg.layers.append(Attention(cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, scale, global_))
        else:
            cfg.layers.append(Attention(cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, scale, local, cfg.sliding_window))
    return cfg


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
