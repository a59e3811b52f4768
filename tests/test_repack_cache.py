"""The repack cache: trusted only when it is this model's and its bytes pass their checksum; anything else
is repacked, with a warning when the cache was damaged, and nothing partial is ever left behind."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import subprocess
import sys
import zlib

import httpx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from kiln import _native, cli
from kiln.engine import repack_cache
from kiln.engine.model import load
from kiln.engine.native import NativeEngine
from kiln.gguf import GGUFFile
from kiln.models import family_for
from kiln.native import kernels
from kiln.store import Store
from kiln.synth import write_random_gguf
from tests.serving import kiln_server

PROMPT = [5, 17, 99, 3, 250, 41]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two models of one shape, one tokenizer and one file size, with different weights."""
    root = tmp_path_factory.mktemp("models")
    a = write_random_gguf(root / "a.gguf", "tiny-llama", qtype=QT.Q8_0, seed=1)
    b = write_random_gguf(root / "b.gguf", "tiny-llama", qtype=QT.Q8_0, seed=2, tokenizer_from=a)
    assert a.stat().st_size == b.stat().st_size
    return a, b


def engine(path, cache_dir=None, sha256=None):
    gguf = GGUFFile(path)
    return NativeEngine(gguf, family_for(gguf), n_ctx=32, threads=1, cache_dir=cache_dir, gguf_sha256=sha256)


def logits(path, cache_dir=None, sha256=None) -> tuple[np.ndarray, bool]:
    e = engine(path, cache_dir, sha256)
    try:
        return e.forward(PROMPT), e.weights.from_cache
    finally:
        e.close()
        e.weights.gguf.close()


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "kiln.cache" and r.levelno >= logging.WARNING]


# --- the checksum -------------------------------------------------------------------------------------
def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = crc >> 1 ^ 0x82F63B78 if crc & 1 else crc >> 1
    return crc ^ 0xFFFFFFFF


def test_checksum_is_crc32c_in_four_lanes():
    assert _native.checksum(b"123456789") == "0" * 24 + "e3069283"  # the standard check value, in lane 3
    data = np.random.default_rng(1).integers(0, 256, 1003, dtype=np.uint8).tobytes()
    piece = 1003 // 4 // 8 * 8
    lanes = [data[:piece], data[piece:2 * piece], data[2 * piece:3 * piece], data[3 * piece:]]
    assert _native.checksum(data) == "".join(f"{crc32c(lane):08x}" for lane in lanes)


@pytest.mark.parametrize("size", [0, 7, 32, (1 << 20) - 1, (3 << 20) + 13])
def test_checksum_is_the_same_in_every_isa_and_every_reader(size, tmp_path):
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    path = tmp_path / "data"
    path.write_bytes(data)
    arena = _native.Arena(size)
    found = {_native.checksum(data), _native.file_checksum(str(path), size), arena.read_file(str(path))}
    before = kernels.active_isa()
    kernels.force_isa("generic")
    try:
        found.add(_native.checksum(data))
    finally:
        kernels.force_isa(before)
    assert len(found) == 1 and bytes(arena) == data
    if size:  # one changed bit anywhere changes it
        flipped = bytearray(data)
        flipped[zlib.crc32(data) % size] ^= 0x10
        assert _native.checksum(bytes(flipped)) not in found


