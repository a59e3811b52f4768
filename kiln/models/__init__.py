"""Model families, found by the GGUF's `general.architecture`."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Callable

from kiln.errors import UnsupportedModelError
from kiln.gguf import GGUFFile
from kiln.models import gemma3, llama, qwen
from kiln.models.base import ModelConfig

FAMILIES: dict[str, ModuleType] = {"llama": llama, "qwen2": qwen, "qwen3": qwen, "gemma3": gemma3}


@dataclass(frozen=True)
class Family:
    config: ModelConfig
    forward: Callable  # forward(ops, config) -> logits


def family_for(gguf: GGUFFile) -> Family:
    arch = gguf.architecture
    module = FAMILIES.get(arch)
    if module is None:
        raise UnsupportedModelError(
            f"{gguf.path}: architecture {arch!r} is not supported; kiln runs {', '.join(sorted(FAMILIES))}"
        )
    return Family(module.config_from_gguf(gguf), module.forward)
