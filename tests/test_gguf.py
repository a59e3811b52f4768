"""GGUF parsing: the reader agrees with the gguf package, and every kind of broken file gets a one-line
error naming the problem."""

from __future__ import annotations

import os
import struct
import subprocess
import sys

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from kiln.errors import ModelFileError, UnsupportedModelError
from kiln.gguf import GGUFFile
from kiln.models import family_for
from kiln.synth import write_random_gguf


@pytest.fixture
def model(tmp_path):
    return write_random_gguf(tmp_path / "m.gguf", "tiny-qwen3", qtype=gguf.GGMLQuantizationType.Q4_0)


def test_reader_agrees_with_gguf_package(model):
    ours, theirs = GGUFFile(model), gguf.GGUFReader(model)
    assert set(ours.tensors) == {t.name for t in theirs.tensors}
    for t in theirs.tensors:
        assert np.array_equal(ours.dequantize(t.name).ravel(), gguf.quants.dequantize(t.data, t.tensor_type).ravel())
    for key, field in theirs.fields.items():
        if not key.startswith("GGUF."):
            expected = field.contents()
            got = ours.metadata[key]
            assert (np.array_equal(got, expected) if isinstance(got, np.ndarray) else got == expected), key


def corrupt(path, offset, value):
    data = bytearray(path.read_bytes())
    data[offset] = value
    path.write_bytes(bytes(data))


def test_truncated_file_names_the_tensor(model):
    size = model.stat().st_size
    model.write_bytes(model.read_bytes()[: size - 1000])
    with pytest.raises(ModelFileError, match=r"tensor '.+' needs bytes .* truncated"):
        GGUFFile(model)


def test_truncated_header_names_the_offset(model):
    model.write_bytes(model.read_bytes()[:2000])
    with pytest.raises(ModelFileError, match=r"truncated .*at byte offset \d+"):
        GGUFFile(model)


def test_flipped_magic_byte(model):
    corrupt(model, 1, ord("X"))
    with pytest.raises(ModelFileError, match="not a GGUF file: magic"):
        GGUFFile(model)


def test_flipped_count_byte_is_caught(model):
    corrupt(model, 15, 0x7F)  # top byte of the tensor count
    with pytest.raises(ModelFileError, match="impossible for this size"):
        GGUFFile(model)


def test_flipped_string_length_is_caught(model):
    corrupt(model, 31, 0x40)  # top byte of the first key's length
    with pytest.raises(ModelFileError, match=r"truncated while reading name of metadata key 0"):
        GGUFFile(model)


@pytest.mark.parametrize("qtype", [QT.Q3_K, QT.IQ4_NL])
def test_exact_rewrites_keep_every_value(qtype):
    """Random blocks (every bit pattern, random-sign scales) rewritten into the kernel type dequantize to
    the very same values, by the gguf package's own dequantization of both."""
    from gguf import GGML_QUANT_SIZES
    from gguf import quants

    from kiln.gguf import EXACT_REWRITES, rewrite_exactly

    target = EXACT_REWRITES[qtype][0]
    block, size = GGML_QUANT_SIZES[qtype]
    seed = int.from_bytes(os.urandom(4), "little")
    rng = np.random.default_rng(seed)
    rows, cols = 7, 3 * 256
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    scale_at = size - 2 if qtype == QT.Q3_K else 0  # the fp16 d: last in a Q3_K block, first in IQ4_NL
    d = (rng.choice([-1, 1], (rows, cols // block)) * 10.0 ** rng.uniform(-4, 0, (rows, cols // block)))
    raw[:, :, scale_at : scale_at + 2] = d.astype(np.float16).view(np.uint8).reshape(rows, -1, 2)
    out = rewrite_exactly(raw.reshape(rows, -1), qtype, rows)
    assert out.shape == (rows, cols // GGML_QUANT_SIZES[target][0] * GGML_QUANT_SIZES[target][1])
    want = quants.dequantize(raw.reshape(rows, -1), qtype)
    assert np.array_equal(quants.dequantize(out, target), want), f"seed {seed}"


@pytest.mark.parametrize("qtype", [QT.F32, QT.F16, QT.BF16, QT.Q8_0])
def test_dequantize_agrees_with_gguf_package_for_vectors_and_matrices(qtype, tmp_path):
    """Norms and biases of any type read as the gguf package dequantizes them (a BF16 norm once failed)."""
    rng = np.random.default_rng(0)
    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    values = {"norm.weight": rng.standard_normal(64).astype(np.float32),
              "proj.weight": rng.standard_normal((4, 64)).astype(np.float32)}
    for name, data in values.items():
        if qtype == QT.F32:
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    g, reader = GGUFFile(path), gguf.GGUFReader(path)
    for t in reader.tensors:
        ours = g.dequantize(t.name)
        theirs = gguf.quants.dequantize(t.data, t.tensor_type).reshape(values[t.name].shape)
        assert ours.dtype == np.float32 and ours.shape == values[t.name].shape
        np.testing.assert_array_equal(ours, theirs)


def test_unsupported_tensor_type(tmp_path):
    path = tmp_path / "q8k.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    raw = np.zeros((4, 292), dtype=np.uint8)  # Q8_K (llama.cpp's intermediate): 292-byte blocks of 256
    w.add_tensor("blk.0.attn_q.weight", raw, raw_dtype=gguf.GGMLQuantizationType.Q8_K)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(UnsupportedModelError, match=r"'blk.0.attn_q.weight' has type Q8_K.*supported: F32.*IQ4_XS"):
        GGUFFile(path)


def test_unknown_architecture(tmp_path):
    path = tmp_path / "mamba.gguf"
    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(UnsupportedModelError, match=r"architecture 'mamba' is not supported; kiln runs .*\bgemma3\b"):
        family_for(GGUFFile(path))


@pytest.mark.parametrize("damage", ["truncate", "magic", "arch"])
def test_cli_reports_one_line_and_list_still_works(damage, model, tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))
    if damage == "truncate":
        model.write_bytes(model.read_bytes()[:-100])
    elif damage == "magic":
        corrupt(model, 0, 0)
    else:
        data = model.read_bytes().replace(b"qwen3", b"qwenX", 1)
        model.write_bytes(data)
    run = subprocess.run([sys.executable, "-m", "kiln", "run", str(model), "hi", "-n", "1"], capture_output=True, text=True)
    assert run.returncode == 1
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kiln: error:") and str(model) in lines[0], run.stderr
    listing = subprocess.run([sys.executable, "-m", "kiln", "list"], capture_output=True, text=True)
    assert listing.returncode == 0, listing.stderr
    assert "smollm2:135m" in listing.stdout


def test_show_checks_a_file_as_a_load_does(model, tmp_path, monkeypatch):
    # a width the tensors disagree with: what `kiln show` reads must have passed the load's checks first
    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))
    data = model.read_bytes()
    at = data.index(b"qwen3.embedding_length") + len(b"qwen3.embedding_length")
    assert struct.unpack_from("<I", data, at)[0] == 4  # GGUF's UINT32
    model.write_bytes(data[:at + 4] + struct.pack("<I", 4096) + data[at + 8:])
    show = subprocess.run([sys.executable, "-m", "kiln", "show", str(model)], capture_output=True, text=True)
    assert show.returncode == 1
    lines = show.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kiln: error:") and "wrong shape" in lines[0], show.stderr
