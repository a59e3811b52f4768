"""A model file checked against its family (kiln/models/check.py, base.Meta): the switches a family reads,
llama.cpp's defaults for missing keys, and one-line errors for what the parser must never trust."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFValueType as VT

from kiln.engine.oracle import OracleEngine
from kiln.errors import ModelFileError
from kiln.gguf import GGUFFile
from kiln.models import check_model_file, family_for
from kiln.synth import write_random_gguf
from tests import fuzz

PATTERN = [1, 0, 1, 1, 0, 1, 1]  # per layer: 1 = sliding window, 0 = global


def variant(tmp_path: Path, shape: str, ops: list[dict], name: str = "v.gguf", seed: int = 7) -> Path:
    """A synth model of `shape` with the fuzzer's header ops applied."""
    base = write_random_gguf(tmp_path / f"base-{shape}.gguf", shape, seed=seed)
    path = tmp_path / name
    path.write_bytes(fuzz.serialize(fuzz.apply(fuzz.parse(base.read_bytes()), ops)))
    return path


def config_of(path: Path):
    gguf = GGUFFile(path)
    try:
        return family_for(gguf).config
    finally:
        gguf.close()


def gemma_switches(tmp_path: Path) -> Path:
    return variant(tmp_path, "tiny-gemma3", [
        {"op": "set", "key": "gemma3.rope.freq_base_swa", "vtype": VT.FLOAT32, "value": 500.0},
        {"op": "set", "key": "gemma3.attention.sliding_window_pattern", "vtype": VT.ARRAY, "item": VT.BOOL,
         "value": PATTERN}])


@pytest.mark.parametrize("pattern, local", [(6, [1, 1, 1, 1, 1, 0, 1]), (3, [1, 1, 0, 1, 1, 0, 1]),
                                            (1, [0] * 7), (0, [1] * 7), (PATTERN, PATTERN)])
def test_gemma3_sliding_window_pattern(tmp_path, pattern, local):
    op = ({"op": "set", "key": "gemma3.attention.sliding_window_pattern", "vtype": VT.UINT32, "value": pattern}
          if isinstance(pattern, int) else
          {"op": "set", "key": "gemma3.attention.sliding_window_pattern", "vtype": VT.ARRAY, "item": VT.BOOL,
           "value": pattern})
    cfg = config_of(variant(tmp_path, "tiny-gemma3", [op]))
    assert [int(a.window is not None) for a in cfg.layers] == local
    assert {a.rope.theta for a, is_local in zip(cfg.layers, local) if is_local} <= {10000.0}  # llama.cpp's default


