"""Mixture-of-experts families (Qwen2-MoE, Qwen3-MoE, OLMoE, Granite-MoE): the oracle against transformers, the native OP_MOE
against the oracle on every ISA (prefill chunks in which some expert gets no row, batched decode whose rows
choose different experts), and the file and plan checks around them."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from kiln import _native
from kiln.engine.oracle import route
from kiln.errors import ModelFileError, UnsupportedModelError
from kiln.gguf import GGUFFile
from kiln.models import family_for
from kiln.synth import SHAPES, write_random_gguf
from tests.reference import Builder, hf_greedy, hf_logits, register_builder, rel_err
from tests.test_dense import _LLAMA_NAMES, _common, _granite_config
from tests.test_models import oracle, oracle_greedy
from tests.test_native import engines, kld

MOE_FAMILIES = ["tiny-qwen3moe", "tiny-qwen2moe", "tiny-olmoe", "tiny-granitemoe", "tiny-granitemoe-shared"]


def _moe_config(meta: dict, base: dict, n_experts_field: str) -> dict:
    a = meta["general.architecture"]
    return {**base, n_experts_field: meta[f"{a}.expert_count"], "num_experts_per_tok": meta[f"{a}.expert_used_count"]}


def _hf_moe_name(block: str):
    """GGUF names → transformers', the expert tables' gate and up under names `_join_gate_up` fuses."""
    moe = {"ffn_gate_inp": block + ".gate" if block == "mlp" else block + ".router",
           "ffn_gate_exps": block + ".experts.gate", "ffn_up_exps": block + ".experts.up",
           "ffn_down_exps": block + ".experts.down_proj",
           # Granite-MoE-Shared's shared expert
           "ffn_gate_shexp": "shared_mlp.gate", "ffn_up_shexp": "shared_mlp.up",
           "ffn_down_shexp": "shared_mlp.output_linear.weight"}
    top = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}

    def name(gguf_name: str) -> str:
        if gguf_name in top:
            return top[gguf_name]
        _, layer, tensor, kind = gguf_name.split(".")
        if tensor in moe:  # transformers' expert tables are parameters of their own, not .weight
            return f"model.layers.{layer}.{moe[tensor]}" + (".weight" if tensor == "ffn_gate_inp" else "")
        return f"model.layers.{layer}.{_LLAMA_NAMES[tensor]}.{kind}"

    return name


def _join_gate_up(state: dict) -> dict:
    """transformers stacks each expert's gate rows, then its up rows, in one gate_up_proj (a shared
    expert's in one input_linear)."""
    import torch

    out = {k: v for k, v in state.items() if not k.endswith((".gate", ".up"))}
    for k in state:
        if k.endswith(".experts.gate"):
            stem = k[: -len("gate")]
            out[stem + "gate_up_proj"] = torch.cat([state[k], state[stem + "up"]], dim=1)
        elif k.endswith(".shared_mlp.gate"):
            stem = k[: -len("gate")]
            out[stem + "input_linear.weight"] = torch.cat([state[k], state[stem + "up"]], dim=0)
    return out


def _granitemoe_config(meta: dict) -> dict:
    shared = meta.get("granitemoe.expert_shared_feed_forward_length", 0)
    model_type = {"model_type": "granitemoeshared", "shared_intermediate_size": shared} if shared else \
        {"model_type": "granitemoe"}
    return _moe_config(meta, {**_granite_config(meta), **model_type}, "num_local_experts")


# llama.cpp converts OLMoE without permuting q/k, Granite-MoE through its Llama class (permuted)
register_builder("olmoe", Builder(config=lambda meta: _moe_config(meta, {**_common(meta, "olmoe", tied=False),
                                                                          "norm_topk_prob": False}, "num_experts"),
                                  name=_hf_moe_name("mlp"), join=_join_gate_up))
register_builder("granitemoe", Builder(config=_granitemoe_config, name=_hf_moe_name("block_sparse_moe"),
                                       unpermute_qk=True, join=_join_gate_up))


def prompt(n: int, seed: int = 5) -> list[int]:
    return [int(i) for i in np.random.default_rng(seed).integers(3, 500, n)]


def routes(engine, ids, layer: int = 0, norm: str = "ffn_norm") -> np.ndarray:
    """The experts each row of a prefill of `ids` (from position 0) chooses in `layer`, by the oracle; `norm`:
    the block's norm before its experts."""
    engine.forward(ids, all_logits=True)
    return route(router_logits(engine, layer, norm), engine.config.experts[layer])[0]


