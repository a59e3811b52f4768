"""gpt-oss's chat format (harmony): the template renders it, with the reasoning effort a request asks for, and
the reply's messages are parsed into reasoning (analysis), content (final) and tool calls (commentary to
functions.NAME), streamed in any pieces, through kiln run and a real `kiln serve` with the official openai and
ollama clients.

The template (kiln.synth's, which its gpt-oss models carry) is a small one written the way gpt-oss's shipped
template works: a system message with `Reasoning: <effort>` (medium unless `reasoning_effort` says otherwise),
the instructions and tools in a developer message, earlier calls as `assistant to=functions.NAME` messages
with the turn's `thinking` before them, tool results from `functions.NAME to=assistant`, and a generation
prompt of `<|start|>assistant`. The models are scripted (tests/scripted.py) with harmony's control tokens; a
bigram script repeats no token, so a second `<|channel|>` or `<|message|>` is spelled in two ordinary tokens
(the parser reads text), and so is "assistant", whose whole word the prompt's last token must not be."""

from __future__ import annotations

import json
from io import StringIO

import ollama
import openai
import pytest

from kiln.chat import render_chat
from kiln.engine.request import GenerationRequest, prepare
from kiln.errors import RequestError
from kiln.harmony import HarmonyParser
from kiln.synth import HARMONY_SPECIALS, HARMONY_TEMPLATE
from kiln.thinking import template_supports_thinking, template_variables, thinking_style
from kiln.tools import Reasoning, ToolCall
from tests.scripted import write_scripted_gguf
from tests.serving import store_server

ANSWER = ["<|channel|>", "analysis", "<|message|>", "Let me count.", "<|end|>", "<|start|>", "assist", "ant",
          "<|chan", "nel|>final", "<|mess", "age|>", "Three!"]
CALLING = ["<|channel|>", "analysis", "<|message|>", "I need the weather.", "<|end|>", "<|start|>", "assist", "ant",
           "<|chan", "nel|>commentary to=functions.get_weather ", "<|constrain|>", "json", "<|mess", "age|>",
           '{"city": "Paris"}']
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
# a forced call's arguments come from the grammar alone (the scripted model knows no call): one enum field
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
HI = [{"role": "user", "content": "How many?"}]
CALL = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'


def split(parser, text: str, size: int) -> tuple[str, str, list]:
    items = []
    for i in range(0, len(text), size):
        items += parser.feed(text[i:i + size])
    items += parser.close()
    assert all(isinstance(i, (str, Reasoning, ToolCall)) for i in items)
    reasoning = "".join(i.text for i in items if isinstance(i, Reasoning))
    return reasoning, "".join(i for i in items if isinstance(i, str)), [(c.name, c.arguments) for c in items
                                                                          if isinstance(c, ToolCall)]


