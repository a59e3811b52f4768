"""Model families, found by the GGUF's `general.architecture`. `family_for` is the one way a file becomes
a model, so every load (CLI, server, bench, eval) is checked the same way before native code sees it."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Callable

from kiln.errors import UnsupportedModelError
from kiln.gguf import GGUFFile
from kiln.models import gemma2, gemma3, lfm2, llama, qwen
from kiln.models import granite, olmo2, smollm3
from kiln.models import phi2, phi3, qwen35
from kiln.models import gptoss, granitemoe, olmoe, qwenmoe
from kiln.models.base import Meta, ModelConfig
from kiln.models.check import check_tensors, check_tokenizer_metadata

FAMILIES: dict[str, ModuleType] = {"llama": llama, "qwen2": qwen, "qwen3": qwen, "gemma3": gemma3,
                                   "granite": granite, "olmo2": olmo2, "smollm3": smollm3, "phi3": phi3, "phi2": phi2,
                                   "lfm2": lfm2, "gemma2": gemma2, "qwen2moe": qwenmoe, "qwen3moe": qwenmoe,
                                   "olmoe": olmoe, "granitemoe": granitemoe, "gpt-oss": gptoss,
                                   "qwen35": qwen35}


@dataclass(frozen=True)
class Family:
    config: ModelConfig
    forward: Callable  # forward(ops, config) -> logits


def family_for(gguf: GGUFFile) -> Family:
    """The file's family and config, once its metadata and every tensor are checked against each other;
    anything else is a one-line ModelFileError naming the key or tensor."""
    arch = gguf.architecture
    module = FAMILIES.get(arch)
    if module is None:
        raise UnsupportedModelError(
            f"{gguf.path}: architecture {arch!r} is not supported; kiln runs {', '.join(sorted(FAMILIES))}"
        )
    check_tokenizer_metadata(gguf)
    meta = Meta(gguf)
    config = module.config_from_gguf(meta)
    meta.refuse_unread()
    check_tensors(gguf, config, module.forward)
    return Family(config, module.forward)


def check_model_file(path) -> None:
    """Raise the error loading `path` would raise about the file itself (an upload, say), or return."""
    gguf = GGUFFile(path)
    try:
        family_for(gguf)
    finally:
        gguf.close()
