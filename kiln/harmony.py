"""gpt-oss's chat format (harmony): a reply is messages on channels, parsed into reasoning, content and tool
calls as it streams.

The template renders the prompt, ending in `<|start|>assistant`; the reply is then a run of messages, each a
header, `<|message|>`, a body and an end: `<|end|>` when another message follows (after `<|start|>` and the
role), or the end of the output (`<|return|>` after the answer and `<|call|>` after a call are stop tokens):

    <|channel|>analysis<|message|>…<|end|>                                   reasoning
    <|start|>assistant<|channel|>final<|message|>…                           content
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{…}   a tool call

The recipient may also stand in the role (`assistant to=functions.NAME<|channel|>commentary json`), as the
template renders earlier calls. A commentary message without one (a preamble the model says before calling)
is content. The tokens that frame messages reach the text because the tokenizer renders them for a harmony
vocabulary (kiln/tokenizer.py, HARMONY_FRAMING).
"""

from __future__ import annotations

import json
import re

import llguidance as llg

from kiln.engine.grammar import JSON_OPTIONS
from kiln.thinking import partial_marker
from kiln.tools import Reasoning, ToolCall

START, CHANNEL, MESSAGE, END = "<|start|>", "<|channel|>", "<|message|>", "<|end|>"
# What ends a message's body: the next message's start when the model left out its <|end|>, and the stop tokens
# should a caller render them.
BODY_ENDS = (END, START, "<|return|>", "<|call|>")

_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


class HarmonyParser:
    """The output parser of a harmony reply (kiln/tools.py's OutputParser, for this format). `keep` False
    discards the reasoning (thinking was turned off; gpt-oss reasons regardless). `names`: the tools offered,
    or None when the request offers none (then a call's text is content, as a tool-call tag is)."""

    def __init__(self, keep: bool = True, names: list[str] | None = None):
        self.keep = keep
        self.names = set(names) if names is not None else None
        self.errors: list[str] = []
        self.reasoning = ""  # all reasoning seen so far
        self._buffer = ""
        self._kind: str | None = None  # None while reading a header; then "reasoning", "content" or "call"
        self._callee = ""
        self._arguments = ""

    def with_tools(self, names: list[str] | None) -> HarmonyParser:
        self.names = set(names) if names is not None else None
        return self

    @property
    def in_reasoning(self) -> bool:
        return self._kind == "reasoning" or (self._kind is None and _channel(self._buffer) == "analysis")

    def feed(self, text: str) -> list[str | ToolCall | Reasoning]:
        self._buffer += text
        return self._drain(final=False)

    def close(self) -> list[str | ToolCall | Reasoning]:
        """Everything still held, at the end of the output."""
        return self._drain(final=True)

    def _drain(self, final: bool) -> list[str | ToolCall | Reasoning]:
        items: list[str | ToolCall | Reasoning] = []
        while True:
            if self._kind is None:
                at = self._buffer.find(MESSAGE)
                if at == -1:
                    if final:
                        # Output outside the format (no framing at all) is the answer; a header the budget cut
                        # off before its body is only framing.
                        if START not in self._buffer and CHANNEL not in self._buffer and self._buffer:
                            items.append(self._buffer)
                        self._buffer = ""
                    return items
                self._begin(self._buffer[:at])
                self._buffer = self._buffer[at + len(MESSAGE):]
                continue
            ends = [(i, m) for m in BODY_ENDS if (i := self._buffer.find(m)) != -1]
            if ends:
                at, marker = min(ends)
                body = self._buffer[:at]
                # the next header reads past its own <|start|>; the other ends are dropped
                self._buffer = self._buffer[at if marker == START else at + len(marker):]
                items += self._body(body, last=True)
                self._kind = None
                continue
            if final:
                body, self._buffer = self._buffer, ""
                items += self._body(body, last=True)
                self._kind = None
                return items
            held = max(partial_marker(self._buffer, m) for m in BODY_ENDS)
            body, self._buffer = self._buffer[: len(self._buffer) - held], self._buffer[len(self._buffer) - held:]
            items += self._body(body, last=False)
            return items

    def _begin(self, header: str) -> None:
        recipient = _RECIPIENT.search(header)
        if recipient is not None and self.names is not None:
            self._kind, self._arguments = "call", ""
            self._callee = recipient.group(1).removeprefix("functions.")
        else:
            self._kind = "reasoning" if _channel(header) == "analysis" else "content"

    def _body(self, text: str, last: bool) -> list[str | ToolCall | Reasoning]:
        if self._kind == "reasoning":
            self.reasoning += text
            return [Reasoning(text)] if text and self.keep else []
        if self._kind == "content":
            return [text] if text else []
        self._arguments += text
        if not last:
            return []
        call = self._call(self._callee, self._arguments)
        return [call] if call is not None else []

    def _call(self, name: str, body: str) -> ToolCall | None:
        if name not in self.names:
            self.errors.append(f"the model called {name!r}, which is not among the tools")
            return None
        try:
            arguments = json.loads(body) if body.strip() else {}
        except ValueError as e:
            self.errors.append(f"the model's call of {name!r} has arguments that are not valid JSON ({e}): "
                               f"{body.strip()!r}")
            return None
        if not isinstance(arguments, dict):
            self.errors.append(f"the model's call of {name!r} has arguments that are not a JSON object: "
                               f"{body.strip()!r}")
            return None
        return ToolCall(name, arguments)


def forced_call_grammar(tools: list[dict], tool_choice: str | dict) -> str:
    """One call as harmony frames it, of the named tool or any tool (`required`), its arguments valid for the
    tool's schema. The reply opens with the call's header, so the model reasons no further."""
    name = tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None
    rules = []
    for t in tools:
        if name is not None and t["function"]["name"] != name:
            continue
        header = f"{CHANNEL}commentary to=functions.{t['function']['name']} <|constrain|>json{MESSAGE}"
        schema = {**(t["function"].get("parameters") or {"type": "object"}), "x-guidance": JSON_OPTIONS}
        rules.append(f"call{len(rules)}: {json.dumps(header)} %json {json.dumps(schema)}")
    start = "start: " + " | ".join(f"call{i}" for i in range(len(rules)))
    return llg.LLMatcher.grammar_from_lark("\n".join([start, *rules]))


def _channel(header: str) -> str | None:
    found = _CHANNEL.search(header)
    return found.group(1) if found else None
