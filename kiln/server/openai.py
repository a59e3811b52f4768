"""OpenAI's API (/v1): chat completions, completions and models, translated to and from `generation.Job`
(kiln's request fields keep OpenAI's names, but for `format`: response_format).

Beyond OpenAI's fields every response carries kiln's timings: `usage.prompt_tokens_details.cached_tokens`
and a `timings` object with llama-server's names (`cache_n`, `prompt_n`, `prompt_per_second`,
`predicted_per_second`, `draft_n`, `draft_n_accepted`, ...) plus kiln's own (`queue_ms`, `ttft_ms`,
`load_ms`, ...).

Speculative decoding per request, an extra body field (the OpenAI SDKs pass it with `extra_body`):
`"speculative": {"mode": "lookup", "max": 8, "ngram": 3}`. `mode` is none, lookup (prompt lookup) or
model (the server's --draft-model); omitted fields take the server's defaults (kiln serve --draft,
--draft-max, --ngram). Requests under a grammar (response_format, a forced tool call) never speculate.

Thinking models' reasoning comes back as `reasoning_content` (llama-server's and DeepSeek's field) on the
message and on stream deltas; `reasoning_effort` switches it (none: off) and `chat_template_kwargs`
reach the template as given.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from kiln import __version__
from kiln.engine.speculative import MAX_DRAFT, MAX_NGRAM
from kiln.engine.fim import Infill
from kiln.engine.request import ANY_JSON, GenerationRequest
from kiln.errors import KilnError, ModelNotFoundError, RequestError, fields_named
from kiln.server.embeddings import embed_inputs, unit_vectors
from kiln.server.generation import Delta, Final, Job, start
from kiln.server.runtime import Runtime

router = APIRouter(prefix="/v1", tags=["OpenAI"])
# kiln's request fields that OpenAI names otherwise
FIELDS = {"format": "response_format", "think": "reasoning_effort", "template_variables": "chat_template_kwargs"}
# reasoning_effort as kiln's think: none turns thinking off, an effort turns it on
_EFFORTS = {"none": False, "minimal": "low", "low": "low", "medium": "medium", "high": "high"}

_ERRORS = {400: {"description": "Invalid request (OpenAI error object naming `param`)"},
           401: {"description": "Missing or wrong API key"},
           404: {"description": "Unknown model"},
           503: {"description": "Queue full, or the model is being unloaded"}}


# --- request models --------------------------------------------------------------------------------
class _Model(BaseModel):
    # clients send fields kiln has no use for (user, metadata, store); "NaN" in a string reads as a float too
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class ContentPart(_Model):
    type: str = Field(description="only 'text' parts are supported: kiln runs text models")
    text: str | None = None


class FunctionCall(_Model):
    name: str
    arguments: str | dict = Field(description="JSON text (OpenAI) or an object")


class ToolCallIn(_Model):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = Field(None, description="an assistant turn's reasoning (llama-server, "
                                                            "DeepSeek); the template decides whether it is rendered")


class FunctionDef(_Model):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="JSON schema of the arguments")


class Tool(_Model):
    type: Literal["function"] = "function"
    function: FunctionDef


class FunctionName(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"] = "function"
    function: FunctionName


class JSONSchemaFormat(_Model):
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None
    object_schema: dict[str, Any] | None = Field(None, alias="schema", description="llama-server's form: with "
                                                 "type json_object, the JSON schema the output must match")

    def format(self) -> str | dict | None:
        """kiln's `format`: None (text), ANY_JSON, or the schema."""
        if self.object_schema is not None and self.type != "json_object":
            raise RequestError(f"response_format.schema goes with the type json_object (got {self.type!r}); "
                               "json_schema takes its schema in response_format.json_schema.schema",
                               "response_format.schema")
        if self.type == "json_schema" and self.json_schema is None:
            raise RequestError("response_format.json_schema is required when the type is json_schema",
                               "response_format.json_schema")
        if self.type == "text":
            return None
        if self.type == "json_object":
            return ANY_JSON if self.object_schema is None else self.object_schema
        return self.json_schema.json_schema if self.json_schema.json_schema is not None else ANY_JSON


class StreamOptions(_Model):
    include_usage: bool = False


class Speculative(_Model):
    mode: Literal["none", "lookup", "model"] | None = Field(
        None, description="none, lookup (draft by prompt lookup) or model (the server's --draft-model)")
    max: int | None = Field(None, ge=1, le=MAX_DRAFT, description="most draft tokens per pass")
    ngram: int | None = Field(None, ge=1, le=MAX_NGRAM, description="longest n-gram prompt lookup matches")


