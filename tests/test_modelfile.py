"""Created models: the Modelfile parser, `kiln create` / `kiln cp` / `kiln show --modelfile`, and what a
created model's system message, defaults and stop strings do when it is loaded."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln import cli
from kiln.errors import StoreError
from kiln.modelfile import Recipe, parse, render
from kiln.store import Store
from kiln.synth import write_random_gguf

MODELFILE = '''# a persona
FROM base:v1
SYSTEM """You are Mario.
Answer as Mario would."""
PARAMETER temperature 0.3
PARAMETER top_k 20
PARAMETER stop "<|im_end|>"
PARAMETER stop User:
PARAMETER num_ctx 4096
LICENSE "MIT"
'''


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def base(tmp_path, home) -> Path:
    path = write_random_gguf(tmp_path / "base.gguf", "tiny-llama", seed=1)
    Store().pull(str(path), progress=False, name="base:v1")
    return path


def test_a_modelfile_reads_like_ollamas():
    recipe = parse(MODELFILE)
    assert recipe.base == "base:v1" and recipe.system == "You are Mario.\nAnswer as Mario would."
    assert recipe.parameters == {"temperature": 0.3, "top_k": 20, "stop": ["<|im_end|>", "User:"]}
    assert recipe.license == "MIT" and recipe.ignored == ["num_ctx"]
    again = parse(render(recipe.base, recipe.system, recipe.parameters, recipe.license))
    assert (again.base, again.system, again.parameters, again.license) == (recipe.base, recipe.system,
                                                                            recipe.parameters, recipe.license)


def test_stop_strings_with_newlines_and_quotes_survive_a_rendered_modelfile():
    stops = ["\n\n", 'say "stop"', "<|im_end|>"]
    rendered = render("base:v1", "hi", {"temperature": 0.5, "stop": stops}, None)
    assert parse(rendered).parameters == {"temperature": 0.5, "stop": stops}
    assert parse('FROM x\nPARAMETER stop "C:\\dir"').parameters["stop"] == ["C:\\dir"]  # not JSON: as written


@pytest.mark.parametrize("text,message", [
    ("SYSTEM hi", "no FROM line"),
    ("FROM x\nTEMPLATE {{ .Prompt }}", "line 2: TEMPLATE is not supported"),
    ("FROM x\nADAPTER lora.gguf", "line 2: ADAPTER is not supported"),
    ("FROM x\n\nPARAMETER top_k 1.5", "line 3: top_k must be an integer"),
    ("FROM x\nPARAMETER temperature -1", "line 2: invalid sampling parameter temperature"),
    ("FROM x\nPARAMETER mirostat 1", "line 2: unknown parameter 'mirostat'"),
    ("FROM x\nPARAMETER seed", "line 2: PARAMETER needs a name and a value"),
    ('FROM x\nSYSTEM """never closed', "line 2: SYSTEM's value has no closing"),
    ("FROM x\nPARAMETER top_p 0.5\nPARAMETER top_p 0.6", "line 3: parameter top_p is set twice"),
    ("FROM x\nINCLUDE y", "line 2: unknown instruction 'INCLUDE'"),
])
def test_a_bad_modelfile_names_the_line(text, message):
    with pytest.raises(StoreError, match=message):
        parse(text, "Modelfile")


def test_created_models_share_the_weights_and_inherit(base, home):
    store = Store()
    mario = store.create("mario", parse(MODELFILE), progress=False)
    assert mario.tag == "mario:latest" and mario.path == store.resolve("base:v1").path
    assert mario.system.startswith("You are Mario") and mario.license == "MIT"
    assert mario.sampling_defaults() == {"temperature": 0.3, "top_k": 20}
    # a model made from a created one keeps what it does not override
    luigi = store.create("luigi", Recipe("mario", parameters={"temperature": 0.9}), progress=False)
    assert luigi.system == mario.system and luigi.parameters == {**mario.parameters, "temperature": 0.9}
    copied = store.copy("luigi", "luigi:copy")
    assert (copied.system, copied.parameters, copied.sha256) == (luigi.system, luigi.parameters, luigi.sha256)
    assert copied.source == "copy of luigi:latest"
    for tag in ("mario", "luigi", "luigi:copy"):
        store.remove(tag)
    assert store.resolve("base:v1").path.is_file()  # the shared blob stays with its last tag


def test_create_from_a_file_and_replace_with_other_weights(tmp_path, base, home):
    store = Store()
    other = write_random_gguf(tmp_path / "other.gguf", "tiny-llama", seed=2)
    first = store.create("mine", Recipe(str(base), system="one"), progress=False)
    second = store.create("mine", Recipe(str(other), system="two"), progress=False)
    assert second.system == "two" and second.sha256 != first.sha256
    assert first.path.is_file()  # still base:v1's
    store.remove("base:v1")
    assert not first.path.exists() and second.path.is_file()
    with pytest.raises(StoreError, match="smollm2:135m is a catalog tag"):
        store.create("smollm2:135m", Recipe("mine"), progress=False)


