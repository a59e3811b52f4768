"""Random-weight GGUF models of any supported family and shape, written with `gguf`'s own writer.

Tests use tiny ones to check kiln against transformers on architectures no real model here covers;
benchmarks use full-size shapes (e.g. Qwen3-0.6B) to measure kernels on realistic matrices.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

from kiln.tokenizer import bytes_to_unicode
from gguf import GGUFValueType as VT

CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' "
    "else message['role']) + '\n' + message['content'] + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)

# Phi-4-mini's end-of-text and turn markers, after its ordinary tokens as in its own vocabulary (llama.cpp
# finds <|end|> and <|endoftext|> by their text), and its template
PHI3_SPECIALS = ["<|endoftext|>", "<|assistant|>", "<|end|>", "<|user|>", "<|system|>"]
PHI3_TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
# gpt-oss's chat format (harmony), small and written the way gpt-oss's shipped template works: a system message
# with `Reasoning: <effort>`, the instructions and tools in a developer message, earlier calls as
# `assistant to=functions.NAME` messages after the turn's `thinking`, tool results from
# `functions.NAME to=assistant`, and a generation prompt of `<|start|>assistant`
HARMONY_TEMPLATE = (
    "{%- set effort = reasoning_effort if reasoning_effort is defined else 'medium' %}"
    "{{- '<|start|>system<|message|>You are a helpful assistant.\\nReasoning: ' + effort + '\\n\\n'"
    " + '# Valid channels: analysis, commentary, final. Channel must be included for every message.' }}"
    "{%- if tools %}{{- \"\\nCalls to these tools must go to the commentary channel: 'functions'.\" }}{%- endif %}"
    "{{- '<|end|>' }}"
    "{%- if messages and messages[0].role in ('system', 'developer') %}"
    "{%- set instructions = messages[0].content %}{%- set rest = messages[1:] %}"
    "{%- else %}{%- set instructions = '' %}{%- set rest = messages %}{%- endif %}"
    "{%- if instructions or tools %}{{- '<|start|>developer<|message|>' }}"
    "{%- if instructions %}{{- '# Instructions\\n\\n' + instructions + '\\n\\n' }}{%- endif %}"
    "{%- if tools %}{{- '# Tools\\n\\n## functions\\n\\nnamespace functions {\\n' }}"
    "{%- for t in tools %}{{- '\\ntype ' + t.function.name + ' = (_: ' + (t.function.parameters | tojson) + ') => any;\\n' }}"
    "{%- endfor %}{{- '\\n} // namespace functions' }}{%- endif %}"
    "{{- '<|end|>' }}{%- endif %}"
    "{%- set last = namespace(name=none) %}"
    "{%- for m in rest %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}"
    "{%- if m.thinking %}{{- '<|start|>assistant<|channel|>analysis<|message|>' + m.thinking + '<|end|>' }}{%- endif %}"
    "{%- set call = m.tool_calls[0].function %}"
    "{{- '<|start|>assistant to=functions.' + call.name + '<|channel|>commentary json<|message|>'"
    " + (call.arguments | tojson) + '<|call|>' }}"
    "{%- set last.name = call.name %}"
    "{%- elif m.role == 'assistant' %}{{- '<|start|>assistant<|channel|>final<|message|>' + m.content + '<|end|>' }}"
    "{%- elif m.role == 'tool' %}"
    "{{- '<|start|>functions.' + last.name + ' to=assistant<|channel|>commentary<|message|>' + (m.content | tojson)"
    " + '<|end|>' }}"
    "{%- else %}{{- '<|start|>' + m.role + '<|message|>' + m.content + '<|end|>' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}"
)
# harmony's control tokens, as gpt-oss's vocabulary has them; <|return|> ends an answer, <|call|> a call
HARMONY_SPECIALS = ["<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
                    "<|return|>", "<|call|>"]


@dataclass(frozen=True)
class Shape:
    arch: str
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    context_length: int = 2048
    tied: bool = True
    sliding_window: int = 8
    rope_dim: int = 0  # rotary dimensions of a head (0: all)
    biases: tuple[str, ...] = ()  # the block's projections (tensor names) that carry a bias
    fused_qkv: bool = False  # q, k and v written as one attn_qkv (the same values as three tensors)
    long_rope: int = 0  # LongRoPE's original context (Phi-3): short and long factors are written when set
    attention_layers: tuple[int, ...] = ()  # hybrids (lfm2): the layers that attend; the others convolve
    conv_length: int = 3
    # qwen35's DeltaNet layers: key heads, value heads, a key head's and a value head's width; every
    # `full_attention_interval`-th layer attends, over `rope_sections` (its multimodal RoPE's pairs)
    delta_net: tuple[int, int, int, int] = ()
    full_attention_interval: int = 4
    rope_sections: tuple[int, ...] = ()
    metadata: tuple[tuple[str, object], ...] = ()  # (key after "<arch>.", value): the switches a variant sets
    llama3_rope: tuple[float, float, float, int] | None = None  # factor, low and high freq factors, old context

    # mixture of experts (0: a dense MLP): experts, experts each row uses, an expert's and the shared
    # expert's widths
    n_experts: int = 0
    n_experts_used: int = 0
    expert_ffn_dim: int = 0
    shared_ffn_dim: int = 0
    expert_qtype: QT | None = None  # the experts' type whatever the rest's (gpt-oss ships MXFP4 experts); None: qtype


# YaRN as Qwen2.5's configs set it (factor 4 over 32k), at a tiny model's scale
_YARN = (("rope.scaling.type", "yarn"), ("rope.scaling.factor", 4.0), ("rope.scaling.original_context_length", 64))

# gpt-oss's: a factor of 32 over 4k, and its attention's biases
_GPT_OSS_YARN = (("rope.scaling.type", "yarn"), ("rope.scaling.factor", 32.0),
                 ("rope.scaling.original_context_length", 4096))
_GPT_OSS_BIASES = ("attn_q", "attn_k", "attn_v", "attn_output")


SHAPES = {
    "tiny-llama": Shape("llama", 64, 2, 4, 2, 16, 128, 512, tied=False),
    "tiny-qwen2": Shape("qwen2", 64, 2, 4, 2, 16, 128, 512),
    "tiny-qwen3": Shape("qwen3", 64, 2, 4, 2, 128, 160, 512, tied=False),
    "tiny-gemma3": Shape("gemma3", 64, 7, 2, 1, 256, 128, 512, sliding_window=4),
    "qwen3-0.6b": Shape("qwen3", 1024, 28, 16, 8, 128, 3072, 151936, context_length=40960),
    "tiny-qwen3moe": Shape("qwen3moe", 64, 2, 4, 2, 16, 192, 512, tied=False, n_experts=8, n_experts_used=2,
                           expert_ffn_dim=96),
    "tiny-qwen2moe": Shape("qwen2moe", 64, 2, 4, 2, 16, 192, 512, n_experts=8, n_experts_used=2,
                           expert_ffn_dim=64, shared_ffn_dim=128),
    # Qwen3-30B-A3B's shape (48 layers; benchmarks cut the layer count)
    "qwen3-30b-a3b": Shape("qwen3moe", 2048, 48, 32, 4, 128, 6144, 151936, context_length=40960, tied=False,
                           n_experts=128, n_experts_used=8, expert_ffn_dim=768),
    "tiny-granite": Shape("granite", 64, 2, 4, 2, 16, 128, 512),
    "tiny-olmo2": Shape("olmo2", 64, 2, 4, 2, 16, 128, 512, tied=False),
    "tiny-smollm3": Shape("smollm3", 64, 4, 4, 2, 16, 128, 512),  # layer 3 has no rope
    "tiny-phi3": Shape("phi3", 64, 2, 4, 2, 16, 128, 512, rope_dim=12, long_rope=32, fused_qkv=True, tied=False),
    "tiny-phi2": Shape("phi2", 64, 2, 4, 4, 16, 256, 512, rope_dim=8, tied=False,
                       biases=("attn_q", "attn_k", "attn_v", "attn_output", "ffn_up", "ffn_down")),
    "phi4-mini": Shape("phi3", 3072, 32, 24, 8, 128, 8192, 200064, context_length=131072, rope_dim=96, long_rope=4096,
                       fused_qkv=True),
    "tiny-lfm2": Shape("lfm2", 64, 4, 4, 2, 16, 128, 512, attention_layers=(1, 3)),
    "lfm2-1.2b": Shape("lfm2", 2048, 16, 32, 8, 64, 8192, 65536, context_length=128000,
                       attention_layers=(2, 5, 8, 10, 12, 14)),
    "tiny-qwen35": Shape("qwen35", 64, 4, 4, 2, 16, 128, 512, rope_dim=4, conv_length=4, delta_net=(2, 4, 16, 8),
                         full_attention_interval=2, rope_sections=(1, 1, 0, 0)),
    # Qwen3.5-0.8B's text model
    "qwen3.5-0.8b": Shape("qwen35", 1024, 24, 8, 2, 256, 3584, 248320, context_length=262144, rope_dim=64,
                          conv_length=4, delta_net=(16, 16, 128, 128), rope_sections=(11, 11, 10, 0)),
    "tiny-llama-yarn": Shape("llama", 64, 2, 4, 2, 16, 128, 512, context_length=256, tied=False, metadata=_YARN),
    "tiny-qwen2-yarn": Shape("qwen2", 64, 2, 4, 2, 16, 128, 512, context_length=256, metadata=_YARN),
    "tiny-qwen3-yarn": Shape("qwen3", 64, 2, 4, 2, 128, 160, 512, context_length=256, tied=False,
                             metadata=_YARN + (("rope.scaling.yarn_beta_fast", 16.0),
                                               ("rope.scaling.yarn_attn_factor", 1.2))),
    # soft caps small enough that random weights' scores and logits reach them
    "tiny-gemma2": Shape("gemma2", 64, 4, 2, 1, 256, 128, 512, sliding_window=4,
                         metadata=(("attn_logit_softcapping", 0.5), ("final_logit_softcapping", 10.0))),
    # DeepSeek-R1-Distill-Llama's Llama 3 RoPE scaling (factor 8), as per-frequency divisors in rope_freqs
    "tiny-llama3": Shape("llama", 64, 2, 4, 2, 16, 128, 512, tied=False, llama3_rope=(8.0, 1.0, 4.0, 64)),
    "tiny-gemma3-softcap": Shape("gemma3", 64, 7, 2, 1, 256, 128, 512, sliding_window=4,
                                 metadata=(("final_logit_softcapping", 10.0),)),
    # a Mistral llama file that names its window: every layer attends through it
    "tiny-mistral": Shape("llama", 64, 2, 4, 2, 16, 128, 512, tied=False, metadata=(("attention.sliding_window", 5),)),
    # OLMoE and Granite-MoE size their experts by feed_forward_length
    "tiny-olmoe": Shape("olmoe", 64, 2, 4, 2, 16, 32, 512, tied=False, n_experts=8, n_experts_used=2,
                        expert_ffn_dim=32),
    "tiny-granitemoe": Shape("granitemoe", 64, 2, 4, 2, 16, 64, 512, n_experts=8, n_experts_used=2,
                             expert_ffn_dim=64),
    "tiny-granitemoe-shared": Shape("granitemoe", 64, 2, 4, 2, 16, 64, 512, n_experts=8, n_experts_used=2,
                                    expert_ffn_dim=64, shared_ffn_dim=32),
    # gpt-oss: biased attention with sinks, local on even layers (a window shorter than the tests' prompts),
    # YaRN as gpt-oss-20b sets it (a factor of 32, the context 32 times the original) at a tiny scale, experts
    # with biases
    "tiny-gpt-oss": Shape("gpt-oss", 64, 2, 4, 2, 16, 64, 512, context_length=2048, tied=False, sliding_window=8,
                          biases=_GPT_OSS_BIASES, n_experts=8, n_experts_used=2, expert_ffn_dim=64,
                          metadata=_GPT_OSS_YARN[:2] + (("rope.scaling.original_context_length", 64),)),
    # gpt-oss-20b's shape (24 layers; benchmarks cut the layer count), its experts MXFP4 as released
    "gpt-oss-20b": Shape("gpt-oss", 2880, 24, 64, 8, 64, 2880, 201088, context_length=131072, tied=False,
                         sliding_window=128, biases=_GPT_OSS_BIASES, n_experts=32, n_experts_used=4,
                         expert_ffn_dim=2880, expert_qtype=QT.MXFP4, metadata=_GPT_OSS_YARN),
}


def bpe_vocab(size: int, specials: list[str], rng: np.random.Generator) -> tuple[list[str], list[str], list[int]]:
    """A byte-level BPE vocabulary: specials, the 256 bytes, then merges of frequent-looking pairs."""
    tokens = list(specials) + list(bytes_to_unicode().values())
    types = [3] * len(specials) + [1] * 256
    known, merges = set(tokens), []
    letters = [bytes_to_unicode()[b] for b in b" etaoinshrdlucmfwypvbgkqjxz"]
    pieces = list(letters)
    while len(tokens) < size:
        a = pieces[int(rng.integers(len(pieces)))]
        b = letters[int(rng.integers(len(letters)))]
        if a + b in known or len(a) > 12:
            continue
        known.add(a + b)
        tokens.append(a + b)
        types.append(1)
        merges.append(f"{a} {b}")
        pieces.append(a + b)
    return tokens, merges, types


def spm_vocab(size: int, rng: np.random.Generator) -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece vocabulary in Gemma's layout: control tokens, byte fallbacks, then pieces."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    types = [3, 3, 3, 2, 3, 3]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    letters = list("▁etaoinshrdlucmfwypvbgkqjxz")
    known = set(tokens) | set(letters)
    tokens += letters
    types += [1] * len(letters)
    pieces = list(letters)
    while len(tokens) < size:
        piece = pieces[int(rng.integers(len(pieces)))] + letters[1 + int(rng.integers(len(letters) - 1))]
        if piece in known or len(piece) > 10:
            continue
        known.add(piece)
        tokens.append(piece)
        types.append(1)
        pieces.append(piece)
    scores = [0.0 if t != 1 else -float(i) for i, t in enumerate(types)]
    return tokens, scores, types


# Above this many values a tensor is drawn and quantized in runs of rows, in float32: Phi-4-mini's embedding
# table (615M values) drawn whole in float64 would take 5 GB
_LARGE = 1 << 28


def _tensor(rng, shape, scale):
    if np.prod(shape) <= _LARGE:
        return (rng.standard_normal(shape) * scale).astype(np.float32)
    out = np.empty(shape, np.float32)
    step = max(1, _LARGE // 16 // int(np.prod(shape[1:])))
    for r in range(0, shape[0], step):
        out[r : r + step] = rng.standard_normal((min(step, shape[0] - r), *shape[1:]), dtype=np.float32)
        out[r : r + step] *= np.float32(scale)
    return out


# Qwen2.5-Coder's fill-in-the-middle tokens, and the metadata keys naming them
FIM_TOKENS = {"pre": "<|fim_prefix|>", "suf": "<|fim_suffix|>", "mid": "<|fim_middle|>", "pad": "<|fim_pad|>",
              "rep": "<|repo_name|>", "sep": "<|file_sep|>"}


def write_random_gguf(path: str | Path, shape: Shape | str, qtype: QT = QT.F32, embed_qtype: QT | None = None,
                      seed: int = 0, tokenizer_from: str | Path | None = None, fim: str | None = None,
                      random_blocks: bool = False,
                      **overrides) -> Path:
    """Write a model of `shape` (a Shape or a name in SHAPES) with random weights quantized to `qtype`.
    `tokenizer_from`: copy that GGUF's tokenizer (and so its vocabulary size), e.g. to make a draft model
    for it. `fim` (byte-level vocabularies): give it fill-in-the-middle tokens, named by the
    tokenizer.ggml.fim_*_token_id keys ("metadata") or only present by text ("vocabulary", as older files).
    `random_blocks`: matrices of a type with scales kiln.synth knows the place of (Q4_0, Q8_0, Q4_K) are
    written as random blocks instead of quantized random floats, which a benchmark's shapes take minutes
    to compute."""
    if isinstance(shape, str):
        shape = SHAPES[shape]
    tokenizer = _tokenizer_fields(tokenizer_from) if tokenizer_from is not None else None
    if tokenizer is not None:
        overrides["vocab_size"] = len(tokenizer["tokenizer.ggml.tokens"][0])
    shape = replace(shape, **overrides)
    rng = np.random.default_rng(seed)
    path = Path(path)
    w = gguf.GGUFWriter(str(path), shape.arch)
    a = shape.arch
    family = FAMILY_WRITERS.get(a)
    w.add_name(f"random {family.model_name if family and family.model_name else a} {shape.dim}x{shape.n_layers}")
    w.add_context_length(shape.context_length)
    w.add_embedding_length(shape.dim)
    w.add_block_count(shape.n_layers)
    w.add_feed_forward_length(shape.ffn_dim)
    w.add_head_count(shape.n_heads)
    if family is not None and family.head_count_kv is not None:
        w.add_array(f"{a}.attention.head_count_kv", family.head_count_kv(shape))
    else:
        w.add_head_count_kv(shape.n_kv_heads)
    w.add_key_length(shape.head_dim)
    w.add_value_length(shape.head_dim)
    if a == "phi2":
        w.add_layer_norm_eps(1e-5)
    else:
        w.add_layer_norm_rms_eps(1e-6)
        w.add_rope_freq_base({"llama": 10000.0, "gpt-oss": 150000.0}.get(a, 1e6))
    if shape.rope_dim:
        w.add_rope_dimension_count(shape.rope_dim)
    if shape.long_rope:
        w.add_rope_scaling_orig_ctx_len(shape.long_rope)
        # convert_hf_to_gguf's value for Phi-3: sqrt(1 + ln(scale) / ln(original context))
        scale = shape.context_length / shape.long_rope
        w.add_rope_scaling_attn_factors(float(np.sqrt(1 + np.log(scale) / np.log(shape.long_rope))) if scale > 1 else 1.0)
    if family is not None:
        family.metadata(w, shape)
    if shape.n_experts:
        _add_expert_counts(w, shape)
    if tokenizer is not None:
        for key, (value, vtype, sub_type) in tokenizer.items():
            w.add_key_value(key, value, vtype, sub_type)
    elif a in ("gemma2", "gemma3"):
        w.add_sliding_window(shape.sliding_window)
        tokens, scores, types = spm_vocab(shape.vocab_size, rng)
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_bos_token_id(2)
        w.add_eos_token_id(1)
        w.add_unk_token_id(3)
        w.add_pad_token_id(0)
        w.add_add_bos_token(True)
        w.add_add_space_prefix(False)
        w.add_chat_template(GEMMA_TEMPLATE)
    elif family is not None and family.tokenizer is not None:
        family.tokenizer(w, shape, rng)
    else:
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + (list(FIM_TOKENS.values()) if fim else [])
        tokens, merges, types = bpe_vocab(shape.vocab_size, specials, rng)
        if fim == "metadata":
            for role, text in FIM_TOKENS.items():
                w.add_uint32(f"tokenizer.ggml.fim_{role}_token_id", tokens.index(text))
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2" if a.startswith("qwen") else "llama-bpe")
        w.add_token_list(tokens)
        w.add_token_merges(merges)
        w.add_token_types(types)
        w.add_bos_token_id(0)
        w.add_eos_token_id(2)
        w.add_add_bos_token(False)
        w.add_chat_template(CHATML_TEMPLATE)
    for key, value in shape.metadata:
        _add_metadata(w, f"{a}.{key}", value)

    def matrix(name, rows, cols, quant=qtype):
        if random_blocks and quant in _BLOCK_SCALES:
            w.add_tensor(name, _random_blocks(rng, rows, cols, quant), raw_dtype=quant)
            return
        data = _tensor(rng, (rows, cols), 1.0 / np.sqrt(cols))
        _add(w, name, data, quant)

    def norm(name, n, center=1.0, spread=0.1):
        _add(w, name, center + _tensor(rng, (n,), spread), QT.F32)

    hd, q_dim, kv_dim = shape.head_dim, shape.n_heads * shape.head_dim, shape.n_kv_heads * shape.head_dim
    if random_blocks and (embed_qtype or qtype) in _BLOCK_SCALES:
        matrix("token_embd.weight", shape.vocab_size, shape.dim, embed_qtype or qtype)
    else:
        _add(w, "token_embd.weight", _tensor(rng, (shape.vocab_size, shape.dim), 1.0), embed_qtype or qtype)
    if a in FAMILY_TENSORS:
        FAMILY_TENSORS[a](w, shape, rng, qtype, embed_qtype)
        return _finish(w, path)
    for i in range(shape.n_layers):
        p = f"blk.{i}."
        if family is not None and family.layer is not None:
            family.layer(p, i, shape, matrix, norm)
            continue
        norm(p + "attn_norm.weight", shape.dim)
        _qkv(w, shape, rng, p, qtype, matrix if random_blocks and qtype in _BLOCK_SCALES else None)
        matrix(p + "attn_output.weight", shape.dim, q_dim)
        if a in ("qwen2", "qwen2moe"):
            for n, d in (("q", q_dim), ("k", kv_dim), ("v", kv_dim)):
                _add(w, p + f"attn_{n}.bias", _tensor(rng, (d,), 0.5), QT.F32)
        if a in ("qwen3", "gemma3", "qwen3moe"):
            norm(p + "attn_q_norm.weight", hd)
            norm(p + "attn_k_norm.weight", hd)
        if a == "olmoe":  # q/k norms over the whole projections
            norm(p + "attn_q_norm.weight", q_dim)
            norm(p + "attn_k_norm.weight", kv_dim)
        norm(p + ("post_attention_norm.weight" if a == "gpt-oss" else "ffn_norm.weight"), shape.dim)
        if a == "gpt-oss":
            _add(w, p + "attn_sinks.weight", _tensor(rng, (shape.n_heads,), 1.0), QT.F32)
        if shape.n_experts:
            _add_experts(w, rng, p, shape, qtype, random_blocks)
        else:
            matrix(p + "ffn_gate.weight", shape.ffn_dim, shape.dim)
            matrix(p + "ffn_up.weight", shape.ffn_dim, shape.dim)
            matrix(p + "ffn_down.weight", shape.dim, shape.ffn_dim)
        if a in ("gemma2", "gemma3"):
            norm(p + "post_attention_norm.weight", shape.dim)
            norm(p + "post_ffw_norm.weight", shape.dim)
        _biases(w, shape, rng, p, exclude=("attn_q", "attn_k", "attn_v", "attn_qkv"))
    if shape.llama3_rope is not None:
        _add(w, "rope_freqs.weight", llama3_rope_factors(10000.0 if a == "llama" else 1e6, hd, *shape.llama3_rope), QT.F32)
    norm(family.output_norm if family is not None else "output_norm.weight", shape.dim)
    if not shape.tied:
        matrix("output.weight", shape.vocab_size, shape.dim, embed_qtype or qtype)
    return _finish(w, path)


def _finish(w: gguf.GGUFWriter, path: Path) -> Path:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def llama3_rope_factors(theta: float, dim: int, factor: float, low: float, high: float, old_context: int) -> np.ndarray:
    """Llama 3's RoPE scaling as the divisor of each frequency: long wavelengths (past old_context / low)
    are divided by `factor`, short ones (below old_context / high) kept, and those between blended."""
    wavelength = 2 * np.pi * theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    smooth = np.clip((old_context / wavelength - low) / (high - low), 0.0, 1.0)
    return (1.0 / ((1.0 - smooth) / factor + smooth)).astype(np.float32)


def _add_metadata(writer: gguf.GGUFWriter, key: str, value) -> None:
    """A key as llama.cpp's converter types it: strings, uint32 counts, float32 numbers."""
    if isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    else:
        writer.add_float32(key, float(value))


