"""`kiln serve` end to end: a real server process with smollm2:135m, driven by the official `openai` and
`ollama` clients (unmodified) and by raw HTTP where the exact wire format matters."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid

import httpx
import jsonschema
import ollama
import openai
import pytest

from tests.conftest import TEST_HOME
from tests.serving import kiln_server

pytestmark = pytest.mark.slow

MODEL = "smollm2:135m"
CTX = 1024
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}}, "required": ["city"]}}}
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 120}}}


@pytest.fixture(scope="module")
def server(smollm2_path):
    with kiln_server(TEST_HOME, MODEL, "--parallel", "4", "--ctx-len", str(CTX), "--max-queue", "8") as s:
        yield s


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def oll(server):
    return ollama.Client(host=server.url, timeout=120)


def chat(oai, messages=QUESTION, **kwargs):
    return oai.chat.completions.create(**{"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 24, **kwargs})


def wait_for(condition, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


# --- OpenAI ------------------------------------------------------------------------------------------
def test_openai_chat_stream_matches_non_stream(oai):
    whole = chat(oai)
    assert whole.choices[0].message.content
    assert whole.choices[0].finish_reason in ("stop", "length")
    usage = whole.usage
    assert usage.completion_tokens == whole.timings["completion_tokens"] > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens == whole.timings["cache_n"]
    for key in ("queue_ms", "ttft_ms", "load_ms", "prefill_tps", "decode_tps", "prompt_per_second", "predicted_per_second"):
        assert key in whole.timings
    assert whole.timings["ttft_ms"] > 0

    chunks = list(chat(oai, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content  # greedy: the same tokens either way
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == usage.completion_tokens


def test_openai_logprobs(oai):
    r = chat(oai, max_tokens=5, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.logprob  # greedy took the best token
    assert "".join(e.token for e in content).startswith(r.choices[0].message.content)


def test_openai_completions(oai):
    args = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    whole = oai.completions.create(**args, logprobs=2)
    choice = whole.choices[0]
    assert choice.text and choice.finish_reason in ("stop", "length")
    assert len(choice.logprobs.tokens) == whole.usage.completion_tokens
    assert all(len(top) == 2 for top in choice.logprobs.top_logprobs)
    streamed = "".join(c.choices[0].text for c in oai.completions.create(**args, stream=True))
    assert streamed == choice.text
    echoed = oai.completions.create(**args, echo=True)
    assert echoed.choices[0].text == "The capital of France is" + choice.text


def test_openai_models(oai):
    ids = [m.id for m in oai.models.list()]
    assert MODEL in ids
    assert oai.models.retrieve(MODEL).id == MODEL


def test_openai_json_schema_output_validates(oai):
    r = chat(oai, messages=[{"role": "user", "content": "Describe a person as JSON."}], max_tokens=80,
             response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)

    r = chat(oai, messages=[{"role": "user", "content": "List three colors as JSON."}], max_tokens=60,
             response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":  # at "length" the object is cut short, as in OpenAI's API
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.startswith("{")


def test_openai_tool_call_round_trip(oai):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = chat(oai, messages=messages, tools=[WEATHER_TOOL], tool_choice="required", max_tokens=60)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER_TOOL["function"]["parameters"])

    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 18})}]
    answer = chat(oai, messages=messages, tools=[WEATHER_TOOL], max_tokens=24)
    assert answer.choices[0].message.content or answer.choices[0].message.tool_calls
    assert answer.usage.prompt_tokens > r.usage.prompt_tokens  # the call and its result are in the prompt
    plain = chat(oai, messages=messages, tools=[WEATHER_TOOL], tool_choice="none", max_tokens=24)
    assert plain.choices[0].message.content and not plain.choices[0].message.tool_calls


def test_openai_tool_call_round_trip_streaming(oai):
    messages = [{"role": "user", "content": "Is it raining in Oslo?"}]
    stream = chat(oai, messages=messages, tools=[WEATHER_TOOL], max_tokens=60, stream=True,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        delta = chunk.choices[0].delta
        for part in delta.tool_calls or []:
            call = calls.setdefault(part.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = call["id"] or part.id
            call["name"] += part.function.name or ""
            call["arguments"] += part.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and list(calls) == [0]
    call = calls[0]
    assert call["name"] == "get_weather"
    jsonschema.validate(json.loads(call["arguments"]), WEATHER_TOOL["function"]["parameters"])

    messages += [{"role": "assistant", "content": None, "tool_calls": [
                     {"id": call["id"], "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}]},
                 {"role": "tool", "tool_call_id": call["id"], "content": "light rain, 9 C"}]
    text = "".join(c.choices[0].delta.content or "" for c in chat(oai, messages=messages, stream=True, max_tokens=24)
                   if c.choices)
    assert text


def test_a_broken_tool_call_is_reported_not_passed_on(oai):
    # A stop string cuts the forced call short, leaving invalid JSON inside <tool_call>.
    r = chat(oai, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER_TOOL],
             tool_choice="required", stop=['"city"'], max_tokens=60)
    choice = r.choices[0]
    assert choice.finish_reason == "invalid_tool_call" and not choice.message.tool_calls
    assert "not valid JSON" in choice.model_extra["tool_call_error"]
    assert choice.message.content.startswith("<tool_call>")  # what the model wrote, as text
    chunks = list(chat(oai, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER_TOOL],
                       tool_choice="required", max_tokens=8, stream=True))
    final = chunks[-1].choices[0]
    assert final.finish_reason == "length" and "tool_call_error" in final.model_extra
    assert not any(c.choices[0].delta.tool_calls for c in chunks)


# --- Ollama ------------------------------------------------------------------------------------------
def test_ollama_chat_stream_matches_non_stream(oll, server):
    options = {"temperature": 0, "num_predict": 24}
    whole = oll.chat(model=MODEL, messages=QUESTION, options=options, stream=False)
    assert whole.message.role == "assistant" and whole.message.content
    assert whole.done and whole.done_reason in ("stop", "length")
    assert whole.eval_count > 0 and whole.prompt_eval_count > 0
    assert whole.total_duration >= whole.prompt_eval_duration + whole.eval_duration > 0
    # the client keeps only Ollama's fields; kiln's timings ride along on the wire
    raw = httpx.post(f"{server.url}/api/chat", json={"model": MODEL, "messages": QUESTION, "options": options,
                                                     "stream": False}, timeout=60).json()
    assert raw["message"]["content"] == whole.message.content
    timings = raw["timings"]
    assert timings["completion_tokens"] == raw["eval_count"] and timings["ttft_ms"] > 0 and "queue_ms" in timings
    assert timings["cached_tokens"] == raw["prompt_eval_count"] - 1  # the same prompt again

    parts = list(oll.chat(model=MODEL, messages=QUESTION, options=options, stream=True))
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert [p.done for p in parts].count(True) == 1 and parts[-1].done and parts[-1].eval_count == whole.eval_count


def test_ollama_generate(oll):
    options = {"temperature": 0, "num_predict": 12}
    r = oll.generate(model=MODEL, prompt="Name a fruit.", options=options)
    assert r.response and r.done and r.context and r.prompt_eval_count < len(r.context)
    raw = oll.generate(model=MODEL, prompt="The capital of France is", raw=True, options=options)
    streamed = "".join(p.response for p in oll.generate(model=MODEL, prompt="The capital of France is", raw=True,
                                                         options=options, stream=True))
    assert raw.response == streamed


def test_ollama_format_schema_validates(oll):
    r = oll.chat(model=MODEL, messages=[{"role": "user", "content": "Describe a person as JSON."}], format=PERSON,
                 options={"temperature": 0, "num_predict": 80})
    assert r.done_reason == "stop"
    jsonschema.validate(json.loads(r.message.content), PERSON)
    r = oll.generate(model=MODEL, prompt="Give me a JSON object.", format="json", options={"temperature": 0, "num_predict": 60})
    assert r.response.startswith("{")


def test_ollama_tool_history_round_trip(oll):
    messages = [{"role": "user", "content": "What is the weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "tool_name": "get_weather", "content": "sunny, 24 C"}]
    r = oll.chat(model=MODEL, messages=messages, tools=[WEATHER_TOOL], options={"temperature": 0, "num_predict": 24})
    assert r.done and (r.message.content or r.message.tool_calls)
    parts = list(oll.chat(model=MODEL, messages=messages, tools=[WEATHER_TOOL], stream=True,
                          options={"temperature": 0, "num_predict": 24}))
    assert parts[-1].done


def test_ollama_models(oll, server, smollm2_path):
    from kiln.store import Store

    listed = {m.model: m for m in oll.list().models}
    assert listed[MODEL].details.family == "llama" and listed[MODEL].size > 0 and listed[MODEL].digest
    shown = oll.show(MODEL)
    assert "tools" in shown.capabilities and "<|im_start|>" in shown.template
    assert shown.modelinfo["llama.context_length"] == 8192 and "temperature" in shown.parameters
    (running,) = oll.ps().models
    assert running.model == MODEL and running.context_length == CTX
    statuses = [p.status for p in oll.pull(MODEL, stream=True)]
    assert statuses[0] == "pulling manifest" and statuses[-1] == "success"
    assert oll.pull(MODEL).status == "success"
    with pytest.raises(ollama.ResponseError, match="not-a-model"):
        list(oll.pull("not-a-model:1b", stream=True))
    assert httpx.get(f"{server.url}/api/version").json()["version"]

    Store(home=TEST_HOME).pull(str(smollm2_path), name="kiln-delete-me", progress=False)
    assert "kiln-delete-me:latest" in {m.model for m in oll.list().models}
    assert oll.delete("kiln-delete-me").status == "success"
    assert "kiln-delete-me:latest" not in {m.model for m in oll.list().models}
    assert MODEL in {m.model for m in oll.list().models}  # the shared blob stays
    with pytest.raises(ollama.ResponseError) as missing:
        oll.delete("kiln-delete-me")
    assert missing.value.status_code == 404


# --- errors --------------------------------------------------------------------------------------------
def test_bad_requests_name_the_field(server, oai):
    post = lambda path, **kw: httpx.post(f"{server.url}{path}", timeout=60, **kw)  # noqa: E731
    body = {"model": MODEL, "messages": QUESTION}

    r = post("/v1/chat/completions", content=b'{"model": "smollm2:135m", "messages": [', headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "body" and "JSON" in r.json()["error"]["message"]
    r = post("/api/chat", content=b"{not json")
    assert r.status_code == 400 and "JSON" in r.json()["error"]

    r = post("/v1/chat/completions", json={**body, "messages": "hello"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = post("/v1/chat/completions", json={**body, "temperature": "warm"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature" and "temperature" in r.json()["error"]["message"]
    r = post("/api/chat", json={**body, "options": {"top_k": "many"}})
    assert r.status_code == 400 and "options.top_k" in r.json()["error"]

    with pytest.raises(openai.BadRequestError) as e:
        chat(oai, max_tokens=-1)
    assert e.value.param == "max_tokens" and "max_tokens" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        chat(oai, n=2)
    assert e.value.param == "n"
    with pytest.raises(openai.BadRequestError) as e:
        chat(oai, tools=[WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert e.value.param == "tool_choice" and "get_time" in e.value.message

    with pytest.raises(openai.NotFoundError) as e:
        chat(oai, model="no-such-model:7b")
    assert e.value.code == "model_not_found" and e.value.param == "model" and "no-such-model" in e.value.message
    with pytest.raises(ollama.ResponseError) as missing:
        ollama.Client(host=server.url).chat(model="no-such-model:7b", messages=QUESTION)
    assert missing.value.status_code == 404 and "no-such-model" in missing.value.error

    long_prompt = [{"role": "user", "content": "word " * (CTX + 100)}]
    with pytest.raises(openai.BadRequestError) as e:
        chat(oai, messages=long_prompt)
    assert e.value.code == "context_length_exceeded" and e.value.param == "messages" and str(CTX) in e.value.message
    r = post("/api/generate", json={"model": MODEL, "prompt": "word " * (CTX + 100), "stream": False})
    assert r.status_code == 400 and "context" in r.json()["error"]


# --- serving behaviour -----------------------------------------------------------------------------------
def test_prompt_cache_reuses_history(oai, server):
    nonce = uuid.uuid4().hex  # no earlier request shares this history
    history = [{"role": "system", "content": f"Session {nonce}. You are a terse assistant."}]
    for i in range(6):
        history += [{"role": "user", "content": f"Tell me fact number {i} about the sea."},
                    {"role": "assistant", "content": f"Fact {i}: the sea covers most of the planet and holds many fish."}]
    history.append({"role": "user", "content": "And one more?"})
    cached_before = server.metric("kiln_prompt_cached_tokens_total")
    first = chat(oai, messages=history, max_tokens=4)
    second = chat(oai, messages=history, max_tokens=4)
    prompt = first.usage.prompt_tokens
    assert prompt > 150
    assert first.usage.prompt_tokens_details.cached_tokens < 40  # at most the template's fixed opening
    assert second.usage.prompt_tokens_details.cached_tokens == prompt - 1  # all but the last token
    assert second.timings["ttft_ms"] < first.timings["ttft_ms"]
    assert second.choices[0].message.content == first.choices[0].message.content
    assert server.metric("kiln_prompt_cached_tokens_total") - cached_before >= prompt - 1


def test_concurrent_streams_all_complete(server):
    import asyncio

    async def one(client, i):
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"Count to {i + 3}."}], "max_tokens": 16,
                "stream": True, "temperature": 0}
        text, finish = "", None
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    choice = json.loads(line[6:])["choices"][0]
                    text += choice["delta"].get("content") or ""
                    finish = choice["finish_reason"] or finish
        return text, finish

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(6)))  # 4 slots: two wait in the queue

    results = asyncio.run(main())
    assert all(text and finish in ("stop", "length") for text, finish in results)
    assert wait_for(lambda: server.metric("kiln_requests_running") == 0)


def test_disconnect_cancels_and_frees_the_slot(server):
    cancelled = server.metric("kiln_requests_total", 'finish_reason="cancelled"')
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a very long story."}], "max_tokens": 800,
            "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
        assert server.metric("kiln_requests_running") == 1
    assert wait_for(lambda: server.metric("kiln_requests_running") == 0, timeout=10)
    assert wait_for(lambda: server.metric("kiln_requests_total", 'finish_reason="cancelled"') == cancelled + 1)


def test_health_metrics_and_openapi(server):
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("kiln_prompt_tokens_total", "kiln_generated_tokens_total", "kiln_time_to_first_token_seconds_bucket",
                 "kiln_queue_wait_seconds_bucket", "kiln_request_duration_seconds_bucket", "kiln_requests_running",
                 "kiln_requests_waiting", "kiln_kv_cache_usage_ratio"):
        assert name in text
    assert server.metric("kiln_generated_tokens_total") > 0
    spec = httpx.get(f"{server.url}/openapi.json").json()
    request = spec["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert {"messages", "max_tokens", "response_format", "tools", "tool_choice", "stream"} <= set(request)


def test_the_endpoints_clients_probe(server, oll):
    for method in ("GET", "HEAD"):
        r = httpx.request(method, f"{server.url}/")
        assert r.status_code == 200 and r.text == ("kiln is running" if method == "GET" else "")
        for path in ("/api/tags", "/api/version"):
            assert httpx.request(method, f"{server.url}{path}").status_code == 200
    assert oll.show(MODEL).capabilities == ["completion", "tools", "embedding"]


def test_llama_server_tokenize_template_props_and_slots(server, oai):
    post = lambda path, body: httpx.post(f"{server.url}{path}", json=body, timeout=120)  # noqa: E731
    text = "Hello, wörld!𒀀"
    ids = post("/tokenize", {"content": text})
    assert ids.status_code == 200 and all(isinstance(i, int) for i in ids.json()["tokens"])
    pieces = post("/tokenize", {"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == ids.json()["tokens"]
    assert b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"]) for p in pieces) == text.encode()
    assert any(isinstance(p["piece"], list) for p in pieces)  # the cuneiform sign is split into byte tokens
    assert post("/detokenize", {"tokens": ids.json()["tokens"]}).json() == {"content": text}

    prompt = post("/apply-template", {"messages": QUESTION}).json()["prompt"]
    assert QUESTION[0]["content"] in prompt and prompt.endswith("<|im_start|>assistant\n")
    tokens = post("/tokenize", {"content": prompt, "add_special": True}).json()["tokens"]
    assert len(tokens) == chat(oai, max_tokens=1).usage.prompt_tokens  # the prompt a chat request runs

    props = httpx.get(f"{server.url}/props").json()
    assert props["default_generation_settings"]["n_ctx"] == CTX and props["total_slots"] == 4
    assert props["model_alias"] == MODEL and props["chat_template"].startswith("{")
    assert props["modalities"] == {"vision": False, "audio": False} and props["build_info"].startswith("kiln ")
    assert props["default_generation_settings"]["params"]["temperature"] >= 0

    idle = httpx.get(f"{server.url}/slots").json()
    assert [s["id"] for s in idle] == [0, 1, 2, 3] and all(s["n_ctx"] == CTX for s in idle)
    assert not any(s["is_processing"] for s in idle) and max(s["tokens_cached"] for s in idle) >= len(tokens) - 1
    body = {"model": MODEL, "prompt": "1, 2, 3, 4, 5,", "max_tokens": 300, "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as stream:
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))  # decoding: counting on
        now = httpx.get(f"{server.url}/slots").json()
        rest = list(lines)
    busy = [s for s in now if s["is_processing"]]
    assert len(busy) == 1 and busy[0]["id_task"] >= 0 and busy[0]["state"] == 1, (first, now, rest[-3:])

    assert post("/detokenize", {"tokens": [10**9]}).json()["error"]["param"] == "tokens"
    assert post("/tokenize", {"content": "x", "model": "no-such:1b"}).status_code == 404
    assert post("/tokenize", {"content": "x", "bogus": 1}).json()["error"]["param"] == "bogus"


def test_another_model_loads_beside_the_busy_one(oll, server, gemma3_path):
    import threading

    parts = []  # a long answer, so the other model's request arrives while it is still running
    story = [{"role": "user", "content": "Write a very long story."}]
    stream = threading.Thread(target=lambda: parts.extend(oll.chat(
        model=MODEL, messages=story, stream=True, options={"temperature": 0, "num_predict": 200})))
    stream.start()
    assert wait_for(lambda: server.metric("kiln_requests_running") == 1)
    loads = server.metric("kiln_model_loads_total", f'model="{MODEL}"')
    other = ollama.Client(host=server.url, timeout=120).generate(
        model="gemma3:270m", prompt="The capital of France is", raw=True, options={"num_predict": 3})
    stream.join()
    assert parts[-1].done and parts[-1].done_reason in ("stop", "length")
    assert other.response and other.load_duration > 0
    assert sorted(m.model for m in oll.ps().models) == ["gemma3:270m", MODEL]  # both stay
    assert server.metric("kiln_model_loads_total", f'model="{MODEL}"') == loads  # smollm2 was never unloaded
    oll.generate(model="gemma3:270m", keep_alive=0)  # the other tests expect smollm2 alone
    assert wait_for(lambda: [m.model for m in oll.ps().models] == [MODEL], timeout=10)


def test_keep_alive_zero_unloads_then_reloads(oll):
    r = oll.generate(model=MODEL, prompt="Hi", options={"num_predict": 2}, keep_alive=0)
    assert r.done
    assert wait_for(lambda: not oll.ps().models, timeout=10)
    loaded = oll.generate(model=MODEL, keep_alive="10m")  # an empty prompt just loads
    assert loaded.done_reason == "load"
    (running,) = oll.ps().models
    assert running.expires_at.timestamp() > time.time() + 500


def kiln_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kiln", *args], capture_output=True, text=True, timeout=120)


def test_kiln_ps_and_stop(oll, server):
    shown = kiln_cli("ps", "--url", server.url)
    assert shown.returncode == 0, shown.stderr
    header, row = shown.stdout.splitlines()
    assert header.split()[:4] == ["NAME", "ID", "SIZE", "PROCESSOR"]
    assert row.split()[0] == MODEL and f" {CTX} " in row and "/4 busy" in row and "from now" in row
    stopped = kiln_cli("stop", "smollm2", "--url", server.url)
    assert stopped.returncode == 0 and stopped.stdout.strip() == f"stopped {MODEL}", stopped.stderr
    assert not oll.ps().models
    assert [line.split() for line in kiln_cli("ps", "--url", server.url).stdout.splitlines()] == [header.split()]
    again = kiln_cli("stop", MODEL, "--url", server.url)
    assert again.returncode == 1 and "no model is loaded" in again.stderr
    assert oll.generate(model=MODEL, keep_alive="10m").done_reason == "load"  # as the other tests expect


EMBED_TEXTS = ["The cat sat on the mat.", "A cat was sitting on a mat.", "Stock markets fell sharply today."]


def test_embeddings_with_the_official_clients(oai, oll, server, smollm2_path):
    import numpy as np

    from kiln.engine.model import load

    before = server.metric("kiln_embedding_inputs_total", 'api="openai"')
    r = oai.embeddings.create(model=MODEL, input=EMBED_TEXTS)  # the SDK asks for base64 and decodes it
    assert server.metric("kiln_embedding_inputs_total", 'api="openai"') == before + 3
    vectors = np.array([d.embedding for d in r.data])
    assert [d.index for d in r.data] == [0, 1, 2] and vectors.shape == (3, 576) and r.model == MODEL
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-5)
    # each is its text's last final hidden state (the output head's input), normalized
    model = load(str(smollm2_path), n_ctx=CTX, progress=False)
    try:
        for text, vector in zip(EMBED_TEXTS, vectors):
            ids = model.tokenizer.encode(text)
            model.engine.step(ids, [0] * len(ids), range(len(ids)), [len(ids) - 1])
            hidden = model.engine.hidden(1)[0]
            assert np.allclose(vector, hidden / np.linalg.norm(hidden), atol=1e-5)
    finally:
        model.close()
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(len(model.tokenizer.encode(t)) for t in EMBED_TEXTS)
    _, same, other = vectors @ vectors[0]
    assert same > other  # two wordings of one sentence are closer than an unrelated one

    floats = httpx.post(f"{server.url}/v1/embeddings", json={"model": MODEL, "input": EMBED_TEXTS[0],
                                                               "encoding_format": "float"}).json()
    assert np.allclose(floats["data"][0]["embedding"], vectors[0], atol=1e-6)
    cut = oai.embeddings.create(model=MODEL, input=EMBED_TEXTS[0], dimensions=64).data[0].embedding
    assert np.allclose(cut, vectors[0][:64] / np.linalg.norm(vectors[0][:64]), atol=1e-5)

    ollama_vectors = oll.embed(model=MODEL, input=EMBED_TEXTS).embeddings
    assert np.allclose(ollama_vectors, vectors, atol=1e-5)
    many = oll.embed(model=MODEL, input=EMBED_TEXTS * 7).embeddings  # more inputs than slots + queue (4 + 8)
    assert np.allclose(many, np.tile(vectors, (7, 1)), atol=1e-5)
    legacy = np.array(oll.embeddings(model=MODEL, prompt=EMBED_TEXTS[0]).embedding)  # the older API: not normalized
    assert np.linalg.norm(legacy) > 2 and np.allclose(legacy / np.linalg.norm(legacy), vectors[0], atol=1e-5)


def test_bad_embedding_requests_name_the_field(server):
    def post(path, body):
        r = httpx.post(f"{server.url}{path}", json={"model": MODEL, **body}, timeout=60)
        assert r.status_code == 400, r.text
        return r.json()["error"]

    long_text = "word " * (CTX + 50)
    error = post("/v1/embeddings", {"input": ["fine", long_text]})
    assert error["param"] == "input[1]" and error["code"] == "context_length_exceeded" and "truncate" in error["message"]
    assert post("/v1/embeddings", {"input": []})["param"] == "input"
    assert post("/v1/embeddings", {"input": "x", "dimensions": 100000})["param"] == "dimensions"
    assert post("/v1/embeddings", {"input": [[1, 2], [10 ** 9]]})["param"] == "input[1]"
    assert "input" in post("/api/embed", {"input": 42})  # Ollama's errors are a message alone
    assert "context" in post("/api/embed", {"input": long_text, "truncate": False})
    assert server.metric("kiln_requests_running") == 0  # nothing left behind by the rejected ones


def test_create_copy_show_and_chat_with_a_created_model(oll):
    system = "You are a terse assistant."
    created = oll.create(model="kiln-terse", from_=MODEL, system=system, parameters={"temperature": 0, "stop": ["\n\n"]})
    assert created.status == "success"
    shown = oll.show("kiln-terse")
    lines = shown.parameters.splitlines()  # the catalog's defaults for the weights, then the model's own
    assert "temperature 0.0" in lines and lines[-1] == r'stop "\n\n"'
    assert f'SYSTEM """{system}"""' in shown.modelfile and shown.details.family == "llama"
    assert oll.copy("kiln-terse", "kiln-terse2").status == "success"
    assert {"kiln-terse:latest", "kiln-terse2:latest"} <= {m.model for m in oll.list().models}
    # the created model's chats get its system message
    mine = oll.chat(model="kiln-terse2", messages=[{"role": "user", "content": "Hi"}], options={"num_predict": 1})
    explicit = [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}]
    base = oll.chat(model=MODEL, messages=explicit, options={"num_predict": 1})
    assert mine.prompt_eval_count == base.prompt_eval_count
    with pytest.raises(ollama.ResponseError) as bad:
        oll.create(model="kiln-bad", from_=MODEL, parameters={"mirostat": 1})
    assert bad.value.status_code == 400 and "mirostat" in str(bad.value)
    for tag in ("kiln-terse", "kiln-terse2"):
        assert oll.delete(tag).status == "success"
    assert MODEL in {m.model for m in oll.list().models}


def test_upload_a_gguf_and_create_a_model_from_it(oll, server, tmp_path):
    import hashlib

    from kiln.store import Store
    from kiln.synth import write_random_gguf

    path = write_random_gguf(tmp_path / "tiny.gguf", "tiny-llama", seed=3)
    digest = oll.create_blob(path)  # the official client's upload: POST /api/blobs/sha256:...
    assert digest == "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()
    assert httpx.head(f"{server.url}/api/blobs/{digest}").status_code == 200
    assert oll.create(model="kiln-uploaded", files={"tiny.gguf": digest}, system="Be brief.").status == "success"
    record = Store(home=TEST_HOME).resolve("kiln-uploaded")
    assert record.path.read_bytes() == path.read_bytes() and record.system == "Be brief."
    assert oll.generate(model="kiln-uploaded", prompt="hi", raw=True, options={"num_predict": 2}).done

    def refused(url, content):
        r = httpx.post(url, content=content)
        assert r.status_code == 400, r.text
        return r.json()["error"]

    assert "sha256" in refused(f"{server.url}/api/blobs/sha256:{'0' * 64}", path.read_bytes())
    text = b"not a model"
    assert "GGUF" in refused(f"{server.url}/api/blobs/sha256:{hashlib.sha256(text).hexdigest()}", text)
    assert "not a digest" in refused(f"{server.url}/api/blobs/md5:abc", text)
    assert httpx.head(f"{server.url}/api/blobs/sha256:{hashlib.sha256(text).hexdigest()}").status_code == 404
    with pytest.raises(ollama.ResponseError) as bad:
        oll.create(model="kiln-bad", files={"x.gguf": "/etc/hostname"})
    assert bad.value.status_code == 400
    assert oll.delete("kiln-uploaded").status == "success"
    assert not record.path.exists()  # its last tag gone, the uploaded blob goes too
    assert oll.generate(model=MODEL, keep_alive="10m").done_reason == "load"


# --- OpenAI Responses API ------------------------------------------------------------------------------
RESPONSE_TOOL = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
                 "parameters": WEATHER_TOOL["function"]["parameters"]}


def test_responses_text_and_stream_agree(oai):
    kwargs = {"model": MODEL, "input": "What is the capital of France?", "instructions": "You are a geography tutor.",
              "max_output_tokens": 24, "temperature": 0}
    whole = oai.responses.create(**kwargs)
    assert whole.object == "response" and whole.status in ("completed", "incomplete") and whole.output_text
    assert whole.usage.input_tokens > 0 and whole.usage.output_tokens <= 24
    events = list(oai.responses.create(**kwargs, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{whole.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == events[-1].response.output_text == whole.output_text


def test_llama_server_json_object_schema_constrains_the_output(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Describe a person as JSON."}], "max_tokens": 80,
            "temperature": 0, "response_format": {"type": "json_object", "schema": PERSON}}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120).json()
    assert r["choices"][0]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(r["choices"][0]["message"]["content"]), PERSON)
    body["response_format"] = {"type": "text", "schema": PERSON}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format.schema"


def test_a_response_cut_by_max_output_tokens_is_incomplete(oai):
    kwargs = {"model": MODEL, "input": "Tell me a long story.", "max_output_tokens": 3, "temperature": 0}
    whole = oai.responses.create(**kwargs)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert [item.status for item in whole.output] == ["incomplete"]
    done = [e for e in oai.responses.create(**kwargs, stream=True) if e.type == "response.output_item.done"]
    assert [e.item.status for e in done] == ["incomplete"]


def test_responses_tool_call_round_trip_and_json(oai):
    first = oai.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[RESPONSE_TOOL],
                                 tool_choice="required", temperature=0)
    (call,) = [o for o in first.output if o.type == "function_call"]
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments)["city"], str)
    streamed = [e for e in oai.responses.create(model=MODEL, input="What is the weather in Paris?",
                                                tools=[RESPONSE_TOOL], tool_choice="required", temperature=0,
                                                stream=True)]
    (done,) = [e.item for e in streamed if e.type == "response.output_item.done" and e.item.type == "function_call"]
    assert done.arguments == call.arguments and streamed[-1].type == "response.completed"
    history = [{"role": "user", "content": "What is the weather in Paris?"},
               {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}]
    answer = oai.responses.create(model=MODEL, input=history, tools=[RESPONSE_TOOL], temperature=0, max_output_tokens=40)
    assert answer.output_text and answer.usage.input_tokens > first.usage.input_tokens
    person = oai.responses.create(model=MODEL, input="Describe a person named Ann, aged 31.", temperature=0,
                                  text={"format": {"type": "json_schema", "name": "person", "schema": PERSON}})
    jsonschema.validate(json.loads(person.output_text), PERSON)


def test_bad_responses_requests_name_the_field(server):
    def error(body):
        r = httpx.post(f"{server.url}/v1/responses", json={"model": MODEL, **body}, timeout=60)
        assert r.status_code == 400, r.text
        return r.json()["error"]

    assert error({"input": "x", "previous_response_id": "resp_1"})["param"] == "previous_response_id"
    assert error({"input": []})["param"] == "input"
    assert error({"input": "x", "max_output_tokens": -1})["param"].endswith("max_output_tokens")
    assert error({"input": "word " * (CTX + 10)})["code"] == "context_length_exceeded"
    bad_call = [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{nope"}]
    assert error({"input": bad_call})["param"] == "input[0].arguments"


def test_logit_bias_bans_and_forces_tokens(oai, server):
    def first_token(**kwargs):
        r = oai.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=1, temperature=0,
                                   logprobs=1, **kwargs)
        return r.choices[0].logprobs.tokens[0], r.choices[0].text

    greedy, _ = first_token()
    ids = httpx.post(f"{server.url}/api/generate", json={"model": MODEL, "prompt": "The capital of France is" + greedy,
                                                         "raw": True, "options": {"num_predict": 0}}).json()["context"]
    greedy_id = ids[-1]  # the greedy token's id: the last of the prompt that ends with it
    banned, _ = first_token(logit_bias={str(greedy_id): -100})
    assert banned != greedy
    _, forced = first_token(logit_bias={str(ids[0]): 100})  # "The", the prompt's first token
    assert forced == oai.completions.create(model=MODEL, prompt=[ids[0]], max_tokens=0, echo=True).choices[0].text
    for bias in ({"abc": 1}, {"1": 500}, {"999999": 1}):
        r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, "messages": QUESTION, "logit_bias": bias})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text
