"""OLMo 2: decoder blocks normalized after each sublayer instead of before it, with q and k
RMS-normalized over the whole projection (all heads at once) before NeoX-style rotary embeddings.

    x = embed(tokens)
    for each layer:
        h = attention(rope(qnorm(q(x))), rope(knorm(k(x))), v(x))      # qnorm, knorm: over all heads
        x = x + post_attention_norm(o(h))
        x = x + post_ffw_norm(down(silu(gate(x)) * up(x)))
    logits = lm_head(norm(x))                                           # never tied
"""

from __future__ import annotations

import math

from kiln.models.base import Attention, Meta, ModelConfig, Ops, Rope, base_config, rope_scale


def config_from_gguf(m: Meta) -> ModelConfig:
    cfg = ModelConfig(**base_config(m, tied_embeddings=False))  # llama.cpp requires output.weight
    for key in ("attention.sliding_window", "attention.sliding_window_pattern", "rope.freq_base_swa"):
        m.absent(key, "kiln's olmo2 family attends over the whole context (OLMo 3's sliding window is not run)")
    cfg.layers = olmo_attention(m, cfg)
    return cfg


def olmo_attention(m: Meta, cfg: ModelConfig) -> list[Attention]:
    """Every layer's attention, OLMo 2's and OLMoE's alike: NeoX rope over the whole head."""
    rope = Rope(
        theta=m.number("rope.freq_base", 10000.0, lo=1.0),
        dim=m.integer("rope.dimension_count", cfg.head_dim, lo=cfg.head_dim, hi=cfg.head_dim),  # llama.cpp's assert
        neox=True,
        position_scale=rope_scale(m),
    )
    return [Attention(cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, 1.0 / math.sqrt(cfg.head_dim), rope)] * cfg.n_layers


def attention_output(op: Ops, cfg: ModelConfig, i: int, h):
    """o(attention(rope(qnorm(q(h))), rope(knorm(k(h))), v(h))), q and k normalized over the whole projection."""
    p, attn, eps = f"blk.{i}.", cfg.layers[i], cfg.norm_eps
    q = op.rmsnorm(op.linear(h, p + "attn_q.weight"), p + "attn_q_norm.weight", eps)
    k = op.rmsnorm(op.linear(h, p + "attn_k.weight"), p + "attn_k_norm.weight", eps)
    v = op.linear(h, p + "attn_v.weight")
    q, k = op.rope(q, attn.rope, attn.n_heads), op.rope(k, attn.rope, attn.n_kv_heads)
    return op.linear(op.attention(i, q, k, v, attn), p + "attn_output.weight")


def block(op: Ops, cfg: ModelConfig, i: int, x):
    p, eps = f"blk.{i}.", cfg.norm_eps
    x = op.add(x, op.rmsnorm(attention_output(op, cfg, i, x), p + "post_attention_norm.weight", eps))

    h = op.linear(op.glu(x, p + "ffn_gate.weight", p + "ffn_up.weight", "silu"), p + "ffn_down.weight")
    return op.add(x, op.rmsnorm(h, p + "post_ffw_norm.weight", eps))


def forward(op: Ops, cfg: ModelConfig):
    x = op.embed("token_embd.weight")
    for i in range(cfg.n_layers):
        x = block(op, cfg, i, x)
    return op.logits(op.rmsnorm(x, "output_norm.weight", cfg.norm_eps), "output.weight")
