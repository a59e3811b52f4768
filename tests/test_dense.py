"""Granite, OLMo2 and SmolLM3 on random tiny weights: the oracle against transformers (built from each
file's config and weights, since transformers reads none of their GGUFs), the native engine against
the oracle on every ISA, their tokenizers and chat templates, their metadata checks, and `kiln run`."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT

from kiln.cli import main
from kiln.errors import ModelFileError, UnsupportedModelError
from kiln.gguf import GGUFFile
from kiln.models import check_model_file, family_for
from kiln.synth import write_random_gguf
from kiln.tokenizer import Tokenizer
from tests.test_check import variant
from tests.reference import Builder, hf_greedy, hf_logits, register_builder, rel_err
from tests.test_models import oracle, oracle_greedy
from tests.test_native import engines, kld
from tests.test_plan import engine as plan_engine
from tests.test_plan import rebuild, run_prompt

SHAPES = ["tiny-granite", "tiny-olmo2", "tiny-smollm3"]


def _common(meta: dict, model_type: str, tied: bool) -> dict:
    a = meta["general.architecture"]
    return dict(model_type=model_type, vocab_size=len(meta["tokenizer.ggml.token_type"]),
                hidden_size=meta[f"{a}.embedding_length"], intermediate_size=meta[f"{a}.feed_forward_length"],
                num_hidden_layers=meta[f"{a}.block_count"], num_attention_heads=meta[f"{a}.attention.head_count"],
                num_key_value_heads=meta[f"{a}.attention.head_count_kv"],
                rms_norm_eps=meta[f"{a}.attention.layer_norm_rms_epsilon"],
                max_position_embeddings=meta[f"{a}.context_length"],
                rope_parameters={"rope_type": "default", "rope_theta": meta[f"{a}.rope.freq_base"]},
                tie_word_embeddings=tied, pad_token_id=None, bos_token_id=None, eos_token_id=None)


def _granite_config(meta: dict) -> dict:
    """Granite's, and Granite-MoE's keys under its own architecture."""
    a = meta["general.architecture"]
    head_dim = meta[f"{a}.embedding_length"] // meta[f"{a}.attention.head_count"]
    return {**_common(meta, "granite", tied=True), "embedding_multiplier": meta.get(f"{a}.embedding_scale", 1.0),
            "residual_multiplier": meta.get(f"{a}.residual_scale", 1.0),
            "attention_multiplier": meta.get(f"{a}.attention.scale", 1 / math.sqrt(head_dim)),
            "logits_scaling": meta[f"{a}.logit_scale"]}


_LLAMA_NAMES = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
                "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
                # OLMo2's
                "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
                "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}


def _hf_name(name: str) -> str | None:
    top = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
    if name in top:
        return top[name]
    _, layer, tensor, kind = name.split(".")
    return f"model.layers.{layer}.{_LLAMA_NAMES[tensor]}.{kind}"


# llama.cpp converts Granite and SmolLM3 through its LlamaModel class (q/k rows permuted), OLMo2 not
register_builder("granite", Builder(config=_granite_config, name=_hf_name, unpermute_qk=True))
register_builder("olmo2", Builder(config=lambda meta: _common(meta, "olmo2", tied=False), name=_hf_name))
register_builder("smollm3", Builder(config=lambda meta: _common(meta, "smollm3", tied=True), name=_hf_name,
                                    unpermute_qk=True))


@pytest.mark.slow
@pytest.mark.parametrize("shape", SHAPES)
def test_family_matches_transformers(shape, tmp_path):
    path = write_random_gguf(tmp_path / f"{shape}.gguf", shape, seed=7)
    ids = [int(i) for i in np.random.default_rng(3).integers(10, 500, 24)]
    ref = hf_logits(path, ids)
    assert rel_err(oracle(path).forward(ids, all_logits=True), ref) <= 1e-4
    assert oracle_greedy(oracle(path), ids, 32) == hf_greedy(path, ids, 32)


@pytest.mark.parametrize("shape", SHAPES)
def test_float_model_matches_oracle(shape, tmp_path, isa):
    path = write_random_gguf(tmp_path / f"{shape}.gguf", shape, qtype=QT.F32, seed=11)
    native, reference = engines(path, prefill_rows=17, max_batch=4, guard=True)
    ids = [int(i) for i in np.random.default_rng(5).integers(3, 500, 40)]
    assert rel_err(native.forward(ids, all_logits=True), reference.forward(ids, all_logits=True)) < 1e-4
    for i, t in enumerate([7, 99, 300, 12, 45]):
        assert rel_err(native.forward([t], 0, 40 + i), reference.forward([t], 0, 40 + i)) < 1e-4
    step = [engine.step([8, 9], [0, 0], [45, 46], [0, 1]) for engine in (native, reference)]
    assert rel_err(step[0], step[1]) < 1e-4
    assert rel_err(native.hidden(2), reference.hidden(2)) < 1e-4  # the head's input, before the logit scale


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q8_0])
def test_quantized_model_is_close_to_oracle(shape, qtype, tmp_path, isa):
    path = write_random_gguf(tmp_path / f"{shape}.gguf", shape, qtype=qtype, seed=4)
    native, reference = engines(path)
    ids = [int(i) for i in np.random.default_rng(8).integers(3, 500, 48)]
    a, b = native.forward(ids, all_logits=True), reference.forward(ids, all_logits=True)
    assert kld(b, a).mean() < 0.01
    assert (a.argmax(-1) == b.argmax(-1)).mean() >= 0.9


def test_olmo2_of_one_kv_head_matches_oracle(tmp_path):
    """k's norm over its whole projection is a head's norm; q's still spans four heads."""
    path = write_random_gguf(tmp_path / "o.gguf", "tiny-olmo2", qtype=QT.F32, seed=12, n_kv_heads=1)
    native, reference = engines(path)
    ids = [int(i) for i in np.random.default_rng(6).integers(3, 500, 20)]
    assert rel_err(native.forward(ids, all_logits=True), reference.forward(ids, all_logits=True)) < 1e-4


