"""Biases and a fused attn_qkv on Llama-family files, and the phi3 and phi2 families: the oracle against
transformers on random tiny weights, the native engine against the oracle on every ISA, and `kiln run`.

transformers reads neither kiln's bias variants nor Phi-3's partial rotary and LongRoPE factors from a
GGUF (its loader drops them), nor Phi-2 at all, so each is built from a config and the file's weights."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from kiln.cli import main
from kiln.engine.native import NativeEngine
from kiln.engine.oracle import OracleEngine
from kiln.errors import ModelFileError
from kiln.gguf import GGUFFile
from kiln.models import family_for
from kiln.synth import SHAPES, write_random_gguf
from tests import reference
from tests.reference import Builder, hf_greedy, hf_logits, oracle, oracle_greedy, register_builder, rel_err
from tests.test_native import kld

LLAMA_BIASES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
QWEN3_BIASES = ("attn_q", "attn_k", "attn_v", "attn_output")  # transformers' Qwen3 MLP has no biases


def _base(shape, meta: dict) -> dict:
    a = shape.arch
    return dict(vocab_size=shape.vocab_size, hidden_size=meta[f"{a}.embedding_length"],
                intermediate_size=meta[f"{a}.feed_forward_length"], num_hidden_layers=meta[f"{a}.block_count"],
                num_attention_heads=meta[f"{a}.attention.head_count"],
                num_key_value_heads=meta[f"{a}.attention.head_count_kv"], head_dim=meta[f"{a}.attention.key_length"],
                max_position_embeddings=meta[f"{a}.context_length"], tie_word_embeddings=shape.tied,
                bos_token_id=None, eos_token_id=None, pad_token_id=None)


def _layer_names(table: dict[str, str]):
    """GGUF name → transformers name, from per-block suffixes and whole-model names."""
    def name(gguf_name: str) -> str | None:
        if gguf_name in table:
            return table[gguf_name]
        _, i, rest = gguf_name.split(".", 2)
        stem, kind = rest.rsplit(".", 1)
        return f"model.layers.{i}.{table[stem]}.{kind}"
    return name


LLAMA_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
               "output.weight": "lm_head.weight", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
               "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
               "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def llama_builder(shape) -> Builder:
    def config(meta):
        return dict(_base(shape, meta), model_type=shape.arch, rms_norm_eps=meta[f"{shape.arch}.attention.layer_norm_rms_epsilon"],
                    rope_parameters={"rope_type": "default", "rope_theta": meta[f"{shape.arch}.rope.freq_base"]},
                    attention_bias="attn_q" in shape.biases, mlp_bias="ffn_up" in shape.biases)
    return Builder(config=config, name=_layer_names(LLAMA_NAMES), unpermute_qk=shape.arch == "llama")


def _phi3_config(meta):
    shape = SHAPES["tiny-phi3"]
    a, head_dim = "phi3", meta["phi3.attention.key_length"]
    rope = {"rope_type": "longrope", "rope_theta": meta["phi3.rope.freq_base"],
            "partial_rotary_factor": meta["phi3.rope.dimension_count"] / head_dim,
            "short_factor": meta["rope_factors_short.weight"], "long_factor": meta["rope_factors_long.weight"],
            "original_max_position_embeddings": meta[f"{a}.rope.scaling.original_context_length"],
            "attention_factor": meta[f"{a}.rope.scaling.attn_factor"]}
    return dict(_base(shape, meta), model_type="phi3", rms_norm_eps=meta["phi3.attention.layer_norm_rms_epsilon"],
                original_max_position_embeddings=rope["original_max_position_embeddings"], rope_parameters=rope,
                sliding_window=None)


def _phi2_config(meta):
    shape = SHAPES["tiny-phi2"]
    head_dim = meta["phi2.embedding_length"] // meta["phi2.attention.head_count"]
    fields = _base(shape, meta)
    fields.pop("head_dim")
    return dict(fields, model_type="phi", layer_norm_eps=meta["phi2.attention.layer_norm_epsilon"], hidden_act="gelu_new",
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "partial_rotary_factor": meta["phi2.rope.dimension_count"] / head_dim})


register_builder("phi3", Builder(
    config=_phi3_config, tensors=("rope_factors_short.weight", "rope_factors_long.weight"),
    name=lambda n: None if n.startswith("rope_factors") else _layer_names(dict(
        LLAMA_NAMES, attn_qkv="self_attn.qkv_proj", ffn_up="mlp.gate_up_proj"))(n)))
register_builder("phi2", Builder(config=_phi2_config, name=_layer_names({
    "token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.final_layernorm.weight",
    "output_norm.bias": "model.final_layernorm.bias", "output.weight": "lm_head.weight", "output.bias": "lm_head.bias",
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.dense", "ffn_up": "mlp.fc1", "ffn_down": "mlp.fc2"})))




def prompt(n, seed=3):
    return [int(i) for i in np.random.default_rng(seed).integers(10, 500, n)]


@pytest.mark.parametrize("shape,biases", [("tiny-llama", LLAMA_BIASES), ("tiny-qwen3", QWEN3_BIASES)])
def test_biases_match_transformers(shape, biases, tmp_path, monkeypatch):
    path = write_random_gguf(tmp_path / f"{shape}-bias.gguf", shape, seed=7, biases=biases)
    monkeypatch.setitem(reference._BUILDERS, SHAPES[shape].arch, llama_builder(replace(SHAPES[shape], biases=biases)))
    ids = prompt(24)
    engine = oracle(path)
    assert rel_err(engine.forward(ids, all_logits=True), hf_logits(path, ids)) <= 1e-4
    assert oracle_greedy(oracle(path), ids, 16) == hf_greedy(path, ids, 16)
    # the biases matter: without them the model is another one
    plain = write_random_gguf(tmp_path / f"{shape}.gguf", shape, seed=7)
    assert rel_err(oracle(plain).forward(ids, all_logits=True), hf_logits(path, ids)) > 1e-2


@pytest.mark.parametrize("shape,fused,separate", [
    ("tiny-llama", ("attn_qkv", "attn_output"), ("attn_q", "attn_k", "attn_v", "attn_output")),
    ("tiny-qwen3", (), ()),
    ("tiny-phi2", ("attn_qkv", "attn_output", "ffn_up", "ffn_down"), SHAPES["tiny-phi2"].biases),
])
def test_fused_qkv_is_the_three_projections(shape, fused, separate, tmp_path):
    """The same values written as one attn_qkv (and bias) and as three tensors give the same model."""
    one = write_random_gguf(tmp_path / "fused.gguf", shape, seed=5, fused_qkv=True, biases=fused)
    three = write_random_gguf(tmp_path / "three.gguf", shape, seed=5, fused_qkv=False, biases=separate)
    assert "blk.0.attn_qkv.weight" in GGUFFile(one).tensors and "blk.0.attn_q.weight" in GGUFFile(three).tensors
    ids = prompt(20)
    assert rel_err(oracle(one).forward(ids, all_logits=True), oracle(three).forward(ids, all_logits=True)) < 1e-6


def test_phi3_matches_transformers_with_long_and_short_factors(tmp_path):
    """LongRoPE: a context beyond the original 32 positions takes the long factors (transformers: a sequence
    longer than 32), a context within it the short ones; partial rotary over 12 of 16 dimensions."""
    path = write_random_gguf(tmp_path / "phi3.gguf", "tiny-phi3", seed=7)
    long_ids, short_ids = prompt(40), prompt(24)
    assert rel_err(oracle(path, n_ctx=256).forward(long_ids, all_logits=True), hf_logits(path, long_ids)) <= 1e-4
    assert rel_err(oracle(path, n_ctx=32).forward(short_ids, all_logits=True), hf_logits(path, short_ids)) <= 1e-4
    assert oracle_greedy(oracle(path), long_ids, 16) == hf_greedy(path, long_ids, 16)
    # the factor sets differ: the long context's logits for the short prompt are another model's
    assert rel_err(oracle(path, n_ctx=256).forward(short_ids, all_logits=True), hf_logits(path, short_ids)) > 1e-2


def test_phi2_matches_transformers(tmp_path):
    path = write_random_gguf(tmp_path / "phi2.gguf", "tiny-phi2", seed=7)
    ids = prompt(24)
    assert rel_err(oracle(path).forward(ids, all_logits=True), hf_logits(path, ids)) <= 1e-4
    assert oracle_greedy(oracle(path), ids, 16) == hf_greedy(path, ids, 16)


VARIANTS = {
    "llama-biases": ("tiny-llama", dict(biases=LLAMA_BIASES)),
    "llama-fused": ("tiny-llama", dict(fused_qkv=True, biases=("attn_qkv", "ffn_down"))),
    "qwen3-biases": ("tiny-qwen3", dict(biases=QWEN3_BIASES)),
    "phi3-long": ("tiny-phi3", {}),
    "phi3-short": ("tiny-phi3", dict(long_rope=4096)),  # the plans' context of 96 is within the original
    "phi2": ("tiny-phi2", {}),
    "phi2-fused": ("tiny-phi2", dict(fused_qkv=True, biases=("attn_qkv", "attn_output", "ffn_up", "ffn_down"))),
}


def engines(path, n_ctx=96, **native_options):
    gguf = GGUFFile(path)
    fam = family_for(gguf)
    native = NativeEngine(gguf, fam, n_ctx=n_ctx, threads=2, **native_options)
    return native, OracleEngine(gguf, fam, n_ctx=n_ctx, kv_dtype=np.float16)


@pytest.mark.parametrize("variant", VARIANTS)
def test_float_model_matches_oracle(variant, tmp_path, isa):
    shape, options = VARIANTS[variant]
    path = write_random_gguf(tmp_path / f"{variant}.gguf", shape, qtype=QT.F32, seed=11, **options)
    native, oracle_ = engines(path, prefill_rows=17, max_batch=4)
    ids = prompt(40, seed=5)
    assert rel_err(native.forward(ids, all_logits=True), oracle_.forward(ids, all_logits=True)) < 1e-4
    for i, t in enumerate([7, 99, 300]):
        assert rel_err(native.forward([t], 0, 40 + i), oracle_.forward([t], 0, 40 + i)) < 1e-4


@pytest.mark.parametrize("variant", ["llama-biases", "phi3-long", "phi2"])
def test_quantized_model_stays_close_to_oracle(variant, tmp_path, isa):
    shape, options = VARIANTS[variant]
    path = write_random_gguf(tmp_path / f"{variant}.gguf", shape, qtype=QT.Q8_0, seed=12, **options)
    native, oracle_ = engines(path)
    ids = prompt(32, seed=6)
    got, want = native.forward(ids, all_logits=True), oracle_.forward(ids, all_logits=True)
    assert kld(want, got).max() < 2e-3
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.95


def test_a_fused_tensor_of_the_wrong_size_is_refused(tmp_path):
    """q, k and v take 128 rows of a 4-head, 2-KV-head attn_qkv of 16-wide heads; a file saying 1 KV head
    leaves rows no view reads."""
    path = write_random_gguf(tmp_path / "p.gguf", "tiny-phi3", seed=1, n_kv_heads=2)
    gguf = GGUFFile(path)
    gguf.metadata["phi3.attention.head_count_kv"] = 1
    with pytest.raises(ModelFileError, match=r"tensor 'blk.0.attn_qkv.weight' has wrong shape; expected \[64, 96\], "
                                             r"got \[64, 128\]"):
        family_for(gguf)


def test_a_bias_missing_from_one_layer_is_an_error(tmp_path):
    path = write_random_gguf(tmp_path / "b.gguf", "tiny-llama", seed=1, biases=("attn_output",))
    gguf = GGUFFile(path)
    del gguf.tensors["blk.1.attn_output.bias"]
    with pytest.raises(ModelFileError, match="required tensor 'blk.1.attn_output.bias' is missing"):
        family_for(gguf)


@pytest.mark.parametrize("shape", ["tiny-phi3", "tiny-phi2"])
def test_kiln_run_answers_on_the_native_engine(shape, tmp_path, capsys):
    path = write_random_gguf(tmp_path / f"{shape}.gguf", shape, qtype=QT.Q8_0, seed=2)
    assert main(["run", str(path), "Hello there", "--backend", "native", "-n", "8", "-c", "128",
                 "--temperature", "0"]) == 0
    assert capsys.readouterr().out.strip()


def test_phi3_vocabulary_has_phi4_minis_layout(tmp_path):
    """Specials after the ordinary tokens, <|endoftext|> as BOS and EOS, GPT-4o's pre-tokenizer, and a name
    without "phi3": llama.cpp gives such a name Phi-3's SentencePiece attributes, looking up </s>, <unk> and
    <s>, which a byte-level vocabulary lacks, and refuses the file."""
    from kiln.tokenizer import Tokenizer

    gguf = GGUFFile(write_random_gguf(tmp_path / "v.gguf", "tiny-phi3", seed=3))
    md, tokens = gguf.metadata, list(gguf.metadata["tokenizer.ggml.tokens"])
    assert len(tokens) == SHAPES["tiny-phi3"].vocab_size
    assert tokens[-5:] == ["<|endoftext|>", "<|assistant|>", "<|end|>", "<|user|>", "<|system|>"]
    assert md["tokenizer.ggml.bos_token_id"] == md["tokenizer.ggml.eos_token_id"] == tokens.index("<|endoftext|>")
    assert md["tokenizer.ggml.pre"] == "gpt-4o"
    name = md["general.name"].lower()
    assert "phi3" not in name and "phi-3" not in name
    tok = Tokenizer.from_gguf(gguf)
    assert {tokens.index("<|end|>"), tokens.index("<|endoftext|>")} <= tok.stop_ids
    assert tok.encode("<|user|>\nHi<|end|>\n")[0] == tokens.index("<|user|>")
