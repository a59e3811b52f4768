"""gpt-oss: the oracle against transformers' GptOssForCausalLM (attention sinks, alternating sliding-window and
global layers, YaRN, biased projections and router, a softmax over the chosen logits, the clamped SwiGLU), the
native plan against the oracle on every ISA (float and MXFP4 experts, fp16 and q8_0 KV caches, contexts past
one attention part, batched decode whose rows choose different experts, prefill chunks that leave experts
unread), and what kiln reports of and does with such a file."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from kiln import _native
from kiln.engine.native import NativeEngine
from kiln.engine.oracle import OracleEngine
from kiln.errors import ModelFileError, UnsupportedModelError
from kiln.gguf import GGUFFile
from kiln.models import family_for
from kiln.synth import SHAPES, write_random_gguf
from tests.reference import Builder, hf_greedy, hf_logits, oracle, oracle_greedy, register_builder, rel_err
from tests.test_dense import _LLAMA_NAMES, _common
from tests.test_moe import router_logits
from tests.test_moe import routes as moe_routes
from tests.test_native import engines, kld

SHAPE = "tiny-gpt-oss"
A = "gpt-oss"
NORM = "post_attention_norm"  # the block's norm before its experts


def _hf_config(meta: dict) -> dict:
    return {**_common(meta, "gpt_oss", tied=False), "head_dim": meta[f"{A}.attention.key_length"],
            "intermediate_size": meta[f"{A}.expert_feed_forward_length"],
            "num_local_experts": meta[f"{A}.expert_count"], "num_experts_per_tok": meta[f"{A}.expert_used_count"],
            "sliding_window": meta[f"{A}.attention.sliding_window"], "attention_bias": True,
            "rope_parameters": {"rope_type": "yarn", "rope_theta": meta[f"{A}.rope.freq_base"],
                                "factor": meta[f"{A}.rope.scaling.factor"], "beta_fast": 32.0, "beta_slow": 1.0,
                                "truncate": False,
                                "original_max_position_embeddings": meta[f"{A}.rope.scaling.original_context_length"]}}


def _hf_name(gguf_name: str) -> str:
    top = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
    if gguf_name in top:
        return top[gguf_name]
    _, layer, tensor, kind = gguf_name.split(".")
    p = f"model.layers.{layer}."
    if tensor == "attn_sinks":
        return p + "self_attn.sinks"
    if tensor == "ffn_gate_inp":
        return p + f"mlp.router.{kind}"
    if tensor.endswith("_exps"):  # joined into transformers' expert parameters (_join_experts)
        return p + f"mlp.experts.{tensor}.{kind}"
    return p + f"{_LLAMA_NAMES[tensor]}.{kind}"


def _join_experts(state: dict) -> dict:
    """transformers keeps each expert's gate and up columns interleaved (gate even, up odd) in one
    [experts, dim, 2 ff] gate_up_proj, its down projection as [experts, ff, dim]."""
    import torch

    out = {k: v for k, v in state.items() if "_exps." not in k}
    for k in state:
        if not k.endswith("ffn_gate_exps.weight"):
            continue
        stem = k[: -len("ffn_gate_exps.weight")]
        gate, up = state[k], state[stem + "ffn_up_exps.weight"]  # [experts, ff, dim]
        out[stem + "gate_up_proj"] = torch.stack([gate.transpose(1, 2), up.transpose(1, 2)], dim=-1).flatten(2)
        out[stem + "gate_up_proj_bias"] = torch.stack([state[stem + "ffn_gate_exps.bias"],
                                                       state[stem + "ffn_up_exps.bias"]], dim=-1).flatten(1)
        out[stem + "down_proj"] = state[stem + "ffn_down_exps.weight"].transpose(1, 2).contiguous()
        out[stem + "down_proj_bias"] = state[stem + "ffn_down_exps.bias"]
    return out


register_builder(A, Builder(config=_hf_config, name=_hf_name, join=_join_experts))


def prompt(n: int, seed: int = 5) -> list[int]:
    return [int(i) for i in np.random.default_rng(seed).integers(3, 500, n)]


def routes(engine, ids, layer: int = 0) -> np.ndarray:
    return moe_routes(engine, ids, layer, NORM)


def test_the_file_reads_as_gpt_oss(tmp_path):
    cfg = family_for(GGUFFile(write_random_gguf(tmp_path / "m.gguf", SHAPE, seed=1))).config
    assert [a.window for a in cfg.layers] == [8, None]  # llama.cpp's pattern: the even layers are local
    assert all(a.sinks == f"blk.{i}.attn_sinks.weight" for i, a in enumerate(cfg.layers))
    assert cfg.layers[0].rope.yarn.factor == 32 and not cfg.layers[0].rope.yarn.truncate
    e = cfg.experts[1]
    assert (e.gating, e.act, e.normalize, e.router_bias) == ("softmax_selected", "swiglu_oai", False,
                                                             "blk.1.ffn_gate_inp.bias")


@pytest.mark.slow
def test_gpt_oss_matches_transformers(tmp_path):
    """A prompt three times the window: the local layers' windows slide while the global layers see it all."""
    path = write_random_gguf(tmp_path / "m.gguf", SHAPE, seed=7)
    ids = prompt(24, seed=3)
    assert rel_err(oracle(path).forward(ids, all_logits=True), hf_logits(path, ids)) <= 1e-4
    assert oracle_greedy(oracle(path), ids, 32) == hf_greedy(path, ids, 32)


