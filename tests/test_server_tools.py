"""Tool-call rendering and parsing, keep-alive durations, and grammar-constrained sampling."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kiln.errors import RequestError
from kiln.server.runtime import parse_keep_alive
from kiln.tools import ToolCall, ToolCallParser, render_messages

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def parse_in_pieces(text: str, size: int, names=("get_weather",)):
    parser = ToolCallParser(list(names))
    items = []
    for i in range(0, len(text), size):
        items += parser.feed(text[i : i + size])
    items += parser.close()
    content = "".join(i for i in items if isinstance(i, str))
    return content, [i for i in items if isinstance(i, ToolCall)], parser.errors


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 1000])
def test_calls_are_parsed_however_the_text_is_split(size):
    text = 'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call> Done <tool'
    content, calls, errors = parse_in_pieces(text, size)
    assert content == "Let me check.  Done <tool"  # a partial tag at the very end is text after all
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert not errors and calls[0].id.startswith("call_")


def test_text_that_only_looks_like_a_tag_is_released_in_order():
    parser = ToolCallParser(["get_weather"])
    assert parser.feed("a <tool") == ["a "]
    assert parser.feed("box> b") == ["<toolbox> b"]


def test_invalid_calls_are_reported_not_passed_on():
    content, calls, errors = parse_in_pieces('<tool_call>{"name": "get_weather", "arguments": {"city": }</tool_call>', 4)
    assert not calls and "not valid JSON" in errors[0]
    assert content.startswith("<tool_call>")  # the raw text is kept as content
    _, calls, errors = parse_in_pieces('<tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>', 9)
    assert not calls and "launch_rockets" in errors[0]
    _, calls, errors = parse_in_pieces('<tool_call>{"name": "get_weather", "arguments": [1]}</tool_call>', 9)
    assert not calls and "not a JSON object" in errors[0]


def test_an_unclosed_call_at_the_end_is_still_parsed():
    _, calls, errors = parse_in_pieces('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}', 3)
    assert [c.arguments for c in calls] == [{"city": "Oslo"}] and not errors
    _, calls, errors = parse_in_pieces('<tool_call>{"name": "get_weather", "argu', 3)
    assert not calls and errors


def test_a_bare_json_call_is_recognised_and_other_json_is_content():
    _, calls, _ = parse_in_pieces(' {"name": "get_weather", "parameters": {"city": "Rome"}}', 4)
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": "Rome"})]
    content, calls, errors = parse_in_pieces('{"temperature": 21}', 4)
    assert content == '{"temperature": 21}' and not calls and not errors


def test_arguments_given_as_a_json_string_are_decoded():
    _, calls, _ = parse_in_pieces('<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Lima\\"}"}</tool_call>', 5)
    assert calls[0].arguments == {"city": "Lima"}


def test_templates_without_tools_get_a_system_message_and_text_history():
    history = [{"role": "system", "content": "Be brief."},
               {"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    messages, tools = render_messages(history, TOOLS, "{% for m in messages %}{{ m.content }}{% endfor %}")
    assert tools is None
    assert messages[0]["content"].startswith("Be brief.") and "get_weather" in messages[0]["content"]
    assert "<tool_call>" in messages[0]["content"]
    assert json.loads(messages[2]["content"].removeprefix("<tool_call>").removesuffix("</tool_call>")) == \
        {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert messages[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}


def test_templates_with_tools_render_them_and_get_argument_objects():
    history = [{"role": "assistant", "tool_calls": [{"function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}]
    messages, tools = render_messages(history, TOOLS, "{% if tools %}{{ tools | tojson }}{% endif %}")
    assert tools == TOOLS and messages[0]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    with pytest.raises(RequestError) as e:
        render_messages([{"role": "assistant", "tool_calls": [{"function": {"name": "x", "arguments": "{oops"}}]}], TOOLS,
                        "{{ tools }}")
    assert e.value.param == "messages[0].tool_calls[0].function.arguments"


@pytest.mark.parametrize("value, seconds", [("5m", 300), ("1h30m", 5400), ("10s", 10), ("1.5h", 5400), ("250ms", 0.25),
                                            (0, 0), ("0", 0), (30, 30), ("300", 300), (-1, None), ("-1m", None)])
def test_keep_alive_durations(value, seconds):
    assert parse_keep_alive(value) == seconds


@pytest.mark.parametrize("value", ["soon", "5 minutes", "", "m", True])
def test_bad_keep_alive_names_the_field(value):
    with pytest.raises(RequestError) as e:
        parse_keep_alive(value)
    assert e.value.param == "keep_alive"


@pytest.mark.slow
def test_grammar_masks_make_random_sampling_valid(smollm2_path):
    """Sampling uniformly among the allowed tokens still yields JSON matching the schema."""
    import jsonschema

    from kiln.engine.grammar import Constraint, json_grammar
    from kiln.gguf import GGUFFile
    from kiln.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(GGUFFile(smollm2_path))
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "tags"],
              "properties": {"name": {"type": "string", "maxLength": 8},
                             "tags": {"type": "array", "maxItems": 2, "items": {"enum": ["a", "b"]}}}}
    rng = np.random.default_rng(0)
    for _ in range(3):
        constraint = Constraint(tok, json_grammar(schema, "response_format"), "response_format")
        ids = []
        while not constraint.done():
            allowed = np.flatnonzero(constraint.allowed())
            token = int(rng.choice(allowed))
            if token in tok.stop_ids:
                break
            constraint.consume(token)
            ids.append(token)
            assert len(ids) < 200
        jsonschema.validate(json.loads(tok.decode(ids)), schema)
    with pytest.raises(RequestError) as e:
        Constraint(tok, json_grammar({"type": "objectx"}, "format"), "format")
    assert e.value.param == "format"
