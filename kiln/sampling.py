"""A request's sampling parameters: what a request, a created model (modelfile.py) and the catalog set,
and what the engine's sampler (engine/sampler.py) applies."""

from __future__ import annotations

from dataclasses import dataclass, fields

from kiln.errors import RequestError


@dataclass
class SamplingParams:
    """Defaults follow Ollama's; temperature 0 means greedy."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.9
    min_p: float = 0.0
    repeat_penalty: float = 1.1
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None

    def __post_init__(self):
        checks = {
            "temperature": self.temperature >= 0,
            "top_k": self.top_k >= 0,
            "top_p": 0 < self.top_p <= 1,
            "min_p": 0 <= self.min_p <= 1,
            "repeat_penalty": self.repeat_penalty > 0,
            "repeat_last_n": self.repeat_last_n >= -1,
        }
        for name, ok in checks.items():
            if not ok:
                raise RequestError(f"invalid sampling parameter {name}={getattr(self, name)!r}", param=name)

    @classmethod
    def greedy(cls) -> "SamplingParams":
        return cls(temperature=0.0, top_k=0, top_p=1.0, repeat_penalty=1.0)

    def replace(self, **changes) -> "SamplingParams":
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update({k: v for k, v in changes.items() if v is not None})
        return SamplingParams(**values)
