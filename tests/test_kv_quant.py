"""The q8_0 KV cache: the native store and attention against the oracle that rounds the same way, its
accuracy against the fp16 cache, how it is asked for, and what it costs in memory."""

from __future__ import annotations

import math

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import quants

from kiln.engine.kv import kv_cache_type, round_q8_0
from kiln.engine.native import NativeEngine
from kiln.engine.oracle import OracleEngine
from kiln.errors import KilnError
from kiln.gguf import GGUFFile
from kiln.models import family_for
from kiln.synth import SHAPES, write_random_gguf
from tests.reference import rel_err

MiB2 = 2 << 20
# head dims 32 (GQA 2:1; gpt-oss's with attention sinks), 128 (q/k norm), 256 (sliding window, one KV head;
# Gemma 2's with soft-capped scores)
SHAPES_Q8 = [("tiny-llama", {"head_dim": 32}), ("tiny-qwen3", {}), ("tiny-gemma3", {}), ("tiny-gemma2", {}),
             ("tiny-gpt-oss", {"head_dim": 32})]


def kld(p_logits: np.ndarray, q_logits: np.ndarray) -> np.ndarray:
    """KL(P || Q) per row, P the reference, from log-softmaxes (tiny models' peaked rows underflow p)."""
    def log_softmax(x):
        x = x.astype(np.float64) - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    lp, lq = log_softmax(p_logits), log_softmax(q_logits)
    return (np.exp(lp) * (lp - lq)).sum(-1)


def model(tmp_path, shape, **options):
    return GGUFFile(write_random_gguf(tmp_path / f"{shape}.gguf", shape, qtype=QT.F32, seed=11, **options))


def test_rounding_is_ggml_q8_0():
    """The oracle's rounding is ggml's quantize_row_q8_0 (the gguf package's copy of it), ties included."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((6, 128)) * rng.uniform(0.01, 30, (6, 1))).astype(np.float32)
    x[0, :32] = np.arange(32) - 15.5  # halves: roundf rounds them away from zero
    x[1, 32:64] = 0  # an all-zero block has scale 0
    want = quants.dequantize(quants.quantize(x, QT.Q8_0), QT.Q8_0)
    assert np.array_equal(round_q8_0(x), want)


@pytest.mark.parametrize("shape,options", SHAPES_Q8)
def test_q8_0_cache_matches_the_oracle(shape, options, tmp_path, isa):
    gguf = model(tmp_path, shape, **options)
    fam = family_for(gguf)
    native = NativeEngine(gguf, fam, n_ctx=96, n_slots=2, threads=2, prefill_rows=17, max_batch=4, kv_type="q8_0",
                          guard=True)
    oracle = OracleEngine(gguf, fam, n_ctx=96, n_slots=2, kv_type="q8_0")
    ids = [int(i) for i in np.random.default_rng(5).integers(3, 500, 40)]
    # A value within a last bit of a rounding boundary may round the other way when the two engines' fp32
    # sums differ in that bit: one q8_0 step is 1/127 of its block's largest value, hence not 1e-4.
    assert rel_err(native.forward(ids, all_logits=True), oracle.forward(ids, all_logits=True)) < 1e-3
    for engine in (native, oracle):
        engine.forward(ids[:9], slot=1)
    for i, t in enumerate([7, 99, 300]):  # batched decode of both slots
        tokens, slots, positions = [t, t + 1], [0, 1], [40 + i, 9 + i]
        got = native.step(tokens, slots, positions, [0, 1])
        assert rel_err(got, oracle.step(tokens, slots, positions, [0, 1])) < 1e-3


def test_q8_0_cache_over_several_parts_matches_the_oracle(tmp_path, isa):
    """A context past 512 keys is split into parts, each prefetching the next part's first keys."""
    gguf = model(tmp_path, "tiny-llama", head_dim=32)
    fam = family_for(gguf)
    native = NativeEngine(gguf, fam, n_ctx=600, threads=2, max_batch=4, kv_type="q8_0")
    oracle = OracleEngine(gguf, fam, n_ctx=600, kv_type="q8_0")
    ids = [int(i) for i in np.random.default_rng(6).integers(3, 500, 530)]
    assert rel_err(native.forward(ids), oracle.forward(ids)) < 1e-3
    assert rel_err(native.forward([17], 0, 530), oracle.forward([17], 0, 530)) < 1e-3


