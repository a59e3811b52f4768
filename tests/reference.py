"""transformers as the reference implementation: models load once per test session (they are slow)."""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np


# Families transformers reads from GGUF itself; the others are built from a config (hf_model_from_gguf)
_BUILDERS: dict[str, "Builder"] = {}


@dataclass(frozen=True)
class Builder:
    """How to build a transformers model of one family from a kiln GGUF file: its config from the file's
    metadata, and each GGUF tensor's transformers name (None: not a parameter, e.g. rope factors)."""

    config: Callable[[dict], dict]  # metadata (key → value) → transformers config fields incl. model_type
    name: Callable[[str], str | None]
    unpermute_qk: bool = False  # llama.cpp's converter permutes q/k rows for its "normal" rope
    tensors: tuple[str, ...] = ()  # tensors whose values the config needs (LongRoPE's factors), given to it by name
    # the named tensors → transformers' parameters, where it stores several GGUF tensors as one (an
    # expert table's gate and up)
    join: Callable[[dict], dict] | None = None


def register_builder(arch: str, builder: Builder) -> None:
    _BUILDERS[arch] = builder


@functools.lru_cache(maxsize=4)
def hf_model(path: Path):
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        arch = _architecture(path)
        if arch in _BUILDERS:
            return hf_model_from_gguf(path, _BUILDERS[arch])
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                     **_unread_config(path, arch))
    return model.eval()


# Config fields transformers' GGUF reader leaves at its defaults, from the keys that hold them
_UNREAD_BY_GGUF_READER = {
    "qwen3moe": {"moe_intermediate_size": "expert_feed_forward_length"},
    "qwen2moe": {"moe_intermediate_size": "expert_feed_forward_length",
                 "shared_expert_intermediate_size": "expert_shared_feed_forward_length"},
}


def _unread_config(path: Path, arch: str) -> dict:
    import gguf

    fields = _UNREAD_BY_GGUF_READER.get(arch, {})
    meta = _metadata(gguf.GGUFReader(path)) if fields else {}
    return {name: meta[f"{arch}.{key}"] for name, key in fields.items() if f"{arch}.{key}" in meta}


def _architecture(path: Path) -> str:
    import gguf

    field = gguf.GGUFReader(path).fields["general.architecture"]
    return bytes(field.parts[field.data[0]]).decode()


def _metadata(reader) -> dict:
    from gguf import GGUFValueType as VT

    out = {}
    for key, field in reader.fields.items():
        if not field.types:
            continue
        if field.types[0] == VT.ARRAY:
            if field.types[-1] == VT.STRING:
                continue  # vocabularies: a transformers model takes token ids
            out[key] = [field.parts[i].tolist()[0] for i in field.data]
        elif field.types[0] == VT.STRING:
            out[key] = bytes(field.parts[field.data[0]]).decode()
        else:
            out[key] = field.parts[field.data[0]].tolist()[0]
    return out


def hf_model_from_gguf(path: Path, builder: Builder):
    """A float32 transformers model holding the file's weights (dequantized), for a family whose GGUF
    transformers cannot read: the inverse of llama.cpp's converter for that family."""
    import gguf
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    reader = gguf.GGUFReader(path)
    meta = _metadata(reader)
    for t in reader.tensors:
        if t.name in builder.tensors:
            meta[t.name] = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).ravel().tolist()
    fields = builder.config(meta)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    arch = meta["general.architecture"]
    n_heads = meta[f"{arch}.attention.head_count"]
    n_kv = meta.get(f"{arch}.attention.head_count_kv", n_heads)
    state = {}
    for t in reader.tensors:
        name = builder.name(t.name)
        if name is None:
            continue
        shape = tuple(int(d) for d in reversed(t.shape))
        data = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
        if builder.unpermute_qk and t.name.endswith(("attn_q.weight", "attn_k.weight", "attn_q.bias", "attn_k.bias")):
            heads = n_heads if ".attn_q." in t.name else n_kv
            data = data.reshape(heads, data.shape[0] // heads // 2, 2, *data.shape[1:]).swapaxes(1, 2).reshape(shape)
        state[name] = torch.from_numpy(np.ascontiguousarray(data))
    if builder.join is not None:
        state = builder.join(state)
    if getattr(config, "tie_word_embeddings", False):
        state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise AssertionError(f"{path}: transformers parameters missing {missing}, unexpected {unexpected}")
    return model


def hf_logits(path: Path, ids: list[int]) -> np.ndarray:
    """Logits for every position, (len(ids), vocab), float32."""
    import torch

    with torch.no_grad():
        return hf_model(path)(torch.tensor([ids])).logits[0].numpy()


def hf_greedy(path: Path, ids: list[int], n: int) -> list[int]:
    """n greedy tokens, never stopping early (end-of-sequence tokens are just tokens here)."""
    import torch

    model = hf_model(path)
    out, past, inputs = [], None, torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            res = model(inputs, past_key_values=past, use_cache=True)
            past = res.past_key_values
            token = int(res.logits[0, -1].argmax())
            out.append(token)
            inputs = torch.tensor([[token]])
    return out


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    """Largest absolute difference relative to the reference's largest magnitude."""
    return float(np.abs(a - b).max() / np.abs(b).max())


def oracle(path: Path, n_ctx: int = 256, **options):
    """kiln's numpy oracle on a file: the other side of every comparison with transformers."""
    from kiln.engine.oracle import OracleEngine
    from kiln.gguf import GGUFFile
    from kiln.models import family_for

    gguf = GGUFFile(path)
    return OracleEngine(gguf, family_for(gguf), n_ctx=n_ctx, **options)


def oracle_greedy(engine, ids: list[int], n: int) -> list[int]:
    """n greedy tokens from an oracle engine, never stopping early (as hf_greedy)."""
    logits, out = engine.forward(ids), []
    for i in range(n):
        out.append(int(np.argmax(logits)))
        logits = engine.forward([out[-1]], 0, len(ids) + i)
    return out
