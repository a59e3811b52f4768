"""gpt-oss: pre-norm blocks of biased grouped-query attention with a learned sink per head, local (a sliding
window) on the even layers and global on the odd ones, and a mixture of experts in place of the MLP.

    x = embed(tokens)
    for each layer:
        h = norm(x)
        x = x + o(attention(rope(q(h)), rope(k(h)), v(h), sinks) + bo)    # q, k, v biased; YaRN rope
        h = post_attention_norm(x)
        x = x + Σ_{e in top-k(router(h) + br)} w_e · (down_e(swiglu_oai(gate_e(h) + bg_e, up_e(h) + bu_e)) + bd_e)
    logits = lm_head(norm(x))                                              # never tied

    sinks:       one logit per query head that joins the softmax's denominator only
    w:           a softmax over the k chosen router logits alone (llama.cpp's SOFTMAX_WEIGHT gating)
    swiglu_oai:  (clamp(u, -7, 7) + 1) * g * sigmoid(1.702 g), g = min(gate, 7)

As llama.cpp reads it (LLM_ARCH_OPENAI_MOE): `attention.sliding_window` and `expert_feed_forward_length`
are required, layer i attends through the window when i is even (its SWA pattern of 2). RoPE is NeoX
with YaRN as transformers' gpt-oss config sets it: the ramp's ends are not rounded (`truncate` false).
"""

from __future__ import annotations

import math
from dataclasses import replace

from kiln.models import llama
from kiln.models.base import MAX_CONTEXT, Attention, Experts, Meta, Ops, Rope, base_config, check_rope, rope_scaling
from kiln.models.qwenmoe import MAX_EXPERTS, MoeConfig

SWA_PATTERN = 2  # llama.cpp's set_swa_pattern(2): the first of every two layers is local
BIASED = frozenset({"attn_q", "attn_k", "attn_v", "attn_output"})


def config_from_gguf(m: Meta) -> MoeConfig:
    # llama.cpp requires output.weight, and the four attention biases
    cfg = MoeConfig(**base_config(m, moe=True, tied_embeddings=False), qkv_bias=True, biases=BIASED)
    window = m.integer("attention.sliding_window", hi=MAX_CONTEXT)
    scaling = rope_scaling(m, cfg.context_length)
    if "yarn" in scaling:
        scaling["yarn"] = replace(scaling["yarn"], truncate=False)
    rope = Rope(theta=m.number("rope.freq_base", 10000.0, lo=1.0), dim=m.integer("rope.dimension_count", cfg.head_dim),
                neox=True, **scaling)
    check_rope(m, rope, cfg.head_dim)
    scale = 1.0 / math.sqrt(cfg.head_dim)
    cfg.layers = [Attention(cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, scale, rope,
                            window if i % SWA_PATTERN < SWA_PATTERN - 1 else None, sinks=f"blk.{i}.attn_sinks.weight")
                  for i in range(cfg.n_layers)]
    n_experts = m.integer("expert_count", hi=MAX_EXPERTS)
    n_used = m.integer("expert_used_count", hi=n_experts)
    ff = m.integer("expert_feed_forward_length")
    cfg.experts = [layer_experts(i, n_experts, n_used, ff) for i in range(cfg.n_layers)]
    return cfg


def layer_experts(i: int, n_experts: int, n_used: int, ff: int) -> Experts:
    p = f"blk.{i}."
    return Experts(router=p + "ffn_gate_inp.weight", gate=p + "ffn_gate_exps.weight", up=p + "ffn_up_exps.weight",
                   down=p + "ffn_down_exps.weight", n_experts=n_experts, n_used=n_used, ff_dim=ff, normalize=False,
                   gating="softmax_selected", act="swiglu_oai", router_bias=p + "ffn_gate_inp.bias",
                   gate_bias=p + "ffn_gate_exps.bias", up_bias=p + "ffn_up_exps.bias", down_bias=p + "ffn_down_exps.bias")


def forward(op: Ops, cfg: MoeConfig):
    x = op.embed("token_embd.weight")
    for i in range(cfg.n_layers):
        x = llama.attention_block(op, cfg, i, x)
        h = op.rmsnorm(x, f"blk.{i}.post_attention_norm.weight", cfg.norm_eps)
        x = op.add(x, op.moe(h, cfg.experts[i]))
    return op.logits(op.rmsnorm(x, "output_norm.weight", cfg.norm_eps), "output.weight")
