"""`kiln serve --ray`: two one-thread replicas of a synth model on a local Ray instance (loopback), driven
by the official `openai`, `ollama` and `anthropic` clients and compared with `kiln serve` on the same model; prefix
affinity against a baseline with it off; a replica killed mid-stream."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import ollama
import openai
import pytest

from kiln.synth import write_random_gguf
from tests.serving import kiln_server

pytestmark = pytest.mark.slow

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"]}}}
SMALL = {"type": "object", "additionalProperties": False, "required": ["n"],
         "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}}
ROLES = ("a ship's navigator", "a pastry chef", "an archivist", "a mountain guide")
SYSTEMS = [f"{role.capitalize()} answers here, briefly and politely, in plain words about the topic asked. " * 3
           for role in ROLES]  # no two share an opening: four applications, each with its own prompt


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    home = tmp_path_factory.mktemp("ray")
    # wider and deeper than tiny-qwen2, so a long answer streams for seconds (the failover test kills it midway)
    path = write_random_gguf(home / "m.gguf", "tiny-qwen2", seed=2, dim=256, n_layers=6, ffn_dim=768)
    return home, str(path)


def _ray_server(model, *flags):
    home, path = model
    return kiln_server(home, path, "--ray", "--replicas", "2", "--threads", "1", "--parallel", "4", *flags,
                       timeout=240, env={"RAY_USAGE_STATS_ENABLED": "0"})


def _ready(url: str, replicas: int, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        health = httpx.get(f"{url}/health", timeout=10).json()
        if health["ready"] == replicas and len(health["replicas"]) == replicas:
            return health
        time.sleep(0.5)
    raise AssertionError(f"{replicas} replicas were not ready in {timeout:.0f} s: {health}")


@pytest.fixture(scope="module")
def servers(model):
    """`kiln serve` while `kiln serve --ray` starts, then `kiln serve --ray --no-affinity --ray-proxy`: two Ray instances
    starting at once on a busy 2-core machine can miss Ray's own 30 s deadline for a node to come up."""
    home, path = model
    with contextlib.ExitStack() as stack, ThreadPoolExecutor(2) as pool:
        futures = {"plain": pool.submit(_enter, lambda: kiln_server(home, path, "--threads", "1", "--parallel", "4")),
                   "ray": pool.submit(_enter, lambda: _ray_server(model))}
        for future in futures.values():  # each one that started is stopped, whichever failed
            if future.exception() is None:
                stack.callback(future.result()[1])
        running = {name: future.result()[0] for name, future in futures.items()}
        _ready(running["ray"].url, 2)
        # the baseline also runs the other topology: Ray's HTTP proxy and the ingress replica (serve run's)
        running["baseline"] = stack.enter_context(_ray_server(model, "--no-affinity", "--ray-proxy"))
        _ready(running["baseline"].url, 2)
        yield running


def _enter(start):
    manager = start()
    return manager.__enter__(), lambda: manager.__exit__(None, None, None)


def _clients(url: str):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120), \
        ollama.Client(host=url, timeout=120)


def _answers(url: str, path: str) -> dict:
    """What the model says through each API feature, with everything that varies by run left out."""
    oai, oll = _clients(url)
    common = {"model": path, "temperature": 0, "seed": 7}
    question = [{"role": "user", "content": "What is the capital of France?"}]
    out = {}
    chat = oai.chat.completions.create(messages=question, max_tokens=12, **common)
    out["chat"] = chat.choices[0].message.content, chat.choices[0].finish_reason, chat.usage.completion_tokens
    chunks = list(oai.chat.completions.create(messages=question, max_tokens=12, stream=True, **common))
    out["stream"] = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    tool = oai.chat.completions.create(messages=question, tools=[WEATHER_TOOL], tool_choice="required",
                                       max_tokens=200, **common)
    calls = tool.choices[0].message.tool_calls
    assert tool.choices[0].finish_reason == "tool_calls" and calls
    out["tools"] = [(c.function.name, c.function.arguments) for c in calls]
    schema = oai.chat.completions.create(messages=question, max_tokens=60, **common, response_format={
        "type": "json_schema", "json_schema": {"name": "small", "schema": SMALL}})
    out["schema"] = schema.choices[0].message.content
    embedded = oai.embeddings.create(model=path, input=["hello", "a longer text to embed"])
    out["embeddings"] = [d.embedding for d in embedded.data]
    options = {"temperature": 0, "seed": 7, "num_predict": 12}
    out["ollama_chat"] = oll.chat(model=path, messages=question, options=options).message.content
    out["ollama_stream"] = "".join(p.message.content for p in oll.chat(model=path, messages=question, options=options,
                                                                       stream=True))
    out["ollama_format"] = oll.generate(model=path, prompt="Count:", format=SMALL, options={**options, "num_predict": 60}).response
    out["ollama_embed"] = oll.embed(model=path, input="hello").embeddings
    claude = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=120)
    message = claude.messages.create(model=path, messages=question, max_tokens=12,
                                     extra_body={"temperature": 0})  # the client no longer lists it
    out["anthropic"] = [block.text for block in message.content if block.type == "text"], message.stop_reason
    return out