# --- loads --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["arena", "index"])
def test_a_flipped_byte_is_detected_and_repacked(models, tmp_path, caplog, where):
    fresh, _ = logits(models[0])
    assert not logits(models[0], tmp_path)[1]
    damaged = tmp_path / ("packed.bin" if where == "arena" else "packed.json")
    data = bytearray(damaged.read_bytes())
    data[len(data) * 2 // 3] ^= 0x01 if where == "arena" else 0x02  # a digit or letter stays one
    damaged.write_bytes(bytes(data))

    again, from_cache = logits(models[0], tmp_path)
    assert not from_cache and np.array_equal(again, fresh)
    (warning,) = warnings_of(caplog)
    assert str(tmp_path / "packed.bin") in warning and "repacking" in warning
    assert "checksum" in warning if where == "arena" else "index" in warning
    cached, from_cache = logits(models[0], tmp_path)  # the bad cache was replaced
    assert from_cache and np.array_equal(cached, fresh) and len(warnings_of(caplog)) == 1


@pytest.mark.parametrize("in_store", [True, False])
def test_another_models_cache_is_not_used(models, tmp_path, caplog, in_store):
    """The same shape and size: the arena would load and answer as the other model. In the store each
    file's sha256 is known; a file used in place is hashed."""
    a, b = models
    sha = {path: hashlib.sha256(path.read_bytes()).hexdigest() if in_store else None for path in models}
    logits(b, tmp_path, sha[b])
    answer, from_cache = logits(a, tmp_path, sha[a])
    assert not from_cache and np.array_equal(answer, logits(a)[0])
    assert "of another model" in warnings_of(caplog)[0]


def test_a_file_used_in_place_is_hashed_once_and_again_when_replaced(models, tmp_path, monkeypatch):
    """Replaced by another model of the same size with the same mtime, it is hashed again (its ctime moved)."""
    path, cache = tmp_path / "m.gguf", tmp_path / "cache"
    path.write_bytes(models[0].read_bytes())
    hashed = []
    hash_fd = repack_cache.sha256_of_fd
    monkeypatch.setattr(repack_cache, "sha256_of_fd", lambda fd: hashed.append(fd) or hash_fd(fd))
    logits(path, cache)
    assert logits(path, cache)[1] and len(hashed) == 1  # the second load took the remembered sha256
    st = path.stat()
    path.write_bytes(models[1].read_bytes())
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    answer, from_cache = logits(path, cache)
    assert not from_cache and len(hashed) == 2 and np.array_equal(answer, logits(models[1])[0])


def test_a_full_disk_leaves_no_partial_file(models, tmp_path, caplog, monkeypatch):
    def fills_the_disk(path, data):
        with open(path, "wb") as f:
            f.write(bytes(memoryview(data)[: len(data) // 2]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(repack_cache, "write_file", fills_the_disk)
    fresh = logits(models[0])[0]
    (tmp_path / "packed.json").write_text(json.dumps({"key": {"version": "5/0.1.0"}}))  # an older kiln's cache,
    (tmp_path / "packed.bin").write_bytes(bytes(4096))  # whose space the new one's write frees first
    for load_number in (1, 2):  # no load leaves a file, so none adds one
        answer, from_cache = logits(models[0], tmp_path)
        assert not from_cache and np.array_equal(answer, fresh)
        assert list(tmp_path.iterdir()) == []
        warning = warnings_of(caplog)[-1]
        assert len(warnings_of(caplog)) == load_number and "\n" not in warning
        assert str(tmp_path / "packed.bin") in warning and "No space left on device" in warning


# --- the store: start-up and `kiln check` -----------------------------------------------------------------
@pytest.fixture
def store(tmp_path, monkeypatch, models):
    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))
    store = Store()
    store.pull(str(models[0]), progress=False, name="m")
    return store


KILLED_WHILE_WRITING = """
import os, signal, sys
from kiln.engine import repack_cache, model
def killed(path, data):
    with open(path, "wb") as f:
        f.write(bytes(memoryview(data)[: len(data) // 2]))
        f.flush()
    os.kill(os.getpid(), signal.SIGKILL)
repack_cache.write_file = killed
model.load("m", progress=False)
"""


def temps(directory):
    return [p for p in directory.iterdir() if p.name.endswith(".kiln-tmp")]


def test_a_killed_repack_leaves_nothing_after_the_next_start(store):
    cache = store.cache_dir(store.resolve("m"))
    killed = subprocess.run([sys.executable, "-c", KILLED_WHILE_WRITING], env=os.environ, capture_output=True)
    assert killed.returncode == -9, killed.stderr.decode()
    assert len(temps(cache)) == 1
    running = cache / f"packed.bin.{os.getpid()}-0.kiln-tmp"  # a load still writing is left alone
    running.write_bytes(b"")
    store.clean_stale()  # what `kiln serve` and `kiln list` start with
    assert temps(cache) == [running]
    running.unlink()

    assert subprocess.run([sys.executable, "-c", KILLED_WHILE_WRITING], env=os.environ).returncode == -9
    assert len(temps(cache)) == 1
    model = load("m", store=store, progress=False)  # a load cleans its own cache
    assert not model.engine.weights.from_cache and temps(cache) == []
    assert (cache / "packed.bin").is_file() and (cache / "packed.json").is_file()
    model.close()


def test_the_server_start_cleans_every_cache_and_listings_only_read(store):
    """A killed repack of a model the server does not load is cleaned when it starts; the listings it answers
    read the store without walking every cache directory."""
    from fastapi.testclient import TestClient

    from kiln.server.app import create_app
    from kiln.server.runtime import Settings

    cache = store.cache_dir(store.resolve("m"))
    assert subprocess.run([sys.executable, "-c", KILLED_WHILE_WRITING], env=os.environ).returncode == -9
    assert len(temps(cache)) == 1
    store.installed()
    assert len(temps(cache)) == 1
    with TestClient(create_app(Settings(threads=1), store=store), base_url="http://localhost") as client:
        assert temps(cache) == []
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == [r.tag for r in store.installed()]


def test_check_reports_a_damaged_cache_and_removes_it(store, capsys):
    def check() -> tuple[int, str, str]:
        capsys.readouterr()
        rc = cli.main(["check", "m"])
        return (rc, *capsys.readouterr())

    rc, out, _ = check()
    assert rc == 0 and "m:latest: no repack cache" in out
    first = load("m", store=store, progress=False)
    rc, out, _ = check()
    assert rc == 0 and "m:latest: repack cache ok" in out
    arena = store.cache_dir(store.resolve("m")) / "packed.bin"
    data = bytearray(arena.read_bytes())
    data[100] ^= 0x80
    arena.write_bytes(bytes(data))

    rc, out, err = check()
    assert rc == 1 and "sha256" in out and err.count("\n") == 1
    assert f"m:latest: repack cache {arena} fails its checksum; removed" in err
    assert not arena.exists()
    again = load("m", store=store, progress=False)
    assert not again.engine.weights.from_cache
    assert np.array_equal(again.engine.forward(PROMPT), first.engine.forward(PROMPT))
    assert check()[0] == 0
    first.close()
    again.close()


@pytest.mark.slow
def test_smollm2_answers_as_itself_after_a_thousand_flipped_bytes(smollm2_path, tmp_path, caplog):
    sha = smollm2_path.name.removeprefix("sha256-")
    expected, from_cache = logits(smollm2_path, tmp_path, sha)  # a fresh repack, which writes the cache
    assert not from_cache
    arena = tmp_path / "packed.bin"
    data = np.fromfile(arena, dtype=np.uint8)
    data[np.random.default_rng(0).choice(data.size, 1000, replace=False)] ^= 0x55
    data.tofile(arena)
    answer, from_cache = logits(smollm2_path, tmp_path, sha)
    assert not from_cache and np.array_equal(answer, expected) and len(warnings_of(caplog)) == 1


def test_kiln_serve_cleans_a_killed_repack_and_repacks_a_damaged_cache(store, tmp_path):
    cache = store.cache_dir(store.resolve("m"))
    assert subprocess.run([sys.executable, "-c", KILLED_WHILE_WRITING], env=os.environ).returncode == -9
    assert len(temps(cache)) == 1
    request = {"model": "m", "prompt": "hello", "raw": True, "stream": False,
               "options": {"temperature": 0, "num_predict": 8}}
    answers = []
    for start in ("after a killed repack", "with a damaged cache"):
        with kiln_server(store.home, "m") as server:
            assert temps(cache) == [], start
            answers.append(httpx.post(f"{server.url}/api/generate", json=request, timeout=60).json()["response"])
            log = server.log.read_text()
        if start == "after a killed repack":
            assert "repack cache" not in log
            arena = cache / "packed.bin"
            data = bytearray(arena.read_bytes())
            data[len(data) // 2] ^= 0x01
            arena.write_bytes(bytes(data))
        else:
            assert f"repack cache {cache / 'packed.bin'} fails its checksum; repacking" in log
    assert answers[0] and answers[1] == answers[0]
