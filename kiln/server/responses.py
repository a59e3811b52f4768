"""OpenAI's Responses API (POST /v1/responses): text and message input, instructions, function tools and
their outputs, JSON output, streaming as typed events. Stateless: kiln keeps no responses, so
`previous_response_id` is refused (send the conversation as `input`); the prompt cache still reuses
the history a client resends."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from kiln.engine.request import ANY_JSON, GenerationRequest
from kiln.errors import RequestError, fields_named
from kiln.server.openai import _EFFORTS, _ERRORS, _raise_engine_error, _runtime, timings
from kiln.server.generation import Delta, Final, Job, start

router = APIRouter(prefix="/v1", tags=["OpenAI"])
FIELDS = {"messages": "input", "max_tokens": "max_output_tokens", "format": "text.format",
          "think": "reasoning.effort"}  # kiln's fields, as named here


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True, allow_inf_nan=False)


class TextPart(_Model):
    type: Literal["input_text", "output_text", "text"]
    text: str


class InputMessage(_Model):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart]


class FunctionCallItem(_Model):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str = Field(description="JSON text")


class FunctionCallOutput(_Model):
    type: Literal["function_call_output"]
    call_id: str
    output: str


class ReasoningText(_Model):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningInput(_Model):
    """A reasoning item of an earlier response, resent with the conversation: the next assistant turn's
    reasoning, rendered as the model's template wants (most drop it)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None


class FunctionTool(_Model):
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="JSON schema of the arguments")
    strict: bool | None = None


class NamedFunction(_Model):
    type: Literal["function"]
    name: str


class TextFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(_Model):
    format: TextFormat | None = None


class ReasoningConfig(_Model):
    effort: Literal["none", "minimal", "low", "medium", "high"] | None = Field(
        None, description="thinking models: none turns thinking off, an effort turns it on")
    summary: str | None = Field(None, description="accepted; the reasoning item carries the whole reasoning text")


class ResponseRequest(_Model):
    model: str = Field(description="an installed model tag, e.g. smollm2:135m")
    input: str | list[InputMessage | FunctionCallItem | FunctionCallOutput | ReasoningInput] = Field(
        description="a text, or message, function_call, function_call_output and reasoning items")
    instructions: str | None = Field(None, description="a system message put before the input")
    max_output_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    previous_response_id: str | None = Field(None, description="not supported: kiln keeps no responses")
    reasoning: ReasoningConfig | None = None


def _messages(body: ResponseRequest) -> list[dict]:
    """The chat the request describes, in the form the chat template renders."""
    out: list[dict] = [{"role": "system", "content": body.instructions}] if body.instructions else []
    if isinstance(body.input, str):
        return out + [{"role": "user", "content": body.input}]
    reasoning = ""  # a reasoning item's text, for the assistant turn that follows it
    for i, item in enumerate(body.input):
        if isinstance(item, ReasoningInput):
            reasoning += "".join(p.text for p in item.content or item.summary)
            continue
        if isinstance(item, InputMessage):
            text = item.content if isinstance(item.content, str) else "".join(p.text for p in item.content)
            out.append({"role": "system" if item.role == "developer" else item.role, "content": text})
        elif isinstance(item, FunctionCallItem):
            try:
                arguments = json.loads(item.arguments)
            except ValueError:
                raise RequestError(f"input[{i}].arguments is not JSON", f"input[{i}].arguments") from None
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": arguments}}
            if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:  # calls of one turn
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        else:
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        if reasoning and out[-1]["role"] == "assistant":
            out[-1]["reasoning_content"], reasoning = reasoning, ""
    if not out:
        raise RequestError("input is empty", "input")
    return out


