"""Context as clients expect it, on a real `kiln serve` with a tiny random model: Ollama's num_ctx reloads
the model at another context (raised and lowered, up to the server's maximum), max_tokens past the
room left ends with "length", /api/embed's truncate, and the KILN_* environment variables."""

from __future__ import annotations

import httpx
import ollama
import openai
import pytest

from kiln.cli import build_parser
from kiln.store import Store
from kiln.synth import write_random_gguf
from tests.serving import kiln_server

MODEL = "tiny:ctx"
TRAINED = 8192  # the model's own context; loaded by default at min(8192, 4096)
FORCED = {"300": 100}  # a token that is never a stop token, pushed to the top: generation runs to its limit


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    path = write_random_gguf(home / "m.gguf", "tiny-qwen2", seed=2, context_length=TRAINED)
    Store(home=home).pull(str(path), progress=False, name=MODEL)
    return home


@pytest.fixture(scope="module")
def server(home):
    with kiln_server(home, MODEL, "--parallel", "2") as s:
        yield s


def _context(server) -> int:
    (model,) = httpx.get(f"{server.url}/api/ps").json()["models"]
    assert httpx.get(f"{server.url}/props").json()["default_generation_settings"]["n_ctx"] == model["context_length"]
    return model["context_length"]


def test_num_ctx_reloads_the_model_raised_and_lowered(server):
    client = ollama.Client(host=server.url)
    assert _context(server) == 4096
    long_prompt = "hello world " * 400  # more tokens than the context it was loaded with
    n_prompt = len(httpx.post(f"{server.url}/tokenize", json={"content": long_prompt}).json()["tokens"])
    assert 4096 < n_prompt < 6000
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model=MODEL, prompt=long_prompt, raw=True, options={"num_predict": 1})
    assert e.value.status_code == 400 and "4096" in e.value.error
    r = client.generate(model=MODEL, prompt=long_prompt, raw=True, options={"num_ctx": 6000, "num_predict": 2})
    assert r.prompt_eval_count == n_prompt and r.eval_count <= 2 and _context(server) == 6000
    r = client.generate(model=MODEL, prompt="hi", raw=True, options={"num_predict": 1})  # no num_ctx: as loaded
    assert _context(server) == 6000
    chunks = list(client.chat(model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True,
                              options={"num_ctx": 64, "num_predict": 2}))
    assert chunks[-1].done and _context(server) == 64
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model=MODEL, prompt="hello world " * 40, raw=True, options={"num_predict": 1})
    assert e.value.status_code == 400 and "64" in e.value.error  # the lowered context holds no more
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model=MODEL, prompt="hi", options={"num_ctx": TRAINED + 1})
    assert e.value.status_code == 400 and "options.num_ctx" in e.value.error and str(TRAINED) in e.value.error
    assert _context(server) == 64  # the refused request left the model as it was


def test_max_tokens_past_the_context_ends_with_length(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x")
    ollama.Client(host=server.url).generate(model=MODEL, prompt="", options={"num_ctx": 48})  # load at 48
    assert _context(server) == 48
    r = client.completions.create(model=MODEL, prompt="hello world", max_tokens=1000, logit_bias=FORCED)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens + r.usage.completion_tokens == 48
    stream = client.completions.create(model=MODEL, prompt="hello world", max_tokens=1000, logit_bias=FORCED,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.prompt_tokens + chunks[-1].usage.completion_tokens == 48
    r = httpx.post(f"{server.url}/api/generate", timeout=60, json={
        "model": MODEL, "prompt": "hello world", "raw": True, "stream": False, "options": {"num_predict": 1000}})
    body = r.json()
    # greedy on this model's weights never meets a stop token before the context is full
    assert (body["done_reason"], body["prompt_eval_count"] + body["eval_count"]) == ("length", 48)
    last = list(ollama.Client(host=server.url).generate(model=MODEL, prompt="hello world", raw=True, stream=True,
                                                        options={"num_predict": 1000}))[-1]
    assert (last.done_reason, last.prompt_eval_count + last.eval_count) == ("length", 48)
    with pytest.raises(openai.BadRequestError) as e:  # a prompt that alone does not fit is still an error
        client.completions.create(model=MODEL, prompt="hello world " * 40, max_tokens=1)
    assert e.value.code == "context_length_exceeded" and e.value.param == "prompt"


def test_embed_truncates_unless_told_not_to(server):
    client = ollama.Client(host=server.url)
    client.generate(model=MODEL, prompt="", options={"num_ctx": 32})
    text = "hello world " * 40
    r = client.embed(model=MODEL, input=["hi", text])
    assert r.prompt_eval_count == len(httpx.post(f"{server.url}/tokenize", json={"content": "hi"}).json()["tokens"]) + 32
    assert len(r.embeddings) == 2
    with pytest.raises(ollama.ResponseError) as e:
        client.embed(model=MODEL, input=["hi", text], truncate=False)
    assert e.value.status_code == 400 and "input[1]" in e.value.error and "truncate" in e.value.error
    r = client.embed(model=MODEL, input=text, options={"num_ctx": 40})  # the context an embedding runs at
    assert r.prompt_eval_count == 40 and _context(server) == 40


def test_environment_variables_set_the_serve_flags(home, monkeypatch):
    for name, value in (("KILN_CONTEXT_LENGTH", "128"), ("KILN_NUM_PARALLEL", "3"), ("KILN_MAX_QUEUE", "5"),
                        ("KILN_KEEP_ALIVE", "7m")):
        monkeypatch.setenv(name, value)
    args = build_parser().parse_args(["serve"])
    assert (args.ctx_len, args.parallel, args.max_queue, args.keep_alive) == (128, 3, 5, "7m")
    args = build_parser().parse_args(["serve", "--parallel", "2", "--ctx-len", "64", "--max-queue", "1"])
    assert (args.ctx_len, args.parallel, args.max_queue) == (64, 2, 1)  # flags override the environment
    env = {"KILN_CONTEXT_LENGTH": "128", "KILN_NUM_PARALLEL": "3"}
    with kiln_server(home, MODEL, "--parallel", "2", env=env) as s:
        props = httpx.get(f"{s.url}/props").json()
        assert (props["default_generation_settings"]["n_ctx"], props["total_slots"]) == (128, 2)
        with pytest.raises(ollama.ResponseError) as e:  # --ctx-len (here from the environment) caps num_ctx
            ollama.Client(host=s.url).generate(model=MODEL, prompt="hi", options={"num_ctx": 256})
        assert e.value.status_code == 400 and "--ctx-len" in e.value.error and "128" in e.value.error
