"""Qwen3.5 (dense text models): a hybrid of Gated DeltaNet layers (linear attention with a recurrent
state) and gated full attention, each followed by a SwiGLU MLP. Layer i attends when (i + 1) is a
multiple of `full_attention_interval` (every fourth); the others run the DeltaNet.

    x = embed(tokens)
    for each layer:
        h = norm(x)
        if attention:   q, g = each head's halves of attn_q(h)
                        a = attention(rope(qnorm(q)), rope(knorm(k(h))), v(h))     # partial rotary
                        x = x + o(a * sigmoid(g))
        else:           q, k, v = silu(conv(attn_qkv(h)))                          # causal, depthwise
                        q, k = l2norm(q), l2norm(k)
                        decay = exp(A * softplus(ssm_alpha(h) + dt_bias)); rate = sigmoid(ssm_beta(h))
                        S = decay * S;  S = S + k ⊗ rate (v - Sᵀk);  y = Sᵀq / sqrt(k_dim)   # per value head
                        x = x + ssm_out(rmsnorm(y) * silu(attn_gate(h)))
        x = x + down(silu(gate(post_norm(x))) * up(post_norm(x)))
    logits = lm_head(norm(x))

The rotary sections (`rope.dimension_sections`, Qwen3.5's multimodal RoPE) give a text token the same
position in every section, so they rotate as one rope over `rope.dimension_count` dimensions. llama.cpp's
converter stores the norms with transformers' 1 + w already added, except the DeltaNet's output norm.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kiln.gguf import head_view, is_int
from kiln.models.base import (Attention, DeltaNet, DeltaNetWeights, Meta, ModelConfig, Ops, Rope, base_config,
                              check_rope, output_weight, rope_scale)

MAX_CONV_LENGTH = 64  # taps; Qwen3.5's are 4


@dataclass
class Qwen35Config(ModelConfig):
    full_attention_interval: int = 4


def _rope_sections(m: Meta, rope_dim: int) -> None:
    """The sections must fit the rotated pairs; a text token's position is the same in each of them."""
    value = m.raw("rope.dimension_sections", None)
    if value is None:
        return
    if not (isinstance(value, (list, np.ndarray)) and all(is_int(v) and v >= 0 for v in value)
            and sum(int(v) for v in value) <= rope_dim // 2):
        raise m.fail("rope.dimension_sections", value, f"counts of rotated pairs summing to at most {rope_dim // 2}")


def config_from_gguf(m: Meta) -> Qwen35Config:
    cfg = Qwen35Config(**base_config(m), full_attention_interval=m.integer("full_attention_interval", 4, hi=1 << 16))
    m.absent("nextn_predict_layers", "kiln's qwen35 family does not run multi-token prediction layers")
    m.absent("attention.sliding_window", "kiln's qwen35 family attends over the whole context")
    rope = Rope(theta=m.number("rope.freq_base", 10000.0, lo=1.0), dim=m.integer("rope.dimension_count", cfg.head_dim),
                neox=True, position_scale=rope_scale(m))
    check_rope(m, rope, cfg.head_dim)
    _rope_sections(m, rope.dim)
    attn = Attention(cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, 1.0 / math.sqrt(cfg.head_dim), rope)
    n_k = m.integer("ssm.group_count", hi=1 << 16)
    n_v = m.integer("ssm.time_step_rank", hi=1 << 16)
    if n_v % n_k:
        raise m.fail("ssm.time_step_rank", n_v, f"a multiple of ssm.group_count ({n_k})")
    inner = m.integer("ssm.inner_size", hi=1 << 24)
    if inner % n_v:
        raise m.fail("ssm.inner_size", inner, f"a multiple of ssm.time_step_rank ({n_v})")
    net = DeltaNet(n_k, n_v, m.integer("ssm.state_size", hi=1 << 12), inner // n_v,
                   m.integer("ssm.conv_kernel", hi=MAX_CONV_LENGTH), cfg.norm_eps)
    cfg.layers = [attn if (i + 1) % cfg.full_attention_interval == 0 else net for i in range(cfg.n_layers)]
    return cfg


def attention_block(op: Ops, cfg: Qwen35Config, i: int, h):
    p, attn = f"blk.{i}.", cfg.layers[i]
    q, gate = (op.linear(h, head_view(p + "attn_q.weight", part, 2, attn.head_dim)) for part in (0, 1))
    q = op.rope(op.rmsnorm(q, p + "attn_q_norm.weight", cfg.norm_eps, heads=attn.n_heads), attn.rope, attn.n_heads)
    k = op.rope(op.rmsnorm(op.linear(h, p + "attn_k.weight"), p + "attn_k_norm.weight", cfg.norm_eps,
                           heads=attn.n_kv_heads), attn.rope, attn.n_kv_heads)
    out = op.attention(i, q, k, op.linear(h, p + "attn_v.weight"), attn)
    return op.linear(op.gate(out, gate), p + "attn_output.weight")


def delta_net_block(op: Ops, cfg: Qwen35Config, i: int, h):
    p = f"blk.{i}."
    weights = DeltaNetWeights(p + "ssm_conv1d.weight", p + "ssm_a", p + "ssm_dt.bias", p + "ssm_norm.weight")
    out = op.delta_net(i, op.linear(h, p + "attn_qkv.weight"), op.linear(h, p + "attn_gate.weight"),
                       op.linear(h, p + "ssm_alpha.weight"), op.linear(h, p + "ssm_beta.weight"), weights, cfg.layers[i])
    return op.linear(out, p + "ssm_out.weight")


def forward(op: Ops, cfg: Qwen35Config):
    x = op.embed("token_embd.weight")
    for i in range(cfg.n_layers):
        h = op.rmsnorm(x, f"blk.{i}.attn_norm.weight", cfg.norm_eps)
        mix = attention_block if isinstance(cfg.layers[i], Attention) else delta_net_block
        x = op.add(x, mix(op, cfg, i, h))
        h = op.rmsnorm(x, f"blk.{i}.post_attention_norm.weight", cfg.norm_eps)
        x = op.add(x, op.linear(op.glu(h, f"blk.{i}.ffn_gate.weight", f"blk.{i}.ffn_up.weight", "silu"),
                                f"blk.{i}.ffn_down.weight"))
    return op.logits(op.rmsnorm(x, "output_norm.weight", cfg.norm_eps), output_weight(cfg))