# --- the template, and parsing -----------------------------------------------------------------------
def test_a_harmony_template_takes_an_effort_and_always_reasons():
    style = thinking_style(HARMONY_TEMPLATE)
    assert style.harmony and (style.switch, style.effort, style.history_field) == (None, True, "thinking")
    assert template_supports_thinking(HARMONY_TEMPLATE)
    assert "Reasoning: medium" in render_chat(HARMONY_TEMPLATE, HI)
    for effort in ("low", "medium", "high"):
        variables = template_variables(style, effort, "m")
        assert variables == {"reasoning_effort": effort}
        assert f"Reasoning: {effort}\n" in render_chat(HARMONY_TEMPLATE, HI, **variables)
    assert template_variables(style, True, "m") == template_variables(style, False, "m") == {}
    with pytest.raises(RequestError, match="think must be true, false or one of low, medium, high"):
        template_variables(style, "extreme", "m")


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8, 1000])
def test_a_reply_is_split_into_its_channels_however_the_text_arrives(size):
    answer = "<|channel|>analysis<|message|>Let me count.<|end|><|start|>assistant<|channel|>final<|message|>Three!"
    assert split(HarmonyParser(), answer, size) == ("Let me count.", "Three!", [])
    assert split(HarmonyParser(keep=False), answer, size) == ("", "Three!", [])  # thinking off: reasoning dropped
    assert split(HarmonyParser(), "<|channel|>final<|message|>Three!", size) == ("", "Three!", [])
    # cut off by the budget inside the reasoning, or in the header before the answer
    assert split(HarmonyParser(), "<|channel|>analysis<|message|>Still go", size) == ("Still go", "", [])
    assert split(HarmonyParser(), "<|channel|>analysis<|message|>Done<|end|><|start|>assistant<|chan", size) == (
        "Done", "", [])
    # a body the model did not end before starting the next message
    assert split(HarmonyParser(), "<|channel|>analysis<|message|>Hm<|start|>assistant<|channel|>final<|message|>A",
                 size) == ("Hm", "A", [])
    # text outside the format is the answer
    assert split(HarmonyParser(), "Just text.", size) == ("", "Just text.", [])
    assert split(HarmonyParser(), "<|channel|>final<|message|>Use <|end of it", size) == ("", "Use <|end of it", [])


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_tool_calls_from_the_commentary_channel(size):
    names = ["get_weather"]
    called = [("get_weather", {"city": "Paris"})]
    text = f"<|channel|>analysis<|message|>Weather needed.<|end|><|start|>assistant{CALL}"
    assert split(HarmonyParser(names=names), text, size) == ("Weather needed.", "", called)
    # the recipient in the role, as the template renders earlier calls
    role = '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}'
    assert split(HarmonyParser(names=names), role, size) == ("", "", called)
    # a preamble on the commentary channel is said to the user
    preamble = f"<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant{CALL}"
    assert split(HarmonyParser(names=names), preamble, size) == ("", "Checking.", called)
    # a call of a tool not offered, or arguments that are not a JSON object: reported, not passed on
    parser = HarmonyParser(names=["get_time"])
    assert split(parser, CALL, size) == ("", "", []) and parser.errors == [
        "the model called 'get_weather', which is not among the tools"]
    parser = HarmonyParser(names=names)
    assert split(parser, CALL.replace('{"city": "Paris"}', '{"city": '), size)[2] == []
    assert "not valid JSON" in parser.errors[0]
    parser = HarmonyParser(names=names)
    assert split(parser, CALL.replace('{"city": "Paris"}', '["Paris"]'), size)[2] == []
    assert "not a JSON object" in parser.errors[0]
    # no tools offered: a call's text is content, as a tool-call tag is then
    assert split(HarmonyParser(), CALL, size) == ("", '{"city": "Paris"}', [])


# --- the tokenizer, the front door and kiln run ---------------------------------------------------------
@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("harmony")
    scripted = dict(after="t", specials=HARMONY_SPECIALS, markers=[])  # the prompt ends "<|start|>assistant"
    return {"gpt-think": write_scripted_gguf(folder / "answer.gguf", HARMONY_TEMPLATE, ANSWER, end="<|return|>",
                                             **scripted),
            "gpt-tools": write_scripted_gguf(folder / "tools.gguf", HARMONY_TEMPLATE, CALLING, end="<|call|>",
                                             **scripted)}


@pytest.fixture(scope="module")
def gpt(models):
    from kiln.engine.model import load

    model = load(str(models["gpt-think"]), n_ctx=2048, progress=False)
    yield model
    model.close()


def test_harmony_vocabulary_renders_its_framing_and_stops_at_return_and_call(gpt):
    tok = gpt.tokenizer
    ids = {name: tok.encode(name)[0] for name in HARMONY_SPECIALS}
    assert {ids["<|return|>"], ids["<|call|>"]} <= tok.stop_ids and ids["<|end|>"] not in tok.stop_ids
    framing = ["<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>"]
    assert tok.decode([ids[name] for name in framing]) == "".join(framing)
    assert tok.decode([ids["<|return|>"], ids["<|endoftext|>"]]) == ""