def test_every_api_answers_as_kiln_serve_does(servers, model):
    plain, ray = servers["plain"], servers["ray"]
    expected, got = _answers(plain.url, model[1]), _answers(ray.url, model[1])
    assert got["stream"] == got["chat"][0] and got["ollama_stream"] == got["ollama_chat"]
    assert re.fullmatch(r'\{ ?"n": ?\d{1,2} ?\}', got["schema"].strip())
    for key in expected:
        assert got[key] == expected[key], key


def test_errors_and_metrics_are_the_servers(servers, model):
    ray = servers["ray"]
    oai, _ = _clients(ray.url)
    with pytest.raises(openai.NotFoundError, match="not found"):
        oai.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="temperature"):
        oai.chat.completions.create(model=model[1], messages=[{"role": "user", "content": "hi"}], temperature=-1)
    for i in range(12):  # unshared prompts: balanced over both replicas
        oai.chat.completions.create(model=model[1], messages=[{"role": "user", "content": f"{i} " * 40}], max_tokens=2)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # each replica reports its metrics every second
        text = httpx.get(f"{ray.url}/metrics", timeout=10).text
        replicas = set(re.findall(r'^kiln_requests_total\{replica="([^"]+)",api="openai"', text, re.M))
        if len(replicas) == 2:
            break
        time.sleep(0.5)
    assert len(replicas) == 2, text
    assert re.search(r'^kiln_ray_routes_total\{decision="balanced"\} [1-9]', text, re.M)
    assert text.count("# TYPE kiln_requests_total counter") == 1  # one family, every replica's samples


def test_a_client_that_leaves_cancels_its_generation(servers, model):
    ray = servers["ray"]
    body = {"model": model[1], "stream": True, "max_tokens": 1800, "temperature": 0,
            "messages": [{"role": "user", "content": "Tell me a long story."}]}
    with httpx.stream("POST", f"{ray.url}/v1/chat/completions", json=body, timeout=60) as response:
        replica = response.headers["x-kiln-replica"]
        next(response.iter_lines())
    pattern = rf'^kiln_requests_total\{{replica="{replica}",api="openai",finish_reason="cancelled"\}} 1\.0'
    deadline = time.monotonic() + 10
    while not re.search(pattern, text := httpx.get(f"{ray.url}/metrics", timeout=10).text, re.M):
        assert time.monotonic() < deadline, text
        time.sleep(0.5)


def _affinity(url: str, path: str) -> tuple[float, float]:
    """4 system prompts x 8 requests, interleaved: the share of each prompt's later requests that land on the
    replica that served its first, and the share that reuse at least the system prompt's tokens."""
    oai, _ = _clients(url)
    system_tokens = [len(httpx.post(f"{url}/tokenize", json={"content": s, "model": path}).json()["tokens"])
                     for s in SYSTEMS]
    holder, on_holder, cached = {}, 0, 0
    for round_ in range(8):
        for i, system in enumerate(SYSTEMS):
            raw = oai.chat.completions.with_raw_response.create(
                model=path, max_tokens=2, temperature=0,
                messages=[{"role": "system", "content": system}, {"role": "user", "content": f"question {round_}"}])
            replica, usage = raw.headers["x-kiln-replica"], raw.parse().usage
            if round_ == 0:
                holder[i] = replica
                continue
            on_holder += replica == holder[i]
            cached += usage.prompt_tokens_details.cached_tokens >= system_tokens[i]
    return on_holder / 28, cached / 28


def test_prefix_affinity_routes_a_prompt_to_the_replica_holding_it(servers, model):
    ray = servers["ray"]
    on_holder, cached = _affinity(ray.url, model[1])
    assert on_holder >= 0.9 and cached >= 0.9, (on_holder, cached)
    text = httpx.get(f"{ray.url}/metrics", timeout=10).text
    assert float(re.search(r'^kiln_ray_routes_total\{decision="affinity"\} (\S+)', text, re.M).group(1)) >= 25