def _bias_rows(shape: Shape, name: str) -> int:
    q_dim, kv_dim = shape.n_heads * shape.head_dim, shape.n_kv_heads * shape.head_dim
    return {"attn_q": q_dim, "attn_k": kv_dim, "attn_v": kv_dim, "attn_qkv": q_dim + 2 * kv_dim,
            "attn_output": shape.dim, "ffn_gate": shape.ffn_dim, "ffn_up": shape.ffn_dim, "ffn_down": shape.dim}[name]


def _biases(w, shape: Shape, rng, p: str, exclude=()) -> None:
    """The block's biases that `shape.biases` names (those of q, k and v are written with their weights)."""
    for name in shape.biases:
        if name not in exclude:
            _add(w, p + name + ".bias", _tensor(rng, (_bias_rows(shape, name),), 0.5), QT.F32)


def _qkv(w, shape: Shape, rng, p: str, qtype: QT, random_matrix=None) -> None:
    """q, k and v (and their biases where `shape.biases` names them): three tensors, or the same values
    stacked in one attn_qkv. `random_matrix`: the writer's random-blocks matrix, for separate q, k, v."""
    q_dim, kv_dim = shape.n_heads * shape.head_dim, shape.n_kv_heads * shape.head_dim
    if random_matrix is not None and not shape.fused_qkv:
        for n, rows in zip("qkv", (q_dim, kv_dim, kv_dim)):
            random_matrix(p + f"attn_{n}.weight", rows, shape.dim)
            if f"attn_{n}" in shape.biases:
                _add(w, p + f"attn_{n}.bias", _tensor(rng, (rows,), 0.5), QT.F32)
        return
    weights = [_tensor(rng, (rows, shape.dim), 1.0 / np.sqrt(shape.dim)) for rows in (q_dim, kv_dim, kv_dim)]
    with_bias = [f"attn_{n}" in shape.biases or "attn_qkv" in shape.biases for n in "qkv"]
    biases = [_tensor(rng, (len(x),), 0.5) if b else None for x, b in zip(weights, with_bias)]
    if shape.fused_qkv:
        _add(w, p + "attn_qkv.weight", np.concatenate(weights), qtype)
        if all(with_bias):
            _add(w, p + "attn_qkv.bias", np.concatenate(biases), QT.F32)
        return
    for n, x, b in zip("qkv", weights, biases):
        _add(w, p + f"attn_{n}.weight", x, qtype)
        if b is not None:
            _add(w, p + f"attn_{n}.bias", b, QT.F32)


