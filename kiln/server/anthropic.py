"""Anthropic's Messages API (/v1/messages): messages and count_tokens, translated to and from
`generation.Job` (kiln's request fields as Anthropic names them: FIELDS).

A field Anthropic defines that kiln does not implement (thinking, images, documents, server tools,
service tiers, ...) is a 400 naming it. Two are accepted because they change no output: `metadata`
(Anthropic's user id for abuse reports) and `cache_control` (a prompt-cache breakpoint: kiln reuses
the longest cached prefix of every prompt without being asked). Usage reports the tokens read from
kiln's prompt cache as `cache_read_input_tokens`; `input_tokens` counts the rest, as Anthropic does.
Errors leave as `{"type": "error", "error": {"type", "message"}}` (app.py calls `error_response`).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from kiln.engine.request import GenerationRequest, prompt_ids
from kiln.errors import KilnError, RequestError, fields_named
from kiln.server.generation import Delta, Final, Job, borrowed, start
from kiln.server.runtime import Runtime

router = APIRouter(prefix="/v1/messages", tags=["Anthropic"])
FIELDS = {"stop": "stop_sequences", "format": "output_format"}  # kiln's request fields that Anthropic names otherwise
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 529: "overloaded_error"}
_ERRORS = {400: {"description": "Invalid request: {type: error, error: {type: invalid_request_error, message}}"},
           401: {"description": "Missing or wrong API key (x-api-key or Authorization: Bearer)"},
           404: {"description": "Unknown model (not_found_error)"},
           529: {"description": "Queue full, or the model is being unloaded (overloaded_error)"}}
_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}  # any other finish ends the turn


def error_response(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    """An error in Anthropic's shape. Its "server busy" is 529 overloaded_error, where kiln's other APIs say 503."""
    status = 529 if status == 503 else status
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return JSONResponse({"type": "error", "error": {"type": kind, "message": message}}, status_code=status,
                        headers=headers)


# --- request models --------------------------------------------------------------------------------
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a field kiln does not implement is an error naming it


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = Field(None, description="accepted: kiln caches every prompt's prefix")


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False
    cache_control: dict[str, Any] | None = None


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: list[Block] | str  # the blocks first: a bad block's error names its type


class ToolDef(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any] = Field(description="JSON schema of the tool's input")
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(None, description="the tool to call, with type 'tool'")
    disable_parallel_tool_use: bool | None = Field(None, description="with any or tool kiln forces exactly one call")


class Metadata(_Strict):
    user_id: str | None = Field(None, description="accepted and unused: Anthropic's id for abuse reports")


class CountTokensRequest(_Strict):
    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None

    def request(self) -> GenerationRequest:
        tool_choice = _tool_choice(self.tool_choice, self.tools)
        return GenerationRequest(messages=_messages(self.system, self.messages),
                                 tools=[_tool(t) for t in self.tools] if self.tools else None, tool_choice=tool_choice)


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1, description="required, as Anthropic requires it")
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    metadata: Metadata | None = None
    cache_control: dict[str, Any] | None = Field(None, description="accepted: kiln caches every prompt's prefix")

    def request(self) -> GenerationRequest:
        request = super().request()
        request.sampling = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}
        request.max_tokens = self.max_tokens
        request.stop = list(self.stop_sequences or [])
        return request


# --- endpoints -----------------------------------------------------------------------------------------
@router.post("", responses=_ERRORS, summary="Anthropic Messages (SSE events when stream is true)")
async def messages(body: MessagesRequest, request: Request):
    job = Job("anthropic", body.model, body.request())
    with fields_named(FIELDS):
        generation = await start(_runtime(request), job)
    meta = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": generation.loaded.tag}
    if body.stream:
        return _sse(_stream(generation, request, meta, job.request.stop))
    _, final = await generation.collect(request)
    if final.error:
        raise KilnError(final.error)
    content = [{"type": "text", "text": final.text}] if final.text else []  # as the stream: no text, no block
    content += [_tool_use(c) for c in final.tool_calls]
    return {**meta, "content": content, **_stop(final, job.request.stop), "usage": _usage(final.timings)}


@router.post("/count_tokens", responses=_ERRORS, summary="The input tokens a Messages request would take")
async def count_tokens(body: CountTokensRequest, request: Request):
    async with borrowed(_runtime(request), body.model) as loaded:
        with fields_named(FIELDS):
            ids = await asyncio.to_thread(prompt_ids, loaded.model, body.request())
    return {"input_tokens": len(ids)}


# --- translation ---------------------------------------------------------------------------------------
def _runtime(request: Request) -> Runtime:
    return request.app.state.runtime


def _text(blocks: str | list[TextBlock]) -> str:
    return blocks if isinstance(blocks, str) else "".join(b.text for b in blocks)


def _messages(system: str | list[TextBlock] | None, messages: list[Message]) -> list[dict]:
    """Anthropic's turns as kiln's chat: tool_use blocks become the assistant's tool calls, each
    tool_result a tool message, text blocks the turn's content."""
    chat = [{"role": "system", "content": _text(system)}] if system else []
    for i, m in enumerate(messages):
        if isinstance(m.content, str):
            chat.append({"role": m.role, "content": m.content})
            continue
        text, calls = [], []
        for j, block in enumerate(m.content):
            where = f"messages[{i}].content[{j}]"
            if isinstance(block, TextBlock):
                text.append(block.text)
            elif m.role == "assistant" and isinstance(block, ToolUseBlock):
                calls.append({"id": block.id, "type": "function",
                              "function": {"name": block.name, "arguments": block.input}})
            elif m.role == "user" and isinstance(block, ToolResultBlock):
                if text:  # text before a result is a turn of its own
                    chat.append({"role": "user", "content": "".join(text)})
                    text = []
                result = _text(block.content)
                chat.append({"role": "tool", "tool_call_id": block.tool_use_id,
                             "content": f"error: {result}" if block.is_error else result})
            else:
                raise RequestError(f"{where}: a {block.type} block belongs in a "
                                   f"{'user' if m.role == 'assistant' else 'assistant'} message", where)
        if text or calls:
            out: dict = {"role": m.role, "content": "".join(text)}
            if calls:
                out["tool_calls"] = calls
            chat.append(out)
    if messages[-1].role == "assistant":
        last = f"messages[{len(messages) - 1}]"
        raise RequestError(f"{last}: the last message must be the user's; kiln does not continue a prefilled "
                           "assistant turn", last)
    return chat