def test_without_affinity_prompts_scatter(servers, model):
    ray = servers["baseline"]
    on_holder, cached = _affinity(ray.url, model[1])
    print(f"affinity off: {on_holder:.0%} on the first replica, {cached:.0%} reused the system prompt")
    assert on_holder < 0.8  # least loaded alone: each request goes to whichever replica is idle


@pytest.mark.parametrize("topology", ["ray", "baseline"])
def test_a_replica_killed_mid_stream(servers, model, topology):
    ray = servers[topology]
    health = _ready(ray.url, 2)
    oai, _ = _clients(ray.url)
    pids = {r["id"]: r["pid"] for r in health["replicas"]}
    stream = oai.chat.completions.with_raw_response.create(
        model=model[1], messages=[{"role": "user", "content": "Tell me a long story."}], max_tokens=1800,
        temperature=0, stream=True)
    victim = stream.headers["x-kiln-replica"]
    chunks = iter(stream.parse())
    next(chunks)
    os.kill(pids[victim], signal.SIGKILL)
    with pytest.raises(openai.APIError, match="replica answering this request stopped"):
        for _ in chunks:
            pass
    for i in range(20):
        answer = oai.chat.completions.create(model=model[1], messages=[{"role": "user", "content": f"again {i}"}],
                                             max_tokens=4, temperature=0)
        assert answer.choices[0].finish_reason in ("stop", "length")
    back = _ready(ray.url, 2, timeout=120)
    assert victim not in {r["id"] for r in back["replicas"]}  # Ray started a new replica in its place
    text = httpx.get(f"{ray.url}/metrics", timeout=10).text
    assert re.search(r"^kiln_ray_streams_failed_total 1\.0", text, re.M)


def test_routing_keys_follow_the_prompt_as_sent():
    from kiln.ray import routing_key

    def key(**body):
        return routing_key("/v1/chat/completions", json.dumps({"model": "m", **body}).encode())

    turn = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    later = [*turn, {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "More"}]
    assert key(messages=later).startswith(key(messages=turn))  # the conversation so far is the prefix
    assert key(messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]) == \
        key(messages=[{"role": "user", "content": "Hi"}])
    assert key(prompt="Once") != key(prompt="Twice") and key(prompt="Once").startswith('"m"\n')
    assert key(tools=[WEATHER_TOOL], messages=turn) != key(messages=turn)
    assert routing_key("/api/tags", b"") is None and routing_key("/v1/chat/completions", b"[1]") is None


def test_metrics_of_replicas_merge_into_one_family_each():
    from kiln.ray import merge_metrics

    text = ('# HELP kiln_requests_total Requests\n# TYPE kiln_requests_total counter\n'
            'kiln_requests_total{api="openai"} 3.0\n# HELP kiln_requests_running Running\n'
            '# TYPE kiln_requests_running gauge\nkiln_requests_running 1.0\n')
    merged = merge_metrics({"b": text, "a": text.replace("3.0", "5.0")})
    assert merged.splitlines() == [
        "# HELP kiln_requests_total Requests", "# TYPE kiln_requests_total counter",
        'kiln_requests_total{replica="a",api="openai"} 5.0', 'kiln_requests_total{replica="b",api="openai"} 3.0',
        "# HELP kiln_requests_running Running", "# TYPE kiln_requests_running gauge",
        'kiln_requests_running{replica="a"} 1.0', 'kiln_requests_running{replica="b"} 1.0']


def test_a_cut_stream_ends_with_its_apis_error_event():
    from kiln.ray import stream_error

    oai = stream_error("/v1/chat/completions", "text/event-stream; charset=utf-8", "gone").decode()
    assert json.loads(oai.split("\n\n")[0][6:])["error"]["message"] == "gone" and oai.endswith("data: [DONE]\n\n")
    assert json.loads(stream_error("/api/chat", "application/x-ndjson", "gone")) == {"error": "gone"}
    anthropic = stream_error("/v1/messages", "text/event-stream", "gone").decode()
    assert anthropic.startswith("event: error\n") and json.loads(anthropic.split("data: ")[1])["type"] == "error"