class _Sampling(_Model):
    model: str = Field(description="an installed model tag, e.g. smollm2:135m")
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, description="llama-server extension")
    min_p: float | None = Field(None, ge=0, le=1, description="llama-server extension")
    repeat_penalty: float | None = Field(None, gt=0, description="llama-server extension")
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    seed: int | None = Field(None, description="a negative seed means random, as in Ollama")
    stop: str | list[str] | None = None
    n: int = Field(1, description="kiln generates one choice per request")
    logit_bias: dict[str, float] | None = Field(None, description="token id -> bias in [-100, 100], added to "
                                                                  "its logit before sampling")
    speculative: Speculative | None = Field(None, description="kiln extension: speculative decoding; omitted "
                                                              "fields take the server's defaults")

    def request_fields(self) -> dict:
        """The kiln request fields every endpoint shares."""
        if self.n != 1:
            raise RequestError(f"n must be 1: kiln generates one choice per request (got {self.n})", "n")
        sampling = {k: getattr(self, k) for k in ("temperature", "top_p", "top_k", "min_p", "repeat_penalty",
                                                  "presence_penalty", "frequency_penalty")}
        sampling["seed"] = self.seed if self.seed is not None and self.seed >= 0 else None
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        speculative = self.speculative.model_dump(exclude_none=True) if self.speculative else {}
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            if not key.lstrip("-").isdigit() or not -100 <= value <= 100:
                raise RequestError(f"logit_bias maps token ids to biases in [-100, 100]; got {key!r}: {value}",
                                   "logit_bias")
            bias[int(key)] = value
        return {"sampling": sampling, "stop": stop, "speculative": speculative, "logit_bias": bias or None}


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = Field(None, description="accepted; a grammar-forced call is always one call")
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = Field(
        None, description="thinking models: none turns thinking off, an effort turns it on (passed to the "
                          "template where it takes one); the reasoning comes back as reasoning_content")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="llama-server extension: more variables "
                                                                          "for the chat template (enable_thinking, ...)")


class CompletionRequest(_Sampling):
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)] | Annotated[list[int], Field(min_length=1)]
    max_tokens: int | None = Field(None, ge=0)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = Field(None, description="text after the cursor: fill in the middle between the prompt and this "
                                                 "(models with fill-in-the-middle tokens); empty: none")


# --- endpoints -----------------------------------------------------------------------------------------
@router.post("/chat/completions", responses=_ERRORS, summary="Chat completion (SSE when stream is true)")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    messages = [chat_message(i, m) for i, m in enumerate(body.messages)]
    fmt = body.response_format
    if body.top_logprobs is not None and not body.logprobs:
        raise RequestError("top_logprobs needs logprobs set to true", "top_logprobs")
    completion = body.max_completion_tokens is not None
    job = Job("openai", body.model, GenerationRequest(
        **body.request_fields(), messages=messages,
        max_tokens=body.max_completion_tokens if completion else body.max_tokens,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        tools=[t.model_dump() for t in body.tools] if body.tools else None,
        tool_choice=_tool_choice(body.tool_choice),
        think=None if body.reasoning_effort is None else _EFFORTS[body.reasoning_effort],
        template_variables=dict(body.chat_template_kwargs or {}),
        format=None if fmt is None else fmt.format()))
    names = {**FIELDS, "max_tokens": "max_completion_tokens"} if completion else FIELDS
    with fields_named(names):
        generation = await start(_runtime(request), job)
    meta = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": generation.loaded.tag,
            "system_fingerprint": _fingerprint()}
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return _sse(_chat_chunks(generation.events(request), meta, include_usage))
    logprobs, final = await generation.collect(request)
    _raise_engine_error(final)
    message: dict = {"role": "assistant", "content": final.text if final.text or not final.tool_calls else None}
    if final.thinking:
        message["reasoning_content"] = final.thinking
    if final.tool_calls:
        message["tool_calls"] = [_tool_call(c) for c in final.tool_calls]
    choice = {"index": 0, "message": message, "finish_reason": final.finish_reason,
              "logprobs": {"content": [_chat_logprob(r) for r in logprobs]} if job.request.logprobs is not None else None}
    if final.tool_error:
        choice["tool_call_error"] = final.tool_error
    return {**meta, "object": "chat.completion", "choices": [choice], "usage": usage(final), "timings": timings(final)}