@pytest.mark.parametrize("shape,options", SHAPES_Q8)
def test_q8_0_cache_against_the_fp16_cache(shape, options, tmp_path):
    gguf = model(tmp_path, shape, **options)
    fam = family_for(gguf)
    ids = [int(i) for i in np.random.default_rng(7).integers(3, 500, 80)]
    logits = {kv: NativeEngine(gguf, fam, n_ctx=96, threads=2, kv_type=kv).forward(ids, all_logits=True)
              for kv in ("f16", "q8_0")}
    divergence = kld(logits["f16"], logits["q8_0"])
    assert divergence.mean() < 2e-4 and divergence.max() < 2e-3, (divergence.mean(), divergence.max())
    assert (logits["f16"].argmax(-1) == logits["q8_0"].argmax(-1)).mean() > 0.95


def test_kv_cache_type_from_the_flag_or_the_environment(monkeypatch):
    monkeypatch.delenv("KILN_KV_CACHE_TYPE", raising=False)
    assert kv_cache_type(None) == "f16" and kv_cache_type("q8_0") == "q8_0"
    monkeypatch.setenv("KILN_KV_CACHE_TYPE", "q8_0")
    assert kv_cache_type(None) == "q8_0" and kv_cache_type("f16") == "f16"  # the flag wins
    with pytest.raises(KilnError, match=r"^--kv-cache 'q5' is not a KV cache type; choose one of f16, q8_0$"):
        kv_cache_type("q5")
    monkeypatch.setenv("KILN_KV_CACHE_TYPE", "fp8")
    with pytest.raises(KilnError, match=r"^KILN_KV_CACHE_TYPE 'fp8' is not a KV cache type"):
        kv_cache_type(None)


def test_run_takes_the_flag_and_names_a_bad_value(tmp_path, monkeypatch):
    from kiln.bench.cli import perf_parser
    from kiln.cli import build_parser
    from kiln.engine.model import load

    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))
    parser = build_parser()
    assert parser.parse_args(["run", "m", "--kv-cache", "q8_0"]).kv_cache == "q8_0"
    assert parser.parse_args(["serve", "--kv-cache", "q8_0"]).kv_cache == "q8_0"
    assert parser.parse_args(["validate", "--kv-cache", "q8_0"]).kv_cache == "q8_0"
    assert perf_parser().parse_args(["m", "--kv-cache", "q8_0"]).kv_cache == "q8_0"
    path = write_random_gguf(tmp_path / "m.gguf", "tiny-qwen3", qtype=QT.F32)
    m = load(str(path), backend="native", n_ctx=64, threads=2, progress=False, kv_cache="q8_0")
    assert m.engine.kv_type == "q8_0"
    m.close()
    o = load(str(path), backend="oracle", n_ctx=64, progress=False, kv_cache="q8_0")
    assert o.engine.kv_type == "q8_0"
    with pytest.raises(KilnError, match="--kv-cache 'q4' is not a KV cache type"):
        load(str(path), backend="native", n_ctx=64, threads=2, progress=False, kv_cache="q4")


def test_a_head_dim_that_is_not_whole_blocks_is_refused(tmp_path):
    gguf = model(tmp_path, "tiny-llama")  # head dim 16
    with pytest.raises(KilnError, match="a q8_0 KV cache needs a head dim that is whole blocks of 32; "
                                        "this model's is 16"):
        NativeEngine(gguf, family_for(gguf), n_ctx=64, threads=2, kv_type="q8_0")


