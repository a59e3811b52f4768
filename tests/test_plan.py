"""The plan's own checks (csrc/plan_check.c) and its guarded mode (csrc/plan.c): C sizes each op's scratch,
holds every address an op carries against the buffers Python handed it, checks each step's rows, and in
guarded mode fails a step whose op writes past its scratch."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from kiln import _native
from kiln.engine.native import NativeEngine
from kiln.gguf import GGUFFile
from kiln.models import family_for
from kiln.synth import write_random_gguf


def engine(path, **options) -> NativeEngine:
    gguf = GGUFFile(path)
    return NativeEngine(gguf, family_for(gguf), n_ctx=64, threads=2, prefill_rows=17, max_batch=4, **options)


def run_prompt(e: NativeEngine, ids) -> np.ndarray:
    """A prompt through full prefill chunks (every op at its largest), then decode steps."""
    logits = [e.forward(ids, all_logits=False)]
    for i, t in enumerate([7, 99, 300]):
        logits.append(e.forward([t], 0, len(ids) + i))
    return np.stack(logits)


@pytest.mark.parametrize("family", ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-gemma3"])
@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.F16])
def test_guarded_plans_run_every_family_on_every_isa(family, qtype, isa, tmp_path):
    """Q8_0 takes precise pairs and the split head, F16 the float path: no op writes outside its scratch,
    and the guards change no bit."""
    path = write_random_gguf(tmp_path / "m.gguf", family, qtype=qtype, seed=5)
    ids = [int(i) for i in np.random.default_rng(2).integers(3, 500, 34)]  # two full prefill chunks
    guarded = engine(path, guard=True)
    assert guarded.prefill_plan.plan.scratch == engine(path).prefill_plan.plan.scratch
    assert np.array_equal(run_prompt(guarded, ids), run_prompt(engine(path), ids))


@pytest.mark.parametrize("kind", ["OP_QUANT", "OP_NORM_QUANT", "OP_QKV", "OP_ATTN", "OP_MATMUL", "OP_GLU"])
def test_undersized_scratch_is_caught(kind, tmp_path):
    path = write_random_gguf(tmp_path / "m.gguf", "tiny-qwen3", qtype=QT.Q8_0, seed=5)
    e = engine(path, guard=True)
    plan = e.prefill_plan
    i = next(n for n, op in enumerate(plan.ops) if op["kind"] == getattr(_native, kind))
    plan.plan.undersize_scratch(i, 1)
    with pytest.raises(RuntimeError, match=rf"plan op {i} \({kind[3:]}, layer \d+\) wrote past its \d+ floats of scratch"):
        e.forward(list(range(3, 3 + plan.rows)))
    with pytest.raises(ValueError, match="guarded plan"):
        engine(path).prefill_plan.plan.undersize_scratch(i, 1)


def test_output_past_its_buffer_is_caught(tmp_path):
    """An op whose output starts 4 bytes late still lies inside the activation arena, so the build's checks
    pass it; a guarded plan's gaps after each buffer catch its last row's last value."""
    import struct

    path = write_random_gguf(tmp_path / "m.gguf", "tiny-llama", qtype=QT.Q8_0, seed=5)
    e = engine(path, guard=True)
    p = e.prefill_plan
    i = next(n for n, op in enumerate(p.ops) if op["kind"] == _native.OP_MATMUL)
    layout, size = _native.op_layout()
    ops = bytearray(p.encoded)
    at = i * size + layout["out"][0]
    struct.pack_into("<Q", ops, at, struct.unpack_from("<Q", ops, at)[0] + 4)
    inputs = [p.inputs[k].ctypes.data for k in ("tokens", "slots", "positions", "row_sel")]
    shifted = _native.Plan(bytes(ops), e.pool, p.buffers, p.rows, p.out_rows, e.kv_ctx, e.n_slots, *inputs,
                           guard=True, guard_gaps=p.guard_gaps)
    p.inputs["tokens"][:] = 5
    p.inputs["slots"][:] = 0
    p.inputs["positions"][:] = range(p.rows)
    p.inputs["row_sel"][:1] = 0
    with pytest.raises(RuntimeError, match=rf"plan op {i} \(MATMUL, layer 0\) wrote past the end of an activation "
                                           r"buffer"):
        shifted.run(p.rows, 1)
    p.plan.run(p.rows, 1)  # the same rows through the plan as built


@pytest.fixture
def built(tmp_path):
    path = write_random_gguf(tmp_path / "m.gguf", "tiny-llama", qtype=QT.Q8_0, seed=5)
    return engine(path)


def rebuild(e: NativeEngine, **buffers):
    """The prefill plan's ops built again over `buffers` in place of the ones it was handed."""
    p = e.prefill_plan
    inputs = [p.inputs[k].ctypes.data for k in ("tokens", "slots", "positions", "row_sel")]
    merged = {k: v for k, v in {**p.buffers, **buffers}.items() if v is not None}
    return _native.Plan(p.encoded, e.pool, merged, p.rows, p.out_rows, e.kv_ctx, e.n_slots, *inputs)


def test_plan_build_checks_each_buffer_against_what_its_ops_touch(built):
    rebuild(built)  # the buffers as handed: accepted
    kv = memoryview(built.kv_arena)
    cfg = built.config
    half_a_layer = 2 * cfg.n_kv_heads * built.kv_ctx * cfg.head_dim // 2  # half of layer 0's keys
    with pytest.raises(ValueError, match=r"plan op \d+ \(QKV, layer 0\): k_cache needs \d+ bytes at byte 0 of "
                                         r"buffer 'kv cache', which holds " + str(half_a_layer)):
        rebuild(built, **{"kv cache": kv[:half_a_layer]})
    act = memoryview(built.prefill_plan.arena)  # its own, sized to its buffers: the row inputs come last
    with pytest.raises(ValueError, match=r"row_sel needs 68 bytes at byte \d+ of buffer 'activations', which holds"):
        rebuild(built, activations=act[: len(act) - 64])
    with pytest.raises(ValueError, match=r"plan op \d+ \(MATMUL, layer 0\): w is not one of the matrices"):
        rebuild(built, **{"blk.0.attn_output.weight": None})
    with pytest.raises(ValueError, match=r"plan op \d+ \(NORM_QUANT, layer \d+\): norm_w \(\d+ bytes\) is inside "
                                         r"none of the buffers"):
        rebuild(built, **{"blk.0.attn_norm.weight": None})


def test_plan_step_checks_tokens_slots_and_positions(built):
    p = built.decode_plan
    vocab = built.config.vocab_size

    def run(token=5, slot=0, position=0, n_out=1):
        p.inputs["tokens"][0], p.inputs["slots"][0], p.inputs["positions"][0] = token, slot, position
        p.inputs["row_sel"][0] = 0
        return p.plan.run(1, n_out)

    run()
    with pytest.raises(ValueError, match=f"token id {vocab} is outside the vocabulary of {vocab}"):
        run(token=vocab)
    with pytest.raises(ValueError, match="token id -1"):
        run(token=-1)
    with pytest.raises(ValueError, match=f"slot 1 position 0 outside 1 slots x {built.kv_ctx} positions"):
        run(slot=1)
    with pytest.raises(ValueError, match=f"slot 0 position {built.kv_ctx} outside"):
        run(position=built.kv_ctx)
    with pytest.raises(ValueError, match=r"a step of 1 rows \(2 with logits\)"):
        run(n_out=2)
    with pytest.raises(ValueError, match=r"exceeds the plan's 4 rows \(4 with logits\)"):
        p.plan.run(5, 1)