@pytest.mark.slow
def test_gemma3_switches_match_transformers(tmp_path):
    """The local RoPE base and the per-layer pattern read from the file, as transformers computes them."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = gemma_switches(tmp_path)
    hf_config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    hf_config.layer_types = ["sliding_attention" if f else "full_attention" for f in PATTERN]
    hf_config.rope_parameters["sliding_attention"]["rope_theta"] = 500.0
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                 config=hf_config).eval()
    ids = [int(i) for i in np.random.default_rng(3).integers(10, 500, 24)]  # past the window of 4
    gguf = GGUFFile(path)
    ours = OracleEngine(gguf, family_for(gguf), n_ctx=64).forward(ids, all_logits=True)
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(ours - ref).max() / np.abs(ref).max() <= 1e-4


def test_gemma3_switches_native_matches_oracle(tmp_path):
    from kiln.engine import native

    if not native.available():
        pytest.skip("the native core is not built")
    gguf = GGUFFile(gemma_switches(tmp_path))
    family = family_for(gguf)
    ids = [int(i) for i in np.random.default_rng(4).integers(10, 500, 20)]
    want = OracleEngine(gguf, family, n_ctx=64, kv_dtype=np.float16).forward(ids, all_logits=True)
    got = native.NativeEngine(gguf, family, n_ctx=64, threads=1).forward(ids, all_logits=True)
    assert np.abs(got - want).max() / np.abs(want).max() <= 1e-4


@pytest.mark.parametrize("ops, scale", [
    ([{"op": "set", "key": "llama.rope.scaling.factor", "vtype": VT.FLOAT32, "value": 4.0}], 0.25),  # linear
    ([{"op": "set", "key": "llama.rope.scaling.factor", "vtype": VT.FLOAT32, "value": 4.0},
      {"op": "set", "key": "llama.rope.scaling.type", "vtype": VT.STRING, "value": "none"}], 1.0),
    ([{"op": "set", "key": "llama.rope.scale_linear", "vtype": VT.FLOAT32, "value": 2.0}], 0.5),  # the old key
    ([{"op": "set", "key": "llama.rope.scaling.factor", "vtype": VT.FLOAT32, "value": 0.0}], 1.0),
])
def test_rope_scaling_reads_as_llama_cpp(tmp_path, ops, scale):
    assert config_of(variant(tmp_path, "tiny-llama", ops)).layers[0].rope.position_scale == scale


@pytest.mark.parametrize("ops, message", [
    ([{"op": "set", "key": "llama.attention.value_length", "vtype": VT.UINT32, "value": 8}],
     "'llama.attention.value_length' is 8, expected an integer in 16..16"),
    ([{"op": "set", "key": "llama.attention.sliding_window", "vtype": VT.FLOAT32, "value": 4096.0}],
     "'llama.attention.sliding_window' is 4096.0, expected an integer in 0..16777216"),
    ([{"op": "set", "key": "llama.rope.scaling.type", "vtype": VT.STRING, "value": "dynamic"}],
     "'llama.rope.scaling.type' is 'dynamic', expected one of 'none', 'linear', 'yarn', 'longrope'"),
    ([{"op": "set", "key": "llama.attention.head_count", "vtype": VT.ARRAY, "item": VT.UINT32, "value": [4, 4]}],
     "expected one count for every layer (per-layer counts are not supported)"),
    ([{"op": "drop_tensor", "tensor": "output.weight"}, {"op": "drop_tensor", "tensor": "output_norm.weight"}],
     "required tensor 'output_norm.weight' is missing"),
    ([{"op": "set", "key": "tokenizer.ggml.scores", "vtype": VT.ARRAY, "item": VT.FLOAT32, "value": [0.0]}],
     "'tokenizer.ggml.scores' is an array of 1, expected per-token numbers (512 of them)"),
])
def test_refusals_name_the_key_or_tensor(tmp_path, ops, message):
    path = variant(tmp_path, "tiny-llama", ops)
    with pytest.raises(ModelFileError) as info:
        check_model_file(path)
    assert message in str(info.value) and str(path) in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("ops, message", [
    ([{"op": "set", "key": "general.nested", "vtype": VT.ARRAY, "item": VT.ARRAY, "value": []}],
     "is an array of value type 9"),
    ([{"op": "dup_tensor", "tensor": "output_norm.weight"}], "tensor 'output_norm.weight' appears twice"),
    ([{"op": "set", "key": "general.name", "vtype": VT.STRING, "value": "a"},
      {"op": "length", "of": "general.name", "field": "value_len", "value": (1 << 64) - 1}], "truncated"),
    ([{"op": "dims", "tensor": "blk.0.attn_q.weight", "dims": [1 << 32, 1 << 32]}], "more than the whole file"),
    ([{"op": "set", "key": "tokenizer.ggml.tokens", "vtype": VT.ARRAY, "item": VT.STRING, "value": []},
      {"op": "length", "of": "tokenizer.ggml.tokens", "field": "value_len", "value": 1 << 40}], "array items"),
])
def test_parser_bounds_everything_by_the_file(tmp_path, ops, message):
    path = variant(tmp_path, "tiny-llama", ops)
    with pytest.raises(ModelFileError, match=message.replace("(", r"\(").replace(")", r"\)")):
        GGUFFile(path)


def test_duplicate_key_is_refused(tmp_path):
    path = variant(tmp_path, "tiny-llama", [])
    h = fuzz.parse(path.read_bytes())
    h.kvs.append(fuzz.KV("general.name", VT.STRING, "again"))
    path.write_bytes(fuzz.serialize(h))
    with pytest.raises(ModelFileError, match="metadata key 'general.name' appears twice"):
        GGUFFile(path)
