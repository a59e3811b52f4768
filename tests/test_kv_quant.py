"""The quantized KV caches (q8_0, q4_0): the native store and attention against the oracle that rounds the
same way, their accuracy against the fp16 cache, how they are asked for, and what they cost in memory."""

from __future__ import annotations

import math

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import quants

from kiln.engine.kv import ROUNDING, kv_cache_type, rotate, stored
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
SHAPES_Q = [("tiny-llama", {"head_dim": 32}), ("tiny-qwen3", {}), ("tiny-gemma3", {}), ("tiny-gemma2", {}),
            ("tiny-gpt-oss", {"head_dim": 32})]
QUANT = ("q8_0", "q4_0")
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18}  # ggml's block_q8_0 and block_q4_0: an fp16 scale and 32 codes
# Against the oracle: a value within a last bit of a rounding boundary may round the other way when the two
# engines' fp32 sums differ in that bit, moving it by one step of its block (1/127 of its largest value for
# q8_0, 1/8 for q4_0), hence not 1e-4. In the rotated basis each stored value mixes its block's 32 inputs, so a
# last-bit difference in any of them puts all 32 at risk, and q4_0's one step is 16 times q8_0's.
ORACLE_TOLERANCE = {"q8_0": 1e-3, "q4_0": 1e-2}


def kld(p_logits: np.ndarray, q_logits: np.ndarray) -> np.ndarray:
    """KL(P || Q) per row, P the reference, from log-softmaxes (tiny models' peaked rows underflow p)."""
    def log_softmax(x):
        x = x.astype(np.float64) - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    lp, lq = log_softmax(p_logits), log_softmax(q_logits)
    return (np.exp(lp) * (lp - lq)).sum(-1)


def model(tmp_path, shape, **options):
    return GGUFFile(write_random_gguf(tmp_path / f"{shape}.gguf", shape, qtype=QT.F32, seed=11, **options))


@pytest.mark.parametrize("kv", QUANT)
def test_rounding_is_ggml(kv):
    """The oracle's rounding is ggml's quantize_row_q8_0 / q4_0 (the gguf package's copies), ties included."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((6, 128)) * rng.uniform(0.01, 30, (6, 1))).astype(np.float32)
    x[0, :32] = np.arange(32) - 15.5  # q8_0's halves: roundf rounds them away from zero
    x[0, 32:64] = np.arange(32) / 2 - 8  # q4_0's: d = 1 (the peak -8), x / d + 8.5 truncated rounds them up
    x[1, 32:64] = 0  # an all-zero block has scale 0
    x[2, 64:96], x[2, 64], x[2, 70] = 0.5, -3, 3  # q4_0 takes the first of two peaks of one magnitude
    qt = QT.Q8_0 if kv == "q8_0" else QT.Q4_0
    assert np.array_equal(ROUNDING[kv](x), quants.dequantize(quants.quantize(x, qt), qt))


def hadamard(n: int) -> np.ndarray:
    h = np.ones((1, 1))
    while len(h) < n:
        h = np.block([[h, h], [h, -h]])
    return h / math.sqrt(n)


def test_rotation_is_an_orthonormal_hadamard_transform_and_its_own_inverse(isa):
    """The native rotation of each block of 32 is the oracle's, bit for bit on every ISA, and both are the
    normalized Hadamard matrix: orthonormal (norms and dot products kept) and its own inverse."""
    from kiln.native import kernels

    rng = np.random.default_rng(1)
    x = (rng.standard_normal((7, 160)) * rng.uniform(0.01, 50, (7, 1))).astype(np.float32)
    y = kernels.kv_rotate(x)
    assert np.array_equal(y, rotate(x))
    blocks = x.reshape(7, 5, 32).astype(np.float64)
    assert np.allclose(y.reshape(7, 5, 32), blocks @ hadamard(32).T, rtol=1e-5, atol=1e-5 * np.abs(x).max())
    assert np.allclose(kernels.kv_rotate(y), x, rtol=1e-5, atol=1e-6 * np.abs(x).max())
    assert np.allclose(np.linalg.norm(y.reshape(7, 5, 32), axis=-1), np.linalg.norm(blocks, axis=-1), rtol=1e-5)
    assert np.allclose((y[:, None] * y[None]).sum(-1), (blocks.reshape(7, 160)[:, None] * x[None]).sum(-1),
                       rtol=1e-4, atol=1e-4 * (x**2).sum(-1).max())
    with pytest.raises(ValueError, match="whole blocks of 32"):
        kernels.kv_rotate(x[:, :48])


@pytest.mark.parametrize("kv", QUANT)
def test_rotation_lowers_the_rounding_error_of_outlier_channels(kv):
    """Rows with a few channels far above the rest (keys after rope, values): unrotated, each such channel
    sets its block's step; rotated, it is spread over the block and the others keep their precision."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((64, 128)).astype(np.float32)
    x[:, rng.choice(128, 6, replace=False)] *= 20
    plain, rotated = (float(((f(x) - x) ** 2).mean()) for f in (ROUNDING[kv], lambda r: stored(kv, r)))
    assert rotated < plain / 4, (rotated, plain)