def _phi3_tensors(w, shape: Shape, rng, qtype: QT, embed_qtype) -> None:
    """Phi-3: fused q/k/v, gate and up stacked in ffn_up (gate first), LongRoPE's two factor sets."""
    q_dim = shape.n_heads * shape.head_dim
    matrix = lambda name, rows, cols: _add(w, name, _tensor(rng, (rows, cols), 1.0 / np.sqrt(cols)), qtype)  # noqa: E731
    norm = lambda name, n: _add(w, name, 1.0 + _tensor(rng, (n,), 0.1), QT.F32)  # noqa: E731
    if shape.long_rope:
        half = (shape.rope_dim or shape.head_dim) // 2
        _add(w, "rope_factors_short.weight", (1.0 + rng.random(half)).astype(np.float32), QT.F32)
        _add(w, "rope_factors_long.weight", (1.0 + 8 * rng.random(half)).astype(np.float32), QT.F32)
    for i in range(shape.n_layers):
        p = f"blk.{i}."
        norm(p + "attn_norm.weight", shape.dim)
        _qkv(w, shape, rng, p, qtype)
        matrix(p + "attn_output.weight", shape.dim, q_dim)
        norm(p + "ffn_norm.weight", shape.dim)
        matrix(p + "ffn_up.weight", 2 * shape.ffn_dim, shape.dim)
        matrix(p + "ffn_down.weight", shape.dim, shape.ffn_dim)
        _biases(w, shape, rng, p, exclude=("attn_q", "attn_k", "attn_v", "attn_qkv"))
    norm("output_norm.weight", shape.dim)
    if not shape.tied:
        matrix("output.weight", shape.vocab_size, shape.dim)


