"""Anthropic's Messages API on a real `kiln serve` with smollm2:135m, driven by the official `anthropic`
client (unmodified), and by raw HTTP where the exact event sequence matters."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from tests.conftest import TEST_HOME
from tests.serving import kiln_server

pytestmark = pytest.mark.slow

MODEL = "smollm2:135m"
KEY = "sk-test"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                            "required": ["city"]}}
GREEDY = {"extra_body": {"temperature": 0}}  # the client's create() no longer lists the sampling fields


@pytest.fixture(scope="module")
def server(smollm2_path):
    with kiln_server(TEST_HOME, MODEL, "--parallel", "2", "--ctx-len", "1024", "--api-key", KEY) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


def ask(client, messages=QUESTION, **kwargs):
    return client.messages.create(**{"model": MODEL, "max_tokens": 24, "messages": messages, **GREEDY, **kwargs})


def test_stream_matches_non_stream_and_reports_usage(client):
    whole = ask(client, system=[{"type": "text", "text": "Answer in one word."}])
    assert whole.type == "message" and whole.role == "assistant" and whole.model == MODEL
    assert [b.type for b in whole.content] == ["text"] and whole.content[0].text
    assert whole.stop_reason in ("end_turn", "max_tokens") and whole.stop_sequence is None
    assert whole.usage.output_tokens > 0 and whole.usage.input_tokens > 0

    with client.messages.stream(model=MODEL, max_tokens=24, messages=QUESTION, **GREEDY,
                                system=[{"type": "text", "text": "Answer in one word."}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text  # greedy: the same tokens either way
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    # the same prompt again: all but the last token come from the prompt cache
    total = whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    assert final.usage.cache_read_input_tokens > 0
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == total


def test_event_sequence_on_the_wire(server):
    body = {"model": MODEL, "max_tokens": 5, "messages": QUESTION, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        blocks = r.read().decode().strip().split("\n\n")
    events = []
    for block in blocks:
        name, data = block.split("\n")
        events.append(json.loads(data.removeprefix("data: ")))
        assert name == f"event: {events[-1]['type']}"
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["message_start", "ping", "content_block_start", "content_block_delta"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[3:-3]) == {"content_block_delta"}
    assert events[-2]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert events[-2]["usage"]["output_tokens"] == 5
    assert events[0]["message"]["content"] == [] and events[0]["message"]["stop_reason"] is None


def test_max_tokens_and_stop_sequences(client):
    cut = ask(client, max_tokens=3)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3
    free = ask(client, max_tokens=30)
    text = free.content[0].text
    word = next(w for w in text.split()[1:] if len(w) > 2)  # a word the greedy answer says, after its first
    stopped = ask(client, max_tokens=30, stop_sequences=[word])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert stopped.content[0].text == text[: text.index(word)]


def test_tool_use_round_trip(client):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = ask(client, messages, max_tokens=60, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"})
    assert first.stop_reason == "tool_use"
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "get_weather" and isinstance(use.input["city"], str) and use.id.startswith("toolu_")
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 24 C"}]}]
    second = ask(client, messages, max_tokens=30, tools=[WEATHER], tool_choice={"type": "none"})
    assert second.stop_reason in ("end_turn", "max_tokens") and second.content[0].text
    # the tool result reached the prompt: it counts tokens
    with_result = client.messages.count_tokens(model=MODEL, messages=messages, tools=[WEATHER])
    without = client.messages.count_tokens(model=MODEL, messages=messages[:1], tools=[WEATHER])
    assert with_result.input_tokens > without.input_tokens

    with client.messages.stream(model=MODEL, max_tokens=60, messages=messages[:1], tools=[WEATHER],
                                tool_choice={"type": "any"}, **GREEDY) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [b.input for b in final.content if b.type == "tool_use"] == [use.input]  # greedy: the same call


def test_count_tokens_matches_the_usage(client):
    counted = client.messages.count_tokens(model=MODEL, messages=QUESTION, system="Be brief.")
    used = ask(client, system="Be brief.", max_tokens=1, messages=QUESTION)
    assert counted.input_tokens == used.usage.input_tokens + used.usage.cache_read_input_tokens > 5


def test_errors_in_anthropics_shape(client, server):
    with pytest.raises(anthropic.NotFoundError) as e:
        ask(client, model="no-such-model:1b")
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "not_found_error"
    assert "no-such-model" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:  # a field kiln does not implement
        ask(client, thinking={"type": "enabled", "budget_tokens": 1024}, metadata={"user_id": "u-1"})
    assert e.value.body["error"]["type"] == "invalid_request_error" and "thinking" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        ask(client, messages=[{"role": "user", "content": [{"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    assert "messages[0].content" in e.value.body["error"]["message"] and "image" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        ask(client, tools=[WEATHER], tool_choice={"type": "tool", "name": "launch"})
    assert "launch" in e.value.body["error"]["message"]
    r = httpx.post(f"{server.url}/v1/messages", json={"model": MODEL, "messages": QUESTION}, headers={"x-api-key": KEY})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]  # required, as Anthropic has it
    r = httpx.post(f"{server.url}/v1/messages", json={"model": MODEL, "max_tokens": 4, "messages": QUESTION},
                   headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
