"""llama-server's introspection endpoints, which its clients probe: /tokenize, /detokenize,
/apply-template, /props and /slots; and /infill, the fill-in-the-middle endpoint editors call.

llama-server serves one model; kiln serves whichever is named. Each request may name it (`model` in the
body, `?model=` on a GET); unnamed, it is the loaded model used last. /props and /slots never load a
model: /slots lists every loaded model's slots (each names its model), empty with none loaded; /props
describes the model used last, and with none loaded says only what the server itself knows.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from kiln import __version__
from kiln.engine.fim import Infill
from kiln.engine.request import GenerationRequest, chat_prompt, sampling_params, token_ids
from kiln.errors import KilnError, RequestError, fields_named
from kiln.server.generation import Final, Job, borrowed, start
from kiln.server.openai import ChatMessage, Tool, _Sampling, chat_message, timings
from kiln.server.runtime import Runtime
from kiln.tools import template_supports_tools

router = APIRouter(tags=["llama-server"])
_ERRORS = {400: {"description": "Invalid request (OpenAI error object naming `param`)"},
           401: {"description": "Missing or wrong API key"}, 404: {"description": "Unknown model"}}


class _Named(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a field kiln does not implement is an error naming it

    model: str | None = Field(None, description="kiln extension: the model to use; default the loaded one")


class TokenizeRequest(_Named):
    content: str
    add_special: bool = Field(False, description="add the BOS token, as the model's file says to")
    parse_special: bool = Field(True, description="read special tokens' text as those tokens")
    with_pieces: bool = Field(False, description="each token as {id, piece}: its text, or its bytes when not UTF-8")


class DetokenizeRequest(_Named):
    tokens: list[int]


class ApplyTemplateRequest(_Named):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None


class ExtraFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    filename: str = "tmp"
    text: str = ""


class InfillRequest(_Sampling):
    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, description="kiln extension: the model to use; default the loaded one")
    input_prefix: str = Field("", description="the text before the cursor")
    input_suffix: str = Field("", description="the text after the cursor")
    input_extra: list[ExtraFile] = Field(default_factory=list, description="other files of the project the model may read")
    prompt: str = Field("", description="more text right before the cursor, after input_prefix")
    n_predict: int = Field(-1, ge=-1, description="most tokens to generate; -1: until the model ends the middle")


# kiln's request fields that /infill names otherwise
INFILL_FIELDS = {"suffix": "input_suffix", "max_tokens": "n_predict", "prompt": "input_prefix"}
_STOP_TYPES = {"length": "limit", "stop": "eos"}


@router.post("/infill", responses=_ERRORS, summary="Fill in the middle between a prefix and a suffix (llama-server)")
async def infill(body: InfillRequest, request: Request):
    runtime = _runtime(request)
    fill = Infill(body.input_prefix, body.input_suffix, [f.model_dump() for f in body.input_extra], body.prompt)
    job = Job("llamacpp", _model(request, body.model), GenerationRequest(
        **body.request_fields(), infill=fill, max_tokens=None if body.n_predict < 0 else body.n_predict))
    with fields_named(INFILL_FIELDS):
        generation = await start(runtime, job)
    tag = generation.loaded.tag
    if body.stream:
        async def lines():
            async for event in generation.events(request):
                if isinstance(event, Final):
                    yield f"data: {json.dumps(_infill_final(event, ''))}\n\n"
                elif event.text:
                    yield f"data: {json.dumps({'content': event.text, 'stop': False, 'model': tag})}\n\n"

        return StreamingResponse(lines(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    _, final = await generation.collect(request)
    if final.error:
        raise KilnError(final.error)
    return _infill_final(final, final.text)


def _infill_final(final: Final, content: str) -> dict:
    """llama-server's last record of a completion: the text (all of it, or empty after a stream) and why it stopped."""
    t, stop_string = final.timings, final.seq.stop_string
    out = {"content": content, "stop": True, "model": final.model, "tokens_predicted": t.completion_tokens,
           "tokens_evaluated": t.prompt_tokens, "tokens_cached": t.cached_tokens, "truncated": False,
           "stop_type": "word" if stop_string else _STOP_TYPES.get(final.finish_reason, "none"),
           "stopping_word": stop_string or "", "timings": timings(final)}
    return {**out, "error": final.error} if final.error else out