def test_sinks_and_expert_biases_change_the_logits(tmp_path):
    """Each of gpt-oss's additions is in the graph: zeroing it changes what the oracle computes."""
    path = write_random_gguf(tmp_path / "m.gguf", SHAPE, seed=7)
    ids = prompt(12)
    want = oracle(path).forward(ids)
    for tensor in ("blk.1.attn_sinks.weight", "blk.0.ffn_down_exps.bias", "blk.1.ffn_gate_inp.bias"):
        broken = oracle(path)
        broken.weight(tensor)[...] = 0
        assert rel_err(broken.forward(ids), want) > 1e-3, tensor


def test_float_gpt_oss_matches_oracle(tmp_path, isa):
    """Prefill in chunks of 17 rows and decode steps past the window, on the float path."""
    path = write_random_gguf(tmp_path / "m.gguf", SHAPE, qtype=QT.F32, seed=11)
    native, reference = engines(path, prefill_rows=17, max_batch=4)
    ids = prompt(40)
    assert rel_err(native.forward(ids, all_logits=True), reference.forward(ids, all_logits=True)) < 1e-4
    for i, t in enumerate([7, 99, 300, 12, 45]):
        assert rel_err(native.forward([t], 0, 40 + i), reference.forward([t], 0, 40 + i)) < 1e-4


def near_ties(engine, n_rows: int, margin: float = 0.01) -> np.ndarray:
    """Rows of the engine's last prefill whose choice in some layer is within `margin` of another (the
    k-th and the next router logit): int8 activations may flip it, and then half a row's mixture differs."""
    near = np.zeros(n_rows, bool)
    for layer, e in enumerate(engine.config.experts):
        logits = np.sort(router_logits(engine, layer, NORM), axis=-1)[:, ::-1]
        near |= logits[:, e.n_used - 1] - logits[:, e.n_used] < margin
    return near


@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q4_0])
def test_mxfp4_experts_are_close_to_oracle(qtype, tmp_path, isa):
    """gpt-oss's experts in MXFP4 (as released) through the MXFP4 kernels, the rest quantized too. A row
    whose routing is a near tie may choose the other expert (a discrete flip, not an error of the kernels):
    those rows are few, and the others are held to the MoE families' bounds."""
    path = write_random_gguf(tmp_path / "m.gguf", SHAPE, qtype=qtype, seed=11, expert_qtype=QT.MXFP4)
    assert GGUFFile(path).info("blk.0.ffn_up_exps.weight").type == QT.MXFP4
    native, reference = engines(path, prefill_rows=17, max_batch=4)
    ids = prompt(40)
    got, want = native.forward(ids, all_logits=True), reference.forward(ids, all_logits=True)
    clear = ~near_ties(reference, len(ids))
    assert clear.mean() >= 0.9
    assert kld(want[clear], got[clear]).mean() < 2e-3
    assert (got[clear].argmax(-1) == want[clear].argmax(-1)).mean() >= 0.95


def test_prefill_chunk_where_experts_get_no_row(tmp_path, isa):
    path = write_random_gguf(tmp_path / "m.gguf", SHAPE, qtype=QT.F32, seed=11)
    native, reference = engines(path)
    ids = prompt(3)
    assert len(np.unique(routes(oracle(path), ids))) < native.config.experts[0].n_experts
    assert rel_err(native.forward(ids, all_logits=True), reference.forward(ids, all_logits=True)) < 1e-4


