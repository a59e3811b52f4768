"""GGUF parsing: the reader agrees with the gguf package, and every kind of broken file gets a one-line
error naming the problem."""

from __future__ import annotations

import subprocess
import sys

import gguf
import numpy as np
import pytest

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
    with pytest.raises(UnsupportedModelError, match=r"architecture 'mamba' is not supported; kiln runs gemma3"):
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