def _phi2_tensors(w, shape: Shape, rng, qtype: QT, embed_qtype) -> None:
    """Phi-2: LayerNorms with biases, biases on every projection and the head, a plain MLP."""
    q_dim = shape.n_heads * shape.head_dim
    matrix = lambda name, rows, cols: _add(w, name, _tensor(rng, (rows, cols), 1.0 / np.sqrt(cols)), qtype)  # noqa: E731

    def layernorm(name: str) -> None:
        _add(w, name + ".weight", 1.0 + _tensor(rng, (shape.dim,), 0.1), QT.F32)
        _add(w, name + ".bias", _tensor(rng, (shape.dim,), 0.1), QT.F32)

    for i in range(shape.n_layers):
        p = f"blk.{i}."
        layernorm(p + "attn_norm")
        _qkv(w, shape, rng, p, qtype)
        matrix(p + "attn_output.weight", shape.dim, q_dim)
        matrix(p + "ffn_up.weight", shape.ffn_dim, shape.dim)
        matrix(p + "ffn_down.weight", shape.dim, shape.ffn_dim)
        _biases(w, shape, rng, p, exclude=("attn_q", "attn_k", "attn_v", "attn_qkv"))
    layernorm("output_norm")
    if not shape.tied:
        matrix("output.weight", shape.vocab_size, shape.dim)
        _add(w, "output.bias", _tensor(rng, (shape.vocab_size,), 0.5), QT.F32)