def router_logits(engine, layer: int, norm: str = "ffn_norm") -> np.ndarray:
    """Layer's router logits for each row of the engine's last prefill (its bias added, if it has one)."""
    e = engine.config.experts[layer]
    h = engine.last_hidden[2 * layer]  # the residual stream after layer's attention
    w = engine.weight(f"blk.{layer}.{norm}.weight")
    x = h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + engine.config.norm_eps) * w
    logits = x @ engine.weight(e.router).T
    return logits if e.router_bias is None else logits + engine.weight(e.router_bias)


@pytest.mark.slow
@pytest.mark.parametrize("shape", MOE_FAMILIES)
def test_moe_family_matches_transformers(shape, tmp_path):
    path = write_random_gguf(tmp_path / f"{shape}.gguf", shape, seed=7)
    ids = prompt(24, seed=3)
    assert rel_err(oracle(path).forward(ids, all_logits=True), hf_logits(path, ids)) <= 1e-4
    assert oracle_greedy(oracle(path), ids, 32) == hf_greedy(path, ids, 32)


@pytest.mark.parametrize("shape", MOE_FAMILIES)
def test_float_moe_matches_oracle(shape, tmp_path, isa):
    """Prefill in chunks of 17 rows and decode steps, on the float path: float32 tolerance."""
    path = write_random_gguf(tmp_path / f"{shape}.gguf", shape, qtype=QT.F32, seed=11)
    native, reference = engines(path, prefill_rows=17, max_batch=4)
    ids = prompt(40)
    assert rel_err(native.forward(ids, all_logits=True), reference.forward(ids, all_logits=True)) < 1e-4
    for i, t in enumerate([7, 99, 300, 12, 45]):
        assert rel_err(native.forward([t], 0, 40 + i), reference.forward([t], 0, 40 + i)) < 1e-4


@pytest.mark.parametrize("shape", MOE_FAMILIES)
@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q8_0])
def test_quantized_moe_is_close_to_oracle(shape, qtype, tmp_path, isa):
    path = write_random_gguf(tmp_path / f"{shape}.gguf", shape, qtype=qtype, seed=11)
    native, reference = engines(path, prefill_rows=17, max_batch=4)
    ids = prompt(40)
    got, want = native.forward(ids, all_logits=True), reference.forward(ids, all_logits=True)
    assert kld(want, got).mean() < 2e-3
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.95


def test_prefill_chunk_where_experts_get_no_row(tmp_path, isa):
    """A 3-row chunk choosing 2 of 8 experts each leaves some experts unread, on float weights."""
    path = write_random_gguf(tmp_path / "m.gguf", "tiny-qwen3moe", qtype=QT.F32, seed=11)
    native, reference = engines(path)
    ids = prompt(3)
    chosen = routes(oracle(path), ids)
    assert len(np.unique(chosen)) < native.config.experts[0].n_experts
    assert rel_err(native.forward(ids, all_logits=True), reference.forward(ids, all_logits=True)) < 1e-4


@pytest.mark.parametrize("shape", MOE_FAMILIES)
def test_batched_decode_rows_choose_different_experts(shape, tmp_path, isa):
    """Four sequences decode in one step; their rows choose different experts, some shared by two rows."""
    path = write_random_gguf(tmp_path / "m.gguf", shape, qtype=QT.F32, seed=11)
    native, reference = engines(path, n_slots=4)
    prompts = [prompt(5 + s, seed=s) for s in range(4)]
    for engine in (native, reference):
        for s, ids in enumerate(prompts):
            engine.forward(ids, slot=s)
    tokens, slots, positions = [11, 222, 333, 444], [0, 1, 2, 3], [len(p) for p in prompts]
    got = native.step(tokens, slots, positions, [0, 1, 2, 3])
    want = reference.step(tokens, slots, positions, [0, 1, 2, 3])
    assert rel_err(got, want) < 1e-4
    chosen = [tuple(routes(oracle(path), p + [t])[-1]) for p, t in zip(prompts, tokens)]
    assert len(set(chosen)) > 1  # the rows did not all choose the same experts
    # a row's logits do not depend on the rows beside it
    alone = native.step([tokens[2]], [2], [positions[2]], [0])
    assert np.array_equal(alone[0], got[2])


def test_threads_give_bit_identical_moe_logits(tmp_path):
    path = write_random_gguf(tmp_path / "m.gguf", "tiny-qwen2moe", qtype=QT.Q8_0, seed=4)
    ids = prompt(30)
    one, _ = engines(path, threads=1, prefill_rows=17)
    two, _ = engines(path, threads=2, prefill_rows=17)
    assert np.array_equal(one.forward(ids, all_logits=True), two.forward(ids, all_logits=True))


