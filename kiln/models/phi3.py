"""Phi-3 (Phi-3.5-mini, Phi-4-mini): the Llama block (llama.py) with q, k and v fused in one `attn_qkv`,
gate and up stacked in one `ffn_up`, NeoX rotary embeddings over part of each head, and LongRoPE.

    x = embed(tokens)
    for each layer:
        q, k, v = split(qkv(norm(x)))                                 # attn_qkv: q rows, then k, then v
        x = x + o(attention(rope(q), rope(k), v))                       # rope on the first rope.dim of a head
        gate, up = split(ffn_up)                                        # gate rows first, as transformers
        x = x + down(silu(gate(norm(x))) * up(norm(x)))
    logits = lm_head(norm(x))

LongRoPE divides the rotary frequencies by `rope_factors_short` or, for a context longer than
`rope.scaling.original_context_length`, by `rope_factors_long`: llama.cpp chooses by the context each
sequence is given (kiln's n_ctx), not by how long it is so far. `rope.scaling.attn_factor` multiplies
cos and sin, for either set, as llama.cpp and transformers do.
"""

from __future__ import annotations

import math

from kiln.gguf import row_view
from kiln.models import llama
from kiln.models.base import MAX_CONTEXT, Attention, Meta, Ops, Rope, base_config, check_rope, output_weight
from kiln.models.llama import LlamaConfig, bias, projections

SHORT_FACTORS, LONG_FACTORS = "rope_factors_short.weight", "rope_factors_long.weight"


def config_from_gguf(m: Meta) -> LlamaConfig:
    tensors = m.gguf.tensors
    cfg = LlamaConfig(**base_config(m), biases=frozenset(n for n in llama.OPTIONAL_BIASES if f"blk.0.{n}.bias" in tensors),
                      fused_qkv="blk.0.attn_qkv.weight" in tensors)
    m.string("rope.scaling.type", "longrope", choices=("longrope",))
    rope = Rope(
        theta=m.number("rope.freq_base", 10000.0, lo=1.0),
        dim=m.integer("rope.dimension_count", cfg.head_dim),
        neox=True,
        freq_factors=SHORT_FACTORS if SHORT_FACTORS in tensors else None,
        long_factors=LONG_FACTORS if LONG_FACTORS in tensors else None,
        # llama.cpp's default: the context the model was trained for
        original_context=m.integer("rope.scaling.original_context_length", cfg.context_length, hi=MAX_CONTEXT),
        attn_factor=m.number("rope.scaling.attn_factor", 1.0, lo=1e-6, hi=1e3),
    )
    check_rope(m, rope, cfg.head_dim)
    window = m.integer("attention.sliding_window", 0, lo=0, hi=MAX_CONTEXT)
    attn = Attention(cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, 1.0 / math.sqrt(cfg.head_dim), rope, window or None)
    cfg.layers = [attn] * cfg.n_layers
    return cfg


def block(op: Ops, cfg: LlamaConfig, i: int, x):
    p, attn, ffn = f"blk.{i}.", cfg.layers[i], cfg.ffn_dim
    h = op.rmsnorm(x, p + "attn_norm.weight", cfg.norm_eps)
    q, k, v = projections(op, cfg, p, h, attn)
    q = op.rope(q, attn.rope, attn.n_heads)
    k = op.rope(k, attn.rope, attn.n_kv_heads)
    x = op.add(x, op.linear(op.attention(i, q, k, v, attn), p + "attn_output.weight", bias(cfg, p, "attn_output")))

    h = op.rmsnorm(x, p + "ffn_norm.weight", cfg.norm_eps)
    up = p + "ffn_up.weight"
    h = op.glu(h, row_view(up, 0, ffn), row_view(up, ffn, 2 * ffn), "silu")
    return op.add(x, op.linear(h, p + "ffn_down.weight", bias(cfg, p, "ffn_down")))


def forward(op: Ops, cfg: LlamaConfig):
    x = op.embed("token_embd.weight")
    for i in range(cfg.n_layers):
        x = block(op, cfg, i, x)
    return op.logits(op.rmsnorm(x, "output_norm.weight", cfg.norm_eps), output_weight(cfg))