@pytest.mark.parametrize("shape,options", [("tiny-qwen3", {}), ("tiny-gemma3", {})])
def test_footprint_and_arena_of_a_q8_0_cache(shape, options, tmp_path, monkeypatch):
    from kiln import validate as V
    from kiln.engine.model import load

    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))
    path = write_random_gguf(tmp_path / "m.gguf", shape, qtype=QT.F32, **options)
    s = SHAPES[shape]
    # 34 bytes a block of 32 values, for keys and values of every layer, slot, position and KV head
    q8 = 2 * s.n_layers * 2 * 256 * s.n_kv_heads * s.head_dim // 32 * 34
    fp = V.footprint(str(path), 256, n_slots=2, kv_cache="q8_0")
    assert fp["kv_type"] == "q8_0" and fp["kv_bytes"] == math.ceil(q8 / MiB2) * MiB2
    assert V.footprint(str(path), 256, n_slots=2)["kv_type"] == "f16"
    monkeypatch.setenv("KILN_KV_CACHE_TYPE", "q8_0")
    assert V.footprint(str(path), 256, n_slots=2)["kv_bytes"] == fp["kv_bytes"]
    m = load(str(path), backend="native", n_ctx=256, n_slots=2, threads=2, progress=False)
    assert m.engine.kv_type == "q8_0" and m.engine.kv_arena.nbytes >= q8
    m.close()
    check, _ = V.check_memory({"mem_total_gib": 64, "mem_available_gib": 32}, str(path), 256, 2, "q8_0")
    assert "KV cache (q8_0)" in check.result


def test_q8_0_attention_is_the_same_bits_on_avx2_and_avx512(tmp_path):
    """The AVX-512 kernels run the AVX2 kernels' arithmetic lane for lane, 16 keys at a time."""
    from kiln.native import kernels

    if any(kernels.isa_missing(isa) for isa in ("avx2", "avx512")):
        pytest.skip("this CPU lacks AVX-512")  # the oracle tests above still cover the ISAs it has
    gguf = model(tmp_path, "tiny-gemma3")  # 2 query heads a KV head, a 4-key window on most layers
    fam = family_for(gguf)
    ids = [int(i) for i in np.random.default_rng(8).integers(3, 500, 90)]
    before, out = kernels.active_isa(), {}
    try:
        for isa in ("avx2", "avx512"):
            kernels.force_isa(isa)
            engine = NativeEngine(gguf, fam, n_ctx=96, threads=2, kv_type="q8_0")
            out[isa] = np.concatenate([engine.forward(ids, all_logits=True), engine.forward([5], 0, 90)[None]])
    finally:
        kernels.force_isa(before)
    assert np.array_equal(out["avx2"], out["avx512"])


def test_plan_refuses_a_kv_buffer_smaller_than_the_q8_0_cache(tmp_path):
    from tests.test_plan import rebuild

    gguf = model(tmp_path, "tiny-qwen3")
    e = NativeEngine(gguf, family_for(gguf), n_ctx=64, threads=2, prefill_rows=17, max_batch=4, kv_type="q8_0")
    rebuild(e)  # the buffers as handed: accepted
    s = SHAPES["tiny-qwen3"]
    layer = 2 * s.n_kv_heads * 64 * s.head_dim // 32 * 34  # keys and values of layer 0, 34 bytes a block
    short = memoryview(e.kv_arena)[: layer // 4]
    with pytest.raises(ValueError, match=r"plan op \d+ \(QKV, layer 0\): k_cache needs \d+ bytes at byte 0 of "
                                         r"buffer 'kv cache', which holds " + str(layer // 4)):
        rebuild(e, **{"kv cache": short})


def test_show_names_the_cache_type(tmp_path, monkeypatch):
    from kiln.modelinfo import _footprint
    from kiln.store import Store

    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))
    path = write_random_gguf(tmp_path / "m.gguf", "tiny-qwen3", qtype=QT.F32)
    record = Store().resolve(str(path))
    monkeypatch.setenv("KILN_KV_CACHE_TYPE", "q8_0")
    info = _footprint(record)
    s = SHAPES["tiny-qwen3"]
    q8 = 2 * s.n_layers * info["kv_context"] * s.n_kv_heads * s.head_dim // 32 * 34
    assert info["kv_cache_type"] == "q8_0" and info["kv_cache_bytes"] == math.ceil(q8 / MiB2) * MiB2