@router.post("/completions", responses=_ERRORS, summary="Text completion (SSE when stream is true)")
async def completions(body: CompletionRequest, request: Request):
    prompt = body.prompt[0] if isinstance(body.prompt, list) and isinstance(body.prompt[0], str) else body.prompt
    if body.suffix and not isinstance(prompt, str):
        raise RequestError("suffix: a fill-in-the-middle prompt is text, not token ids", "suffix")
    job = Job("openai", body.model, GenerationRequest(**body.request_fields(), prompt=prompt, raw=True,
                                                      max_tokens=body.max_tokens, logprobs=body.logprobs,
                                                      infill=Infill(prompt, body.suffix) if body.suffix else None))
    with fields_named(FIELDS):
        generation = await start(_runtime(request), job)
    meta = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": generation.loaded.tag,
            "system_fingerprint": _fingerprint()}
    echo = generation.seq.tokenizer.decode(generation.seq.prompt_ids) if body.echo else ""
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return _sse(_completion_chunks(generation.events(request), meta, include_usage, echo, job.request.logprobs is not None))
    logprobs, final = await generation.collect(request)
    _raise_engine_error(final)
    choice = {"index": 0, "text": echo + final.text, "finish_reason": final.finish_reason,
              "logprobs": _completion_logprobs(logprobs, len(echo)) if job.request.logprobs is not None else None}
    return {**meta, "object": "text_completion", "choices": [choice], "usage": usage(final), "timings": timings(final)}


class EmbeddingRequest(_Model):
    model: str
    input: str | list[str] | list[int] | list[list[int]] = Field(
        description="a text, a list of texts, token ids, or a list of token id lists")
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, description="keep the first N dimensions (then normalized again)")


@router.post("/embeddings", responses=_ERRORS, summary="Embeddings: each input's last final hidden state, normalized")
async def embeddings(body: EmbeddingRequest, request: Request):
    import base64

    raw = body.input
    inputs = [raw] if isinstance(raw, str) or (raw and isinstance(raw[0], int)) else list(raw)
    if not inputs:
        raise RequestError("input is empty", "input")
    result = await embed_inputs(_runtime(request), "openai", body.model, inputs, param="input", http_request=request)
    data = []
    for i, v in enumerate(unit_vectors(result.vectors, body.dimensions)):
        vector = base64.b64encode(v.astype("<f4").tobytes()).decode() if body.encoding_format == "base64" else v.tolist()
        data.append({"object": "embedding", "index": i, "embedding": vector})
    return {"object": "list", "data": data, "model": result.tag,
            "usage": {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens}}


@router.get("/models", responses={401: _ERRORS[401]}, summary="Installed models")
async def list_models(request: Request):
    runtime = _runtime(request)
    records = await runtime.installed()
    return {"object": "list", "data": [_model_entry(r) for r in records]}


@router.get("/models/{model:path}", responses={401: _ERRORS[401], 404: _ERRORS[404]}, summary="One installed model")
async def get_model(model: str, request: Request):
    for record in await _runtime(request).installed():
        if record.tag == model:
            return _model_entry(record)
    raise ModelNotFoundError(f"model {model!r} not found")


# --- translation ---------------------------------------------------------------------------------------
def _runtime(request: Request) -> Runtime:
    return request.app.state.runtime


def _model_entry(record) -> dict:
    created = int(record.path.stat().st_mtime) if record.path.exists() else 0
    return {"id": record.tag, "object": "model", "created": created, "owned_by": "kiln"}


def _fingerprint() -> str:
    return f"kiln-{__version__}"


def chat_message(index: int, m: ChatMessage) -> dict:
    content = m.content
    if isinstance(content, list):
        for j, part in enumerate(content):
            if part.type != "text" or part.text is None:
                param = f"messages[{index}].content[{j}]"
                raise RequestError(f"{param}: only text parts are supported (got {part.type!r}); kiln runs text models",
                                   param)
        content = "".join(part.text for part in content)
    out: dict = {"role": "system" if m.role == "developer" else m.role, "content": content}
    if m.name:
        out["name"] = m.name
    if m.tool_calls:
        out["tool_calls"] = [c.model_dump() for c in m.tool_calls]
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    if m.reasoning_content:
        out["reasoning_content"] = m.reasoning_content
    return out