# Families whose blocks are not the Llama block's tensors
FAMILY_TENSORS = {"phi3": _phi3_tensors, "phi2": _phi2_tensors}


def _tokenizer_fields(path: str | Path) -> dict:
    """Every tokenizer.* key of a GGUF file as (value, type, element type). kiln's reader keeps Python
    values, so scalar ints are written back as uint32, the type of every token id key."""
    from kiln.gguf import _NUMPY_DTYPES, GGUFFile

    element = {np.dtype(d): t for t, d in _NUMPY_DTYPES.items()}
    g = GGUFFile(path)
    try:
        fields = {}
        for key, value in g.metadata.items():
            if not key.startswith("tokenizer."):
                continue
            if isinstance(value, np.ndarray):
                fields[key] = (value.tolist(), VT.ARRAY, element[value.dtype])
            elif isinstance(value, str):
                fields[key] = (value, VT.STRING, None)
            elif isinstance(value, bool):
                fields[key] = (value, VT.BOOL, None)
            elif isinstance(value, int):
                fields[key] = (value, VT.UINT32, None)
            elif isinstance(value, float):
                fields[key] = (value, VT.FLOAT32, None)
            else:  # an array of strings
                fields[key] = (list(value), VT.ARRAY, VT.STRING)
        return fields
    finally:
        g.close()


