"""Thinking models: the template's switch, reasoning parsed out of the reply (streamed in any pieces),
through kiln run and a real `kiln serve` with the official openai and ollama clients.

The fixture templates are small ones written the way the shipped templates work: Qwen3's takes
`enable_thinking` (an empty `<think>` block in the generation prompt turns thinking off) and renders an
assistant turn's `reasoning_content`; SmolLM3's takes `enable_thinking` or a `/no_think` system flag;
DeepSeek-R1 distills' opens the `<think>` block in the generation prompt and drops earlier reasoning.
The models are scripted (tests/scripted.py): each writes one fixed reply."""

from __future__ import annotations

from io import StringIO

import httpx
import ollama
import openai
import pytest

from kiln.chat import CHATML_TEMPLATE, render_chat
from kiln.engine.request import GenerationRequest, prepare
from kiln.errors import RequestError, fields_named
from kiln.server import openai as openai_api
from kiln.thinking import ReasoningParser, template_supports_thinking, template_variables, thinking_style
from kiln.tools import OutputParser, Reasoning, ToolCall, ToolCallParser, OPEN
from tests.scripted import write_scripted_gguf
from tests.serving import store_server

QWEN3_STYLE = (
    "{%- if tools %}{{- '<|im_start|>system\\n<tools>' }}{%- for t in tools %}{{- t | tojson }}{%- endfor %}"
    "{{- '</tools><|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if m.reasoning_content %}{{- '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' }}{%- endif %}"
    "{{- m.content }}"
    "{%- for c in m.tool_calls or [] %}{{- '<tool_call>' + c.function | tojson + '</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
SMOLLM3_STYLE = (
    "{%- set ns = namespace(think=not (enable_thinking is defined and enable_thinking is false)) %}"
    "{%- for m in messages if m.role == 'system' %}"
    "{%- if '/no_think' in m.content %}{%- set ns.think = false %}"
    "{%- elif '/think' in m.content %}{%- set ns.think = true %}{%- endif %}{%- endfor %}"
    "{{- '<|im_start|>system\\nReasoning Mode: ' + ('/think' if ns.think else '/no_think') + '<|im_end|>\\n' }}"
    "{%- for m in messages if m.role != 'system' %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if not ns.think %}{{- '<think>\\n\\n</think>\\n' }}{%- endif %}{%- endif %}"
)
DEEPSEEK_R1_STYLE = (
    "{%- for m in messages %}{%- if m.role == 'system' %}{{- m.content }}"
    "{%- elif m.role == 'user' %}{{- '<|im_start|>user\\n' + m.content }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + m.content.split('</think>')[-1] + '<|im_end|>' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}"
)
GRANITE_STYLE = ("{%- if thinking %}Think first, between <think></think>.{% endif %}"
                 "{%- for m in messages %}{{ m.content }}{% endfor %}")
EFFORT_STYLE = "{{ reasoning_effort }}<think>{% for m in messages %}{{ m.content }}{% endfor %}"

THOUGHT = ["<think>", "Let me count", ".", "</think>", "\n\n", "Three", "!"]
CALLING = ["<think>", "I need the weather", "</think>", "\n\n", "<tool_call>",
           '{"name": "get_weather", "arguments": {"city": "Paris"}}', "</tool_call>"]
INSIDE = ["Hmm", "</think>", "\n\n", "Hi"]  # DeepSeek-R1: the prompt opened the block
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
HI = [{"role": "user", "content": "How many?"}]
RESPONSE_TOOL = {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}


def split(parser, text: str, size: int) -> tuple[str, str, list]:
    items = []
    for i in range(0, len(text), size):
        items += parser.feed(text[i:i + size])
    items += parser.close()
    reasoning = "".join(i.text for i in items if isinstance(i, Reasoning))
    return reasoning, "".join(i for i in items if isinstance(i, str)), [i for i in items if isinstance(i, ToolCall)]


# --- the template's switch, and parsing -----------------------------------------------------------
def test_templates_say_whether_and_how_they_think():
    qwen, smol, r1 = thinking_style(QWEN3_STYLE), thinking_style(SMOLLM3_STYLE), thinking_style(DEEPSEEK_R1_STYLE)
    assert (qwen.open, qwen.close, qwen.switch, qwen.history_field) == ("<think>", "</think>", "enable_thinking",
                                                                        "reasoning_content")
    assert (smol.switch, smol.history_field) == ("enable_thinking", None)
    assert (r1.switch, r1.history_field, r1.effort) == (None, None, False)
    assert thinking_style(GRANITE_STYLE).switch == "thinking" and thinking_style(EFFORT_STYLE).effort
    assert not template_supports_thinking(CHATML_TEMPLATE) and template_supports_thinking(QWEN3_STYLE)


def test_think_becomes_the_templates_own_switch():
    qwen, smol = thinking_style(QWEN3_STYLE), thinking_style(SMOLLM3_STYLE)
    off = render_chat(QWEN3_STYLE, HI, **template_variables(qwen, False, "m"))
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert render_chat(QWEN3_STYLE, HI, **template_variables(qwen, True, "m")).endswith("assistant\n")
    assert render_chat(SMOLLM3_STYLE, HI, **template_variables(smol, False, "m")).endswith("<think>\n\n</think>\n")
    flagged = render_chat(SMOLLM3_STYLE, [{"role": "system", "content": "/no_think"}, *HI])
    assert "Reasoning Mode: /no_think" in flagged and flagged.endswith("<think>\n\n</think>\n")
    assert template_variables(thinking_style(GRANITE_STYLE), "high", "m") == {"thinking": True}
    assert template_variables(thinking_style(EFFORT_STYLE), "low", "m") == {"reasoning_effort": "low"}
    assert template_variables(None, False, "plain:1b") == {}
    with pytest.raises(RequestError, match="think: model 'plain:1b' does not support thinking") as e:
        template_variables(None, True, "plain:1b")
    assert e.value.param == "think"
    with pytest.raises(RequestError) as e, fields_named(openai_api.FIELDS):
        template_variables(None, "high", "plain:1b")
    assert e.value.param == "reasoning_effort" and str(e.value).startswith("reasoning_effort: model 'plain:1b'")


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8, 1000])
def test_reasoning_is_split_out_however_the_text_arrives(size):
    style = thinking_style(QWEN3_STYLE)
    assert split(ReasoningParserOnly(style), "<think>\nLet me count.\n</think>\n\nThree!", size)[:2] == (
        "Let me count.", "Three!")
    assert split(ReasoningParserOnly(style), "<think>\n\n</think>\n\nThree!", size)[:2] == ("", "Three!")
    assert split(ReasoningParserOnly(style), "Three <think>!", size)[:2] == ("", "Three <think>!")
    assert split(ReasoningParserOnly(style, inside=True), "Hmm\n</think>\n\nHi", size)[:2] == ("Hmm", "Hi")
    assert split(ReasoningParserOnly(style), "<think>\nStill going", size)[:2] == ("Still going", "")
    # thinking turned off, yet the model thinks: nothing of it reaches the content
    assert split(ReasoningParserOnly(style, keep=False), "<think>Let me</think>Three!", size)[:2] == ("", "Three!")


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_tool_calls_after_or_inside_reasoning(size):
    style = thinking_style(QWEN3_STYLE)

    def parser():
        return OutputParser(ReasoningParser(style, ends_at=OPEN), ToolCallParser(["get_weather"]))

    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    for text in (f"<think>Weather needed.</think>\n\n{call}", f"<think>Weather needed.\n{call}"):
        reasoning, content, calls = split(parser(), text, size)
        assert (reasoning, content.strip()) == ("Weather needed.", "")
        assert [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": "Paris"})]
    # text that only begins a tool call's tag stays reasoning
    reasoning, content, calls = split(parser(), "<think>Maybe <tool_c later.</think>Fine.", size)
    assert (reasoning, content, calls) == ("Maybe <tool_c later.", "Fine.", [])


def ReasoningParserOnly(style, inside=False, keep=True):  # noqa: N802 - reads as the parser it builds
    return OutputParser(ReasoningParser(style, inside, keep), None)


# --- the front door, and kiln run -------------------------------------------------------------------
@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("thinking")
    return {"qwen-think": write_scripted_gguf(folder / "qwen.gguf", QWEN3_STYLE, THOUGHT),
            "qwen-tools": write_scripted_gguf(folder / "tools.gguf", QWEN3_STYLE, CALLING),
            "r1": write_scripted_gguf(folder / "r1.gguf", DEEPSEEK_R1_STYLE, INSIDE),
            "plain": write_scripted_gguf(folder / "plain.gguf", CHATML_TEMPLATE, ["Hello"])}


@pytest.fixture(scope="module")
def qwen(models):
    from kiln.engine.model import load

    model = load(str(models["qwen-think"]), n_ctx=256, progress=False)
    yield model
    model.close()


def test_earlier_reasoning_is_rendered_as_the_template_wants(qwen, models):
    history = [*HI, {"role": "assistant", "content": "Two.", "reasoning_content": "Counting slowly"},
               {"role": "user", "content": "Sure?"}]
    seq, _ = prepare(qwen, GenerationRequest(messages=history))
    assert "<think>\nCounting slowly\n</think>\n\nTwo." in qwen.tokenizer.decode(seq.prompt_ids)
    ollama_style = [*history[:1], {"role": "assistant", "content": "Two.", "thinking": "Counting slowly"}, history[2]]
    seq, _ = prepare(qwen, GenerationRequest(messages=ollama_style))
    assert "Counting slowly" in qwen.tokenizer.decode(seq.prompt_ids)
    seq, _ = prepare(qwen, GenerationRequest(messages=history, think=False))
    assert qwen.tokenizer.decode(seq.prompt_ids).endswith("<think>\n\n</think>\n\n")
    with pytest.raises(RequestError, match="think needs the chat template") as e:
        prepare(qwen, GenerationRequest(prompt="hi", raw=True, think=True))
    assert e.value.param == "think"
    with pytest.raises(RequestError, match="may not set 'messages'"):
        prepare(qwen, GenerationRequest(messages=HI, template_variables={"messages": []}))


def test_kiln_run_shows_thinking_dimmed_hides_it_or_turns_it_off(qwen, capsys):
    from kiln.cli import main
    from kiln.commands.run import Chat, slash_command

    chat = Chat(qwen, {"temperature": 0}, 32, None, raw=False)
    out = StringIO()
    chat.ask("How many?", out)
    assert out.getvalue() == "Thinking...\nLet me count.\n\nThree!\n"
    assert chat.messages[-1] == {"role": "assistant", "content": "Three!", "thinking": "Let me count."}
    chat.hide_thinking = True
    out = StringIO()
    chat.ask("Again?", out)
    assert out.getvalue() == "Three!\n"
    slash_command(chat, "/set nothink")
    assert chat.think is False
    out = StringIO()
    chat.ask("Once more?", out)
    assert out.getvalue() == "Three!\n" and chat.last.tokenizer.decode(chat.last.prompt_ids).endswith("</think>\n\n")
    slash_command(chat, "/set think")
    assert chat.think is True
    slash_command(chat, "/set think high")
    assert chat.think == "high"
    slash_command(chat, "/set think maybe")
    assert chat.think == "high" and "Invalid value for think" in capsys.readouterr().err
    assert main(["run", str(qwen.path), "How many?", "--think", "--hidethinking", "-c", "128"]) == 0
    assert capsys.readouterr().out == "Three!\n"
    assert main(["run", str(qwen.path), "How many?", "--think=false", "-c", "128"]) == 0
    assert capsys.readouterr().out == "Three!\n"
    assert main(["run", str(qwen.path), "How many?", "--think", "--raw", "-c", "128"]) == 1
    assert "--think needs the chat template" in capsys.readouterr().err
    assert main(["run", str(qwen.path), "How many?", "--think", "maybe", "-c", "128"]) == 1
    assert "--think: expected true, false, low, medium or high" in capsys.readouterr().err


# --- through a real server and the official clients --------------------------------------------------
@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    with store_server(tmp_path_factory.mktemp("home"), models, "qwen-think", "--parallel", "1", "--ctx-len", "1024") as s:
        yield s


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="kiln")


