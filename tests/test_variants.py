"""The switches today's families' files carry, each against transformers on random tiny weights (the
transformers model built as the model's own config means the switch) and the native engine against the
oracle on every ISA: YaRN on llama, qwen2 and qwen3; Llama 3's rope factors (DeepSeek-R1-Distill-Llama);
Mistral's window on llama; Gemma 2 (soft-capped scores and logits, a window on even layers); Gemma 3's
soft caps."""

from __future__ import annotations

import functools
import math
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT

from kiln.engine.oracle import OracleEngine
from kiln.errors import ModelFileError
from kiln.gguf import GGUFFile
from kiln.models import check_model_file, family_for
from kiln.synth import SHAPES, write_random_gguf
from tests import fuzz
from tests.reference import hf_model, oracle, oracle_greedy, rel_err

YARN = ["tiny-llama-yarn", "tiny-qwen2-yarn", "tiny-qwen3-yarn"]
VARIANTS = YARN + ["tiny-llama3", "tiny-mistral", "tiny-gemma2", "tiny-gemma3-softcap"]


def switches(shape: str) -> dict:
    return dict(SHAPES[shape].metadata)


def hf_rope(shape: str) -> dict:
    """The shape's RoPE scaling as transformers' config names it."""
    s = SHAPES[shape]
    if s.llama3_rope is not None:
        factor, low, high, old = s.llama3_rope
        return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                "original_max_position_embeddings": old}
    meta = switches(shape)
    rope = {"rope_type": "yarn", "factor": meta["rope.scaling.factor"],
            "original_max_position_embeddings": meta["rope.scaling.original_context_length"]}
    names = {"rope.scaling.yarn_beta_fast": "beta_fast", "rope.scaling.yarn_attn_factor": "attention_factor"}
    rope.update({name: meta[key] for key, name in names.items() if key in meta})
    return rope


@functools.lru_cache(maxsize=2)
def reference(path: Path, shape: str):
    """A float32 transformers model of the file, with the switch the GGUF loader does not map."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, MistralConfig, MistralForCausalLM

    if shape == "tiny-mistral":  # transformers reads llama files as Llama, which has no window
        llama = hf_model(path)
        fields = {k: v for k, v in llama.config.to_dict().items() if k not in ("model_type", "architectures")}
        model = MistralForCausalLM(MistralConfig(**fields, sliding_window=switches(shape)["attention.sliding_window"]))
        model.load_state_dict(llama.state_dict(), strict=True)
        return model.eval()
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    if shape.startswith("tiny-gemma"):
        for key, value in switches(shape).items():
            setattr(config, key, value)  # the soft caps, named as in the model's config
    else:
        config.rope_parameters.update(hf_rope(shape))
    # eager attention: transformers' sdpa path drops the soft cap on scores
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                config=config, attn_implementation="eager").eval()


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    import torch

    out, past, inputs = [], None, torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            res = model(inputs, past_key_values=past, use_cache=True)
            past = res.past_key_values
            out.append(int(res.logits[0, -1].argmax()))
            inputs = torch.tensor([[out[-1]]])
    return out




# past YaRN's original context of 64 and the windows of 4 and 5
IDS = [int(i) for i in np.random.default_rng(3).integers(10, 500, 80)]


@pytest.mark.slow
@pytest.mark.parametrize("shape", VARIANTS)
def test_variant_matches_transformers(shape, tmp_path):
    import torch

    path = write_random_gguf(tmp_path / f"{shape}.gguf", shape, seed=7)
    model = reference(path, shape)
    with torch.no_grad():
        ref = model(torch.tensor([IDS])).logits[0].numpy()
    assert rel_err(oracle(path).forward(IDS, all_logits=True), ref) <= 1e-4
    assert oracle_greedy(oracle(path), IDS, 24) == hf_greedy(model, IDS, 24)


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["tiny-qwen2-yarn", "tiny-llama3", "tiny-mistral", "tiny-gemma2", "tiny-gemma3-softcap"])
def test_switches_change_the_model(shape, tmp_path):
    """Each switch matters at this scale: the model without it is far from the one with it, so the
    agreement above is the switch's."""
    import torch

    path = write_random_gguf(tmp_path / f"{shape}.gguf", shape, seed=7)
    with torch.no_grad():
        ref = reference(path, shape)(torch.tensor([IDS])).logits[0].numpy()
    s = SHAPES[shape]
    plain = write_random_gguf(tmp_path / "plain.gguf", shape, seed=7, llama3_rope=None,
                              metadata=tuple((key, 0.0) for key, _ in s.metadata if key.endswith("softcapping")))
    assert rel_err(oracle(plain).forward(IDS, all_logits=True), ref) > 0.05