# Where the f16 scales of a block sit, and the largest multiple of them a value reaches: random bits with
# those scales set give finite values near the float weights' size, for types gguf cannot quantize to.
_RANDOM_BLOCKS = {QT.Q2_K: ((80, 82), 45), QT.Q3_K: ((108,), 128), QT.IQ4_NL: ((0,), 127), QT.IQ4_XS: ((0,), 3937)}
# and types gguf can quantize to, but too slowly for a benchmark's shapes (`random_blocks`; Q4_K: its 6-bit
# sub-block scales and minimums are random too, so the reach is their largest product with a quant)
_BLOCK_SCALES = {**_RANDOM_BLOCKS, QT.Q4_0: ((0,), 8), QT.Q8_0: ((0,), 127), QT.Q4_K: ((0, 2), 63 * 15)}


def _random_blocks(rng, rows: int, cols: int, qtype: QT) -> np.ndarray:
    if qtype == QT.MXFP4:
        return _random_mxfp4(rng, rows, cols)
    (offsets, reach), (block, size) = _BLOCK_SCALES[qtype], gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(3.0 / np.sqrt(cols) / reach).tobytes(), dtype=np.uint8)
    for at in offsets:
        raw[..., at : at + 2] = scale
    return raw.reshape(rows, -1)


def _random_mxfp4(rng, rows: int, cols: int) -> np.ndarray:
    """MXFP4 blocks of random nibbles under one e8m0 exponent (2^(e - 128) times e2m1's doubled values, at
    most 12), chosen so the largest value is near the float weights' size."""
    block, size = gguf.GGML_QUANT_SIZES[QT.MXFP4]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    raw[..., 0] = np.uint8(round(128 + np.log2(3.0 / np.sqrt(cols) / 12)))
    return raw.reshape(rows, -1)


def _add(writer: gguf.GGUFWriter, name: str, data: np.ndarray, qtype: QT) -> None:
    if qtype in _RANDOM_BLOCKS:
        rows, cols = int(np.prod(data.shape[:-1])), data.shape[-1]
        rng = np.random.default_rng(data.view(np.uint32).ravel()[:8])  # the model's seed decides the bits
        blocks = _random_blocks(rng, rows, cols, qtype)
        writer.add_tensor(name, blocks.reshape(*data.shape[:-1], -1), raw_dtype=qtype)
    elif qtype == QT.F32:
        writer.add_tensor(name, data)
    elif qtype == QT.F16:
        writer.add_tensor(name, data.astype(np.float16))
    elif data.size > _LARGE:
        step = _LARGE // 16 // data.shape[1]
        raw = np.concatenate([gguf.quants.quantize(data[r : r + step], qtype) for r in range(0, data.shape[0], step)])
        writer.add_tensor(name, raw, raw_dtype=qtype)
    else:
        writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)


def _add_expert_counts(w: gguf.GGUFWriter, shape: Shape) -> None:
    w.add_expert_count(shape.n_experts)
    w.add_expert_used_count(shape.n_experts_used)
    w.add_expert_feed_forward_length(shape.expert_ffn_dim)
    if shape.shared_ffn_dim:
        w.add_expert_shared_feed_forward_length(shape.shared_ffn_dim)


def _add_experts(w: gguf.GGUFWriter, rng, p: str, shape: Shape, qtype: QT, random_blocks: bool) -> None:
    """One layer's router, experts (3-D, as llama.cpp's converter stacks them) and shared expert. Routers
    stay float32, as llama.cpp's quantizer leaves them."""
    n, dim, ff = shape.n_experts, shape.dim, shape.expert_ffn_dim
    qtype = qtype if shape.expert_qtype is None else shape.expert_qtype
    _add(w, p + "ffn_gate_inp.weight", _tensor(rng, (n, dim), 1.0 / np.sqrt(dim)), QT.F32)
    for name, rows, cols in (("gate", ff, dim), ("up", ff, dim), ("down", dim, ff)):
        if random_blocks and qtype in (*_BLOCK_SCALES, QT.MXFP4):
            w.add_tensor(p + f"ffn_{name}_exps.weight", _random_blocks(rng, n * rows, cols, qtype).reshape(n, rows, -1),
                         raw_dtype=qtype)
        else:
            _add(w, p + f"ffn_{name}_exps.weight", _tensor(rng, (n, rows, cols), 1.0 / np.sqrt(cols)), qtype)
    if shape.shared_ffn_dim:
        sff = shape.shared_ffn_dim
        for name, rows, cols in (("gate", sff, dim), ("up", sff, dim), ("down", dim, sff)):
            _add(w, p + f"ffn_{name}_shexp.weight", _tensor(rng, (rows, cols), 1.0 / np.sqrt(cols)), qtype)
        if shape.arch == "qwen2moe":  # its shared expert's sigmoid gate (Granite-MoE-Shared's has none)
            _add(w, p + "ffn_gate_inp_shexp.weight", _tensor(rng, (dim,), 1.0 / np.sqrt(dim)), QT.F32)
    if shape.arch == "gpt-oss":  # the router's and each expert's biases, float32 as llama.cpp leaves them
        _add(w, p + "ffn_gate_inp.bias", _tensor(rng, (n,), 0.5), QT.F32)
        for name, width in (("gate", ff), ("up", ff), ("down", dim)):
            _add(w, p + f"ffn_{name}_exps.bias", _tensor(rng, (n, width), 0.5), QT.F32)