def test_batched_decode_rows_choose_different_experts(tmp_path, isa):
    path = write_random_gguf(tmp_path / "m.gguf", SHAPE, qtype=QT.F32, seed=11)
    native, reference = engines(path, n_slots=4)
    prompts = [prompt(5 + 3 * s, seed=s) for s in range(4)]  # some past the window, some within it
    for engine in (native, reference):
        for s, ids in enumerate(prompts):
            engine.forward(ids, slot=s)
    tokens, slots, positions = [11, 222, 333, 444], [0, 1, 2, 3], [len(p) for p in prompts]
    got = native.step(tokens, slots, positions, [0, 1, 2, 3])
    assert rel_err(got, reference.step(tokens, slots, positions, [0, 1, 2, 3])) < 1e-4
    chosen = [tuple(routes(oracle(path), p + [t])[-1]) for p, t in zip(prompts, tokens)]
    assert len(set(chosen)) > 1
    assert np.array_equal(native.step([tokens[2]], [2], [positions[2]], [0])[0], got[2])


@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
def test_sinks_over_a_context_in_several_parts(kv_type, tmp_path, isa):
    """Past 512 keys the global layers' attention is split into parts, merged with the sink in the
    denominator once; on both caches, and the thread count changes no bit."""
    path = write_random_gguf(tmp_path / "m.gguf", SHAPE, qtype=QT.F32, seed=12, head_dim=32)
    gguf = GGUFFile(path)
    fam = family_for(gguf)
    ids = prompt(560)
    runs = []
    for threads in (1, 2):
        native = NativeEngine(gguf, fam, n_ctx=600, threads=threads, max_batch=4, kv_type=kv_type)
        runs.append(np.stack([native.forward(ids)] + [native.forward([7 + i], 0, 560 + i) for i in range(2)]))
    ref = OracleEngine(gguf, fam, n_ctx=600, kv_dtype=np.float16, kv_type=None if kv_type == "f16" else kv_type)
    want = np.stack([ref.forward(ids)] + [ref.forward([7 + i], 0, 560 + i) for i in range(2)])
    assert rel_err(runs[0], want) < (1e-4 if kv_type == "f16" else 1e-3)
    assert np.array_equal(runs[0], runs[1])


def test_guarded_gpt_oss_plans(tmp_path, isa):
    """The sinks, the router's and the experts' biases are read inside their buffers; guards change no bit."""
    path = write_random_gguf(tmp_path / "m.gguf", SHAPE, qtype=QT.Q8_0, seed=5, expert_qtype=QT.MXFP4)
    guarded, _ = engines(path, prefill_rows=17, max_batch=4, guard=True)
    plain, _ = engines(path, prefill_rows=17, max_batch=4)
    ids = prompt(34)
    assert np.array_equal(guarded.forward(ids, all_logits=True), plain.forward(ids, all_logits=True))


def test_plan_checks_the_sinks_and_expert_biases(tmp_path):
    path = write_random_gguf(tmp_path / "m.gguf", SHAPE, qtype=QT.Q8_0, seed=5)
    native, _ = engines(path)
    p = native.prefill_plan
    inputs = [p.inputs[k].ctypes.data for k in ("tokens", "slots", "positions", "row_sel")]

    def rebuild(**buffers):
        merged = {k: v for k, v in {**p.buffers, **buffers}.items() if v is not None}
        return _native.Plan(p.encoded, native.pool, merged, p.rows, p.out_rows, native.kv_ctx, native.n_slots,
                            *inputs)

    rebuild()
    with pytest.raises(ValueError, match=r"\(ATTN, layer 1\): sinks needs 16 bytes at byte 0 of buffer "
                                         r"'blk.1.attn_sinks.weight', which holds 8"):
        rebuild(**{"blk.1.attn_sinks.weight": native.weights.vector("blk.1.attn_sinks.weight")[:2]})
    with pytest.raises(ValueError, match=r"\(MOE, layer 1\): exp_down_b needs 2048 bytes"):
        rebuild(**{"blk.1.ffn_down_exps.bias": native.weights.vector("blk.1.ffn_down_exps.bias")[:64]})
    layout, size = _native.op_layout()
    moe = next(n for n, op in enumerate(p.ops) if op["kind"] == _native.OP_MOE)

    def patched(field: str, value: int):
        ops = bytearray(p.encoded)
        struct.pack_into("<i", ops, moe * size + layout[field][0], value)
        return _native.Plan(bytes(ops), native.pool, p.buffers, p.rows, p.out_rows, native.kv_ctx, native.n_slots,
                            *inputs)

    with pytest.raises(ValueError, match=r"gating 2 is not one op_moe.c computes"):
        patched("moe_gating", 2)
    with pytest.raises(ValueError, match=r"glu_act 1 is not an experts' activation"):
        patched("glu_act", _native.ACT_GELU_TANH)