@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.F16])
def test_guarded_moe_plans(qtype, tmp_path, isa):
    """No MOE op writes outside its scratch or its buffers, and the guards change no bit."""
    path = write_random_gguf(tmp_path / "m.gguf", "tiny-qwen2moe", qtype=qtype, seed=5)
    ids = prompt(34)
    guarded, _ = engines(path, prefill_rows=17, max_batch=4, guard=True)
    plain, _ = engines(path, prefill_rows=17, max_batch=4)
    assert np.array_equal(guarded.forward(ids, all_logits=True), plain.forward(ids, all_logits=True))


def test_moe_plan_checks_its_experts_and_buffers(tmp_path):
    path = write_random_gguf(tmp_path / "m.gguf", "tiny-qwen2moe", qtype=QT.Q8_0, seed=5)
    native, _ = engines(path)
    p = native.prefill_plan
    inputs = [p.inputs[k].ctypes.data for k in ("tokens", "slots", "positions", "row_sel")]

    def rebuild(**buffers):
        merged = {k: v for k, v in {**p.buffers, **buffers}.items() if v is not None}
        return _native.Plan(p.encoded, native.pool, merged, p.rows, p.out_rows, native.kv_ctx, native.n_slots,
                            *inputs)

    rebuild()
    with pytest.raises(ValueError, match=r"plan op \d+ \(MOE, layer \d+\): an exp_up matrix is not one of the"):
        rebuild(**{"blk.0.ffn_up_exps.weight expert 3": None})
    table = native.weights.expert_table("blk.1.ffn_down_exps.weight")
    with pytest.raises(ValueError, match=r"\(MOE, layer \d+\): exp_down needs 64 bytes at byte 0 of buffer "
                                         r"'blk.1.ffn_down_exps.weight experts', which holds 32"):
        rebuild(**{"blk.1.ffn_down_exps.weight experts": table[:4]})
    with pytest.raises(ValueError, match=r"\(MOE, layer \d+\): sh_scale is not one of the matrices"):
        rebuild(**{"blk.0.ffn_gate_inp_shexp.weight": None})
    layout, size = _native.op_layout()
    moe = next(n for n, op in enumerate(p.ops) if op["kind"] == _native.OP_MOE)

    def patched(field: str, value: int):
        ops = bytearray(p.encoded)
        struct.pack_into("<i", ops, moe * size + layout[field][0], value)
        return _native.Plan(bytes(ops), native.pool, p.buffers, p.rows, p.out_rows, native.kv_ctx, native.n_slots,
                            *inputs)

    with pytest.raises(ValueError, match=rf"plan op {moe} \(MOE, layer \d+\): 9 of 8 experts per row"):
        patched("n_used", 9)
    with pytest.raises(ValueError, match=r"gating 2 is not one op_moe.c computes"):
        patched("moe_gating", 2)
    with pytest.raises(ValueError, match=r"gate and up chunks of 4 rows cut an activation group"):
        patched("chunk_tiles", 1)
    with pytest.raises(ValueError, match=rf"plan op {moe} \(MOE, layer \d+\): scale is 0"):
        patched("scale", 0)  # the residual multiplier's float, all bits zero


def test_moe_undersized_scratch_is_caught(tmp_path):
    """The shared expert's chunks take every row: they fill the op's scratch to its end."""
    path = write_random_gguf(tmp_path / "m.gguf", "tiny-qwen2moe", qtype=QT.Q8_0, seed=5)
    native, _ = engines(path, prefill_rows=17, guard=True)
    plan = native.prefill_plan
    i = next(n for n, op in enumerate(plan.ops) if op["kind"] == _native.OP_MOE)
    plan.plan.undersize_scratch(i, 1)
    with pytest.raises(RuntimeError, match=rf"plan op {i} \(MOE, layer \d+\) wrote past its \d+ floats of scratch"):
        native.forward(prompt(plan.rows))


def patch_u32(path, key: str, value: int):
    """Rewrite a uint32 metadata value in place: after the key come its type (4 bytes), then the value."""
    data = bytearray(path.read_bytes())
    at = data.index(key.encode() + (4).to_bytes(4, "little")) + len(key) + 4
    data[at : at + 4] = value.to_bytes(4, "little")
    path.write_bytes(bytes(data))
    return path