def outlier_model(tmp_path, shape, **options):
    """A random model whose keys and values have outlier channels: a sixteenth of the rows of every K and
    V projection scaled by 8."""
    import gguf as gg

    path = write_random_gguf(tmp_path / f"{shape}-outliers.gguf", shape, qtype=QT.F32, seed=11, **options)
    reader, rng = gg.GGUFReader(str(path), "r+"), np.random.default_rng(3)
    for t in reader.tensors:
        if t.name.endswith(("attn_k.weight", "attn_v.weight")):
            t.data[rng.choice(len(t.data), len(t.data) // 16, replace=False)] *= 8
    del reader
    return GGUFFile(path)


@pytest.mark.parametrize("kv", QUANT)
def test_the_rotated_cache_diverges_less_where_keys_and_values_have_outliers(kv, tmp_path):
    """The native cache (rotated) against the fp16 cache, and the same rounding without the rotation (the
    oracle's cache rounding rows as they come): the rotation cuts the divergence several times."""
    gguf = outlier_model(tmp_path, "tiny-llama", head_dim=32)
    fam = family_for(gguf)
    ids = [int(i) for i in np.random.default_rng(7).integers(3, 500, 80)]
    native = {t: NativeEngine(gguf, fam, n_ctx=96, threads=2, kv_type=t).forward(ids, all_logits=True)
              for t in ("f16", kv)}
    unrotated = OracleEngine(gguf, fam, n_ctx=96, kv_type=kv)
    unrotated.kv.rounding = ROUNDING[kv]
    fp16 = OracleEngine(gguf, fam, n_ctx=96, kv_dtype=np.float16).forward(ids, all_logits=True)
    rotated_kld = kld(native["f16"], native[kv]).mean()
    plain_kld = kld(fp16, unrotated.forward(ids, all_logits=True)).mean()
    assert rotated_kld < plain_kld / 3, (rotated_kld, plain_kld)


@pytest.mark.parametrize("kv", QUANT)
@pytest.mark.parametrize("shape,options", SHAPES_Q)
def test_quantized_cache_matches_the_oracle(shape, options, kv, tmp_path, isa):
    gguf = model(tmp_path, shape, **options)
    fam = family_for(gguf)
    native = NativeEngine(gguf, fam, n_ctx=96, n_slots=2, threads=2, prefill_rows=17, max_batch=4, kv_type=kv,
                          guard=True)
    oracle = OracleEngine(gguf, fam, n_ctx=96, n_slots=2, kv_type=kv)
    ids = [int(i) for i in np.random.default_rng(5).integers(3, 500, 40)]
    tol = ORACLE_TOLERANCE[kv]
    assert rel_err(native.forward(ids, all_logits=True), oracle.forward(ids, all_logits=True)) < tol
    for engine in (native, oracle):
        engine.forward(ids[:9], slot=1)
    for i, t in enumerate([7, 99, 300]):  # batched decode of both slots
        tokens, slots, positions = [t, t + 1], [0, 1], [40 + i, 9 + i]
        got = native.step(tokens, slots, positions, [0, 1])
        assert rel_err(got, oracle.step(tokens, slots, positions, [0, 1])) < tol


@pytest.mark.parametrize("kv", QUANT)
def test_quantized_cache_over_several_parts_matches_the_oracle(kv, tmp_path, isa):
    """A context past 512 keys is split into parts, each prefetching the next part's first keys."""
    gguf = model(tmp_path, "tiny-llama", head_dim=32)
    fam = family_for(gguf)
    native = NativeEngine(gguf, fam, n_ctx=600, threads=2, max_batch=4, kv_type=kv)
    oracle = OracleEngine(gguf, fam, n_ctx=600, kv_type=kv)
    ids = [int(i) for i in np.random.default_rng(6).integers(3, 500, 530)]
    tol = ORACLE_TOLERANCE[kv]
    assert rel_err(native.forward(ids), oracle.forward(ids)) < tol
    assert rel_err(native.forward([17], 0, 530), oracle.forward([17], 0, 530)) < tol


# KLD against the fp16 cache on random tiny models (mean, max): q4_0's steps are 16x q8_0's. tiny-gpt-oss's
# random attention is the most sensitive to the rounding (its oracle, rounding the same way, measures the
# same divergence as the native engine), hence bounds of its own; its first row attends to one key beside
# its sink, so that row's divergence is one q4_0 rounding of one value row. Random rows have no outlier
# channels, so the rotation neither helps nor hurts them on average (the outlier tests above show its gain).
KLD_BOUNDS = {"q8_0": (2e-4, 2e-3), "q4_0": (5e-3, 2e-2)}
KLD_BOUNDS_GPT_OSS = {"q8_0": (2e-3, 0.1), "q4_0": (2e-2, 0.3)}


@pytest.mark.parametrize("kv", QUANT)
@pytest.mark.parametrize("shape,options", SHAPES_Q)
def test_quantized_cache_against_the_fp16_cache(shape, options, kv, tmp_path):
    gguf = model(tmp_path, shape, **options)
    fam = family_for(gguf)
    ids = [int(i) for i in np.random.default_rng(7).integers(3, 500, 80)]
    logits = {t: NativeEngine(gguf, fam, n_ctx=96, threads=2, kv_type=t).forward(ids, all_logits=True)
              for t in ("f16", kv)}
    divergence = kld(logits["f16"], logits[kv])
    mean_bound, max_bound = (KLD_BOUNDS_GPT_OSS if shape == "tiny-gpt-oss" else KLD_BOUNDS)[kv]
    assert divergence.mean() < mean_bound and divergence.max() < max_bound, (divergence.mean(), divergence.max())
    assert (logits["f16"].argmax(-1) == logits[kv].argmax(-1)).mean() > (0.95 if kv == "q8_0" else 0.85)
    # the divergence is the format's: the oracle's, with the same rounding in numpy, is the same
    oracle = {t: OracleEngine(gguf, fam, n_ctx=96, kv_dtype=np.float16 if t == "f16" else np.float32,
                              kv_type=None if t == "f16" else t).forward(ids, all_logits=True) for t in ("f16", kv)}
    want = kld(oracle["f16"], oracle[kv]).mean()
    assert abs(divergence.mean() - want) <= 0.02 * want + 1e-6, (divergence.mean(), want)


def test_kv_cache_type_from_the_flag_or_the_environment(monkeypatch):
    monkeypatch.delenv("KILN_KV_CACHE_TYPE", raising=False)
    assert kv_cache_type(None) == "f16" and kv_cache_type("q8_0") == "q8_0"
    monkeypatch.setenv("KILN_KV_CACHE_TYPE", "q8_0")
    assert kv_cache_type(None) == "q8_0" and kv_cache_type("f16") == "f16"  # the flag wins
    with pytest.raises(KilnError, match=r"^--kv-cache 'q5' is not a KV cache type; choose one of f16, q8_0, q4_0$"):
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
    assert parser.parse_args(["run", "m", "--kv-cache", "q4_0"]).kv_cache == "q4_0"
    assert parser.parse_args(["serve", "--kv-cache", "q8_0"]).kv_cache == "q8_0"
    assert parser.parse_args(["validate", "--kv-cache", "q8_0"]).kv_cache == "q8_0"
    assert perf_parser().parse_args(["m", "--kv-cache", "q8_0"]).kv_cache == "q8_0"
    path = write_random_gguf(tmp_path / "m.gguf", "tiny-qwen3", qtype=QT.F32)
    for kv in QUANT:
        m = load(str(path), backend="native", n_ctx=64, threads=2, progress=False, kv_cache=kv)
        assert m.engine.kv_type == kv
        m.close()
        o = load(str(path), backend="oracle", n_ctx=64, progress=False, kv_cache=kv)
        assert o.engine.kv_type == kv
    with pytest.raises(KilnError, match="--kv-cache 'q4' is not a KV cache type"):
        load(str(path), backend="native", n_ctx=64, threads=2, progress=False, kv_cache="q4")


@pytest.mark.parametrize("kv", QUANT)
def test_a_head_dim_that_is_not_whole_blocks_is_refused(kv, tmp_path):
    gguf = model(tmp_path, "tiny-llama")  # head dim 16
    for make in (lambda: NativeEngine(gguf, family_for(gguf), n_ctx=64, threads=2, kv_type=kv),
                 lambda: OracleEngine(gguf, family_for(gguf), n_ctx=64, kv_type=kv)):
        with pytest.raises(KilnError, match=f"a {kv} KV cache needs a head dim that is whole blocks of 32; "
                                            "this model's is 16"):
            make()


@pytest.mark.parametrize("kv", QUANT)
@pytest.mark.parametrize("shape,options", [("tiny-qwen3", {}), ("tiny-gemma3", {})])
def test_footprint_and_arena_of_a_quantized_cache(shape, options, kv, tmp_path, monkeypatch):
    from kiln import validate as V
    from kiln.engine.model import load

    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))
    path = write_random_gguf(tmp_path / "m.gguf", shape, qtype=QT.F32, **options)
    s = SHAPES[shape]
    # a block's bytes for 32 values, for keys and values of every layer, slot, position and KV head
    want = 2 * s.n_layers * 2 * 256 * s.n_kv_heads * s.head_dim // 32 * BLOCK_BYTES[kv]
    fp = V.footprint(str(path), 256, n_slots=2, kv_cache=kv)
    assert fp["kv_type"] == kv and fp["kv_bytes"] == math.ceil(want / MiB2) * MiB2
    assert V.footprint(str(path), 256, n_slots=2)["kv_type"] == "f16"
    monkeypatch.setenv("KILN_KV_CACHE_TYPE", kv)
    assert V.footprint(str(path), 256, n_slots=2)["kv_bytes"] == fp["kv_bytes"]
    m = load(str(path), backend="native", n_ctx=256, n_slots=2, threads=2, progress=False)
    assert m.engine.kv_type == kv and m.engine.kv_arena.nbytes >= want
    m.close()
    check, _ = V.check_memory({"mem_total_gib": 64, "mem_available_gib": 32}, str(path), 256, 2, kv)
    assert f"KV cache ({kv})" in check.result