def test_gpt_oss_files_are_checked(tmp_path):
    def without(key: str):
        path = write_random_gguf(tmp_path / "m.gguf", SHAPE, seed=1)
        data = bytearray(path.read_bytes())
        at = data.index(f"{A}.{key}".encode())
        data[at : at + len(A)] = b"x" * len(A)  # the key renamed: the family no longer finds it
        path.write_bytes(bytes(data))
        return path

    with pytest.raises(ModelFileError, match=r"required metadata key 'gpt-oss.attention.sliding_window' is missing"):
        family_for(GGUFFile(without("attention.sliding_window")))
    with pytest.raises(ModelFileError, match=r"required metadata key 'gpt-oss.expert_feed_forward_length' is missing"):
        family_for(GGUFFile(without("expert_feed_forward_length")))
    with pytest.raises(ModelFileError, match=r"'blk.0.ffn_gate_exps.weight' has wrong shape; expected \[64, 96, 8\], "
                                             r"got \[64, 64, 8\]"):
        family_for(GGUFFile(_patch_u32(write_random_gguf(tmp_path / "f.gguf", SHAPE, seed=1),
                                       f"{A}.expert_feed_forward_length", 96)))


def test_a_file_without_sinks_is_refused(tmp_path):
    path = write_random_gguf(tmp_path / "m.gguf", SHAPE, seed=1)
    data = path.read_bytes()
    path.write_bytes(data.replace(b"blk.1.attn_sinks.weight", b"blk.1.attn_sinkz.weight"))
    with pytest.raises(UnsupportedModelError, match=r"tensor 'blk.1.attn_sinkz.weight' is not one kiln's gpt-oss"):
        family_for(GGUFFile(path))


def _patch_u32(path, key: str, value: int):
    data = bytearray(path.read_bytes())
    at = data.index(key.encode() + (4).to_bytes(4, "little")) + len(key) + 4
    data[at : at + 4] = value.to_bytes(4, "little")
    path.write_bytes(bytes(data))
    return path


def test_kiln_show_counts_total_and_active_parameters(tmp_path, monkeypatch, capsys):
    """A token computes with 2 of 8 experts per layer: their matrices and their bias rows."""
    from kiln import cli
    from kiln.commands.models import _millions_or_billions
    from kiln.models.base import active_parameters

    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))
    path = write_random_gguf(tmp_path / "m.gguf", SHAPE, qtype=QT.Q8_0, seed=5, expert_qtype=QT.MXFP4)
    gguf = GGUFFile(path)
    total = sum(t.n_elements for t in gguf.tensors.values())
    per_layer = sum(gguf.info(f"blk.0.ffn_{m}_exps.{k}").n_elements for m in ("gate", "up", "down")
                    for k in ("weight", "bias"))
    active = total - 2 * per_layer * 6 // 8
    assert active_parameters(gguf, family_for(gguf).config) == active
    assert cli.main(["show", str(path)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("parameters"))
    assert f"({total:,}), {_millions_or_billions(active)} active per token" in line


def test_the_harmony_template_in_the_file_renders_and_parses(tmp_path):
    from kiln.engine.model import load
    from kiln.engine.request import GenerationRequest, prepare
    from kiln.harmony import HarmonyParser

    model = load(str(write_random_gguf(tmp_path / "m.gguf", SHAPE, seed=1)), n_ctx=256, progress=False)
    try:
        seq, parser = prepare(model, GenerationRequest(messages=[{"role": "user", "content": "hi"}], think="low"))
        text = model.tokenizer.decode(seq.prompt_ids, skip_special=False)
        assert "Reasoning: low\n" in text and text.endswith("<|start|>user<|message|>hi<|end|><|start|>assistant")
        assert isinstance(parser, HarmonyParser)
        assert model.tokenizer.encode("<|return|>")[0] in model.tokenizer.stop_ids
    finally:
        model.close()


def test_the_20b_shape_is_gpt_oss_20b():
    s = SHAPES["gpt-oss-20b"]
    assert (s.n_layers, s.dim, s.n_heads, s.n_kv_heads, s.head_dim, s.n_experts, s.n_experts_used,
            s.expert_ffn_dim, s.vocab_size, s.expert_qtype) == (24, 2880, 64, 8, 64, 32, 4, 2880, 201088, QT.MXFP4)