def _tool(t: ToolDef) -> dict:
    return {"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.input_schema}}


def _tool_choice(choice: ToolChoice | None, tools: list[ToolDef] | None) -> str | dict:
    if choice is None or choice.type == "auto":
        if choice is not None and choice.disable_parallel_tool_use:
            raise RequestError("tool_choice.disable_parallel_tool_use: kiln keeps a single call only when one is "
                               "forced (type any or tool)", "tool_choice.disable_parallel_tool_use")
        return "auto"
    if choice.type == "tool":
        if not choice.name:
            raise RequestError("tool_choice.name is required when the type is tool", "tool_choice.name")
        return {"type": "function", "function": {"name": choice.name}}
    if choice.name is not None:
        raise RequestError(f"tool_choice.name goes with the type tool (got {choice.type!r})", "tool_choice.name")
    if choice.type == "any" and not tools:
        raise RequestError("tool_choice is 'any' but the request has no tools", "tool_choice")
    return "required" if choice.type == "any" else "none"


def _tool_use(call) -> dict:
    return {"type": "tool_use", "id": f"toolu_{call.id}", "name": call.name, "input": call.arguments}


def _stop(final: Final, stop_sequences: list[str]) -> dict:
    matched = final.seq.stop_string if final.seq.stop_string in stop_sequences else None
    reason = "stop_sequence" if matched is not None else _STOP_REASONS.get(final.finish_reason, "end_turn")
    return {"stop_reason": reason, "stop_sequence": matched}


def _usage(t) -> dict:
    return {"input_tokens": t.prompt_tokens - t.cached_tokens, "output_tokens": t.completion_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": t.cached_tokens}


def _sse(events) -> StreamingResponse:
    async def lines():
        async for event in events:
            yield f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"

    return StreamingResponse(lines(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _stream(generation, http_request, meta: dict, stop_sequences: list[str]):
    """Anthropic's event sequence: message_start, ping, then per content block start → deltas → stop,
    then message_delta (stop reason and usage) and message_stop. message_start waits for the first
    event, by which time the prompt cache has been looked up, so its usage is already true."""
    events = aiter(generation.events(http_request))
    first = await anext(events)
    yield {"type": "message_start", "message": {**meta, "content": [], "stop_reason": None, "stop_sequence": None,
                                                "usage": _usage(generation.seq.timings)}}
    yield {"type": "ping"}
    index, text_open = 0, False

    async def pending():
        yield first
        async for event in events:
            yield event

    async for event in pending():
        if isinstance(event, Delta):
            if event.text:
                if not text_open:
                    yield {"type": "content_block_start", "index": index, "content_block": {"type": "text", "text": ""}}
                    text_open = True
                yield {"type": "content_block_delta", "index": index, "delta": {"type": "text_delta", "text": event.text}}
            for call in event.tool_calls:
                if text_open:
                    yield {"type": "content_block_stop", "index": index}
                    index, text_open = index + 1, False
                yield {"type": "content_block_start", "index": index,
                       "content_block": {**_tool_use(call), "input": {}}}
                yield {"type": "content_block_delta", "index": index,
                       "delta": {"type": "input_json_delta", "partial_json": json.dumps(call.arguments)}}
                yield {"type": "content_block_stop", "index": index}
                index += 1
            continue
        if event.error:
            yield {"type": "error", "error": {"type": "api_error", "message": event.error}}
            return
        if text_open:
            yield {"type": "content_block_stop", "index": index}
        yield {"type": "message_delta", "delta": _stop(event, stop_sequences), "usage": _usage(event.timings)}
        yield {"type": "message_stop"}
        return