def test_the_front_door_renders_the_effort_and_parses_the_reply(gpt):
    for think, effort in ((None, "medium"), (True, "medium"), ("high", "high"), ("low", "low"), (False, "medium")):
        seq, parser = prepare(gpt, GenerationRequest(messages=HI, think=think))
        prompt = gpt.tokenizer.decode(seq.prompt_ids, skip_special=False)
        assert f"Reasoning: {effort}\n" in prompt and prompt.endswith("<|end|><|start|>assistant")
        assert isinstance(parser, HarmonyParser) and parser.keep is (think is not False)
    history = [*HI, {"role": "assistant", "content": "", "thinking": "Weather first.",
                     "tool_calls": [{"function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "content": "sunny"}]
    seq, _ = prepare(gpt, GenerationRequest(messages=history, tools=[WEATHER]))
    prompt = gpt.tokenizer.decode(seq.prompt_ids, skip_special=False)
    assert ('<|start|>assistant<|channel|>analysis<|message|>Weather first.<|end|><|start|>assistant '
            'to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
            '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"sunny"<|end|>') in prompt


def test_kiln_run_shows_the_reasoning_dimmed_or_hides_it(gpt, capsys):
    from kiln.cli import main
    from kiln.commands.run import Chat

    chat = Chat(gpt, {"temperature": 0}, 64, None, raw=False)
    out = StringIO()
    chat.ask("How many?", out)
    assert out.getvalue() == "Thinking...\nLet me count.\n\nThree!\n"
    assert chat.messages[-1] == {"role": "assistant", "content": "Three!", "thinking": "Let me count."}
    assert main(["run", str(gpt.path), "How many?", "--hidethinking", "-c", "1024"]) == 0
    assert capsys.readouterr().out == "Three!\n"
    assert main(["run", str(gpt.path), "How many?", "--think", "high", "-c", "1024"]) == 0
    assert capsys.readouterr().out.endswith("Three!\n")


# --- through a real server and the official clients --------------------------------------------------
@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    with store_server(tmp_path_factory.mktemp("home"), models, "gpt-think", "--parallel", "1", "--ctx-len", "2048") as s:
        yield s


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="kiln")


@pytest.fixture(scope="module")
def oll(server):
    return ollama.Client(host=server.url)


def test_openai_reasoning_and_content_whole_and_streamed(oai):
    whole = oai.chat.completions.create(model="gpt-think", messages=HI)
    message = whole.choices[0].message
    assert (message.reasoning_content, message.content, whole.choices[0].finish_reason) == (
        "Let me count.", "Three!", "stop")
    assert whole.usage.completion_tokens_details.reasoning_tokens == 3  # "analysis", <|message|>, "Let me count."
    chunks = list(oai.chat.completions.create(model="gpt-think", messages=HI, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "Let me count."
    assert "".join(d.content or "" for d in deltas) == "Three!"
    # the effort reaches the template: "low", "medium" and "high" are 3, 6 and 4 byte tokens in the prompt
    tokens = {e: oai.chat.completions.create(model="gpt-think", messages=HI, reasoning_effort=e).usage.prompt_tokens
              for e in ("low", "medium", "high")}
    assert (tokens["medium"] - tokens["low"], tokens["high"] - tokens["low"]) == (3, 1)
    off = oai.chat.completions.create(model="gpt-think", messages=HI, reasoning_effort="none")
    assert off.choices[0].message.content == "Three!"
    assert getattr(off.choices[0].message, "reasoning_content", None) is None


def test_openai_tool_call_after_reasoning(oai):
    for stream in (False, True):
        r = oai.chat.completions.create(model="gpt-tools", messages=HI, tools=[WEATHER], stream=stream)
        if stream:
            deltas = [c.choices[0] for c in r if c.choices]
            reasoning = "".join(getattr(d.delta, "reasoning_content", None) or "" for d in deltas)
            content = "".join(d.delta.content or "" for d in deltas)
            calls = [c for d in deltas for c in d.delta.tool_calls or []]
            reason = deltas[-1].finish_reason
        else:
            message = r.choices[0].message
            reasoning, content, calls, reason = (message.reasoning_content, message.content or "",
                                                 message.tool_calls, r.choices[0].finish_reason)
        assert (reasoning, content, reason) == ("I need the weather.", "", "tool_calls")
        assert [(c.function.name, c.function.arguments) for c in calls] == [("get_weather", '{"city": "Paris"}')]


def test_responses_api_reasoning_item_and_call(oai):
    whole = oai.responses.create(model="gpt-think", input="How many?", reasoning={"effort": "high"})
    assert [item.type for item in whole.output] == ["reasoning", "message"]
    assert whole.output[0].content[0].text == "Let me count." and whole.output_text == "Three!"
    events = list(oai.responses.create(model="gpt-think", input="How many?", stream=True))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "Let me count."
    assert events[-1].response.output_text == "Three!"
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}
    called = oai.responses.create(model="gpt-tools", input="Weather?", tools=[tool])
    assert [item.type for item in called.output] == ["reasoning", "function_call"]
    assert (called.output[1].name, json.loads(called.output[1].arguments)) == ("get_weather", {"city": "Paris"})


def test_a_forced_call_is_framed_as_harmony_frames_calls(oai):
    """tool_choice on a model that would answer instead: the grammar opens the reply with a call's header."""
    for choice in ({"type": "function", "function": {"name": "get_time"}}, "required"):
        for stream in (False, True):
            r = oai.chat.completions.create(model="gpt-think", messages=HI, tools=[TIME], tool_choice=choice,
                                            stream=stream)
            if stream:
                deltas = [c.choices[0] for c in r if c.choices]
                calls = [c for d in deltas for c in d.delta.tool_calls or []]
                reason = deltas[-1].finish_reason
            else:
                calls, reason = r.choices[0].message.tool_calls, r.choices[0].finish_reason
            assert reason == "tool_calls" and [c.function.name for c in calls] == ["get_time"], (choice, stream)
            assert json.loads(calls[0].function.arguments)["zone"] in ("UTC", "CET")


def test_ollama_think_effort_thinking_and_tool_calls(oll):
    r = oll.chat(model="gpt-think", messages=HI, think=True)
    assert (r.message.thinking, r.message.content) == ("Let me count.", "Three!")
    parts = list(oll.chat(model="gpt-think", messages=HI, think="high", stream=True))
    assert "".join(p.message.thinking or "" for p in parts) == "Let me count."
    assert "".join(p.message.content for p in parts) == "Three!" and parts[-1].done
    counts = {e: oll.chat(model="gpt-think", messages=HI, think=e).prompt_eval_count for e in ("low", "high")}
    assert counts["high"] - counts["low"] == 1
    off = oll.chat(model="gpt-think", messages=HI, think=False)
    assert (off.message.thinking, off.message.content) == (None, "Three!")
    g = oll.generate(model="gpt-think", prompt="How many?", think=True)
    assert (g.thinking, g.response) == ("Let me count.", "Three!")
    for stream in (False, True):
        if stream:
            parts = list(oll.chat(model="gpt-tools", messages=HI, tools=[WEATHER], stream=True))
            thinking = "".join(p.message.thinking or "" for p in parts)
            calls = [c for p in parts for c in p.message.tool_calls or []]
        else:
            r = oll.chat(model="gpt-tools", messages=HI, tools=[WEATHER])
            thinking, calls = r.message.thinking, r.message.tool_calls
        assert thinking == "I need the weather."
        assert [(c.function.name, c.function.arguments) for c in calls] == [("get_weather", {"city": "Paris"})]
