"""Tool calling: tools into the prompt, tool calls out of the model's text.

A chat template that knows about tools (it uses the `tools` variable) renders them itself. For one that
does not, kiln describes the tools in a system message and asks for calls written as
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (the Hermes/Qwen convention many small models
learned); history in the same shape (assistant tool calls, tool results) is rewritten into text.

Calls are parsed back out of the output as it streams: text that may open a `<tool_call>` is held back
until it is clear, and a call is emitted once its closing tag arrives. A call that is not valid JSON, or
names no offered tool, is reported (`ToolCallParser.errors`), never passed on as a call.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field

from kiln.engine.grammar import tagged_json_grammar
from kiln.errors import RequestError
from kiln.thinking import ReasoningParser, partial_marker

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass
class ToolCall:
    name: str
    arguments: dict
    id: str = field(default_factory=lambda: f"call_{secrets.token_hex(12)}")


@dataclass
class Reasoning:
    """Reasoning text, as the output parser releases it."""

    text: str


def template_supports_tools(template: str) -> bool:
    return re.search(r"\btools\b", template) is not None


def tool_names(tools: list[dict]) -> list[str]:
    return [t["function"]["name"] for t in tools]


def render_messages(messages: list[dict], tools: list[dict] | None, template: str,
                    tool_choice: str | dict = "auto") -> tuple[list[dict], list[dict] | None]:
    """The messages and the `tools` variable to render `template` with."""
    # OpenAI allows `content: null` (an assistant turn that only calls tools); templates concatenate it.
    messages = [{**_with_argument_objects(i, m), "content": _text(m.get("content"))} for i, m in enumerate(messages)]
    if template_supports_tools(template):
        return messages, tools or None
    out: list[dict] = []
    for m in messages:
        if m.get("role") == "assistant" and m.get("tool_calls"):
            calls = "\n".join(OPEN + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})
                              + CLOSE for c in m["tool_calls"])
            text = m["content"]
            out.append({"role": "assistant", "content": f"{text}\n{calls}" if text else calls})
        elif m.get("role") == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        else:
            out.append(m)
    if tools:
        instructions = describe_tools(tools, tool_choice)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{instructions}"}
        else:
            out.insert(0, {"role": "system", "content": instructions})
    return out, None


def describe_tools(tools: list[dict], tool_choice: str | dict = "auto") -> str:
    listing = "\n".join(json.dumps(t["function"]) for t in tools)
    if isinstance(tool_choice, dict):
        rule = f"You must call the tool {tool_choice['function']['name']}."
    elif tool_choice == "required":
        rule = "You must call one of the tools."
    else:
        rule = "Call a tool when it helps answer; otherwise answer normally."
    return (f"You can call these tools:\n<tools>\n{listing}\n</tools>\n{rule} To call a tool, write exactly\n"
            f'{OPEN}{{"name": "<tool name>", "arguments": {{<arguments as JSON>}}}}{CLOSE}')


def forced_call_grammar(tools: list[dict], tool_choice: str | dict) -> str:
    """One call, of the named tool or any tool (`required`), with arguments valid for its schema."""
    name = tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None
    variants = [
        {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
         "properties": {"name": {"const": t["function"]["name"]},
                        "arguments": t["function"].get("parameters") or {"type": "object"}}}
        for t in tools if name is None or t["function"]["name"] == name
    ]
    return tagged_json_grammar(OPEN, variants[0] if len(variants) == 1 else {"anyOf": variants}, CLOSE)


def check_tool_choice(tools: list[dict] | None, tool_choice: str | dict) -> None:
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        if name not in tool_names(tools or []):
            raise RequestError(f"tool_choice names the function {name!r}, which is not among the tools", "tool_choice")
    elif tool_choice == "required" and not tools:
        raise RequestError("tool_choice is 'required' but the request has no tools", "tool_choice")


class ToolCallParser:
    def __init__(self, names: list[str]):
        self.names = set(names)
        self.errors: list[str] = []
        self._buffer = ""
        self._in_call = False
        self._started = False  # any non-space output seen; a bare JSON call must open the answer
        self._bare = False  # the answer opened with "{": held whole, it may be a call without tags

    def feed(self, text: str) -> list[str | ToolCall]:
        self._buffer += text
        if not self._started and self._buffer.strip():
            self._started = True
            self._bare = self._buffer.lstrip().startswith("{")
        return [] if self._bare else self._drain(final=False)

    def close(self) -> list[str | ToolCall]:
        """Everything still held, at the end of the output."""
        if self._bare:
            call = self._call(self._buffer, report=False)
            items: list[str | ToolCall] = [call] if call else [self._buffer]
        else:
            items = self._drain(final=True)
            if self._in_call:  # a call the model never closed (it stopped, or ran out of tokens)
                items.append(self._call(self._buffer, report=True) or OPEN + self._buffer)
        self._buffer = ""
        return [i for i in items if i]

    def _drain(self, final: bool) -> list[str | ToolCall]:
        items: list[str | ToolCall] = []
        while True:
            if self._in_call:
                at = self._buffer.find(CLOSE)
                if at == -1:
                    return items
                body, self._buffer, self._in_call = self._buffer[:at], self._buffer[at + len(CLOSE):], False
                items.append(self._call(body, report=True) or OPEN + body + CLOSE)
                continue
            at = self._buffer.find(OPEN)
            if at != -1:
                items.append(self._buffer[:at])
                self._buffer, self._in_call = self._buffer[at + len(OPEN):], True
                continue
            keep = 0 if final else partial_marker(self._buffer, OPEN)
            items.append(self._buffer[: len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep:]
            return items

    def _call(self, body: str, report: bool) -> ToolCall | None:
        problem, call = _parse_call(body, self.names)
        if problem and report:
            self.errors.append(problem)
        return call


def _parse_call(body: str, names: set[str]) -> tuple[str | None, ToolCall | None]:
    try:
        data = json.loads(body)
    except ValueError as e:
        return f"the model's tool call is not valid JSON ({e}): {body.strip()!r}", None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return f"the model's tool call has no \"name\": {body.strip()!r}", None
    if data["name"] not in names:
        return f"the model called {data['name']!r}, which is not among the tools", None
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    if not isinstance(arguments, dict):
        return f"the model's call of {data['name']!r} has arguments that are not a JSON object: {body.strip()!r}", None
    return None, ToolCall(data["name"], arguments)


def _text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict) and part.get("type") == "text")


def _with_argument_objects(index: int, message: dict) -> dict:
    """OpenAI sends a call's arguments as a JSON string; templates (and kiln's own text form) want objects."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    fixed = []
    for j, call in enumerate(calls):
        function = dict(call.get("function") or {})
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                function["arguments"] = json.loads(arguments) if arguments.strip() else {}
            except ValueError as e:
                param = f"messages[{index}].tool_calls[{j}].function.arguments"
                raise RequestError(f"{param} is not valid JSON ({e})", param) from None
        fixed.append({**call, "function": function})
    return {**message, "tool_calls": fixed}


class OutputParser:
    """A reply split once as it streams: its reasoning (when the template thinks), then content and tool
    calls, which are parsed only outside the reasoning."""

    def __init__(self, reasoning: ReasoningParser | None, calls: ToolCallParser | None):
        self.reasoning, self.calls = reasoning, calls

    @property
    def errors(self) -> list[str]:
        return self.calls.errors if self.calls else []

    @property
    def in_reasoning(self) -> bool:
        return self.reasoning is not None and self.reasoning.in_reasoning

    def feed(self, text: str) -> list[str | ToolCall | Reasoning]:
        return self._split(*(self.reasoning.feed(text) if self.reasoning else ("", text)), final=False)

    def close(self) -> list[str | ToolCall | Reasoning]:
        return self._split(*(self.reasoning.close() if self.reasoning else ("", "")), final=True)

    def _split(self, reasoning: str, content: str, final: bool) -> list[str | ToolCall | Reasoning]:
        items: list[str | ToolCall | Reasoning] = [Reasoning(reasoning)] if reasoning else []
        if self.calls is None:
            return items + ([content] if content else [])
        items += self.calls.feed(content) if content else []
        return items + (self.calls.close() if final else [])