# ---- families whose files depart from the Llama layout above -------------------------------------------


@dataclass(frozen=True)
class FamilyWriter:
    """A family's own metadata keys, vocabulary and chat template (None: the byte-level one above), one
    layer's tensors (None: Llama's; called with the layer's prefix and index), the per-layer KV head counts
    that replace the scalar (None: the scalar), and the final norm's name, written with llama.cpp's key and
    tensor names."""

    metadata: Callable[[gguf.GGUFWriter, Shape], None]
    tokenizer: Callable[[gguf.GGUFWriter, Shape, np.random.Generator], None] | None
    layer: Callable[[str, int, Shape, Callable, Callable], None] | None = None
    head_count_kv: Callable[[Shape], list[int]] | None = None
    output_norm: str = "output_norm.weight"
    model_name: str | None = None  # general.name's stem (None: the architecture)


def _bpe_tokenizer(w: gguf.GGUFWriter, shape: Shape, rng, specials: list[str], pre: str, bos: int, eos: int,
                   template: str) -> None:
    tokens, merges, types = bpe_vocab(shape.vocab_size, specials, rng)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types(types)
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    w.add_add_bos_token(False)
    w.add_chat_template(template)


# Granite 3.x's multipliers are its muP widths' (Granite-3.3-2B: 12, 0.22, 1/head size, 8)
GRANITE_TEMPLATE = (
    "{%- for message in messages %}{{- '<|start_of_role|>' + message['role'] + '<|end_of_role|>' + message['content']"
    " + '<|end_of_text|>\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|start_of_role|>assistant<|end_of_role|>' }}"
    "{%- endif %}"
)


def _granite_metadata(w: gguf.GGUFWriter, shape: Shape) -> None:
    w.add_embedding_scale(12.0)
    w.add_residual_scale(0.22)
    w.add_attention_scale(1.0 / shape.head_dim)
    w.add_logit_scale(8.0)


def _granite_tokenizer(w: gguf.GGUFWriter, shape: Shape, rng) -> None:
    _bpe_tokenizer(w, shape, rng, ["<|end_of_text|>", "<|start_of_role|>", "<|end_of_role|>"], "refact", 0, 0,
                   GRANITE_TEMPLATE)


OLMO2_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + message['content'] + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def _olmo2_tokenizer(w: gguf.GGUFWriter, shape: Shape, rng) -> None:
    _bpe_tokenizer(w, shape, rng, ["<|endoftext|>", "<|user|>", "<|assistant|>", "<|system|>"], "dbrx", 0, 0,
                   OLMO2_TEMPLATE)


def _olmo2_layer(p: str, i: int, shape: Shape, matrix, norm) -> None:
    """No pre-norms: a norm after each sublayer, and q/k norms as wide as the projections."""
    q_dim, kv_dim = shape.n_heads * shape.head_dim, shape.n_kv_heads * shape.head_dim
    matrix(p + "attn_q.weight", q_dim, shape.dim)
    matrix(p + "attn_k.weight", kv_dim, shape.dim)
    matrix(p + "attn_v.weight", kv_dim, shape.dim)
    matrix(p + "attn_output.weight", shape.dim, q_dim)
    norm(p + "attn_q_norm.weight", q_dim)
    norm(p + "attn_k_norm.weight", kv_dim)
    norm(p + "post_attention_norm.weight", shape.dim)
    matrix(p + "ffn_gate.weight", shape.ffn_dim, shape.dim)
    matrix(p + "ffn_up.weight", shape.ffn_dim, shape.dim)
    matrix(p + "ffn_down.weight", shape.dim, shape.ffn_dim)
    norm(p + "post_ffw_norm.weight", shape.dim)


SMOLLM3_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _smollm3_tokenizer(w: gguf.GGUFWriter, shape: Shape, rng) -> None:
    _bpe_tokenizer(w, shape, rng, ["<|begin_of_text|>", "<|im_start|>", "<|im_end|>"], "smaug-bpe", 0, 2,
                   SMOLLM3_TEMPLATE)


def _lfm2_metadata(w: gguf.GGUFWriter, shape: Shape) -> None:
    w.add_uint32(f"{shape.arch}.shortconv.l_cache", shape.conv_length)


def _lfm2_head_count_kv(shape: Shape) -> list[int]:
    """Only the attention layers have KV heads; the convolutions' entries are 0."""
    return [shape.n_kv_heads if i in shape.attention_layers else 0 for i in range(shape.n_layers)]


def _lfm2_layer(p: str, i: int, shape: Shape, matrix: Callable, norm: Callable) -> None:
    d = shape.dim
    norm(p + "attn_norm.weight", d)
    if i in shape.attention_layers:
        q_dim, kv_dim = shape.n_heads * shape.head_dim, shape.n_kv_heads * shape.head_dim
        matrix(p + "attn_q.weight", q_dim, d)
        matrix(p + "attn_k.weight", kv_dim, d)
        matrix(p + "attn_v.weight", kv_dim, d)
        matrix(p + "attn_output.weight", d, q_dim)
        norm(p + "attn_q_norm.weight", shape.head_dim)
        norm(p + "attn_k_norm.weight", shape.head_dim)
    else:
        matrix(p + "shortconv.in_proj.weight", 3 * d, d)
        # float: its rows of l_cache taps are far shorter than a quantization block, as in llama.cpp's files
        matrix(p + "shortconv.conv.weight", d, shape.conv_length, QT.F32)
        matrix(p + "shortconv.out_proj.weight", d, d)
    norm(p + "ffn_norm.weight", d)
    matrix(p + "ffn_gate.weight", shape.ffn_dim, d)
    matrix(p + "ffn_up.weight", shape.ffn_dim, d)
    matrix(p + "ffn_down.weight", d, shape.ffn_dim)