def _job(body: ResponseRequest) -> Job:
    if body.previous_response_id:
        raise RequestError("previous_response_id is not supported: kiln keeps no responses; send the "
                           "conversation so far as input items", "previous_response_id")
    fmt = body.text.format if body.text else None
    if fmt is not None and fmt.type == "json_schema" and fmt.json_schema is None:
        raise RequestError("text.format.schema is required when the type is json_schema", "text.format.schema")
    choice = body.tool_choice
    tools = [{"type": "function", "function": t.model_dump(include={"name", "description", "parameters"})}
             for t in body.tools or []]
    return Job("openai", body.model, GenerationRequest(
        messages=_messages(body), sampling={"temperature": body.temperature, "top_p": body.top_p},
        max_tokens=body.max_output_tokens, tools=tools or None,
        think=_EFFORTS[body.reasoning.effort] if body.reasoning and body.reasoning.effort else None,
        tool_choice={"type": "function", "function": {"name": choice.name}} if isinstance(choice, NamedFunction)
        else choice or "auto",
        format=None if fmt is None or fmt.type == "text" else ANY_JSON if fmt.json_schema is None else fmt.json_schema))


@router.post("/responses", responses=_ERRORS, summary="A model response (typed SSE events when stream is true)")
async def responses(body: ResponseRequest, request: Request):
    job = _job(body)
    with fields_named(FIELDS):
        generation = await start(_runtime(request), job)
    shell = {"id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": int(time.time()),
             "model": generation.loaded.tag, "instructions": body.instructions,
             "max_output_tokens": body.max_output_tokens, "parallel_tool_calls": True,
             "temperature": body.temperature, "top_p": body.top_p,
             "tool_choice": body.tool_choice.model_dump() if isinstance(body.tool_choice, NamedFunction)
             else body.tool_choice or "auto",
             "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
             "text": {"format": body.text.format.model_dump(by_alias=True, exclude_none=True)
                      if body.text and body.text.format else {"type": "text"}},
             "error": None, "incomplete_details": None, "metadata": {}}
    if body.stream:
        return _events(_stream(generation.events(request), shell))
    _, final = await generation.collect(request)
    _raise_engine_error(final)
    message_id = f"msg_{uuid.uuid4().hex}"
    return _finished(shell, final, _output(final, message_id))


def _output(final: Final, message_id: str) -> list[dict]:
    items = [_reasoning_item(f"rs_{uuid.uuid4().hex}", final.thinking, "completed")] if final.thinking else []
    if final.text or not final.tool_calls:
        items.append(_message_item(message_id, final.text, _message_status(final)))
    items += [_call_item(c, "completed") for c in final.tool_calls]
    return items


def _message_status(final: Final) -> str:
    """A message cut by max_output_tokens is incomplete, as the response that holds it is."""
    return "incomplete" if final.finish_reason == "length" else "completed"


def _message_item(item_id: str, text: str | None, status: str) -> dict:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": []}]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _reasoning_item(item_id: str, text: str | None, status: str) -> dict:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": item_id, "status": status, "summary": [], "content": content}


def _call_item(call, status: str) -> dict:
    return {"type": "function_call", "id": f"fc_{call.id}", "call_id": call.id, "name": call.name,
            "arguments": json.dumps(call.arguments), "status": status}


def _finished(shell: dict, final: Final, output: list[dict]) -> dict:
    t = final.timings
    incomplete = final.finish_reason == "length"
    return {**shell, "status": "incomplete" if incomplete else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None, "output": output,
            "usage": {"input_tokens": t.prompt_tokens, "input_tokens_details": {"cached_tokens": t.cached_tokens},
                      "output_tokens": t.completion_tokens, "output_tokens_details": {"reasoning_tokens": final.reasoning_tokens},
                      "total_tokens": t.prompt_tokens + t.completion_tokens},
            "timings": timings(final)}