def test_kiln_create_show_and_cp(tmp_path, base, home, capsys):
    modelfile = tmp_path / "Modelfile"
    modelfile.write_text(MODELFILE)
    assert cli.main(["create", "mario", "-f", str(modelfile)]) == 0
    out = capsys.readouterr()
    assert "created mario:latest from base:v1" in out.out and "ignored" in out.err and "num_ctx" in out.err
    assert cli.main(["show", "mario", "--modelfile"]) == 0
    shown = capsys.readouterr().out
    assert shown.startswith("# Modelfile generated by kiln\nFROM mario:latest\n")
    recreated = tmp_path / "Again"
    recreated.write_text(shown)
    assert cli.main(["create", "mario2", "-f", str(recreated)]) == 0
    capsys.readouterr()
    a, b = Store().resolve("mario"), Store().resolve("mario2")
    assert (a.system, a.parameters, a.license) == (b.system, b.parameters, b.license)
    assert cli.main(["show", "mario", "--parameters"]) == 0
    assert capsys.readouterr().out.split("\n")[:4] == ["temperature      0.3", "top_k            20",
                                                        'stop             "<|im_end|>"', 'stop             "User:"']
    assert cli.main(["show", "mario", "--system"]) == 0 and "Answer as Mario" in capsys.readouterr().out
    assert cli.main(["cp", "mario", "peach"]) == 0 and "copied mario to peach:latest" in capsys.readouterr().out
    assert cli.main(["create", "x", "-f", str(tmp_path / "missing")]) == 1
    assert "cannot read the Modelfile" in capsys.readouterr().err


def test_a_loaded_created_model_carries_its_system_defaults_and_stops(base, home):
    from kiln.engine.model import load

    Store().create("mario", parse(MODELFILE), progress=False)
    model = load("mario", n_ctx=64, progress=False)
    try:
        assert model.system == "You are Mario.\nAnswer as Mario would."
        assert model.defaults == {"temperature": 0.3, "top_k": 20} and model.stop == ["<|im_end|>", "User:"]
    finally:
        model.close()


def test_chat_reads_multiline_messages_and_saves_and_loads_models(base, home, monkeypatch, capsys):
    from kiln.commands.run import HELP, Chat, interactive
    from kiln.engine.model import load

    lines = iter(['"""first line', "second line", 'third"""', "/set temperature 0", "/set system Be brief.",
                  "/save brief", "/load brief", "/?", "/bye"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    asked = []
    monkeypatch.setattr(Chat, "ask", lambda self, text, out=None: asked.append((self.model.tag, text)))
    model = load("base:v1", n_ctx=64, progress=False)
    chat = Chat(model, {}, None, None, False)
    chat.load_options = {"n_ctx": 64}
    assert interactive(chat) == 0
    assert asked == [("base:v1", "first line\nsecond line\nthird")]
    saved = Store().resolve("brief")
    assert saved.system == "Be brief." and saved.parameters == {"temperature": 0.0} and saved.sha256
    assert chat.model.tag == "brief:latest" and chat.system == "Be brief." and chat.params.temperature == 0.0
    err = capsys.readouterr().err
    assert "Created new model 'brief:latest'" in err and "Loaded brief:latest" in err and HELP in err
    chat.model.close()


def test_a_manifest_with_bad_parameters_is_reported_as_damaged(base, home):
    import json

    Store().create("mario", parse(MODELFILE), progress=False)
    manifest = home / "manifests" / "mario" / "latest.json"
    data = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**data, "parameters": {"temperature": "hot"}}))
    record = next(r for r in Store().installed() if r.tag == "mario:latest")
    assert "temperature must be a number" in record.problem and str(manifest) in record.problem
    with pytest.raises(StoreError, match="mario:latest is damaged"):
        Store().resolve("mario")


def test_prune_removes_old_blobs_no_model_uses(base, home):
    import hashlib
    import os

    store = Store()
    used = store.resolve("base:v1").path
    for content, age in ((b"old upload", 7200), (b"fresh upload", 0)):
        digest = "sha256:" + hashlib.sha256(content).hexdigest()
        blob = home / "blobs" / digest.replace(":", "-")
        blob.write_bytes(content)
        os.utime(blob, (blob.stat().st_atime - age, blob.stat().st_mtime - age))
    old = home / "blobs" / ("sha256-" + hashlib.sha256(b"old upload").hexdigest())
    (home / "cache" / old.name).mkdir(parents=True)
    os.utime(used, (used.stat().st_atime - 7200, used.stat().st_mtime - 7200))
    broken = home / "manifests" / "broken" / "latest.json"
    broken.parent.mkdir(parents=True)
    broken.write_text("{not json")
    assert store.prune() == []  # an unreadable manifest might name any of them
    broken.unlink()
    assert store.prune() == [old]
    assert not (home / "cache" / old.name).exists() and used.is_file()
    assert sorted(p.name for p in (home / "blobs").iterdir()) == sorted(
        [used.name, "sha256-" + hashlib.sha256(b"fresh upload").hexdigest()])
