"""`kiln run`'s --format: JSON answers, from a schema given inline or in a file."""

from __future__ import annotations

import json

import jsonschema
import pytest

from kiln.cli import main
from kiln.commands.run import ANY_JSON, Chat, output_format, slash_command
from kiln.errors import KilnError

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0}}}


def test_format_takes_json_an_inline_schema_or_a_file(tmp_path):
    assert output_format(None) is None and output_format("json") == ANY_JSON
    assert output_format(json.dumps(PERSON)) == PERSON
    path = tmp_path / "person.json"
    path.write_text(json.dumps(PERSON))
    assert output_format(str(path)) == PERSON


@pytest.mark.parametrize("value,message", [("missing.json", "cannot read 'missing.json'"), ("[1, 2]", "must be an object"),
                                           ('{"type": 5}', "cannot be enforced"), ("{oops", "not valid JSON")])
def test_a_bad_format_is_an_error_naming_the_flag(value, message):
    with pytest.raises(KilnError, match=message) as e:
        output_format(value)
    assert str(e.value).startswith("--format")


def test_set_format_in_a_chat(capsys):
    chat = Chat(model=None, sampling=None, num_predict=None, system=None, raw=False)
    slash_command(chat, "/set format json")
    assert chat.format == ANY_JSON
    slash_command(chat, f"/set format {json.dumps(PERSON)}")
    assert chat.format == PERSON
    slash_command(chat, "/set format [1]")
    assert chat.format == PERSON and "Invalid value for format" in capsys.readouterr().err
    slash_command(chat, "/set noformat")
    assert chat.format is None


@pytest.mark.slow
def test_run_answers_json_matching_the_schema(smollm2_path, tmp_path, capsys):
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON))
    for fmt in (str(schema), "json"):
        assert main(["run", str(smollm2_path), "Describe a person named Ann, aged 31, as JSON.", "--format", fmt,
                     "--temperature", "0", "-n", "64", "-c", "256"]) == 0
        answer = json.loads(capsys.readouterr().out) if fmt != "json" else None
        if answer is not None:
            jsonschema.validate(answer, PERSON)


@pytest.mark.slow
def test_kiln_run_and_the_server_give_the_same_greedy_tokens():
    from io import StringIO

    from fastapi.testclient import TestClient

    from kiln.engine.model import load
    from kiln.server.app import create_app
    from kiln.server.runtime import Settings
    from kiln.store import Store
    from tests.conftest import TEST_HOME

    prompt, sampling = "Name three colours.", {"temperature": 0.0, "repeat_penalty": 1.2}
    store = Store(home=TEST_HOME)
    with TestClient(create_app(Settings(parallel=2, ctx_len=256), store=store), base_url="http://127.0.0.1") as client:
        r = client.post("/api/generate", json={"model": "smollm2:135m", "prompt": prompt, "stream": False,
                                              "options": {**sampling, "num_predict": 24}})
    assert r.status_code == 200, r.text
    model = load("smollm2:135m", n_ctx=256, store=store, progress=False)
    try:
        chat = Chat(model, sampling, 24, model.system, raw=False)
        out = StringIO()
        chat.ask(prompt, out)
    finally:
        model.close()
    served = r.json()
    assert chat.last.all_ids == served["context"] and len(chat.last.output_ids) == served["eval_count"] > 0
    assert out.getvalue() == served["response"] + "\n"