def test_moe_files_are_checked(tmp_path):
    ok = write_random_gguf(tmp_path / "ok.gguf", "tiny-qwen3moe", seed=1)
    cfg = family_for(GGUFFile(ok)).config
    assert [e.n_experts for e in cfg.experts] == [8, 8] and cfg.experts[0].normalize
    assert not family_for(GGUFFile(write_random_gguf(tmp_path / "q2.gguf", "tiny-qwen2moe"))).config.experts[0].normalize
    with pytest.raises(ModelFileError, match=r"'blk.0.ffn_gate_inp.weight' has wrong shape; expected \[64, 7\], "
                                             r"got \[64, 8\]"):
        family_for(GGUFFile(patch_u32(write_random_gguf(tmp_path / "a.gguf", "tiny-qwen3moe"), "qwen3moe.expert_count",
                                      7)))
    with pytest.raises(ModelFileError, match=r"'qwen3moe.expert_used_count' is 9, expected an integer in 1..8"):
        family_for(GGUFFile(write_random_gguf(tmp_path / "b.gguf", "tiny-qwen3moe", n_experts_used=9)))
    with pytest.raises(ModelFileError, match=r"'llama.expert_count' is 4, expected an integer in 0..0"):
        family_for(GGUFFile(write_random_gguf(tmp_path / "c.gguf", "tiny-llama", n_experts=4, n_experts_used=2,
                                              expert_ffn_dim=32)))
    with pytest.raises(UnsupportedModelError, match=r"'qwen3moe.expert_shared_feed_forward_length' is set"):
        family_for(GGUFFile(write_random_gguf(tmp_path / "d.gguf", "tiny-qwen3moe", shared_ffn_dim=32)))


@pytest.mark.parametrize("shape", ["tiny-qwen2", "tiny-gemma3", "tiny-granite", "tiny-olmo2", "tiny-smollm3",
                                   "tiny-phi3", "tiny-phi2"])
def test_dense_families_refuse_experts(tmp_path, shape):
    """Every dense family reads its config through base_config, which refuses a file naming experts."""
    arch = SHAPES[shape].arch
    path = write_random_gguf(tmp_path / "e.gguf", shape, n_experts=4, n_experts_used=2, expert_ffn_dim=32)
    with pytest.raises(ModelFileError, match=rf"'{arch}.expert_count' is 4, expected an integer in 0..0"):
        family_for(GGUFFile(path))


def test_olmoe_and_granitemoe_files_are_checked(tmp_path):
    """Both size their experts by feed_forward_length; Granite-MoE's shared expert has no gate tensor."""
    with pytest.raises(ModelFileError, match=r"'olmoe.expert_feed_forward_length' is 16, expected an integer in 32..32"):
        family_for(GGUFFile(write_random_gguf(tmp_path / "a.gguf", "tiny-olmoe", expert_ffn_dim=16)))
    cfg = family_for(GGUFFile(write_random_gguf(tmp_path / "b.gguf", "tiny-granitemoe-shared"))).config
    assert cfg.experts[1].shared_ff_dim == 32 and cfg.experts[1].shared_scale is None
    assert not family_for(GGUFFile(write_random_gguf(tmp_path / "c.gguf", "tiny-granitemoe"))).config.experts[0].shared_gate


def test_active_parameters_and_bytes_per_decode_row(tmp_path):
    """A token computes with 2 of 8 experts per layer; a decode row reads the router, its 2 experts and the
    shared expert of each MOE op, and every other matrix once."""
    from kiln.models.base import active_parameters
    from kiln.trace import dispatch_figures, packed_bytes

    path = write_random_gguf(tmp_path / "m.gguf", "tiny-qwen2moe", qtype=QT.Q8_0, seed=5)
    gguf = GGUFFile(path)
    cfg = family_for(gguf).config
    total = sum(t.n_elements for t in gguf.tensors.values())
    experts = sum(gguf.info(f"blk.{i}.ffn_{m}_exps.weight").n_elements for i in range(2) for m in ("gate", "up", "down"))
    assert active_parameters(gguf, cfg) == total - experts * 6 // 8
    native, _ = engines(path)
    w = native.weights
    dense = sum(packed_bytes(m.layout) for name, m in w.mats.items() if "_exps." not in name)
    per_expert = sum(packed_bytes(w.matrix(f"blk.{i}.ffn_{m}_exps.weight").layout) for i in range(2)
                     for m in ("gate", "up", "down"))
    assert dispatch_figures(native)["weight_bytes"] == dense + 2 * per_expert


def test_rows_per_expert_are_counted(tmp_path):
    """kiln trace's expert load: each step adds the rows each expert got, as the oracle routes them."""
    from kiln.trace import expert_load

    path = write_random_gguf(tmp_path / "m.gguf", "tiny-qwen3moe", qtype=QT.F32, seed=11)
    native, _ = engines(path, prefill_rows=17)
    native.expert_rows = {}
    ids = prompt(20)
    native.forward(ids)  # a chunk of 17 rows, then one of 3
    chosen = routes(oracle(path), ids, layer=1)
    assert sorted(native.expert_rows) == [0, 1]
    assert native.expert_rows[1].tolist() == np.bincount(chosen.ravel(), minlength=8).tolist()
    load = expert_load(native.expert_rows)
    counts = np.array(load["rows_per_expert"][1])
    assert counts.sum() == 20 * 2 and load["busiest_over_mean"][1] == counts.max() / counts.mean()
