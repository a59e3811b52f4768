"""Granite-MoE (Granite 3.x's mixtures of experts): Granite's block and multipliers (granite.py) with a
mixture of experts in place of the MLP, its output scaled by the residual multiplier like every branch.

    x = x + residual_scale * (Σ_{e in top-k(router(norm(x)))} w_e · down_e(silu(gate_e) * up_e)
                              [+ down_s(silu(gate_s(norm(x))) * up_s(norm(x)))])     # Granite-MoE-Shared

As llama.cpp builds it: a softmax over every expert, the top k kept and renormalized (the same as
transformers' softmax over the k best logits), experts as wide as `feed_forward_length`, a shared
expert (when `expert_shared_feed_forward_length` is set) added unscaled.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kiln.models import granite
from kiln.models.base import Experts, Meta, Ops, output_weight
from kiln.models.granite import GraniteConfig
from kiln.models.qwenmoe import layer_experts


@dataclass
class GraniteMoeConfig(GraniteConfig):
    experts: list[Experts] = field(default_factory=list, repr=False)  # one per layer


def config_from_gguf(m: Meta) -> GraniteMoeConfig:
    cfg = GraniteMoeConfig(**vars(granite.config_from_gguf(m, moe=True)))
    ff = cfg.ffn_dim
    m.integer("expert_feed_forward_length", ff, lo=ff, hi=ff)  # llama.cpp sizes the experts by ffn_dim
    shared_ff = m.integer("expert_shared_feed_forward_length", 0, lo=0)  # Granite-MoE-Shared's (0: none)
    cfg.experts = layer_experts(m, cfg.n_layers, ff, normalize=True, shared_ff=shared_ff)
    return cfg


def forward(op: Ops, cfg: GraniteMoeConfig):
    x = op.embed("token_embd.weight", scale=cfg.embedding_scale)
    for i in range(cfg.n_layers):
        x = granite.attention_block(op, cfg, i, x, cfg.residual_scale)
        h = op.rmsnorm(x, f"blk.{i}.ffn_norm.weight", cfg.norm_eps)
        x = op.add(x, op.moe(h, cfg.experts[i]), scale=cfg.residual_scale)
    return op.logits(op.rmsnorm(x, "output_norm.weight", cfg.norm_eps), output_weight(cfg),
                     scale=1.0 / cfg.logit_scale)