def variant(tmp_path: Path, shape: str, ops: list[dict]) -> Path:
    base = write_random_gguf(tmp_path / f"base-{shape}.gguf", shape, seed=7)
    path = tmp_path / "v.gguf"
    path.write_bytes(fuzz.serialize(fuzz.apply(fuzz.parse(base.read_bytes()), ops)))
    return path


def setting(key: str, value, vtype=VT.FLOAT32) -> dict:
    return {"op": "set", "key": key, "vtype": vtype, "value": value}


def drop(key: str) -> dict:
    return {"op": "drop_key", "key": key}


def layer0(path: Path):
    gguf = GGUFFile(path)
    try:
        return family_for(gguf).config.layers[0]
    finally:
        gguf.close()


def test_yarn_reads_the_files_keys_with_llama_cpps_defaults(tmp_path):
    yarn = layer0(variant(tmp_path, "tiny-qwen2-yarn", [])).rope.yarn
    assert (yarn.factor, yarn.original_context, yarn.beta_fast, yarn.beta_slow) == (4.0, 64, 32.0, 1.0)
    assert yarn.magnitude == pytest.approx(1 + 0.1 * math.log(4.0))
    # no original context: the trained one (256); llama.cpp's own attn_factor multiplies the magnitude
    yarn = layer0(variant(tmp_path, "tiny-qwen2-yarn", [drop("qwen2.rope.scaling.original_context_length"),
                                                        setting("qwen2.rope.scaling.attn_factor", 2.0)])).rope.yarn
    assert yarn.original_context == 256 and yarn.magnitude == pytest.approx(2 * (1 + 0.1 * math.log(4.0)))
    yarn = layer0(variant(tmp_path, "tiny-qwen3-yarn", [])).rope.yarn
    assert (yarn.beta_fast, yarn.magnitude) == (16.0, pytest.approx(1.2))  # the file's attention factor
    assert layer0(variant(tmp_path, "tiny-llama-yarn", [setting("llama.rope.scaling.yarn_ext_factor", 1.0)])).rope.yarn


@pytest.mark.parametrize("shape, ops, message", [
    ("tiny-llama-yarn", [setting("llama.rope.scaling.yarn_log_multiplier", 0.25)],
     "'llama.rope.scaling.yarn_log_multiplier' is set (0.25): kiln's YaRN has no mscale_all_dim ratio"),
    ("tiny-qwen2-yarn", [setting("qwen2.rope.scaling.yarn_ext_factor", 0.5)],
     "'qwen2.rope.scaling.yarn_ext_factor' is 0.5, expected a number in 1..1"),
    ("tiny-llama", [setting("llama.rope.scaling.yarn_beta_fast", 8.0)],
     "'llama.rope.scaling.yarn_beta_fast' is set (8.0): it is a YaRN setting, and the file's RoPE is not YaRN-scaled"),
    ("tiny-gemma3", [setting("gemma3.rope.scaling.type", "yarn", VT.STRING)],
     "'gemma3.rope.scaling.type' is 'yarn': kiln's gemma3 family runs unscaled or linearly scaled RoPE only"),
    ("tiny-qwen3-yarn", [setting("qwen3.rope.freq_base", 1.0)],
     "'qwen3.rope.freq_base' is 1.0, expected a base above 1 for YaRN"),
    ("tiny-gemma2", [setting("gemma2.final_logit_softcapping", 2.0 ** -12)],
     "'gemma2.final_logit_softcapping' is 0.000244140625, expected 0 (no cap) or a cap from 0.001"),
    ("tiny-gemma2", [{"op": "rename", "tensor": "blk.0.attn_k.weight", "to": "blk.0.attn_k_norm.weight"}],
     "tensor 'blk.0.attn_k_norm.weight' is not one kiln's gemma2 family reads"),
    ("tiny-gemma3", [setting("gemma3.attn_logit_softcapping", 50.0)],
     "'gemma3.attn_logit_softcapping' is set (50.0): Gemma 3 does not soft-cap attention scores"),
    ("tiny-qwen2", [setting("qwen2.attention.sliding_window", 4, VT.UINT32)],
     "'qwen2.attention.sliding_window' is set (4): kiln's qwen2 family attends over the whole context"),
])
def test_refusals_name_the_key(tmp_path, shape, ops, message):
    path = variant(tmp_path, shape, ops)
    with pytest.raises(ModelFileError) as info:
        check_model_file(path)
    assert message in str(info.value)