def test_batch_of_slots_matches_oracle(tmp_path):
    """Decode rows of two sequences and a prefill chunk of a third in one step: OLMo2's second QKV pass
    normalizes and stores each row under its own slot and position."""
    path = write_random_gguf(tmp_path / "o.gguf", "tiny-olmo2", qtype=QT.F16, seed=3)
    native, reference = engines(path, n_slots=3)
    for engine in (native, reference):
        engine.forward([5, 6, 7, 8], slot=0)
        engine.forward([9, 10], slot=1)
    tokens, slots, positions = [11, 12, 20, 21, 22, 23, 24], [0, 1, 2, 2, 2, 2, 2], [4, 2, 0, 1, 2, 3, 4]
    got = native.step(tokens, slots, positions, [0, 1, 6])
    assert rel_err(got, reference.step(tokens, slots, positions, [0, 1, 6])) < 1e-4


def test_multipliers_and_norope_layers_change_the_model(tmp_path):
    """Each switch the families read is live: the oracle's logits move when one is dropped."""
    path = write_random_gguf(tmp_path / "g.gguf", "tiny-granite", seed=2)
    gguf = GGUFFile(path)
    fam = family_for(gguf)
    cfg = fam.config
    assert (cfg.embedding_scale, cfg.residual_scale, cfg.logit_scale) == (12.0, pytest.approx(0.22), 8.0)
    assert cfg.layers[0].scale == pytest.approx(1 / 16) and cfg.layers[0].rope is not None
    smol = family_for(GGUFFile(write_random_gguf(tmp_path / "s.gguf", "tiny-smollm3", seed=2, n_layers=8)))
    assert [a.rope is None for a in smol.config.layers] == [False, False, False, True] * 2


@pytest.mark.parametrize("shape,ops,message", [
    ("tiny-granite", [{"op": "drop_key", "key": "granite.logit_scale"}],
     "required metadata key 'granite.logit_scale' is missing"),
    ("tiny-granite", [{"op": "set", "key": "granite.expert_shared_feed_forward_length", "vtype": VT.UINT32, "value": 64}],
     "is the dense one"),
    ("tiny-granite", [{"op": "set", "key": "granite.rope.scaling.finetuned", "vtype": VT.UINT32, "value": 3}],
     "expected a boolean"),
    ("tiny-granite", [{"op": "set", "key": "granite.attn_logit_softcapping", "vtype": VT.FLOAT32, "value": 30.0}],
     "not one kiln's granite family reads"),
    ("tiny-olmo2", [{"op": "set", "key": "olmo2.attention.sliding_window", "vtype": VT.UINT32, "value": 8}],
     "OLMo 3's sliding window is not run"),
    ("tiny-olmo2", [{"op": "rename", "tensor": "blk.0.post_ffw_norm.weight", "to": "blk.0.ffn_norm.weight"}],
     "tensor 'blk.0.ffn_norm.weight' is not one kiln's olmo2 family reads"),
    ("tiny-smollm3", [{"op": "set", "key": "smollm3.rope.dimension_count", "vtype": VT.UINT32, "value": 8}],
     "expected an integer in 16..16"),
])
def test_switches_are_read_or_refused(shape, ops, message, tmp_path):
    path = variant(tmp_path, shape, ops)
    with pytest.raises((ModelFileError, UnsupportedModelError), match=re.escape(message)) as info:
        check_model_file(path)
    assert str(path) in str(info.value)


def test_granite_rope_switch_turns_rope_off(tmp_path):
    """llama.cpp runs Granite without rope when `rope.scaling.finetuned` is false; so do both engines."""
    path = variant(tmp_path, "tiny-granite", [{"op": "set", "key": "granite.rope.scaling.finetuned",
                                               "vtype": VT.BOOL, "value": False}])
    cfg = family_for(GGUFFile(path)).config
    assert all(a.rope is None for a in cfg.layers)
    native, reference = engines(path)
    ids = [5, 80, 7, 300, 41, 9]
    assert rel_err(native.forward(ids, all_logits=True), reference.forward(ids, all_logits=True)) < 1e-4