@router.post("/tokenize", responses=_ERRORS, summary="Token ids of a text (llama-server)")
async def tokenize(body: TokenizeRequest, request: Request):
    async with borrowed(_runtime(request), _model(request, body.model)) as loaded:
        tok = loaded.model.tokenizer
        ids = await asyncio.to_thread(tok.encode, body.content, None if body.add_special else False, body.parse_special)
        if not body.with_pieces:
            return {"tokens": ids}
        return {"tokens": [{"id": i, "piece": _piece(tok.token_bytes(i))} for i in ids]}


@router.post("/detokenize", responses=_ERRORS, summary="The text of token ids (llama-server)")
async def detokenize(body: DetokenizeRequest, request: Request):
    async with borrowed(_runtime(request), _model(request, body.model)) as loaded:
        tok = loaded.model.tokenizer
        ids = token_ids(body.tokens, tok.vocab_size, "tokens")
        return {"content": tok.decode(ids, skip_special=False)}


@router.post("/apply-template", responses=_ERRORS, summary="The prompt a chat renders to (llama-server)")
async def apply_template(body: ApplyTemplateRequest, request: Request):
    chat = GenerationRequest(messages=[chat_message(i, m) for i, m in enumerate(body.messages)],
                             tools=[t.model_dump() for t in body.tools] if body.tools else None)
    async with borrowed(_runtime(request), _model(request, body.model)) as loaded:
        return {"prompt": await asyncio.to_thread(chat_prompt, loaded.model, chat)}


@router.get("/props", responses={401: _ERRORS[401]}, summary="The server and its model (llama-server)")
async def props(request: Request):
    runtime = _runtime(request)
    loaded = runtime.loaded
    settings = {"n_ctx": loaded.model.n_ctx if loaded else runtime.settings.ctx_len, "is_processing":
                bool(loaded and loaded.active)}
    out = {"total_slots": runtime.settings.parallel, "modalities": {"vision": False, "audio": False},
           "build_info": f"kiln {__version__}", "model_alias": None, "model_path": None, "chat_template": None,
           "chat_template_caps": None, "eos_token": None}
    if loaded is not None:
        model, tok = loaded.model, loaded.model.tokenizer
        sampling = {**_sampling_defaults(model), "n_predict": -1, "stop": list(model.stop)}
        settings["params"] = sampling
        out.update(model_alias=loaded.tag, model_path=str(loaded.record.path), chat_template=tok.chat_template,
                   chat_template_caps={"supports_tools": template_supports_tools(tok.chat_template)},
                   eos_token=tok.id_to_token(tok.eos_id) if tok.eos_id is not None else None)
    return {"default_generation_settings": settings, **out}


@router.get("/slots", responses={401: _ERRORS[401]}, summary="Each loaded model's KV slots and their state (llama-server)")
async def slots(request: Request):
    return [{"id": s["id"], "id_task": s["request"] if s["request"] is not None else -1, "n_ctx": loaded.model.n_ctx,
             "is_processing": s["request"] is not None, "state": 0 if s["request"] is None else 1,
             "tokens_cached": s["cached"], "model": loaded.tag}
            for loaded in list(_runtime(request).models.values()) for s in loaded.scheduler.slots()]


def _sampling_defaults(model) -> dict:
    """The sampling a request that sets nothing gets (llama-server's names are kiln's)."""
    p = sampling_params(model, {})
    return {**dataclasses.asdict(p), "seed": -1 if p.seed is None else p.seed}


def _runtime(request: Request) -> Runtime:
    return request.app.state.runtime


def _model(request: Request, named: str | None) -> str:
    if named:
        return named
    loaded = _runtime(request).loaded
    if loaded is None:
        raise RequestError("model: no model is loaded; name the model to use", "model")
    return loaded.tag


def _piece(data: bytes) -> str | list[int]:
    """llama-server's piece: the token's text, or its bytes when they are not whole UTF-8."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return list(data)
