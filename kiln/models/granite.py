"""Granite 3.x (dense): the Llama block (llama.py) with four multipliers, from training at another width
(muP): the embeddings, each residual branch, the attention scores and the logits are scaled.

    x = embed(tokens) * embedding_scale
    for each layer:
        h = attention(rope(q(norm(x))), rope(k(norm(x))), v(norm(x)), scale=attention_scale)
        x = x + residual_scale * o(h)
        x = x + residual_scale * down(silu(gate(norm(x))) * up(norm(x)))
    logits = lm_head(norm(x)) / logit_scale

llama.cpp's defaults: a multiplier the file leaves out (or sets to 0) is 1, the attention scale
1/sqrt(head size); the logit scale is required. `rope.scaling.finetuned` false turns rope off.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kiln.models.base import Attention, Meta, ModelConfig, Ops, Rope, base_config, output_weight, rope_scale


@dataclass
class GraniteConfig(ModelConfig):
    embedding_scale: float = 1.0
    residual_scale: float = 1.0
    logit_scale: float = 1.0


def multiplier(m: Meta, key: str) -> float:
    """An optional multiplier; llama.cpp reads 0 as none."""
    return m.number(key, 0.0, hi=1e6) or 1.0


def config_from_gguf(m: Meta, moe: bool = False) -> GraniteConfig:
    """`moe=True`: Granite-MoE's (granitemoe.py), which reads the expert keys itself."""
    cfg = GraniteConfig(**base_config(m, moe=moe), embedding_scale=multiplier(m, "embedding_scale"),
                        residual_scale=multiplier(m, "residual_scale"),
                        logit_scale=m.number("logit_scale", lo=1e-6, hi=1e6))
    m.absent("attention.sliding_window", "kiln's granite family attends over the whole context")
    if not moe:
        m.absent("expert_shared_feed_forward_length", "kiln's granite family is the dense one (no shared expert)")
    scale = m.number("attention.scale", 0.0, hi=1e6) or 1.0 / math.sqrt(cfg.head_dim)
    position_scale = rope_scale(m)
    finetuned = m.raw("rope.scaling.finetuned", True)  # llama.cpp's switch for Granite's rope
    if not isinstance(finetuned, bool):
        raise m.fail("rope.scaling.finetuned", finetuned, "a boolean")
    rope = Rope(
        theta=m.number("rope.freq_base", 10000.0, lo=1.0),
        dim=m.integer("rope.dimension_count", cfg.head_dim, lo=cfg.head_dim, hi=cfg.head_dim),  # llama.cpp's assert
        neox=False,  # llama.cpp's converter permutes q and k for the adjacent-pair rotation
        freq_factors="rope_freqs.weight" if "rope_freqs.weight" in m.gguf.tensors else None,
        position_scale=position_scale,
    )
    cfg.layers = [Attention(cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, scale, rope if finetuned else None)] * cfg.n_layers
    return cfg


def block(op: Ops, cfg: ModelConfig, i: int, x, residual_scale: float = 1.0):
    """The Llama block with each residual branch scaled, rotary embeddings only where the layer has them
    (SmolLM3's block too, unscaled)."""
    p, eps = f"blk.{i}.", cfg.norm_eps
    x = attention_block(op, cfg, i, x, residual_scale)
    h = op.rmsnorm(x, p + "ffn_norm.weight", eps)
    h = op.linear(op.glu(h, p + "ffn_gate.weight", p + "ffn_up.weight", "silu"), p + "ffn_down.weight")
    return op.add(x, h, scale=residual_scale)


def attention_block(op: Ops, cfg: ModelConfig, i: int, x, residual_scale: float = 1.0):
    """The residual stream after layer i's attention (Granite-MoE's too)."""
    p, attn = f"blk.{i}.", cfg.layers[i]
    h = op.rmsnorm(x, p + "attn_norm.weight", cfg.norm_eps)
    q, k, v = (op.linear(h, p + f"attn_{n}.weight") for n in "qkv")
    if attn.rope is not None:
        q, k = op.rope(q, attn.rope, attn.n_heads), op.rope(k, attn.rope, attn.n_kv_heads)
    return op.add(x, op.linear(op.attention(i, q, k, v, attn), p + "attn_output.weight"), scale=residual_scale)


def forward(op: Ops, cfg: GraniteConfig):
    x = op.embed("token_embd.weight", scale=cfg.embedding_scale)
    for i in range(cfg.n_layers):
        x = block(op, cfg, i, x, cfg.residual_scale)
    return op.logits(op.rmsnorm(x, "output_norm.weight", cfg.norm_eps), output_weight(cfg), scale=1.0 / cfg.logit_scale)
