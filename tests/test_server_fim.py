"""Fill-in-the-middle end to end: Ollama's and OpenAI's `suffix` and llama-server's /infill on a real
`kiln serve`, with tiny random models that have FIM tokens (by metadata key, or only by text as older
files) and one that has none."""

from __future__ import annotations

import json

import httpx
import ollama
import openai
import pytest

from kiln.engine.fim import Infill
from kiln.engine.model import load
from kiln.engine.request import GenerationRequest, prompt_ids
from kiln.store import Store
from kiln.synth import FIM_TOKENS, write_random_gguf
from tests.serving import kiln_server

FIM = "coder:fim"  # FIM tokens named by tokenizer.ggml.fim_*_token_id
OLD = "coder:old"  # the same tokens, only in the vocabulary
PLAIN = "plain:tiny"  # no FIM tokens
PREFIX, SUFFIX = "def add(a, b):\n    ", "\n    return c\n"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    store = Store(home=home)
    for tag, fim in ((FIM, "metadata"), (OLD, "vocabulary"), (PLAIN, None)):
        path = write_random_gguf(home / f"{fim}.gguf", "tiny-qwen2", seed=1, fim=fim)
        store.pull(str(path), progress=False, name=tag)
    with kiln_server(home, FIM, "--ctx-len", "256", "--parallel", "2") as s:
        s.home = home
        yield s


def _tokens(server, model: str, text: str) -> list[int]:
    r = httpx.post(f"{server.url}/tokenize", json={"model": model, "content": text, "parse_special": False})
    return r.json()["tokens"]


def _fim_ids(server, model: str) -> dict[str, int]:
    r = httpx.post(f"{server.url}/tokenize", json={"model": model, "content": "".join(FIM_TOKENS.values()),
                                                   "with_pieces": True})
    ids = {piece["piece"]: piece["id"] for piece in r.json()["tokens"]}
    return {role: ids[text] for role, text in FIM_TOKENS.items()}


@pytest.mark.parametrize("model", [FIM, OLD])
def test_ollama_suffix_builds_prefix_suffix_middle(server, model):
    fim = _fim_ids(server, model)
    client = ollama.Client(host=server.url)
    r = client.generate(model=model, prompt=PREFIX, suffix=SUFFIX, options={"num_predict": 4, "temperature": 0})
    expected = [fim["pre"], *_tokens(server, model, PREFIX), fim["suf"], *_tokens(server, model, SUFFIX), fim["mid"]]
    assert r.context[:len(expected)] == expected
    assert r.prompt_eval_count == len(expected)
    assert r.done and r.eval_count <= 4
    chunks = list(client.generate(model=model, prompt=PREFIX, suffix=SUFFIX, stream=True,
                                  options={"num_predict": 4, "temperature": 0}))
    assert chunks[-1].done and "".join(c.response for c in chunks) == r.response


def test_openai_suffix_stops_at_the_fim_end_token(server):
    fim = _fim_ids(server, FIM)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x")
    # Every FIM end token ends the middle; pushed to the top, the first token generated ends it.
    for end in ("pad", "sep", "rep"):
        r = client.completions.create(model=FIM, prompt=PREFIX, suffix=SUFFIX, max_tokens=8,
                                      logit_bias={str(fim[end]): 100})
        assert (r.choices[0].finish_reason, r.choices[0].text, r.usage.completion_tokens) == ("stop", "", 1), end
    # Without a suffix the same token is an ordinary one: generation runs to max_tokens.
    r = client.completions.create(model=FIM, prompt=PREFIX, max_tokens=3, logit_bias={str(fim["pad"]): 100})
    assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("length", 3)
    stream = client.completions.create(model=FIM, prompt=PREFIX, suffix=SUFFIX, max_tokens=8, stream=True,
                                       logit_bias={str(fim["pad"]): 100})
    assert [c.choices[0].finish_reason for c in stream][-1] == "stop"


def test_infill_with_extra_files(server):
    fim = _fim_ids(server, FIM)
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "prompt": "c = ", "n_predict": 3, "temperature": 0,
            "input_extra": [{"filename": "util.py", "text": "X = 1\n"}], "logit_bias": {str(fim["mid"]): 50}}
    r = httpx.post(f"{server.url}/infill", json=body, timeout=60).json()
    assert (r["stop"], r["stop_type"], r["tokens_predicted"]) == (True, "limit", 3)
    expected = [fim["rep"], *_tokens(server, FIM, "myproject\n"), fim["sep"], *_tokens(server, FIM, "util.py\n"),
                *_tokens(server, FIM, "X = 1\n"), fim["sep"], *_tokens(server, FIM, "filename\n"), fim["pre"],
                *_tokens(server, FIM, PREFIX), *_tokens(server, FIM, "c = "), fim["suf"],
                *_tokens(server, FIM, SUFFIX), fim["mid"]]
    assert r["tokens_evaluated"] == len(expected)
    model = load(str(server.home / "metadata.gguf"), backend="oracle")
    try:
        fill = Infill(PREFIX, SUFFIX, [{"filename": "util.py", "text": "X = 1\n"}], "c = ")
        assert prompt_ids(model, GenerationRequest(infill=fill)) == expected
    finally:
        model.close()
    with httpx.stream("POST", f"{server.url}/infill", json={**body, "stream": True}, timeout=60) as s:
        records = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    assert records[-1]["stop"] and not any(rec["stop"] for rec in records[:-1])
    assert "".join(rec["content"] for rec in records) == r["content"]
    ended = httpx.post(f"{server.url}/infill", json={**body, "logit_bias": {str(fim["pad"]): 100}}).json()
    assert (ended["stop_type"], ended["tokens_predicted"], ended["content"]) == ("eos", 1, "")


def test_models_without_fim_tokens(server):
    client = ollama.Client(host=server.url)
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model=PLAIN, prompt=PREFIX, suffix=SUFFIX)
    assert e.value.status_code == 400 and "suffix" in e.value.error and PLAIN in e.value.error
    with pytest.raises(openai.BadRequestError) as e:
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="x").completions.create(model=PLAIN, prompt=PREFIX,
                                                                                   suffix=SUFFIX, max_tokens=2)
    assert e.value.param == "suffix" and PLAIN in e.value.message
    r = httpx.post(f"{server.url}/infill", json={"model": PLAIN, "input_prefix": PREFIX, "input_suffix": SUFFIX})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input_suffix" and PLAIN in r.json()["error"]["message"]
    assert "insert" in client.show(FIM).capabilities and "insert" in client.show(OLD).capabilities
    assert "insert" not in client.show(PLAIN).capabilities
