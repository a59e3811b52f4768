"""OLMoE: pre-norm decoder blocks whose q and k are RMS-normalized over the whole projection (as OLMo 2's,
olmo2.py) before NeoX rotary embeddings, and a mixture of experts in place of the MLP.

    h = norm(x)
    x = x + o(attention(rope(qnorm(q(h))), rope(knorm(k(h))), v(h)))     # qnorm, knorm: over all heads
    x = x + Σ_{e in top-k(softmax(router(norm(x))))} w_e · down_e(silu(gate_e) * up_e)
    logits = lm_head(norm(x))                                             # never tied

As llama.cpp builds it: the kept router weights are not renormalized, and the experts are as wide as
`feed_forward_length`.
"""

from __future__ import annotations

import math

from kiln.models.base import Attention, Meta, Ops, Rope, base_config, rope_scale
from kiln.models.qwenmoe import MoeConfig, layer_experts


def config_from_gguf(m: Meta) -> MoeConfig:
    cfg = MoeConfig(**base_config(m, moe=True, tied_embeddings=False))  # llama.cpp requires output.weight
    m.absent("attention.sliding_window", "kiln's olmoe family attends over the whole context")
    ff = cfg.ffn_dim
    m.integer("expert_feed_forward_length", ff, lo=ff, hi=ff)  # llama.cpp sizes the experts by ffn_dim
    rope = Rope(
        theta=m.number("rope.freq_base", 10000.0, lo=1.0),
        dim=m.integer("rope.dimension_count", cfg.head_dim, lo=cfg.head_dim, hi=cfg.head_dim),  # llama.cpp's assert
        neox=True,
        position_scale=rope_scale(m),
    )
    cfg.layers = [Attention(cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, 1.0 / math.sqrt(cfg.head_dim), rope)] * cfg.n_layers
    cfg.experts = layer_experts(m, cfg.n_layers, ff, normalize=False)
    return cfg


def forward(op: Ops, cfg: MoeConfig):
    x = op.embed("token_embd.weight")
    for i in range(cfg.n_layers):
        p, attn, eps = f"blk.{i}.", cfg.layers[i], cfg.norm_eps
        h = op.rmsnorm(x, p + "attn_norm.weight", eps)
        q = op.rmsnorm(op.linear(h, p + "attn_q.weight"), p + "attn_q_norm.weight", eps)
        k = op.rmsnorm(op.linear(h, p + "attn_k.weight"), p + "attn_k_norm.weight", eps)
        v = op.linear(h, p + "attn_v.weight")
        q, k = op.rope(q, attn.rope, attn.n_heads), op.rope(k, attn.rope, attn.n_kv_heads)
        x = op.add(x, op.linear(op.attention(i, q, k, v, attn), p + "attn_output.weight"))
        x = op.add(x, op.moe(op.rmsnorm(x, p + "ffn_norm.weight", eps), cfg.experts[i]))
    return op.logits(op.rmsnorm(x, "output_norm.weight", cfg.norm_eps), "output.weight")
