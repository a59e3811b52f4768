"""SmolLM3: the Llama block (llama.py) without rotary embeddings on every fourth layer (NoPE), whose
attention sees positions only through the causal mask.

    x = embed(tokens)
    for each layer i:
        q, k, v = q(norm(x)), k(norm(x)), v(norm(x))
        if (i + 1) % 4 != 0: q, k = rope(q), rope(k)
        x = x + o(attention(q, k, v))
        x = x + down(silu(gate(norm(x))) * up(norm(x)))
    logits = lm_head(norm(x))

The period is llama.cpp's (`n_no_rope_layer_step`), which GGUF does not store; transformers' default
`no_rope_layers` is the same pattern.
"""

from __future__ import annotations

import math

from kiln.models.base import Attention, Meta, ModelConfig, Ops, Rope, base_config, output_weight, rope_scale
from kiln.models.granite import block

NO_ROPE_EVERY = 4


def config_from_gguf(m: Meta) -> ModelConfig:
    cfg = ModelConfig(**base_config(m))
    m.absent("attention.sliding_window", "kiln's smollm3 family attends over the whole context")
    rope = Rope(
        theta=m.number("rope.freq_base", 10000.0, lo=1.0),
        dim=m.integer("rope.dimension_count", cfg.head_dim, lo=cfg.head_dim, hi=cfg.head_dim),  # llama.cpp's assert
        neox=False,  # llama.cpp's converter permutes q and k for the adjacent-pair rotation
        position_scale=rope_scale(m),
    )
    scale = 1.0 / math.sqrt(cfg.head_dim)
    cfg.layers = [Attention(cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, scale,
                            rope if (i + 1) % NO_ROPE_EVERY else None) for i in range(cfg.n_layers)]
    return cfg


def forward(op: Ops, cfg: ModelConfig):
    x = op.embed("token_embd.weight")
    for i in range(cfg.n_layers):
        x = block(op, cfg, i, x)
    return op.logits(op.rmsnorm(x, "output_norm.weight", cfg.norm_eps), output_weight(cfg))