async def _stream(events, shell: dict):
    """The Responses API's event sequence: created, then per output item added → deltas → done, then
    completed, incomplete or failed. Items are numbered in the order they start."""
    yield {"type": "response.created", "response": {**shell, "status": "in_progress", "output": []}}
    yield {"type": "response.in_progress", "response": {**shell, "status": "in_progress", "output": []}}
    message_id, text, message_index, output = f"msg_{uuid.uuid4().hex}", "", None, []
    reasoning_id, reasoning, reasoning_index = f"rs_{uuid.uuid4().hex}", "", None

    def close_reasoning():
        nonlocal reasoning_index
        if reasoning_index is None or output[reasoning_index] is not None:
            return
        output[reasoning_index] = _reasoning_item(reasoning_id, reasoning, "completed")
        yield {"type": "response.reasoning_text.done", "item_id": reasoning_id, "output_index": reasoning_index,
               "content_index": 0, "text": reasoning}
        yield {"type": "response.output_item.done", "output_index": reasoning_index, "item": output[reasoning_index]}

    def open_message():
        yield {"type": "response.output_item.added", "output_index": len(output),
               "item": _message_item(message_id, None, "in_progress")}
        yield {"type": "response.content_part.added", "item_id": message_id, "output_index": len(output),
               "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": []}}
        output.append(None)  # the message's place, filled when it is done

    async for event in events:
        if isinstance(event, Delta):
            if event.thinking:
                if reasoning_index is None:
                    reasoning_index = len(output)
                    output.append(None)  # the reasoning's place, filled when it is done
                    yield {"type": "response.output_item.added", "output_index": reasoning_index,
                           "item": _reasoning_item(reasoning_id, None, "in_progress")}
                reasoning += event.thinking
                yield {"type": "response.reasoning_text.delta", "item_id": reasoning_id,
                       "output_index": reasoning_index, "content_index": 0, "delta": event.thinking}
            if event.text or event.tool_calls:
                for e in close_reasoning():
                    yield e
            if event.text:
                if message_index is None:
                    message_index = len(output)
                    for e in open_message():
                        yield e
                text += event.text
                yield {"type": "response.output_text.delta", "item_id": message_id, "output_index": message_index,
                       "content_index": 0, "delta": event.text, "logprobs": []}
            for call in event.tool_calls:
                item, index = _call_item(call, "completed"), len(output)
                output.append(item)
                yield {"type": "response.output_item.added", "output_index": index,
                       "item": {**item, "arguments": "", "status": "in_progress"}}
                yield {"type": "response.function_call_arguments.delta", "item_id": item["id"], "output_index": index,
                       "delta": item["arguments"]}
                yield {"type": "response.function_call_arguments.done", "item_id": item["id"], "output_index": index,
                       "arguments": item["arguments"]}
                yield {"type": "response.output_item.done", "output_index": index, "item": item}
            continue
        if event.error:
            yield {"type": "response.failed", "response": {**shell, "status": "failed", "output": [],
                                                           "error": {"code": "server_error", "message": event.error}}}
            return
        for e in close_reasoning():
            yield e
        if message_index is None and not any(item["type"] != "reasoning" for item in output):
            # nothing said at all: still one (empty) message
            message_index = len(output)
            for e in open_message():
                yield e
        if message_index is not None:
            part = {"type": "output_text", "text": text, "annotations": []}
            output[message_index] = _message_item(message_id, text, _message_status(event))
            yield {"type": "response.output_text.done", "item_id": message_id, "output_index": message_index,
                   "content_index": 0, "text": text, "logprobs": []}
            yield {"type": "response.content_part.done", "item_id": message_id, "output_index": message_index,
                   "content_index": 0, "part": part}
            yield {"type": "response.output_item.done", "output_index": message_index, "item": output[message_index]}
        done = _finished(shell, event, output)
        yield {"type": "response.incomplete" if done["status"] == "incomplete" else "response.completed",
               "response": done}
        return


def _events(events) -> StreamingResponse:
    async def lines():
        number = 0
        async for event in events:
            yield f"event: {event['type']}\ndata: {json.dumps({**event, 'sequence_number': number})}\n\n"
            number += 1

    return StreamingResponse(lines(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
