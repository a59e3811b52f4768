"""One request at a time through the scheduler, stepped on the calling thread: `kiln run` and the
in-process benchmarks take the same decode loop, prompt cache, stops, grammar and speculation as the
server's requests."""

from __future__ import annotations

from typing import Iterator

from kiln.engine.scheduler import Finished, Request, Scheduler, Token
from kiln.engine.sequence import Sequence
from kiln.errors import KilnError


def generate(scheduler: Scheduler, seq: Sequence) -> Iterator[str]:
    """Yield text as `seq` releases it, running `scheduler`'s steps here (its thread is never started)
    until the sequence finishes. Leaving early, or an interrupt, cancels it and forgets what its slot
    holds."""
    events: list[Token | Finished] = []
    request = Request(seq, events.append)
    scheduler.submit(request)
    finished = False
    try:
        while not finished:
            scheduler.step()
            arrived, events[:] = list(events), []
            for event in arrived:
                if isinstance(event, Finished):
                    finished = True
                    if event.error:
                        raise KilnError(event.error)
                elif event.text:
                    yield event.text
    finally:
        if not finished:
            scheduler.abandon(request)