def test_gemma2_reads_llama_cpps_defaults(tmp_path):
    path = variant(tmp_path, "tiny-gemma2", [drop("gemma2.attn_logit_softcapping"), drop("gemma2.final_logit_softcapping"),
                                             drop("gemma2.attention.sliding_window")])
    gguf = GGUFFile(path)
    cfg = family_for(gguf).config
    assert cfg.final_softcap == 30.0 and {a.softcap for a in cfg.layers} == {50.0}
    assert [a.window for a in cfg.layers] == [4096, None, 4096, None]  # the even layers are local
    assert cfg.layers[0].scale == 1 / 16  # 1/sqrt(head size)


def test_mistral_window_zero_is_none(tmp_path):
    path = variant(tmp_path, "tiny-mistral", [setting("llama.attention.sliding_window", 0, VT.UINT32)])
    assert layer0(path).window is None and layer0(variant(tmp_path, "tiny-mistral", [])).window == 5


def engines(path, **options):
    from kiln.engine.native import NativeEngine

    gguf = GGUFFile(path)
    fam = family_for(gguf)
    native = NativeEngine(gguf, fam, n_ctx=128, threads=2, **options)
    return native, OracleEngine(gguf, fam, n_ctx=128, kv_dtype=np.float16)


# Gemma 3's cap runs through the LOGITS op Gemma 2's does: once is enough for it
@pytest.mark.parametrize("shape", [s for s in VARIANTS if s != "tiny-gemma3-softcap"])
def test_native_matches_oracle(shape, tmp_path, isa):
    """Float weights to float32 tolerance (prefill in chunks, then decode steps); int8 ones by KLD and
    top-1. A Q8_0 head is split, so its refinement margin runs through the soft cap."""
    native_matches_oracle(shape, tmp_path)


def test_gemma3_soft_cap_native_matches_oracle(tmp_path):
    native_matches_oracle("tiny-gemma3-softcap", tmp_path)


def native_matches_oracle(shape, tmp_path):
    path = write_random_gguf(tmp_path / "f.gguf", shape, qtype=QT.F32, seed=11)
    native, oracle_ = engines(path, prefill_rows=17, max_batch=4)
    ids = IDS[:70]
    assert rel_err(native.forward(ids, all_logits=True), oracle_.forward(ids, all_logits=True)) < 1e-4
    for i, t in enumerate([7, 99, 300]):
        assert rel_err(native.forward([t], 0, 70 + i), oracle_.forward([t], 0, 70 + i)) < 1e-4
    from tests.test_native import kld

    path = write_random_gguf(tmp_path / "q.gguf", shape, qtype=QT.Q8_0, seed=4)
    native, oracle_ = engines(path)
    a, b = native.forward(ids, all_logits=True), oracle_.forward(ids, all_logits=True)
    assert kld(b, a).mean() < 0.002 and (a.argmax(-1) == b.argmax(-1)).mean() >= 0.9


def test_kiln_run_answers_with_gemma2_on_the_native_engine(tmp_path, monkeypatch, capsys):
    from kiln.cli import main
    from kiln.engine import model as model_module
    from kiln.engine import native

    if not native.available():
        pytest.skip("the native core is not built")
    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))
    made, make = [], model_module.make_engine
    monkeypatch.setattr(model_module, "make_engine", lambda *a, **k: made.append(make(*a, **k)) or made[-1])
    path = write_random_gguf(tmp_path / "gemma2.gguf", "tiny-gemma2", qtype=QT.Q8_0, seed=5)
    assert main(["run", str(path), "Hello there", "--temperature", "0", "-n", "8", "-c", "128"]) == 0
    assert capsys.readouterr().out.strip() and [engine.name for engine in made] == ["native"]


def test_soft_capped_split_head_refines_within_the_capped_margins(tmp_path, isa, monkeypatch):
    """A split int8 head refines the logits within its margins of the best as they leave the op, capped:
    the capped logits near the best come out as the whole head gives them (margins taken before the cap
    would leave most of them unrefined, the cap squeezing the top logits together)."""
    from kiln.engine import native as native_module

    path = write_random_gguf(tmp_path / "h.gguf", "tiny-gemma2", qtype=QT.Q8_0, seed=13)
    split, _ = engines(path)
    monkeypatch.setattr(native_module, "heads_of", lambda root: set())
    whole, _ = engines(path)
    assert split.weights.remainder("token_embd.weight") is not None
    assert whole.weights.remainder("token_embd.weight") is None
    split.forward(IDS[:24]), whole.forward(IDS[:24])
    for step, t in enumerate([7, 99, 300, 12]):
        a, b = split.forward([t], 0, 24 + step), whole.forward([t], 0, 24 + step)
        near = b >= b.max() - 3  # within both heads' margins (4 and 10) of the capped best
        assert np.abs(a - b)[near].max() <= 1e-5 * np.abs(b).max() and near.sum() > 10, step
        assert a.argmax() == b.argmax()