# Qwen3.5's generation prompt opens the reasoning block, or renders it empty when thinking is off
QWEN35_TEMPLATE = (
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}"
    "{%- else %}{{- '<think>\n' }}{%- endif %}{%- endif %}"
)


def _qwen35_metadata(w: gguf.GGUFWriter, shape: Shape) -> None:
    n_k, n_v, k_dim, v_dim = shape.delta_net
    w.add_ssm_conv_kernel(shape.conv_length)
    w.add_ssm_state_size(k_dim)
    w.add_ssm_group_count(n_k)
    w.add_ssm_time_step_rank(n_v)
    w.add_ssm_inner_size(n_v * v_dim)
    w.add_full_attention_interval(shape.full_attention_interval)
    if shape.rope_sections:
        w.add_rope_dimension_sections(list(shape.rope_sections))


def _qwen35_tokenizer(w: gguf.GGUFWriter, shape: Shape, rng) -> None:
    _bpe_tokenizer(w, shape, rng, ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"], "qwen2",
                   0, 2, QWEN35_TEMPLATE)


def _qwen35_layer(p: str, i: int, shape: Shape, matrix: Callable, norm: Callable) -> None:
    """llama.cpp's layout: attn_q holds each head's queries then its gate; a DeltaNet's value heads are in
    tiled order (value head j reads key head j % key heads)."""
    d, hd = shape.dim, shape.head_dim
    norm(p + "attn_norm.weight", d)
    if (i + 1) % shape.full_attention_interval == 0:
        q_dim, kv_dim = shape.n_heads * hd, shape.n_kv_heads * hd
        matrix(p + "attn_q.weight", 2 * q_dim, d)
        matrix(p + "attn_k.weight", kv_dim, d)
        matrix(p + "attn_v.weight", kv_dim, d)
        matrix(p + "attn_output.weight", d, q_dim)
        norm(p + "attn_q_norm.weight", hd)
        norm(p + "attn_k_norm.weight", hd)
    else:
        n_k, n_v, k_dim, v_dim = shape.delta_net
        width = 2 * n_k * k_dim + n_v * v_dim
        matrix(p + "attn_qkv.weight", width, d)
        matrix(p + "attn_gate.weight", n_v * v_dim, d)
        matrix(p + "ssm_alpha.weight", n_v, d)
        matrix(p + "ssm_beta.weight", n_v, d)
        # float, as llama.cpp's quantizer leaves the convolution and the per-head vectors
        matrix(p + "ssm_conv1d.weight", width, shape.conv_length, QT.F32)
        norm(p + "ssm_a", n_v, center=-1.0, spread=0.2)  # -exp(A_log): every head decays
        norm(p + "ssm_dt.bias", n_v, center=0.0, spread=0.5)
        norm(p + "ssm_norm.weight", v_dim)
        matrix(p + "ssm_out.weight", d, n_v * v_dim)
    norm(p + "post_attention_norm.weight", d)
    matrix(p + "ffn_gate.weight", shape.ffn_dim, d)
    matrix(p + "ffn_up.weight", shape.ffn_dim, d)
    matrix(p + "ffn_down.weight", d, shape.ffn_dim)


def _phi3_tokenizer(w: gguf.GGUFWriter, shape: Shape, rng) -> None:
    """Phi-4-mini's layout: a byte-level BPE vocabulary split by GPT-4o's pre-tokenizer, the specials last,
    <|endoftext|> both BOS and EOS."""
    tokens, merges, types = bpe_vocab(shape.vocab_size - len(PHI3_SPECIALS), [], rng)
    eot = len(tokens)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-4o")
    w.add_token_list(tokens + PHI3_SPECIALS)
    w.add_token_merges(merges)
    w.add_token_types(types + [3] * len(PHI3_SPECIALS))
    w.add_bos_token_id(eot)
    w.add_eos_token_id(eot)
    w.add_add_bos_token(False)
    w.add_chat_template(PHI3_TEMPLATE)


FAMILY_WRITERS: dict[str, FamilyWriter] = {
    "granite": FamilyWriter(_granite_metadata, _granite_tokenizer),
    "olmo2": FamilyWriter(lambda w, shape: None, _olmo2_tokenizer, _olmo2_layer),
    "smollm3": FamilyWriter(lambda w, shape: None, _smollm3_tokenizer),
    "lfm2": FamilyWriter(_lfm2_metadata, None, _lfm2_layer, _lfm2_head_count_kv, "token_embd_norm.weight"),
    # llama.cpp gives a file whose name says "phi3" or "phi-3" Phi-3's SentencePiece token attributes, and
    # fails on a byte-level vocabulary without </s>, <unk> and <s>; Phi-4-mini's files are named "Phi 4 ..."
    "phi3": FamilyWriter(lambda w, shape: None, _phi3_tokenizer, model_name="Phi-4-mini-like"),
}
FAMILY_WRITERS["qwen35"] = FamilyWriter(_qwen35_metadata, _qwen35_tokenizer, _qwen35_layer)
FAMILY_WRITERS["olmoe"] = FamilyWriter(lambda w, shape: None, _olmo2_tokenizer)


def _gpt_oss_tokenizer(w: gguf.GGUFWriter, shape: Shape, rng) -> None:
    """harmony's control tokens, GPT-4o's pre-tokenizer (gpt-oss's o200k), <|return|> the end of a reply."""
    _bpe_tokenizer(w, shape, rng, HARMONY_SPECIALS, "gpt-4o", 0, HARMONY_SPECIALS.index("<|return|>"),
                   HARMONY_TEMPLATE)


FAMILY_WRITERS["gpt-oss"] = FamilyWriter(lambda w, shape: w.add_sliding_window(shape.sliding_window), _gpt_oss_tokenizer)
FAMILY_WRITERS["granitemoe"] = FamilyWriter(_granite_metadata, _granite_tokenizer)