@pytest.mark.parametrize("kv", QUANT)
def test_quantized_attention_is_the_same_bits_on_avx2_and_avx512(kv, tmp_path):
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
            engine = NativeEngine(gguf, fam, n_ctx=96, threads=2, kv_type=kv)
            out[isa] = np.concatenate([engine.forward(ids, all_logits=True), engine.forward([5], 0, 90)[None]])
    finally:
        kernels.force_isa(before)
    assert np.array_equal(out["avx2"], out["avx512"])


@pytest.mark.parametrize("kv", QUANT)
def test_plan_refuses_a_kv_buffer_smaller_than_the_quantized_cache(kv, tmp_path):
    from tests.test_plan import rebuild

    gguf = model(tmp_path, "tiny-qwen3")
    e = NativeEngine(gguf, family_for(gguf), n_ctx=64, threads=2, prefill_rows=17, max_batch=4, kv_type=kv)
    rebuild(e)  # the buffers as handed: accepted
    s = SHAPES["tiny-qwen3"]
    layer = 2 * s.n_kv_heads * 64 * s.head_dim // 32 * BLOCK_BYTES[kv]  # keys and values of layer 0
    short = memoryview(e.kv_arena)[: layer // 4]
    with pytest.raises(ValueError, match=r"plan op \d+ \(QKV, layer 0\): k_cache needs \d+ bytes at byte 0 of "
                                         r"buffer 'kv cache', which holds " + str(layer // 4)):
        rebuild(e, **{"kv cache": short})


@pytest.mark.parametrize("kv", QUANT)
def test_show_names_the_cache_type(kv, tmp_path, monkeypatch):
    from kiln.modelinfo import _footprint
    from kiln.store import Store

    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))
    path = write_random_gguf(tmp_path / "m.gguf", "tiny-qwen3", qtype=QT.F32)
    record = Store().resolve(str(path))
    monkeypatch.setenv("KILN_KV_CACHE_TYPE", kv)
    info = _footprint(record)
    s = SHAPES["tiny-qwen3"]
    want = 2 * s.n_layers * info["kv_context"] * s.n_kv_heads * s.head_dim // 32 * BLOCK_BYTES[kv]
    assert info["kv_cache_type"] == kv and info["kv_cache_bytes"] == math.ceil(want / MiB2) * MiB2