@pytest.fixture(scope="module")
def oll(server):
    return ollama.Client(host=server.url)


def test_openai_reasoning_content_whole_and_streamed(oai):
    whole = oai.chat.completions.create(model="qwen-think", messages=HI)
    message = whole.choices[0].message
    assert (message.reasoning_content, message.content, whole.choices[0].finish_reason) == (
        "Let me count.", "Three!", "stop")
    assert whole.usage.completion_tokens_details.reasoning_tokens == 3  # <think>, "Let me count", "."
    chunks = list(oai.chat.completions.create(model="qwen-think", messages=HI, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "Let me count."
    assert "".join(d.content or "" for d in deltas) == "Three!"
    cut = oai.chat.completions.create(model="qwen-think", messages=HI, max_tokens=2)
    assert (cut.choices[0].message.reasoning_content, cut.choices[0].message.content,
            cut.choices[0].finish_reason) == ("Let me count", "", "length")


def test_openai_switches_thinking_off_by_effort_or_template_kwargs(oai):
    on = oai.chat.completions.create(model="qwen-think", messages=HI)
    for kwargs in ({"reasoning_effort": "none"}, {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}):
        off = oai.chat.completions.create(model="qwen-think", messages=HI, **kwargs)
        assert off.choices[0].message.content == "Three!"
        assert getattr(off.choices[0].message, "reasoning_content", None) is None
        assert off.usage.prompt_tokens == on.usage.prompt_tokens + 4  # the empty block: <think>, \n\n, </think>, \n\n
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="plain", messages=HI, reasoning_effort="high")
    assert "reasoning_effort" in str(e.value) and "'plain:latest'" in str(e.value)


def test_openai_tool_call_after_reasoning(oai):
    for stream in (False, True):
        r = oai.chat.completions.create(model="qwen-tools", messages=HI, tools=[WEATHER], stream=stream)
        if stream:
            deltas = [c.choices[0] for c in r if c.choices]
            reasoning = "".join(getattr(d.delta, "reasoning_content", None) or "" for d in deltas)
            calls = [c for d in deltas for c in d.delta.tool_calls or []]
            reason = deltas[-1].finish_reason
        else:
            reasoning, calls, reason = (r.choices[0].message.reasoning_content, r.choices[0].message.tool_calls,
                                        r.choices[0].finish_reason)
        assert (reasoning, reason) == ("I need the weather", "tool_calls")
        assert [(c.function.name, c.function.arguments) for c in calls] == [("get_weather", '{"city": "Paris"}')]


def test_a_reply_that_begins_inside_reasoning(oai):
    r = oai.chat.completions.create(model="r1", messages=HI)
    assert (r.choices[0].message.reasoning_content, r.choices[0].message.content) == ("Hmm", "Hi")


def test_responses_api_reasoning_item(oai):
    whole = oai.responses.create(model="qwen-think", input="How many?")
    assert [item.type for item in whole.output] == ["reasoning", "message"]
    assert whole.output[0].content[0].text == "Let me count." and whole.output_text == "Three!"
    assert whole.usage.output_tokens_details.reasoning_tokens == 3
    events = list(oai.responses.create(model="qwen-think", input="How many?", stream=True))
    kinds = [e.type for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "Let me count."
    done = events[-1].response
    assert [item.type for item in done.output] == ["reasoning", "message"] and done.output_text == "Three!"
    # a tool loop resends the output, reasoning item and all
    called = oai.responses.create(model="qwen-tools", input="Weather?", tools=[RESPONSE_TOOL])
    assert [item.type for item in called.output] == ["reasoning", "function_call"]
    call = called.output[1]
    def resend(items):
        return oai.responses.create(model="qwen-tools", tools=[RESPONSE_TOOL], input=[
            {"role": "user", "content": "Weather?"}, *[item.model_dump(exclude_none=True) for item in items],
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])

    again, without = resend(called.output), resend(called.output[1:])
    assert again.status == without.status == "completed"
    # the template renders the turn's reasoning: <think>, \n, the text (18 bytes, one merge: " t"), \n, </think>, \n\n
    assert again.usage.input_tokens - without.usage.input_tokens == 1 + 1 + 17 + 1 + 1 + 1


def test_ollama_think_and_thinking(oll):
    r = oll.chat(model="qwen-think", messages=HI, think=True)
    assert (r.message.thinking, r.message.content) == ("Let me count.", "Three!")
    parts = list(oll.chat(model="qwen-think", messages=HI, think=True, stream=True))
    assert "".join(p.message.thinking or "" for p in parts) == "Let me count."
    assert "".join(p.message.content for p in parts) == "Three!" and parts[-1].done
    off = oll.chat(model="qwen-think", messages=HI, think=False)
    assert (off.message.thinking, off.message.content) == (None, "Three!")
    g = oll.generate(model="qwen-think", prompt="How many?", think=True)
    assert (g.thinking, g.response) == ("Let me count.", "Three!")
    streamed = list(oll.generate(model="qwen-think", prompt="How many?", think=True, stream=True))
    assert "".join(p.thinking or "" for p in streamed) == "Let me count."
    tools = oll.chat(model="qwen-tools", messages=HI, think=True, tools=[WEATHER])
    assert tools.message.thinking == "I need the weather"
    assert [(c.function.name, c.function.arguments) for c in tools.message.tool_calls] == [
        ("get_weather", {"city": "Paris"})]


def test_ollama_capability_and_think_on_a_model_that_does_not(oll, server):
    assert "thinking" in oll.show("qwen-think").capabilities
    assert "thinking" not in oll.show("plain").capabilities
    with pytest.raises(ollama.ResponseError) as e:
        oll.chat(model="plain", messages=HI, think=True)
    assert e.value.status_code == 400 and "think" in str(e.value) and "'plain:latest'" in str(e.value)
    r = httpx.post(f"{server.url}/api/generate", json={"model": "qwen-think", "prompt": "x", "think": "very"})
    assert r.status_code == 400 and "think" in r.json()["error"]
