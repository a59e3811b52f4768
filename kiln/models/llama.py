"""Llama (SmolLM2, Llama 2/3): pre-norm decoder blocks of grouped-query attention and a SwiGLU MLP.

    x = embed(tokens)
    for each layer:
        h = attention(rope(q(norm(x))), rope(k(norm(x))), v(norm(x)))      # GQA over the KV cache
        x = x + o(h)
        x = x + down(silu(gate(norm(x))) * up(norm(x)))
    logits = lm_head(norm(x))

Qwen2 and Qwen3 (qwen.py) are this block with two switches: biases on q/k/v, and RMSNorm per head
on q and k. Any file may carry biases on its projections, and q, k and v as one fused `attn_qkv`
(read as three row views of it, so the native engine packs three matrices and runs its usual QKV op).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kiln.gguf import row_view
from kiln.models.base import (MAX_CONTEXT, Attention, Meta, ModelConfig, Ops, Rope, base_config, check_rope, output_weight,
                              rope_scaling)


@dataclass
class LlamaConfig(ModelConfig):
    qkv_bias: bool = False
    qk_norm: bool = False
    biases: frozenset[str] = frozenset()  # the projections that add a bias, by tensor name within the block
    fused_qkv: bool = False  # q, k and v stacked in one `attn_qkv` (in that order)


# Biases llama.cpp reads where a file carries them (the layer's tensors must then all have them)
OPTIONAL_BIASES = ("attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def config_from_gguf(m: Meta, neox: bool = False, moe: bool = False, **switches) -> LlamaConfig:
    """`moe=True`: the caller's family reads the expert keys itself (qwenmoe.py)."""
    tensors = m.gguf.tensors
    fused = "blk.0.attn_qkv.weight" in tensors
    biases = {n for n in OPTIONAL_BIASES if f"blk.0.{n}.bias" in tensors}
    if switches.get("qkv_bias"):
        biases |= {"attn_qkv"} if fused else {"attn_q", "attn_k", "attn_v"}
    cfg = LlamaConfig(**base_config(m, moe=moe), **switches, biases=frozenset(biases), fused_qkv=fused)
    # Mistral's llama files say their window here (0: none); llama.cpp ignores it, transformers' Mistral
    # applies it on every layer, as kiln does
    window = None
    if m.arch == "llama":
        window = m.integer("attention.sliding_window", 0, lo=0, hi=MAX_CONTEXT) or None
    else:
        m.absent("attention.sliding_window", f"kiln's {m.arch} family attends over the whole context")
    rope = Rope(
        theta=m.number("rope.freq_base", 10000.0, lo=1.0),
        dim=m.integer("rope.dimension_count", cfg.head_dim),
        neox=neox,
        freq_factors="rope_freqs.weight" if "rope_freqs.weight" in m.gguf.tensors else None,
        **rope_scaling(m, cfg.context_length),
    )
    check_rope(m, rope, cfg.head_dim)
    attn = Attention(cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, 1.0 / math.sqrt(cfg.head_dim), rope, window)
    cfg.layers = [attn] * cfg.n_layers
    return cfg


def attention_block(op: Ops, cfg: LlamaConfig, i: int, x):
    """The residual stream after layer i's attention."""
    p, attn = f"blk.{i}.", cfg.layers[i]
    h = op.rmsnorm(x, p + "attn_norm.weight", cfg.norm_eps)
    q, k, v = projections(op, cfg, p, h, attn)
    if cfg.qk_norm:
        q = op.rmsnorm(q, p + "attn_q_norm.weight", cfg.norm_eps, heads=attn.n_heads)
        k = op.rmsnorm(k, p + "attn_k_norm.weight", cfg.norm_eps, heads=attn.n_kv_heads)
    q = op.rope(q, attn.rope, attn.n_heads)
    k = op.rope(k, attn.rope, attn.n_kv_heads)
    return op.add(x, op.linear(op.attention(i, q, k, v, attn), p + "attn_output.weight", bias(cfg, p, "attn_output")))


def block(op: Ops, cfg: LlamaConfig, i: int, x):
    p = f"blk.{i}."
    x = attention_block(op, cfg, i, x)
    h = op.rmsnorm(x, p + "ffn_norm.weight", cfg.norm_eps)
    h = op.glu(h, p + "ffn_gate.weight", p + "ffn_up.weight", "silu", bias(cfg, p, "ffn_gate"), bias(cfg, p, "ffn_up"))
    return op.add(x, op.linear(h, p + "ffn_down.weight", bias(cfg, p, "ffn_down")))


def bias(cfg: LlamaConfig, p: str, name: str) -> str | None:
    return p + name + ".bias" if name in cfg.biases else None


def projections(op: Ops, cfg: LlamaConfig, p: str, h, attn: Attention):
    """q, k and v of the block's input: three tensors, or three parts of a fused one."""
    if not cfg.fused_qkv:
        return (op.linear(h, p + f"attn_{n}.weight", bias(cfg, p, f"attn_{n}")) for n in "qkv")
    q_dim, kv_dim = attn.n_heads * attn.head_dim, attn.n_kv_heads * attn.head_dim
    parts = ((0, q_dim), (q_dim, q_dim + kv_dim), (q_dim + kv_dim, q_dim + 2 * kv_dim))
    b = bias(cfg, p, "attn_qkv")
    return (op.linear(h, row_view(p + "attn_qkv.weight", lo, hi), b and row_view(b, lo, hi)) for lo, hi in parts)


def forward(op: Ops, cfg: LlamaConfig):
    x = op.embed("token_embd.weight")
    for i in range(cfg.n_layers):
        x = block(op, cfg, i, x)
    return op.logits(op.rmsnorm(x, "output_norm.weight", cfg.norm_eps), output_weight(cfg))