def test_serve_run_arguments_are_typed_and_checked():
    from kiln.errors import KilnError
    from kiln.ray import RayOptions

    options = RayOptions.from_args({"model": "smollm2:135m", "replicas": "2", "pull": "false", "cors": "a.test,b.test",
                                    "threads": "none", "target_ongoing": "1.5"})
    assert (options.replicas, options.pull, options.cors, options.threads, options.target_ongoing) == \
        (2, False, ["a.test", "b.test"], None, 1.5)
    # what the single server's flags set in each replica's app: the cache type, models held, body limits
    options = RayOptions.from_args({"model": "m", "kv_cache": "q8_0", "max_loaded": "2", "max_body_bytes": "1048576"})
    assert (options.kv_cache, options.max_loaded, options.max_body_bytes, options.max_upload_bytes) == \
        ("q8_0", 2, 1048576, None)
    assert RayOptions.from_args({"model": "m", "stream_interval": "0"}).stream_interval == 0.0
    with pytest.raises(KilnError, match="--stream-interval must be between 0 and 1000 ms, not 2000"):
        RayOptions.from_args({"model": "m", "stream_interval": "2"})
    with pytest.raises(KilnError, match="'q5' is not a KV cache type"):
        RayOptions.from_args({"model": "m", "kv_cache": "q5"})
    with pytest.raises(KilnError, match="--max-loaded must be at least 1"):
        RayOptions.from_args({"model": "m", "max_loaded": "0"})
    with pytest.raises(KilnError, match="no argument 'replica'"):
        RayOptions.from_args({"model": "m", "replica": "2"})
    with pytest.raises(KilnError, match="replicas='two': expected int"):
        RayOptions.from_args({"model": "m", "replicas": "two"})
    with pytest.raises(KilnError, match="more than --max-replicas"):
        RayOptions.from_args({"model": "m", "min_replicas": "3", "max_replicas": "2"})
    with pytest.raises(KilnError, match="--min-replicas bounds autoscaling"):
        RayOptions.from_args({"model": "m", "min_replicas": "2"})
    with pytest.raises(KilnError, match=r"--replicas \(3\) fixes the count"):
        RayOptions.from_args({"model": "m", "replicas": "3", "max_replicas": "4"})
    with pytest.raises(KilnError, match="a model is required"):
        RayOptions.from_args({})


def test_the_application_builds_with_fixed_or_autoscaled_replicas():
    from ray.serve import Application

    from kiln.ray import app

    assert isinstance(app({"model": "smollm2:135m", "replicas": "3", "threads": "2"}), Application)
    assert isinstance(app({"model": "smollm2:135m", "min_replicas": "1", "max_replicas": "4", "target_ongoing": "3"}),
                      Application)  # Ray refuses num_replicas beside autoscaling, and mistyped bounds


def _relayed(stream_interval: float, others: int) -> list[bytes]:
    """The messages a replica hands Ray for an app that streams 20 chunks 5 ms apart, with `others`
    responses streaming beside it."""
    import asyncio

    from kiln.ray import KilnReplica

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for i in range(20):
            await send({"type": "http.response.body", "body": b"%d," % i, "more_body": True})
            await asyncio.sleep(0.005)
        await send({"type": "http.response.body", "body": b"end", "more_body": False})

    bare = type("BareReplica", (KilnReplica,), {"__del__": lambda self: None})  # no lifespan to leave
    replica = object.__new__(bare)  # its app only: no Ray, no model
    replica.app, replica.replica_id, replica.stream_interval, replica.streaming = app, "r", stream_interval, others
    request = {"method": "POST", "path": "/v1/chat/completions", "query": b"", "headers": [], "body": b"{}",
               "client": None, "server": None}

    async def collect():
        return [item async for item in replica.forward(request)]

    items = asyncio.run(collect())
    assert items[0] == (200, [(b"x-kiln-replica", b"r")]) and replica.streaming == others
    assert b"".join(items[1:]) == b"".join(b"%d," % i for i in range(20)) + b"end"  # every byte, in order
    return items[1:]


def test_under_load_a_replica_sends_each_response_once_an_interval():
    alone = _relayed(0.04, others=0)
    assert len(alone) >= 20  # a lone response: every chunk as the app sends it
    assert len(_relayed(0.0, others=1)) >= 20
    grouped = _relayed(0.04, others=1)  # ~100 ms of chunks beside another response: ~3 messages after the first two
    assert grouped[:2] == [b"0,", b"1,"] and len(grouped) <= 6, grouped


def test_kiln_serve_ray_flags_left_out_keep_the_options_defaults():
    from kiln.cli import build_parser
    from kiln.commands.serve import ray_options
    from kiln.ray import RayOptions

    def options(*flags):
        return ray_options(build_parser().parse_args(["serve", "m", "--ray", *flags]))

    default, chosen = RayOptions(model="m"), options("--replicas", "3", "--target-ongoing", "1.5",
                                                     "--stream-interval", "0")
    assert (options().replicas, options().target_ongoing, options().stream_interval) == \
        (default.replicas, default.target_ongoing, default.stream_interval)
    assert (chosen.replicas, chosen.target_ongoing, chosen.stream_interval) == (3, 1.5, 0.0)
    assert options("--max-replicas", "4").max_replicas == 4  # --replicas left out is not a fixed count