def _tool_choice(choice):
    if choice is None:
        return "auto"
    return choice.model_dump() if isinstance(choice, NamedToolChoice) else choice


def _tool_call(call, index: int | None = None) -> dict:
    out = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}
    return out if index is None else {"index": index, **out}


def _raise_engine_error(final: Final) -> None:
    if final.error:
        raise KilnError(final.error)


def usage(final: Final) -> dict:
    t = final.timings
    return {"prompt_tokens": t.prompt_tokens, "completion_tokens": t.completion_tokens,
            "total_tokens": t.prompt_tokens + t.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": t.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": final.reasoning_tokens}}


def timings(final: Final) -> dict:
    """llama-server's timing names, then kiln's own. `predicted_per_second` counts the tokens after the
    first, which comes out of the prefill."""
    t = final.timings
    computed = t.prompt_tokens - t.cached_tokens
    steps = max(t.completion_tokens - 1, 0)
    return {"cache_n": t.cached_tokens, "prompt_n": computed, "prompt_ms": round(t.prefill_ms, 3),
            "prompt_per_token_ms": round(t.prefill_ms / computed, 3) if computed else 0.0,
            "prompt_per_second": round(t.prefill_tps, 2), "predicted_n": t.completion_tokens,
            "predicted_ms": round(t.decode_ms, 3),
            "predicted_per_token_ms": round(t.decode_ms / steps, 3) if steps else 0.0,
            "predicted_per_second": round(t.decode_tps, 2), "draft_n": t.draft_tokens,
            "draft_n_accepted": t.draft_accepted, **t.as_dict()}


def _chat_logprob(record: dict) -> dict:
    def entry(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {**entry(record["token"], record["logprob"]), "top_logprobs": [entry(a["token"], a["logprob"]) for a in record["top"]]}


def _completion_logprobs(records: list[dict], offset: int) -> dict:
    offsets = []
    for r in records:
        offsets.append(offset)
        offset += len(r["token"])
    return {"tokens": [r["token"] for r in records], "token_logprobs": [r["logprob"] for r in records],
            "top_logprobs": [{a["token"]: a["logprob"] for a in r["top"]} for r in records], "text_offset": offsets}


def _sse(chunks) -> StreamingResponse:
    async def lines():
        async for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(lines(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _stream_error(final: Final) -> dict:
    return {"error": {"message": final.error, "type": "server_error", "param": None, "code": None}}


async def _chat_chunks(events, meta: dict, include_usage: bool):
    def chunk(delta: dict, finish_reason=None, **extra) -> dict:
        return {**meta, "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, **extra}]}

    yield chunk({"role": "assistant", "content": ""})
    n_calls = 0
    async for event in events:
        if isinstance(event, Delta):
            delta: dict = {"content": event.text} if event.text else {}
            if event.thinking:
                delta["reasoning_content"] = event.thinking
            if event.tool_calls:
                delta["tool_calls"] = [_tool_call(c, n_calls + i) for i, c in enumerate(event.tool_calls)]
                n_calls += len(event.tool_calls)
            logprobs = {"content": [_chat_logprob(r) for r in event.logprobs]} if event.logprobs else None
            yield chunk(delta, logprobs=logprobs)
            continue
        if event.error:
            yield _stream_error(event)
            return
        extra = {"tool_call_error": event.tool_error} if event.tool_error else {}
        yield {**chunk({}, event.finish_reason, **extra), "timings": timings(event)}
        if include_usage:
            yield {**meta, "object": "chat.completion.chunk", "choices": [], "usage": usage(event), "timings": timings(event)}


async def _completion_chunks(events, meta: dict, include_usage: bool, echo: str, logprobs: bool):
    def chunk(text: str, finish_reason=None, records=()) -> dict:
        return {**meta, "object": "text_completion",
                "choices": [{"index": 0, "text": text, "finish_reason": finish_reason,
                             "logprobs": _completion_logprobs(list(records), offset) if logprobs and records else None}]}

    offset = 0
    if echo:
        yield chunk(echo)
        offset = len(echo)
    async for event in events:
        if isinstance(event, Delta):
            yield chunk(event.text, records=event.logprobs)
            offset += sum(len(r["token"]) for r in event.logprobs)
            continue
        if event.error:
            yield _stream_error(event)
            return
        yield {**chunk("", event.finish_reason), "timings": timings(event)}
        if include_usage:
            yield {**meta, "object": "text_completion", "choices": [], "usage": usage(event), "timings": timings(event)}
