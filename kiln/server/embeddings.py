"""Embeddings on the server: texts run as prompts through the loaded model's scheduler, whose final
hidden states come back instead of sampled tokens."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from functools import partial

import numpy as np

from kiln.engine.request import GenerationRequest, prepare, token_ids
from kiln.engine.scheduler import Embedded, Finished, Request
from kiln.errors import ContextLengthError, KilnError, RequestError
from kiln.server.generation import until_disconnect
from kiln.server.runtime import DEFAULT, Runtime


async def embed_inputs(runtime: Runtime, api: str, model: str, inputs: list, keep_alive=DEFAULT, param: str = "input",
                       http_request=None, truncate: bool = False, n_ctx: int | None = None) -> Embeddings:
    """Each input's final hidden state, computed as prompts through the scheduler, so embeddings share
    the engine's steps with running generations (and its prompt cache). Inputs go in as many at a
    time as there are KV slots, so a long list never fills the request queue. When the client of
    `http_request` disconnects, what is left is cancelled. `truncate`: an input longer than the context
    is cut to it (Ollama's /api/embed) instead of being an error. `n_ctx`: the context to run at, as a
    generation's (the model is reloaded at it)."""
    t0 = time.perf_counter()
    loaded = await runtime.acquire(model, n_ctx=n_ctx)
    loop, vectors, requests, futures = asyncio.get_running_loop(), [], [], []
    gone = asyncio.ensure_future(until_disconnect(http_request)) if http_request is not None else None
    try:
        load_ms = (time.perf_counter() - t0) * 1e3
        ids = await asyncio.to_thread(embedding_ids, loaded.model, inputs, param, truncate)
        window = loaded.scheduler.n_slots
        for first in range(0, len(ids), window):
            requests, futures = [], []
            for tokens in ids[first : first + window]:
                futures.append(loop.create_future())
                seq, _ = prepare(loaded.model, GenerationRequest(prompt=tokens, embed=True))
                requests.append(Request(seq, partial(_embedding_sink, loop, futures[-1]), embed=True))
                loaded.scheduler.submit(requests[-1])
            batch = asyncio.gather(*futures)
            if gone is not None:
                await asyncio.wait({batch, gone}, return_when=asyncio.FIRST_COMPLETED)
                if gone.done():
                    batch.cancel()
                    raise KilnError("the client disconnected before its embeddings were computed")
            vectors += await batch
    except BaseException as e:
        runtime.metrics.rejected.labels(type(e).__name__).inc()
        raise
    finally:
        if gone is not None:
            gone.cancel()
        for req, future in zip(requests, futures):  # a client gone, or a sibling input rejected: free their slots
            future.cancel()
            loaded.scheduler.cancel(req)
        await runtime.release(loaded, keep_alive)
    runtime.metrics.embedding_inputs.labels(api).inc(len(ids))
    runtime.metrics.prompt_tokens.inc(sum(map(len, ids)))
    return Embeddings(loaded.tag, vectors, sum(map(len, ids)), load_ms, (time.perf_counter() - t0) * 1e3)


def _embedding_sink(loop, future, event) -> None:  # on the engine thread
    def deliver():
        if future.done():
            return
        if isinstance(event, Embedded):
            future.set_result(event.vector)
        elif isinstance(event, Finished):
            future.set_exception(KilnError(event.error or "the embedding request was cancelled"))

    try:
        loop.call_soon_threadsafe(deliver)
    except RuntimeError:  # the event loop has closed: the server is shutting down
        pass


@dataclass
class Embeddings:
    tag: str
    vectors: list[np.ndarray]  # one per input: its last token's final hidden state, not normalized
    prompt_tokens: int
    load_ms: float
    total_ms: float


def unit_vectors(vectors: list[np.ndarray], dimensions: int | None, param: str = "dimensions") -> list[np.ndarray]:
    """Embeddings as both APIs return them: length 1, each first cut to its first `dimensions` values when
    asked (as OpenAI's `dimensions` does)."""
    if dimensions is not None and vectors and dimensions > vectors[0].size:
        raise RequestError(f"{param} is {dimensions} but the model's embeddings have {vectors[0].size}", param)
    out = []
    for v in vectors:
        v = v[:dimensions].astype(np.float32)
        norm = float(np.linalg.norm(v))
        out.append(v / norm if norm > 0 else v)
    return out


def embedding_ids(model, inputs: list, param: str, truncate: bool = False) -> list[list[int]]:
    """Token ids of each input (text, or ids already), checked: none empty, none longer than the context
    (or, with `truncate`, each cut to its first n_ctx tokens)."""
    tok, n_ctx = model.tokenizer, model.n_ctx
    out = []
    for i, item in enumerate(inputs):
        where = f"{param}[{i}]" if len(inputs) > 1 else param
        if truncate and isinstance(item, str):
            # the first n_ctx tokens lie within the text's first max_chars(n_ctx) characters; the rest
            # (one more token's worth kept, for a word running past the cut) need not be encoded at all
            item = item[: tok.max_chars(n_ctx + 1)]
        try:
            ids = (token_ids(item, tok.vocab_size, where) if isinstance(item, list)
                   else tok.encode(item, max_tokens=None if truncate else n_ctx))
        except ContextLengthError as e:
            raise ContextLengthError(f"{where}: {e}", where) from None
        if not ids:
            raise RequestError(f"{where} is empty", where)
        if len(ids) > n_ctx and truncate:
            ids = ids[:n_ctx]
        elif len(ids) > n_ctx:
            raise ContextLengthError(f"{where} is {len(ids)} tokens but the context holds {n_ctx}; "
                                     "kiln does not truncate inputs unless asked (truncate)", where)
        out.append(ids)
    return out
