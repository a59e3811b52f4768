"""Qwen2-MoE and Qwen3-MoE: the Qwen block (qwen.py) with its MLP replaced by a mixture of experts.

    x = x + attention(...)                                 # as Qwen2 (q/k/v biases) or Qwen3 (q/k norms)
    h = norm(x)
    x = x + Σ_{e in top-k(router(h))} w_e · down_e(silu(gate_e(h)) * up_e(h))
          [+ sigmoid(h · g) · down_s(silu(gate_s(h)) * up_s(h))]          # Qwen2-MoE's shared expert

As llama.cpp builds them: the router's weights are a softmax over every expert, of which the top-k are
kept; Qwen3-MoE renormalizes the kept weights to sum to 1, Qwen2-MoE does not.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kiln.models import llama
from kiln.models.base import Experts, Meta, Ops, output_weight
from kiln.models.llama import LlamaConfig

MAX_EXPERTS = 512  # llama.cpp's LLAMA_MAX_EXPERTS


@dataclass
class MoeConfig(LlamaConfig):
    experts: list[Experts] = field(default_factory=list, repr=False)  # one per layer


def config_from_gguf(m: Meta) -> MoeConfig:
    qwen3 = m.arch == "qwen3moe"
    base = llama.config_from_gguf(m, neox=True, moe=True, qk_norm=qwen3, qkv_bias=not qwen3)
    cfg = MoeConfig(**vars(base))
    n_used = m.integer("expert_used_count", hi=m.integer("expert_count", hi=MAX_EXPERTS))
    # llama.cpp's defaults when the sizes are missing: the dense width split among the used experts, and
    # a shared expert as wide as the dense MLP
    ff = m.integer("expert_feed_forward_length", max(cfg.ffn_dim // n_used, 1))
    shared_ff = 0 if qwen3 else m.integer("expert_shared_feed_forward_length", cfg.ffn_dim)
    if qwen3:
        m.absent("expert_shared_feed_forward_length", "Qwen3-MoE has no shared expert")
    cfg.experts = layer_experts(m, cfg.n_layers, ff, normalize=qwen3, shared_ff=shared_ff, shared_scale=not qwen3)
    return cfg


def layer_experts(m: Meta, n_layers: int, ff: int, normalize: bool, shared_ff: int = 0,
                  shared_scale: bool = False) -> list[Experts]:
    """Each layer's experts under llama.cpp's tensor names, softmax-routed (the families' shared reading
    of the expert keys; `shared_ff` 0: no shared expert)."""
    n_experts = m.integer("expert_count", hi=MAX_EXPERTS)
    n_used = m.integer("expert_used_count", hi=n_experts)
    out = []
    for i in range(n_layers):
        p = f"blk.{i}."
        shared = {}
        if shared_ff:
            shared = dict(shared_gate=p + "ffn_gate_shexp.weight", shared_up=p + "ffn_up_shexp.weight",
                          shared_down=p + "ffn_down_shexp.weight", shared_ff_dim=shared_ff,
                          shared_scale=p + "ffn_gate_inp_shexp.weight" if shared_scale else None)
        out.append(Experts(router=p + "ffn_gate_inp.weight", gate=p + "ffn_gate_exps.weight",
                           up=p + "ffn_up_exps.weight", down=p + "ffn_down_exps.weight", n_experts=n_experts,
                           n_used=n_used, ff_dim=ff, normalize=normalize, **shared))
    return out


def forward(op: Ops, cfg: MoeConfig):
    x = op.embed("token_embd.weight")
    for i in range(cfg.n_layers):
        x = llama.attention_block(op, cfg, i, x)
        h = op.rmsnorm(x, f"blk.{i}.ffn_norm.weight", cfg.norm_eps)
        x = op.add(x, op.moe(h, cfg.experts[i]))
    return op.logits(op.rmsnorm(x, "output_norm.weight", cfg.norm_eps), output_weight(cfg))
