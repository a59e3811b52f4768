"""Thinking models: the switch their chat template takes, and their reasoning parsed out of the output.

A template that supports thinking names the reasoning markers (`<think>`…`</think>` and kin) and takes a
switch: `enable_thinking` (Qwen3, SmolLM3), `thinking` (Granite 3.3) or an effort (`reasoning_effort`).
DeepSeek-R1 distills take none: they always think, and their generation prompt already opens the block,
so the reply begins inside reasoning. The output is split once, as it streams, into reasoning and
content; what comes after the block goes on to the tool-call parser. gpt-oss's harmony format has channels
instead of markers: kiln/harmony.py parses its replies.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

from kiln.errors import Field, RequestError
from kiln.tokenizer import HARMONY_FRAMING

# Reasoning markers templates use, open and close.
MARKERS = (("<think>", "</think>"), ("<thinking>", "</thinking>"),
           ("<|begin_of_thought|>", "<|end_of_thought|>"), ("◁think▷", "◁/think▷"))
EFFORTS = ("low", "medium", "high")
# gpt-oss's harmony format: reasoning is a message on the analysis channel, and the whole reply is read by
# kiln/harmony.py's parser. A template is harmony's when it writes the messages' framing tokens.
HARMONY_TEMPLATE_MARKERS = HARMONY_FRAMING[:3]
HARMONY_ANALYSIS = ("<|channel|>analysis<|message|>", "<|end|>")


@dataclass(frozen=True)
class ThinkingStyle:
    """What a chat template says about thinking."""

    open: str
    close: str
    switch: str | None  # the template variable that turns thinking on and off; None: it always thinks
    effort: bool  # the template reads `reasoning_effort`
    history_field: str | None  # the message field it renders earlier reasoning from, if any
    harmony: bool = False  # gpt-oss's channels (kiln/harmony.py), not markers around a block


@lru_cache(maxsize=32)
def thinking_style(template: str) -> ThinkingStyle | None:
    """The template's thinking switch and markers, or None when it has no reasoning."""
    history = next((f for f in ("reasoning_content", "thinking")
                    if re.search(rf"(message|m)\.{f}\b|\[['\"]{f}['\"]\]", template)), None)
    if all(m in template for m in HARMONY_TEMPLATE_MARKERS):  # it always reasons; an effort is all it takes
        return ThinkingStyle(*HARMONY_ANALYSIS, None, "reasoning_effort" in template, history, harmony=True)
    marker = next(((o, c) for o, c in MARKERS if o in template or c in template), None)
    if marker is None:
        return None
    switch = ("enable_thinking" if re.search(r"\benable_thinking\b", template)
              else "thinking" if re.search(r"(?<![\w.])thinking\b", template) else None)
    return ThinkingStyle(marker[0], marker[1], switch, "reasoning_effort" in template, history)


def template_supports_thinking(template: str) -> bool:
    """Whether /api/show lists the "thinking" capability for a model with this template."""
    return thinking_style(template) is not None


def template_variables(style: ThinkingStyle | None, think: bool | str | None, model: str) -> dict:
    """The variables that pass `think` (True/False, or an effort) to the template."""
    if think is None or (think is False and style is None):  # nothing to turn off
        return {}
    if style is None:
        raise RequestError((Field("think"), f": model {model!r} does not support thinking (its chat template has "
                            "no reasoning)"), "think")
    if isinstance(think, str):
        if think not in EFFORTS:
            raise RequestError((Field("think"), f" must be true, false or one of {', '.join(EFFORTS)}; got {think!r}"),
                               "think")
        # A template without an effort takes the effort as thinking on.
        variables: dict = {"reasoning_effort": think} if style.effort else {}
        on = True
    else:
        variables, on = {}, think
    if style.switch is not None:
        variables[style.switch] = on
    return variables


def history_messages(messages: list[dict], style: ThinkingStyle | None) -> list[dict]:
    """Earlier reasoning (`thinking` or `reasoning_content` on assistant turns) under the field the
    template renders it from; dropped when it renders none."""
    out = []
    for m in messages:
        reasoning = m.get("thinking") or m.get("reasoning_content")
        m = {k: v for k, v in m.items() if k not in ("thinking", "reasoning_content")}
        if reasoning and style is not None and style.history_field is not None and m.get("role") == "assistant":
            m[style.history_field] = reasoning
        out.append(m)
    return out


class ReasoningParser:
    """Splits streamed output into reasoning and content. `inside`: the prompt opened the block, so the
    output begins in it. Markers split across pieces are held back until they are clear; whitespace
    between the block and the answer is dropped. With `keep` False the reasoning is parsed out and
    discarded (thinking was turned off, yet the model wrote some). `ends_at`: a marker that ends an
    unclosed block too (a tool call's open tag: models call tools without closing their reasoning)."""

    def __init__(self, style: ThinkingStyle, inside: bool = False, keep: bool = True, ends_at: str | None = None):
        self.style, self.keep, self.ends_at = style, keep, ends_at
        self._state = "opened" if inside else "start"  # start -> opened -> reasoning -> after -> content
        self._buffer = ""
        self.reasoning = ""  # all reasoning seen so far

    @property
    def in_reasoning(self) -> bool:
        return self._state in ("opened", "reasoning")

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) released by this piece."""
        self._buffer += text
        return self._drain(final=False)

    def close(self) -> tuple[str, str]:
        """What is still held, at the end of the output."""
        return self._drain(final=True)

    def _drain(self, final: bool) -> tuple[str, str]:
        reasoning = content = ""
        while True:
            if self._state == "start":
                stripped = self._buffer.lstrip()
                if not stripped:
                    if final:
                        self._buffer = ""
                    return self._released(reasoning), content
                if stripped.startswith(self.style.open):
                    self._buffer, self._state = stripped[len(self.style.open):], "opened"
                    continue
                if self.style.open.startswith(stripped) and not final:
                    return self._released(reasoning), content  # may yet become the open marker
                self._state = "content"
                continue
            if self._state in ("opened", "after"):  # whitespace around the block is neither reasoning nor answer
                self._buffer = self._buffer.lstrip()
                if not self._buffer and not final:
                    return self._released(reasoning), content
                self._state = "reasoning" if self._state == "opened" else "content"
                continue
            if self._state == "reasoning":
                at = self._buffer.find(self.style.close)
                call = self._buffer.find(self.ends_at) if self.ends_at else -1
                if call != -1 and (at == -1 or call < at):
                    reasoning, self._buffer = reasoning + self._buffer[:call].rstrip(), self._buffer[call:]
                    self._state = "content"
                    continue
                if at != -1:
                    reasoning += self._buffer[:at].rstrip()
                    self._buffer, self._state = self._buffer[at + len(self.style.close):], "after"
                    continue
                if final:
                    reasoning, self._buffer = reasoning + self._buffer.rstrip(), ""
                    return self._released(reasoning), content
                # Held back: a marker's start, and trailing whitespace the close may follow.
                keep = max(partial_marker(self._buffer, m) for m in (self.style.close, self.ends_at) if m)
                keep += len(self._buffer) - keep - len(self._buffer[: len(self._buffer) - keep].rstrip())
                reasoning += self._buffer[: len(self._buffer) - keep]
                self._buffer = self._buffer[len(self._buffer) - keep:]
                return self._released(reasoning), content
            content, self._buffer = content + self._buffer, ""
            return self._released(reasoning), content

    def _released(self, reasoning: str) -> str:
        self.reasoning += reasoning
        return reasoning if self.keep else ""


def partial_marker(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
