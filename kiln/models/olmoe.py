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

from kiln.models.base import Meta, Ops, base_config
from kiln.models.olmo2 import attention_output, olmo_attention
from kiln.models.qwenmoe import MoeConfig, layer_experts


def config_from_gguf(m: Meta) -> MoeConfig:
    cfg = MoeConfig(**base_config(m, moe=True, tied_embeddings=False))  # llama.cpp requires output.weight
    m.absent("attention.sliding_window", "kiln's olmoe family attends over the whole context")
    ff = cfg.ffn_dim
    m.integer("expert_feed_forward_length", ff, lo=ff, hi=ff)  # llama.cpp sizes the experts by ffn_dim
    cfg.layers = olmo_attention(m, cfg)
    cfg.experts = layer_experts(m, cfg.n_layers, ff, normalize=False)
    return cfg


def forward(op: Ops, cfg: MoeConfig):
    x = op.embed("token_embd.weight")
    for i in range(cfg.n_layers):
        p, eps = f"blk.{i}.", cfg.norm_eps
        x = op.add(x, attention_output(op, cfg, i, op.rmsnorm(x, p + "attn_norm.weight", eps)))
        x = op.add(x, op.moe(op.rmsnorm(x, p + "ffn_norm.weight", eps), cfg.experts[i]))
    return op.logits(op.rmsnorm(x, "output_norm.weight", cfg.norm_eps), "output.weight")
