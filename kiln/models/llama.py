"""Llama (SmolLM2, Llama 2/3): pre-norm decoder blocks of grouped-query attention and a SwiGLU MLP.

    x = embed(tokens)
    for each layer:
        h = attention(rope(q(norm(x))), rope(k(norm(x))), v(norm(x)))      # GQA over the KV cache
        x = x + o(h)
        x = x + down(silu(gate(norm(x))) * up(norm(x)))
    logits = lm_head(norm(x))

Qwen2 and Qwen3 (qwen.py) are this block with two switches: biases on q/k/v, and RMSNorm per head
on q and k.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kiln.models.base import (Attention, Meta, ModelConfig, Ops, Rope, base_config, check_rope, output_weight,
                              refuse_experts, rope_scale)


@dataclass
class LlamaConfig(ModelConfig):
    qkv_bias: bool = False
    qk_norm: bool = False


def config_from_gguf(m: Meta, neox: bool = False, dense: bool = True, **switches) -> LlamaConfig:
    """`dense=False`: the caller's family reads the expert keys itself (qwenmoe.py)."""
    if dense:
        refuse_experts(m)
    cfg = LlamaConfig(**base_config(m), **switches)
    m.absent("attention.sliding_window", f"kiln's {m.arch} family attends over the whole context")
    rope = Rope(
        theta=m.number("rope.freq_base", 10000.0, lo=1.0),
        dim=m.integer("rope.dimension_count", cfg.head_dim),
        neox=neox,
        freq_factors="rope_freqs.weight" if "rope_freqs.weight" in m.gguf.tensors else None,
        position_scale=rope_scale(m),
    )
    check_rope(m, rope, cfg.head_dim)
    attn = Attention(cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, 1.0 / math.sqrt(cfg.head_dim), rope)
    cfg.layers = [attn] * cfg.n_layers
    return cfg


def attention_block(op: Ops, cfg: LlamaConfig, i: int, x):
    """The residual stream after layer i's attention."""
    p, attn = f"blk.{i}.", cfg.layers[i]
    h = op.rmsnorm(x, p + "attn_norm.weight", cfg.norm_eps)
    q, k, v = (op.linear(h, p + f"attn_{n}.weight", p + f"attn_{n}.bias" if cfg.qkv_bias else None) for n in "qkv")
    if cfg.qk_norm:
        q = op.rmsnorm(q, p + "attn_q_norm.weight", cfg.norm_eps, heads=attn.n_heads)
        k = op.rmsnorm(k, p + "attn_k_norm.weight", cfg.norm_eps, heads=attn.n_kv_heads)
    q = op.rope(q, attn.rope, attn.n_heads)
    k = op.rope(k, attn.rope, attn.n_kv_heads)
    return op.add(x, op.linear(op.attention(i, q, k, v, attn), p + "attn_output.weight"))


def block(op: Ops, cfg: LlamaConfig, i: int, x):
    p = f"blk.{i}."
    x = attention_block(op, cfg, i, x)
    h = op.rmsnorm(x, p + "ffn_norm.weight", cfg.norm_eps)
    return op.add(x, op.linear(op.glu(h, p + "ffn_gate.weight", p + "ffn_up.weight", "silu"), p + "ffn_down.weight"))


def forward(op: Ops, cfg: LlamaConfig):
    x = op.embed("token_embd.weight")
    for i in range(cfg.n_layers):
        x = block(op, cfg, i, x)
    return op.logits(op.rmsnorm(x, "output_norm.weight", cfg.norm_eps), output_weight(cfg))
