"""What an engine is to the rest of kiln: the calls the scheduler, speculation and the measurement tools
make, and the limits of one step. Both engines implement it: the native core (native.py) and the numpy
oracle (oracle.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np

from kiln.models.base import ModelConfig


@dataclass(frozen=True)
class Limits:
    """How many rows one `step` takes. The native engine's plans are compiled for these sizes; the oracle
    has no plans, takes the same batches and returns logits for any of its rows."""

    rows: int = 128  # rows of one step (a prefill chunk, with the decode rows beside it)
    batch: int = 16  # rows of a decode step: sequences decoded together
    out_rows: int = 16  # rows of one step that return logits


class Engine(Protocol):
    name: str  # "native" or "oracle"
    processor: str  # what runs it, for humans: "CPU (avx512, 2 threads)"
    config: ModelConfig
    n_ctx: int  # positions per KV slot
    n_slots: int  # KV slots: sequences in flight at once
    limits: Limits
    threads: int | None  # native threads; None: the calling thread alone
    pool: object | None  # the native thread pool a step's rows are sampled on; None: the calling thread

    def step(self, tokens: Sequence[int], slots: Sequence[int], positions: Sequence[int],
             out_rows: Sequence[int]) -> np.ndarray:
        """Run one batch of rows (any mix of sequences and slots); the logits of `out_rows`, in order."""

    def hidden(self, n_out: int) -> np.ndarray:
        """The last step's final hidden states of its first `n_out` rows with logits."""

    def decode(self, tokens: Sequence[int], slots: Sequence[int], positions: Sequence[int]) -> np.ndarray:
        """One token for each of several slots: their logits, in order."""

    def forward(self, tokens: Sequence[int], slot: int = 0, start: int = 0, all_logits: bool = False) -> np.ndarray:
        """One sequence's tokens from position `start`: the last row's logits, or every row's."""

    def hidden_states(self, tokens: Sequence[int], slot: int = 0, start: int = 0) -> list[np.ndarray]:
        """The residual stream after every add, for diagnosis."""

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        """Copy the KV of positions [0, length) of slot `src` into slot `dst`, and its recurrent state."""

    def resume_point(self, slot: int, position: int) -> int:
        """The furthest position at or before `position` from which the slot can continue (be fed next):
        `position` itself for a KV cache alone; for a recurrent state, one it still reaches or its
        snapshot, else 0 (kiln/engine/kv.py, StateWindow)."""

    def snapshot(self, slot: int, position: int) -> None:
        """Keep the recurrent state before `position` aside, so the slot can later continue there (a
        prompt's end, for the next turn); nothing without a recurrent state."""

    def checkpoint(self, slot: int, position: int) -> None:
        """Before a step that may be undone (a draft to verify): snapshot the state at `position` where it
        cannot rewind past the step's rows (a DeltaNet's matrices); nothing where it can."""

    def set_debug_negate(self, layer: int | None) -> None:
        """Break one layer on purpose, to show that accuracy checks fail."""

    def close(self) -> None: ...
