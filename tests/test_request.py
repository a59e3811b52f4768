"""The front door (kiln.engine.request): a request in kiln's terms, checked and turned into a Sequence;
errors name kiln's fields, which each API renames at its edge."""

from __future__ import annotations

import pytest

from kiln.engine.request import ANY_JSON, GenerationRequest, prepare
from kiln.errors import ContextLengthError, RequestError, fields_named
from kiln.server import ollama, responses


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from kiln.engine.model import load
    from kiln.synth import write_random_gguf

    path = write_random_gguf(tmp_path_factory.mktemp("m") / "tiny.gguf", "tiny-llama")
    m = load(str(path), backend="oracle", n_ctx=32, progress=False)
    yield m
    m.close()


def test_a_request_becomes_a_sequence_with_the_model_defaults_under_its_own(model):
    model.defaults = {"temperature": 0.3, "top_k": 7}
    try:
        seq, parser = prepare(model, GenerationRequest(prompt=[1, 2, 3], sampling={"top_k": 2, "seed": None},
                                                       max_tokens=5, stop=["x"]))
    finally:
        model.defaults = {}
    assert (seq.prompt_ids, seq.max_tokens, seq.stop, parser) == ([1, 2, 3], 5, ["x"], None)
    assert (seq.params.temperature, seq.params.top_k, seq.params.top_p) == (0.3, 2, 0.9)
    assert seq.stop_ids == model.tokenizer.stop_ids
    exact, _ = prepare(model, GenerationRequest(prompt=[1, 2], max_tokens=4, ignore_eos=True))
    assert exact.stop_ids == frozenset() and exact.stop == []
    assert prepare(model, GenerationRequest(prompt=[1], format=ANY_JSON))[0].constraint is not None


def test_errors_name_kiln_fields_and_each_api_its_own(model):
    with pytest.raises(ContextLengthError) as e:
        prepare(model, GenerationRequest(prompt=[1] * 40, max_tokens=3))
    assert e.value.param == "prompt"
    assert str(e.value) == ("prompt: the prompt is 40 tokens but the context holds 32 (at least one must be left "
                            "to generate)")
    assert prepare(model, GenerationRequest(prompt=[1] * 10, max_tokens=30))[0].max_tokens == 22  # the room left
    with pytest.raises(RequestError) as e, fields_named(ollama.FIELDS):
        prepare(model, GenerationRequest(prompt=[1], max_tokens=-2))
    assert (e.value.param, str(e.value)) == ("options.num_predict", "options.num_predict must be >= 0, got -2")
    with pytest.raises(RequestError) as e, fields_named(responses.FIELDS):
        prepare(model, GenerationRequest(messages=[{"role": "user", "content": "hi"}], max_tokens=-1))
    assert (e.value.param, str(e.value)) == ("max_output_tokens", "max_output_tokens must be >= 0, got -1")
    with pytest.raises(RequestError) as e, fields_named(ollama.FIELDS):
        prepare(model, GenerationRequest(prompt=[1], speculative={"max": 99}))
    assert e.value.param == "options.draft_max" and str(e.value).startswith("options.draft_max must be")
    with pytest.raises(RequestError) as e:
        prepare(model, GenerationRequest(prompt=[1, 999]))
    assert (e.value.param, str(e.value)) == ("prompt", "prompt has token id 999, outside the vocabulary (0..511)")
    with pytest.raises(RequestError) as e, fields_named({"prompt": "input"}):
        prepare(model, GenerationRequest(prompt=[]))
    assert (e.value.param, str(e.value)) == ("input", "input is empty")