@pytest.mark.parametrize("shape,user,assistant,end", [
    ("tiny-granite", "<|start_of_role|>user<|end_of_role|>", "<|start_of_role|>assistant<|end_of_role|>",
     "<|end_of_text|>"),
    ("tiny-olmo2", "<|endoftext|><|user|>\n", "<|assistant|>\n", "<|endoftext|>"),  # opening with bos
    ("tiny-smollm3", "<|im_start|>user\n", "<|im_start|>assistant\n", "<|im_end|>"),
])
def test_tokenizer_and_chat_template_come_from_the_file(shape, user, assistant, end, tmp_path):
    gguf = GGUFFile(write_random_gguf(tmp_path / f"{shape}.gguf", shape, seed=5))
    tok = Tokenizer.from_gguf(gguf)
    assert tok.chat_template == gguf.get("tokenizer.chat_template")
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi there"}])
    assert prompt.startswith(user) and prompt.endswith(assistant) and "hi there" in prompt
    ids = tok.encode(prompt)
    markers = [t for t in re.findall(r"<\|[a-z_]+\|>", prompt)]
    assert markers and all(tok.token_to_id(t) in ids for t in markers)  # each marker one token, not its letters
    assert tok.decode(ids, skip_special=False) == prompt
    assert tok.id_to_token(tok.eos_id) == end


@pytest.mark.parametrize("shape", SHAPES)
def test_kiln_run_answers_on_the_native_engine(shape, tmp_path, capsys):
    """A one-shot answer through the chat template, on the native engine (which refuses rather than falls
    back), token for token the oracle's. Untied: a random tied head mostly repeats the prompt's last token."""
    path = write_random_gguf(tmp_path / f"{shape}.gguf", shape, seed=9, tied=False)
    answers = []
    for backend in ("native", "oracle"):
        assert main(["run", str(path), "Name three colours.", "--backend", backend, "--temperature", "0", "-n", "12",
                     "-c", "128"]) == 0
        out, err = capsys.readouterr()
        answers.append(out)
    assert answers[0].strip() and answers[0] == answers[1]


@pytest.mark.parametrize("shape", SHAPES)
def test_guarded_plans_run_on_every_isa(shape, isa, tmp_path):
    """Q8_0: precise pairs and the split head; no op writes outside its scratch, the guards change no bit."""
    path = write_random_gguf(tmp_path / "m.gguf", shape, qtype=QT.Q8_0, seed=5)
    ids = [int(i) for i in np.random.default_rng(2).integers(3, 500, 34)]
    assert np.array_equal(run_prompt(plan_engine(path, guard=True), ids), run_prompt(plan_engine(path), ids))


def _with_field(e, kind: int, layer: int, field: str, value):
    """The prefill plan built again with one field of the first `kind` op of `layer` replaced."""
    import struct

    from kiln import _native

    p = e.prefill_plan
    i = next(n for n, op in enumerate(p.ops) if op["kind"] == kind and op.get("layer", 0) == layer)
    layout, size = _native.op_layout()
    ops = bytearray(p.encoded)
    offset, code = layout[field]
    struct.pack_into({"i": "<i", "f": "<f", "p": "<Q"}[code], ops, i * size + offset, value)
    inputs = [p.inputs[k].ctypes.data for k in ("tokens", "slots", "positions", "row_sel")]
    return _native.Plan(bytes(ops), e.pool, p.buffers, p.rows, p.out_rows, e.kv_ctx, e.n_slots, *inputs)


def test_plan_build_checks_the_new_fields(tmp_path):
    from kiln import _native

    olmo = plan_engine(write_random_gguf(tmp_path / "o.gguf", "tiny-olmo2", qtype=QT.Q8_0, seed=5))
    rebuild(olmo)
    with pytest.raises(ValueError, match=r"plan op \d+ \(QKV, layer 0\): qnorm.weight \(256 bytes\) is inside none"):
        rebuild(olmo, **{"blk.0.attn_q_norm.weight": None})  # as long as the whole projection
    with pytest.raises(ValueError, match=r"\(QKV, layer 1\): qk_raw is NULL"):
        _with_field(olmo, _native.OP_QKV, 1, "qk_raw", 0)
    with pytest.raises(ValueError, match=r"\(QKV, layer 0\): a whole-projection norm of q and k lacks a weight"):
        _with_field(olmo, _native.OP_QKV, 0, "knorm.weight", 0)
    granite = plan_engine(write_random_gguf(tmp_path / "g.gguf", "tiny-granite", qtype=QT.Q8_0, seed=5))
    for kind in (_native.OP_MATMUL, _native.OP_LOGITS):  # an op laid out without its scale
        with pytest.raises(ValueError, match=r"\((MATMUL|LOGITS), layer 0\): scale is 0"):
            _with_field(granite, kind, 0, "scale", 0.0)
    smol = plan_engine(write_random_gguf(tmp_path / "s.gguf", "tiny-smollm3", qtype=QT.Q8_0, seed=5))
    with pytest.raises(ValueError, match=r"\(QKV, layer 3\): rope over 0 of a head's 16 dims"):
        _with_field(smol, _native.OP_QKV, 3, "rope.cos", 64)  # a table, with no width
