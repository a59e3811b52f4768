"""Phi-2: parallel blocks, in which attention and a GELU MLP both read one LayerNorm of the residual
stream, with biases on every projection and on the output head.

    x = embed(tokens)
    for each layer:
        h = layernorm(x)                                                # with a bias
        x = x + o(attention(rope(q(h)), rope(k(h)), v(h))) + down(gelu(up(h)))
    logits = lm_head(layernorm(x))                                      # the head has a bias too

q, k and v are three tensors or one fused `attn_qkv` (older conversions), each with its bias; rotary
embeddings are NeoX-style over the first rope.dimension_count dimensions of a head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kiln.gguf import row_view
from kiln.models.base import Attention, Meta, ModelConfig, Ops, Rope, base_config, check_rope, output_weight


@dataclass
class Phi2Config(ModelConfig):
    fused_qkv: bool = False


def config_from_gguf(m: Meta) -> Phi2Config:
    # Phi-2's norms are LayerNorms: llama.cpp reads their epsilon from attention.layer_norm_epsilon
    cfg = Phi2Config(**base_config(m, norm_eps=m.number("attention.layer_norm_epsilon", hi=1.0)),
                     fused_qkv="blk.0.attn_qkv.weight" in m.gguf.tensors)
    rope = Rope(theta=m.number("rope.freq_base", 10000.0, lo=1.0), dim=m.integer("rope.dimension_count", cfg.head_dim),
                neox=True)
    check_rope(m, rope, cfg.head_dim)
    cfg.layers = [Attention(cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, 1.0 / math.sqrt(cfg.head_dim), rope)] * cfg.n_layers
    return cfg


def projections(op: Ops, cfg: Phi2Config, p: str, h, attn: Attention):
    if not cfg.fused_qkv:
        return (op.linear(h, p + f"attn_{n}.weight", p + f"attn_{n}.bias") for n in "qkv")
    q_dim, kv_dim = attn.n_heads * attn.head_dim, attn.n_kv_heads * attn.head_dim
    parts = ((0, q_dim), (q_dim, q_dim + kv_dim), (q_dim + kv_dim, q_dim + 2 * kv_dim))
    w, b = p + "attn_qkv.weight", p + "attn_qkv.bias"
    return (op.linear(h, row_view(w, lo, hi), row_view(b, lo, hi)) for lo, hi in parts)


def block(op: Ops, cfg: Phi2Config, i: int, x):
    p, attn = f"blk.{i}.", cfg.layers[i]
    h = op.layernorm(x, p + "attn_norm.weight", p + "attn_norm.bias", cfg.norm_eps)
    q, k, v = projections(op, cfg, p, h, attn)
    q = op.rope(q, attn.rope, attn.n_heads)
    k = op.rope(k, attn.rope, attn.n_kv_heads)
    x_attn = op.add(x, op.linear(op.attention(i, q, k, v, attn), p + "attn_output.weight", p + "attn_output.bias"))
    mlp = op.activation(op.linear(h, p + "ffn_up.weight", p + "ffn_up.bias"), "gelu_tanh")
    return op.add(x_attn, op.linear(mlp, p + "ffn_down.weight", p + "ffn_down.bias"))


def forward(op: Ops, cfg: Phi2Config):
    x = op.embed("token_embd.weight")
    for i in range(cfg.n_layers):
        x = block(op, cfg, i, x)
    h = op.layernorm(x, "output_norm.weight", "output_norm.bias", cfg.norm_eps)
    return op.logits(h, output_weight(cfg), None if cfg.tied_embeddings else "output.bias")
