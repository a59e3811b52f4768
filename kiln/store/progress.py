"""How a pull reports its progress: stages of bytes, to any consumer of `PullProgress`. The terminal bar
(`TerminalBar`) draws them; Ollama's /api/pull streams them (kiln.server.ollama)."""

from __future__ import annotations

from typing import Protocol

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn, TransferSpeedColumn


class PullProgress(Protocol):
    def update(self, stage: str, completed: int, total: int | None) -> None:
        """`stage` (download, copy, extract, verify, ...) has done `completed` of `total` bytes (None: unknown)."""

    def note(self, message: str) -> None:
        """A line for the user: a source that failed, before the next one is tried."""


class Counted:
    """Bytes reported as they are counted: a callable that advances one stage."""

    def __init__(self, progress: PullProgress, stage: str, total: int | None, initial: int = 0):
        self.progress, self.stage, self.total, self.done = progress, stage, total, initial
        progress.update(stage, initial, total)

    def __call__(self, n: int) -> None:
        self.done += n
        self.progress.update(self.stage, self.done, self.total)


class TerminalBar:
    """Progress bars on stderr (stdout stays clean for --json), drawn only on a terminal, not into logs."""

    def __init__(self, enabled: bool):
        console = Console(stderr=True, soft_wrap=True)
        columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn())
        columns += (TimeElapsedColumn(),)
        self._bar = Progress(*columns, console=console, disable=not (enabled and console.is_terminal))
        self._tasks: dict[str, int] = {}

    def __enter__(self) -> TerminalBar:
        self._bar.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._bar.__exit__(*exc)

    def update(self, stage: str, completed: int, total: int | None) -> None:
        if stage not in self._tasks:
            self._tasks[stage] = self._bar.add_task(stage, total=total, completed=completed)
        else:
            self._bar.update(self._tasks[stage], total=total, completed=completed)

    def note(self, message: str) -> None:
        self._bar.console.print(message, markup=False, highlight=False)
