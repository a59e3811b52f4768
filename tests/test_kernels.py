"""Repacking and quantized matmul kernels against the gguf package's dequantization.

Every GGUF type kiln loads, on every ISA variant this CPU runs (others skip with the missing feature).
Inputs are fresh random data each run; the seed is in every failure message and can be replayed with
KILN_TEST_SEED=<seed>. Weights are random GGUF blocks (random bytes with sane fp16 scales), so every
bit pattern of the quants is exercised, including K-quants that the gguf package cannot quantize.
"""

from __future__ import annotations

import ctypes
import os
import platform
import re
import shutil
import subprocess
import sys
import threading
import zlib
from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT
from gguf import quants

from kiln.gguf import GGUFFile
from kiln.engine.kv import KV_CACHE_TYPES as KV_TYPES
from kiln.native import kernels as K

SEED = int(os.environ.get("KILN_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
FLOAT_TYPES = (QT.F32, QT.F16, QT.BF16)
BLOCK32_TYPES = (QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q8_0, QT.MXFP4)
K_TYPES = (QT.Q4_K, QT.Q5_K, QT.Q6_K)
ALL_TYPES = FLOAT_TYPES + BLOCK32_TYPES + K_TYPES
ROWS = (1, 3, 5, 67)
COLS_32 = (32, 64, 96, 576, 640, 1536)
COLS_K = (256, 512, 768)
NTOK = (1, 2, 3, 7, 16, 33)
# Byte offsets of the fp16 scale fields of each block type.
SCALE_FIELDS = {QT.Q4_0: (0,), QT.Q4_1: (0, 2), QT.Q5_0: (0,), QT.Q8_0: (0,), QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208,)}


def rng_for(*key) -> np.random.Generator:
    return np.random.default_rng([SEED, *[zlib.crc32(str(k).encode()) for k in key]])


def ctx(*what) -> str:
    return f"seed {SEED} (replay: KILN_TEST_SEED={SEED}), " + ", ".join(str(w) for w in what)


def random_weights(t: QT, rows: int, cols: int, rng: np.random.Generator, typical: bool = False) -> np.ndarray:
    """GGUF bytes of a random (rows, cols) tensor of type t. Scales are finite and of random sign; their
    magnitudes span 100x, or, when `typical`, vary within 2x as in trained weights."""
    if t in FLOAT_TYPES:
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        return quants.quantize(w, t) if t == QT.BF16 else w.astype(np.float16 if t == QT.F16 else np.float32)
    block, size = GGML_QUANT_SIZES[t]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    if t == QT.MXFP4:  # an e8m0 exponent byte: 2^(e-128) per block, a few subnormal (e < 2) unless typical
        e = rng.integers(124, 126, raw.shape[:2]) if typical else rng.integers(118, 125, raw.shape[:2])
        if not typical:
            few = rng.random(e.shape) < 0.02
            e[few] = rng.integers(0, 3, int(few.sum()))
        raw[:, :, 0] = e
        return raw.reshape(rows, -1)
    for off in SCALE_FIELDS[t]:
        mag = rng.uniform(0.01, 0.02, (rows, cols // block)) if typical else 10.0 ** rng.uniform(-3, -1, (rows, cols // block))
        d = (np.sign(rng.standard_normal((rows, cols // block))) * mag).astype(np.float16)
        raw[:, :, off : off + 2] = d.view(np.uint8).reshape(rows, cols // block, 2)
    return raw.reshape(rows, -1)


def dequant(t: QT, raw: np.ndarray, rows: int, cols: int) -> np.ndarray:
    if t == QT.F32:
        return raw.astype(np.float64)
    if t == QT.F16:
        return raw.astype(np.float64)
    return quants.dequantize(raw, t).astype(np.float64).reshape(rows, cols)


def quantized_act(x: np.ndarray) -> np.ndarray:
    """What the kernels see of fp32 activations: int8 per 32-block, scale max|x|/127, round to nearest even."""
    n, c = x.shape
    xb = x.reshape(n, c // 32, 32)
    d = np.abs(xb).max(-1, keepdims=True) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    q = np.rint((xb * inv).astype(np.float32))
    return (q.astype(np.float64) * d).reshape(n, c)


def activations(t: QT, n: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    x = rng.standard_normal((n, cols)).astype(np.float32)
    x[:, : min(cols, 32)] *= 8  # blocks of different scale; an all-zero block when there is room
    if cols >= 64:
        x[0, 32:64] = 0
    return x


@pytest.fixture(params=K.ISAS)
def isa(request):
    name = request.param
    missing = K.isa_missing(name)
    if missing:
        pytest.skip(f"CPU lacks {missing}")
    before = K.ISAS[K._native.isa_active()]
    K.force_isa(name)
    yield name
    K.force_isa(before)


def shapes(t: QT):
    cols = COLS_32 if t not in K_TYPES else COLS_K
    for i, (r, c) in enumerate((r, c) for r in ROWS for c in cols):
        yield r, c, NTOK[i % len(NTOK)]
        yield r, c, NTOK[(i + 3) % len(NTOK)]


@pytest.mark.parametrize("t", ALL_TYPES, ids=lambda t: t.name)
def test_matmul_matches_dequantized_reference(t, isa):
    for rows, cols, n in shapes(t):
        rng = rng_for(t, rows, cols, n)
        raw = random_weights(t, rows, cols, rng)
        w = dequant(t, raw, rows, cols)
        x = activations(t, n, cols, rng)
        pm = K.pack(t, raw, rows, cols)
        y = K.matmul_f32(pm, x)
        where = ctx(t.name, isa, f"rows {rows}", f"cols {cols}", f"n_tok {n}")
        assert y.shape == (n, rows) and np.isfinite(y).all(), where
        xq = x.astype(np.float64) if t in FLOAT_TYPES else quantized_act(x)
        ref = xq @ w.T  # same inputs as the kernel sees: only the summation order differs
        # The size of the terms, not of their sum: with few rows one output can cancel to near zero by
        # chance (seed 2807691941: a single row summed to -0.0068 from products whose root-sum-square
        # is 6.4), and float rounding is relative to what is summed. For random signs the two agree.
        scale = max(np.abs(ref).max(), np.sqrt((xq**2) @ (w**2).T).max())
        assert np.abs(y - ref).max() <= 1e-5 * scale, where + f": max error {np.abs(y - ref).max() / scale:.2e} of the terms' size"
        if t not in FLOAT_TYPES:  # against the fp32 activations: activation rounding error only
            full = x.astype(np.float64) @ w.T
            # Rounding to a step of d = max|x|/127 per block errs by at most d/2, like uniform noise:
            # each output's error has deviation sigma = sqrt(sum_k w_k^2 d_k^2 / 12).
            step = np.repeat(np.abs(x.reshape(n, -1, 32)).max(-1) / 127, 32, axis=1).astype(np.float64)
            sigma = np.sqrt((step**2 / 12) @ (w**2).T)
            assert (np.abs(y - full) <= 8 * sigma + 1e-6 * scale).all(), where + ": error vs fp32 activations beyond 8 sigma"


@pytest.mark.parametrize("t", BLOCK32_TYPES + K_TYPES, ids=lambda t: t.name)
def test_close_to_fp32_activations(t, isa):
    """On typical data, int8 activations cost about 1% of the output's range."""
    for rows, cols, n in [(16, 256, 4), (64, 768, 2), (67, 1536, 7)]:
        if t in K_TYPES and cols % 256:
            continue
        rng = rng_for("fp32", t, cols)
        raw = random_weights(t, rows, cols, rng, typical=True)
        w = dequant(t, raw, rows, cols)
        x = rng.standard_normal((n, cols)).astype(np.float32)
        y = K.matmul_f32(K.pack(t, raw, rows, cols), x)
        full = x.astype(np.float64) @ w.T
        rel = np.abs(y - full).max() / np.abs(full).max()
        where = ctx(t.name, isa, f"rows {rows}", f"cols {cols}", f"n_tok {n}")
        assert rel <= 2e-2, where + f": error vs fp32 activations {rel:.2e}"
        assert np.corrcoef(y.ravel(), full.ravel())[0, 1] > 0.999, where


@pytest.mark.parametrize("t", ALL_TYPES, ids=lambda t: t.name)
def test_isa_variants_agree_bit_for_bit(t):
    usable = [name for name in K.ISAS if not K.isa_missing(name)]
    if len(usable) < 2:
        pytest.skip("only one ISA variant runs on this CPU")
    before = K.ISAS[K._native.isa_active()]
    rng = rng_for("isa", t)
    cols = 768 if t in K_TYPES else 576
    raw = random_weights(t, 9, cols, rng)
    pm = K.pack(t, raw, 9, cols)
    x = activations(t, 5, cols, rng)
    try:
        results = {}
        for name in usable:
            K.force_isa(name)
            results[name] = (K.quantize_act(pm.fmt, x), K.matmul_f32(pm, x), K.matmul_f32(pm, x[:2]),
                             K.matmul_f32(pm, x[:1]))
            if t not in FLOAT_TYPES:
                results[name] += K.quantize_act_pair(pm.fmt, x[0])
    finally:
        K.force_isa(before)
    first = usable[0]
    what = ("activation buffer", "5 tokens", "2 tokens", "1 token", "precise pair's first row", "precise pair's second row")
    for name in usable[1:]:
        for a, b, what in zip(results[first], results[name], what):
            assert np.array_equal(a, b), ctx(t.name, what, f"{first} vs {name}")


@pytest.mark.parametrize("wide", [False, True], ids=("narrow", "wide"))
@pytest.mark.parametrize("t", ALL_TYPES, ids=lambda t: t.name)
def test_deterministic_and_batch_invariant(t, isa, wide):
    """Bit-identical on repeat, and a token's result does not depend on the tokens beside it. Wide rows of
    4 groups or more take the AVX-512 kernel's longer token blocks."""
    rng = rng_for("det", t)
    cols = 1024 if wide else 512 if t in K_TYPES else 640
    rows, n = 13, 40  # 40 tokens: more than one token block
    raw = random_weights(t, rows, cols, rng)
    pm = K.pack(t, raw, rows, cols)
    x = activations(t, n, cols, rng)
    y = K.matmul_f32(pm, x)
    assert np.array_equal(y, K.matmul_f32(pm, x)), ctx(t.name, isa, "repeat")
    for i in (0, 17, 39):
        assert np.array_equal(y[i], K.matmul_f32(pm, x[i : i + 1])[0]), ctx(t.name, isa, f"token {i} alone")
    assert np.array_equal(y[3:11], K.matmul_f32(pm, x[3:11])), ctx(t.name, isa, "8-token batch")
    assert np.array_equal(y[20:22], K.matmul_f32(pm, x[20:22])), ctx(t.name, isa, "2-token batch")


def test_activation_quantizer_agrees_across_isas_at_every_width():
    """Every short last group (1..7 blocks: pair order, shared tail, natural order) and full groups."""
    usable = [name for name in K.ISAS if not K.isa_missing(name)]
    if len(usable) < 2:
        pytest.skip("only one ISA variant runs on this CPU")
    before = K.ISAS[K._native.isa_active()]
    rng = rng_for("widths")
    try:
        for cols in range(32, 1024 + 32, 32):
            x = activations(QT.Q8_0, 2, cols, rng)
            results = {}
            for name in usable:
                K.force_isa(name)
                results[name] = (K.quantize_act(K.Format.Q8_0, x), *K.quantize_act_pair(K.Format.Q8_0, x[0]))
            for name in usable[1:]:
                for a, b in zip(results[usable[0]], results[name]):
                    assert np.array_equal(a, b), ctx(f"cols {cols}", f"{usable[0]} vs {name}")
    finally:
        K.force_isa(before)


def identity_q8(cols: int) -> np.ndarray:
    """GGUF bytes of a Q8_0 identity matrix with block scales 1.0: a matmul then returns the values an
    activation row stands for, each rounded once ((float)q * d), as the kernels' FMA into zero does."""
    blocks = np.zeros((cols, cols // 32), dtype=[("d", "<f2"), ("q", "i1", 32)])
    blocks["d"] = 1.0
    for r in range(cols):
        blocks["q"][r, r // 32, r % 32] = 1
    return blocks.view(np.uint8).reshape(cols, -1)


@pytest.mark.parametrize("cols", [576, 1024])
def test_precise_pair_quantizes_the_residual(cols, isa):
    rng = rng_for("pair", cols)
    eye = K.pack(QT.Q8_0, identity_q8(cols), cols, cols)
    for x in activations(QT.Q8_0, 3, cols, rng):
        first, second = K.quantize_act_pair(K.Format.Q8_0, x)
        assert np.array_equal(first, K.quantize_act(K.Format.Q8_0, x)), ctx(isa, cols, "first row")
        v1 = K.matmul(eye, first, 1)[0]
        assert np.array_equal(second, K.quantize_act(K.Format.Q8_0, x - v1)), ctx(isa, cols, "second row")
        v2 = K.matmul(eye, second, 1)[0]
        # each block's pair carries ~15 bits: 1/127 of the first row's step, halved by rounding
        blocks = np.abs(x).reshape(-1, 32).max(1)
        bound = np.repeat(blocks / 127 / 254 * 1.01, 32)
        assert (np.abs(x - v1 - v2) <= bound + 1e-30).all(), ctx(isa, cols, "pair error")


@pytest.mark.parametrize("t", ALL_TYPES, ids=lambda t: t.name)
def test_packed_rows_unpack_to_their_gguf_bytes(t):
    """Every row, padding rows beside it included: full groups, short groups, a shared tail (576)."""
    rng = rng_for("unpack", t)
    for rows, cols in ([(7, 768), (5, 512)] if t in K_TYPES else [(7, 576), (6, 640), (5, 96), (3, 40 if t in FLOAT_TYPES else 32)]):
        raw = random_weights(t, rows, cols, rng)
        pm = K.pack(t, raw, rows, cols)
        gguf_rows = np.ascontiguousarray(raw).view(np.uint8).reshape(rows, -1)
        for r in range(rows):
            assert np.array_equal(K.unpack_row(pm, int(t), r), gguf_rows[r]), ctx(t.name, f"{rows}x{cols}", f"row {r}")
    with pytest.raises(IndexError):
        K.unpack_row(pm, int(t), rows)


def test_split_q8_0_is_exact():
    """An int8 head splits into Q5_0 (q >> 3, scale 8d) and Q4_0 (q & 7) whose values add up to the Q8_0
    values exactly, with subnormal and large scales too, and whose packed rows unpack to the Q8_0 bytes."""
    rng = rng_for("split")
    for rows, cols in [(7, 576), (6, 640), (5, 96), (3, 32)]:
        raw = random_weights(QT.Q8_0, rows, cols, rng).copy()
        d = raw.reshape(rows, -1, 34)[:, :, :2]
        d[0, 0] = np.frombuffer(np.float16(3e-7).tobytes(), np.uint8)  # subnormal: 8d stays exact
        d[-1, -1] = np.frombuffer(np.float16(-4000.0).tobytes(), np.uint8)  # 8d = -32000 still fits
        hi, lo = K.split_q8_0(raw, rows)
        want = dequant(QT.Q8_0, raw, rows, cols)
        assert np.array_equal(dequant(QT.Q5_0, hi, rows, cols) + dequant(QT.Q4_0, lo, rows, cols), want), ctx(rows, cols)
        ph, pl = K.pack(QT.Q5_0, hi, rows, cols), K.pack(QT.Q4_0, lo, rows, cols)
        for r in range(rows):
            assert np.array_equal(K.unpack_split_row(ph, pl, r), raw[r]), ctx(f"{rows}x{cols}", f"row {r}")
    raw[0, :2] = np.frombuffer(np.float16(9000.0).tobytes(), np.uint8)
    assert K.split_q8_0(raw, rows) is None  # 8 x 9000 overflows fp16


@pytest.mark.parametrize("t", (QT.Q4_0, QT.Q5_0), ids=lambda t: t.name)
def test_offsets_come_from_the_block_sums(t, isa):
    """Q4_0 and Q5_0 subtract their offsets (8, 16) through the activation's block sums in every ISA, so a
    caller that shifts a sum (the split head does) shifts the result by offset x shift x scales."""
    rng = rng_for("sums", t, isa)
    off = 8 if t == QT.Q4_0 else 16
    for rows, cols in [(5, 576), (7, 640), (3, 1536)]:
        raw = random_weights(t, rows, cols, rng)
        pm = K.pack(t, raw, rows, cols)
        act = K.quantize_act(pm.fmt, activations(t, 1, cols, rng))
        y = K.matmul(pm, act, 1)
        shifted = act.copy()
        groups = shifted.reshape(-1, 384)
        sums = groups[:, 320:352].view(np.int32)
        delta = rng.integers(-50, 50, sums.shape).astype(np.int32)
        if cols % 256 == 64:  # a shared tail's lanes repeat blocks 0 and 1
            delta[-1, 2:] = np.tile(delta[-1, :2], 3)
        sums += delta
        got = K.matmul(pm, shifted, 1)
        da = groups[:, 256:288].view(np.float32)
        scales = np.frombuffer(np.ascontiguousarray(raw).reshape(rows, -1, GGML_QUANT_SIZES[t][1])[:, :, :2].tobytes(),
                               np.float16).reshape(rows, -1).astype(np.float64)
        nb = cols // 32
        shift = (delta.astype(np.float64) * da).reshape(-1)[: 8 * ((nb + 7) // 8)]
        lanes = [g * 8 + j for g in range((nb + 7) // 8) for j in range(min(8, nb - 8 * g))]
        want = y - off * scales[:, : len(lanes)] @ shift[lanes]
        assert np.abs(got - y).max() > 1e-3 * np.abs(y).max()  # the shift is visible
        assert np.abs(got - want).max() <= 1e-5 * np.abs(y).max() + 1e-6, ctx(t.name, isa, f"{rows}x{cols}")


def test_tile_ranges_and_threads(isa):
    """Disjoint tile ranges, also from concurrent threads, fill exactly their rows."""
    rng = rng_for("tiles")
    rows, cols, n = 203, 576, 3
    raw = random_weights(QT.Q4_1, rows, cols, rng)
    pm = K.pack(QT.Q4_1, raw, rows, cols)
    act = K.quantize_act(pm.fmt, activations(QT.Q4_1, n, cols, rng))
    whole = K.matmul(pm, act, n)
    part = np.full((n, rows), np.nan, np.float32)
    K.matmul(pm, act, n, out=part, tile0=5, tile1=9)
    assert np.array_equal(part[:, 20:36], whole[:, 20:36]), ctx(isa)
    assert np.isnan(part[:, :20]).all() and np.isnan(part[:, 36:]).all(), ctx(isa, "rows outside the range were written")
    threaded = np.full((n, rows), np.nan, np.float32)
    bounds = [0, 7, 19, 33, 51]
    workers = [threading.Thread(target=K.matmul, args=(pm, act, n), kwargs=dict(out=threaded, tile0=a, tile1=b))
               for a, b in zip(bounds, bounds[1:])]
    for th in workers:
        th.start()
    for th in workers:
        th.join()
    assert np.array_equal(threaded, whole), ctx(isa, "threads")


def test_pack_sizes_keep_gguf_density():
    """576 columns are not padded to 256: bytes per weight stay at the GGUF type's (Q4_K, Q5_K: +4 bytes
    of decoded scales per 256 weights)."""
    for t, extra in [(QT.Q4_0, 0), (QT.Q4_1, 0), (QT.Q5_0, 0), (QT.Q8_0, 0), (QT.Q4_K, 4), (QT.Q5_K, 4), (QT.Q6_K, 0),
                     (QT.MXFP4, 0)]:
        block, size = GGML_QUANT_SIZES[t]
        cols = 768 if t in K_TYPES else 576
        gguf_row = cols // block * size
        expected = 64 * (gguf_row + extra * cols // 256) + 64  # 64 rows = 16 tiles, plus read slack
        assert K.pack_size(t, 64, cols) == expected, t.name
        assert K.pack(t, random_weights(t, 64, cols, rng_for("size", t)), 64, cols).tile_bytes * 16 + 64 == expected
    assert K.pack_size(QT.F16, 5, 20) == 8 * 32 * 2 + 64  # floats: 8 rows x 32 columns (padded to 16)


def test_activation_buffers_are_shared_by_kind():
    kinds = {f: K.act_kind(f) for f in K.Format}
    assert {f for f, k in kinds.items() if k == K.ActKind.F32} == {K.Format.F32, K.Format.F16, K.Format.BF16}
    assert K.act_size(K.Format.Q4_1, 576, 3) == K.act_size(K.Format.Q8_0, 576, 3) == 3 * 3 * 384
    rng = rng_for("shared")
    x = activations(QT.Q8_0, 2, 512, rng)
    assert np.array_equal(K.quantize_act(K.Format.Q4_K, x), K.quantize_act(K.Format.Q8_0, x))


def test_errors_are_reported():
    assert K._native.wfmt_for_ggml(int(QT.Q2_K)) == -1
    with pytest.raises(ValueError):
        K.format_for(QT.Q2_K)
    with pytest.raises(ValueError):
        K.pack(QT.Q4_K, np.zeros((2, 144), np.uint8), 2, 250)
    pm = K.pack(QT.Q8_0, random_weights(QT.Q8_0, 4, 64, rng_for("err")), 4, 64)
    act = K.quantize_act(pm.fmt, np.ones((1, 64), np.float32))
    with pytest.raises(ValueError, match="activation buffer"):
        K.matmul(pm, act[:-1], 1)
    with pytest.raises(ValueError, match="activation buffer"):
        K.matmul(pm, act, 2, out=np.zeros((2, 4), np.float32))
    with pytest.raises(ValueError, match="packed weights"):
        K.matmul(K.PackedMatrix(pm.fmt, 40, 64, 40, pm.tile_bytes, pm.data), act, 1)
    with pytest.raises(ValueError, match="tile_bytes"):
        K.matmul(K.PackedMatrix(pm.fmt, 4, 64, 4, pm.tile_bytes - 8, pm.data), act, 1)
    for name in K.ISAS:
        missing = K.isa_missing(name)
        if missing:
            with pytest.raises(RuntimeError, match=f"CPU lacks {missing}"):
                K.force_isa(name)


@pytest.mark.parametrize("value,expect", [("generic", "generic"), ("bogus", "expected generic, avx2, avx512 or amx")])
def test_kiln_isa_environment(value, expect):
    code = "from kiln.native import kernels as K\ntry:\n    print(K.active_isa())\nexcept RuntimeError as e:\n    print(e)"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "KILN_ISA": value}, capture_output=True, text=True)
    assert expect in out.stdout, out.stdout + out.stderr
    for name in K.ISAS:
        missing = K.isa_missing(name)
        if missing:
            out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "KILN_ISA": name}, capture_output=True, text=True)
            assert f"CPU lacks {missing}" in out.stdout, out.stdout + out.stderr


def test_huge_buffer_and_mem_read(isa):
    buf = K.huge_empty(3 << 20)
    assert buf.ctypes.data % (2 << 20) == 0 and buf.size == 3 << 20
    buf[:] = 0
    buf[8] = 5
    buf[(3 << 20) - 1] = 7
    assert K.mem_read(buf) == 5 ^ (7 << 56)
    words = np.random.default_rng(1).integers(0, 2**63, 13, dtype=np.uint64)  # 104 bytes: a tail past 64 and 32
    assert K.mem_read(words.view(np.uint8)) == int(np.bitwise_xor.reduce(words))


def _real_tensor_check(path, names_types, rows=96, n=3):
    f = GGUFFile(path)
    for name, t in names_types:
        info = f.info(name)
        assert info.type == t, (name, info.type)
        r = min(rows, info.shape[0])
        cols = info.shape[1]
        raw = np.asarray(f.raw(name)[:r])
        w = (f.dequantize(name)[:r] if info.shape[0] <= 4096 else
             quants.dequantize(raw, t).reshape(r, cols)).astype(np.float64)
        pm = K.pack(t, raw, r, cols)
        x = activations(t, n, cols, rng_for(name))
        ref = quantized_act(x) @ w.T
        y = K.matmul_f32(pm, x)
        err = np.abs(y - ref).max() / np.abs(ref).max()
        assert err <= 1e-5, ctx(path.name, name, f"error {err:.2e}")


def test_real_smollm2_tensors(smollm2_path):
    _real_tensor_check(smollm2_path, [("blk.0.attn_q.weight", QT.Q4_1), ("blk.0.ffn_down.weight", QT.Q4_1),
                                      ("blk.0.ffn_up.weight", QT.Q4_1), ("token_embd.weight", QT.Q8_0)])


def test_real_gemma3_tensors(gemma3_path):
    f = GGUFFile(gemma3_path)
    wanted = {}
    for name, info in f.tensors.items():  # the first 2-D tensor of each type kiln needs to cover
        if len(info.shape) == 2 and info.type in (QT.Q5_0, QT.Q8_0, QT.Q4_K, QT.Q6_K):
            wanted.setdefault(info.type, name)
    assert set(wanted) == {QT.Q5_0, QT.Q8_0, QT.Q4_K, QT.Q6_K}
    _real_tensor_check(gemma3_path, [(name, t) for t, name in wanted.items()])


# ---- AVX-512 logic on CPUs without AVX-512 -----------------------------------------------------------
# kern_avx512.c is compiled against plain-C stand-ins for the AVX-512 intrinsics it uses (written from
# Intel's documented semantics) and must agree bit for bit with the generic kernels. This checks the
# data flow of the AVX-512 variant everywhere; test_matmul_matches_dequantized_reference[avx512] checks
# the real instructions where the CPU has them.
EMU512_H = r"""
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
typedef struct { union { uint8_t b[64]; int8_t sb[64]; uint16_t w[32]; int32_t d[16]; uint32_t u[16]; float f[16]; __m256i h[2]; __m256 hf[2]; }; } E512;
typedef uint64_t emask64;
#define L64 for (int i = 0; i < 64; i++)
static inline E512 emu_and_si512(E512 a, E512 b) { L64 a.b[i] &= b.b[i]; return a; }
static inline E512 emu_or_si512(E512 a, E512 b) { L64 a.b[i] |= b.b[i]; return a; }
static inline E512 emu_xor_si512(E512 a, E512 b) { L64 a.b[i] ^= b.b[i]; return a; }
static inline E512 emu_broadcast_i64x4(__m256i a) { E512 r; r.h[0] = r.h[1] = a; return r; }
static inline __m256 emu_castps512_ps256(E512 v) { return v.hf[0]; }
static inline E512 emu_castps_pd(E512 v) { return v; }
static inline E512 emu_castsi256_si512(__m256i a) { E512 r; memset(&r, 0xAB, 64); r.h[0] = a; return r; }
static inline E512 emu_castsi512_ps(E512 v) { return v; }
static inline __m256i emu_castsi512_si256(E512 v) { return v.h[0]; }
static inline E512 emu_cvtepu16_epi32(__m256i a) { E512 r; uint16_t s[16]; memcpy(s, &a, 32); for (int i = 0; i < 16; i++) r.d[i] = s[i]; return r; }
static inline E512 emu_cvtph_ps(__m256i a) { E512 r; r.hf[0] = _mm256_cvtph_ps(_mm256_castsi256_si128(a)); r.hf[1] = _mm256_cvtph_ps(_mm256_extracti128_si256(a, 1)); return r; }
static inline E512 emu_dpbusd_epi32(E512 s, E512 a, E512 b) {
    for (int i = 0; i < 16; i++) for (int k = 0; k < 4; k++) s.d[i] += (int32_t)a.b[4 * i + k] * (int32_t)b.sb[4 * i + k];
    return s;
}
static inline __m256i emu256_dpbusd_epi32(__m256i s, __m256i a, __m256i b) {
    E512 r, x, y; r.h[0] = s; x.h[0] = a; y.h[0] = b; r.h[1] = x.h[1] = y.h[1] = _mm256_setzero_si256();
    return emu_dpbusd_epi32(r, x, y).h[0];
}
static inline __m256d emu_extractf64x4_pd(E512 v, int imm) { return _mm256_castps_pd(v.hf[imm & 1]); }
static inline __m256i emu_extracti64x4_epi64(E512 v, int imm) { return v.h[imm & 1]; }
static inline E512 emu_fmadd_ps(E512 a, E512 b, E512 c) { for (int i = 0; i < 16; i++) c.f[i] = fmaf(a.f[i], b.f[i], c.f[i]); return c; }
static inline E512 emu_inserti64x4(E512 a, __m256i b, int imm) { a.h[imm & 1] = b; return a; }
static inline E512 emu_loadu_ps(const float *p) { E512 r; memcpy(&r, p, 64); return r; }
static inline E512 emu_loadu_si512(const void *p) { E512 r; memcpy(&r, p, 64); return r; }
static inline E512 emu_mask_add_epi8(E512 s, emask64 k, E512 a, E512 b) { L64 s.b[i] = (k >> i & 1) ? (uint8_t)(a.b[i] + b.b[i]) : s.b[i]; return s; }
static inline E512 emu_set1_epi8(char c) { E512 r; memset(&r, (uint8_t)c, 64); return r; }
static inline E512 emu_setzero_ps(void) { E512 r; memset(&r, 0, 64); return r; }
static inline E512 emu_setzero_si512(void) { E512 r; memset(&r, 0, 64); return r; }
static inline E512 emu_slli_epi32(E512 a, unsigned n) { for (int i = 0; i < 16; i++) a.u[i] = n > 31 ? 0 : a.u[i] << n; return a; }
static inline E512 emu_srli_epi16(E512 a, unsigned n) { for (int i = 0; i < 32; i++) a.w[i] = n > 15 ? 0 : a.w[i] >> n; return a; }
static inline E512 emu_sllv_epi16(E512 a, E512 c) { for (int i = 0; i < 32; i++) a.w[i] = c.w[i] > 15 ? 0 : (uint16_t)(a.w[i] << c.w[i]); return a; }
static inline E512 emu_srlv_epi16(E512 a, E512 c) { for (int i = 0; i < 32; i++) a.w[i] = c.w[i] > 15 ? 0 : a.w[i] >> c.w[i]; return a; }
static inline emask64 emu_test_epi8_mask(E512 a, E512 b) { emask64 k = 0; L64 k |= (emask64)((a.b[i] & b.b[i]) != 0) << i; return k; }
static inline E512 emu_shuffle_epi8(E512 a, E512 idx) { E512 r; L64 r.b[i] = idx.b[i] & 0x80 ? 0 : a.b[(i & ~15) | (idx.b[i] & 15)]; return r; }
#define L16 for (int i = 0; i < 16; i++)
static inline E512 emu_add_epi32(E512 a, E512 b) { L16 a.u[i] += b.u[i]; return a; }
static inline E512 emu_sub_epi32(E512 a, E512 b) { L16 a.u[i] -= b.u[i]; return a; }
static inline E512 emu_mullo_epi32(E512 a, E512 b) { L16 a.u[i] *= b.u[i]; return a; }
static inline E512 emu_mul_ps(E512 a, E512 b) { L16 a.f[i] *= b.f[i]; return a; }
static inline E512 emu_cvtepi32_ps(E512 a) { L16 a.f[i] = (float)a.d[i]; return a; }
static inline E512 emu_fnmadd_ps(E512 a, E512 b, E512 c) { L16 c.f[i] = fmaf(-a.f[i], b.f[i], c.f[i]); return c; }
static inline E512 emu_set1_epi32(int32_t v) { E512 r; L16 r.d[i] = v; return r; }
static inline E512 emu_setr_epi32(int32_t a0, int32_t a1, int32_t a2, int32_t a3, int32_t a4, int32_t a5, int32_t a6, int32_t a7,
                                  int32_t a8, int32_t a9, int32_t a10, int32_t a11, int32_t a12, int32_t a13, int32_t a14, int32_t a15) {
    E512 r; int32_t v[16] = {a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15}; memcpy(r.d, v, 64); return r;
}
static inline E512 emu_permutexvar_ps(E512 idx, E512 a) { E512 r; L16 r.f[i] = a.f[idx.u[i] & 15]; return r; }
static inline E512 emu_permutex2var_ps(E512 a, E512 idx, E512 b) { E512 r; L16 { int j = idx.u[i] & 31; r.f[i] = j < 16 ? a.f[j] : b.f[j - 16]; } return r; }
static inline E512 emu_add_ps(E512 a, E512 b) { L16 a.f[i] += b.f[i]; return a; }
static inline __m128 emu_castps512_ps128(E512 v) { return _mm256_castps256_ps128(v.hf[0]); }
static inline __m128 emu_extractf32x4_ps(E512 v, int imm) { __m128 r; memcpy(&r, v.f + 4 * (imm & 3), 16); return r; }
static inline E512 emu_cvtepu8_epi32(__m128i a) { E512 r; uint8_t s[16]; memcpy(s, &a, 16); L16 r.d[i] = s[i]; return r; }
static inline E512 emu_zextsi256_si512(__m256i a) { E512 r; memset(&r, 0, 64); r.h[0] = a; return r; }
static inline E512 emu_castps128_ps512(__m128 a) { E512 r; memset(&r, 0xAB, 64); memcpy(&r, &a, 16); return r; }
static inline E512 emu_shuffle_i64x2(E512 a, E512 b, int imm) {  /* 128-bit lanes: two of a, then two of b */
    E512 r; for (int l = 0; l < 4; l++) memcpy(r.b + 16 * l, (l < 2 ? a.b : b.b) + 16 * (imm >> 2 * l & 3), 16); return r;
}
"""

# What kern_amx.c (and attn_avx512.c) use on top: more AVX-512, and the AMX tiles (8 registers of up to 16 rows x 64 bytes, shaped
# by the loaded configuration; a load zeroes what its shape leaves out; tdpbssd sums signed byte quadruples).
EMUAMX_H = r"""
#include "emu512.h"
typedef uint16_t emask16;
static inline E512 emu_sub_epi8(E512 a, E512 b) { L64 a.b[i] -= b.b[i]; return a; }
static inline E512 emu_set1_epi16(short v) { E512 r; for (int i = 0; i < 32; i++) r.w[i] = (uint16_t)v; return r; }
static inline E512 emu_set1_ps(float v) { E512 r; L16 r.f[i] = v; return r; }
static inline E512 emu_load_ps(const float *p) { return emu_loadu_ps(p); }
static inline E512 emu_load_si512(const void *p) { return emu_loadu_si512(p); }
static inline void emu_storeu_si512(void *p, E512 v) { memcpy(p, &v, 64); }
static inline void emu_storeu_ps(float *p, E512 v) { memcpy(p, &v, 64); }
static inline void emu_mask_storeu_ps(float *p, emask16 k, E512 v) { L16 if (k >> i & 1) p[i] = v.f[i]; }
typedef E512 E512bh;
static inline E512 emu_cvtepi8_epi32(__m128i a) { E512 r; int8_t s[16]; memcpy(s, &a, 16); L16 r.d[i] = s[i]; return r; }
static inline uint16_t emu_bf16(float f) { uint32_t u; memcpy(&u, &f, 4); return (uint16_t)((u + 0x7fff + (u >> 16 & 1)) >> 16); }
static inline E512 emu_cvtne2ps_pbh(E512 hi, E512 lo) { E512 r; L16 { r.w[i] = emu_bf16(lo.f[i]); r.w[16 + i] = emu_bf16(hi.f[i]); } return r; }
static inline E512 emu_permutex2var_epi32(E512 a, E512 idx, E512 b) { E512 r; L16 { int j = idx.u[i] & 31; r.u[i] = j < 16 ? a.u[j] : b.u[j - 16]; } return r; }
static uint8_t emu_tiles[8][16][64];
static uint8_t emu_rows[8];
static uint16_t emu_colsb[8];
static inline void emu_tile_loadconfig(const void *cfg) {
    const uint8_t *c = cfg;
    for (int t = 0; t < 8; t++) { emu_rows[t] = c[48 + t]; memcpy(&emu_colsb[t], c + 16 + 2 * t, 2); }
    memset(emu_tiles, 0, sizeof emu_tiles);
}
static inline void emu_tile_release(void) { memset(emu_rows, 0, sizeof emu_rows); memset(emu_colsb, 0, sizeof emu_colsb); }
static inline void emu_tile_zero(int t) { memset(emu_tiles[t], 0, sizeof emu_tiles[t]); }
static inline void emu_tile_loadd(int t, const void *base, size_t stride) {
    emu_tile_zero(t);
    for (int r = 0; r < emu_rows[t]; r++) memcpy(emu_tiles[t][r], (const uint8_t *)base + r * stride, emu_colsb[t]);
}
static inline void emu_tile_stored(int t, void *base, size_t stride) {
    for (int r = 0; r < emu_rows[t]; r++) memcpy((uint8_t *)base + r * stride, emu_tiles[t][r], emu_colsb[t]);
}
static inline void emu_tile_dpbssd(int c, int a, int b) {
    for (int m = 0; m < emu_rows[c]; m++)
        for (int n = 0; n < emu_colsb[c] / 4; n++) {
            int32_t s;
            memcpy(&s, &emu_tiles[c][m][4 * n], 4);
            for (int k = 0; k < emu_colsb[a] / 4; k++)
                for (int i = 0; i < 4; i++) s += (int32_t)(int8_t)emu_tiles[a][m][4 * k + i] * (int8_t)emu_tiles[b][k][4 * n + i];
            memcpy(&emu_tiles[c][m][4 * n], &s, 4);
        }
}
static inline float emu_from_bf16(const uint8_t *p) { uint32_t u = (uint32_t)(p[0] | p[1] << 8) << 16; float f; memcpy(&f, &u, 4); return f; }
static inline void emu_tile_dpbf16ps(int c, int a, int b) { /* fp32 sums of bf16 pairs */
    for (int m = 0; m < emu_rows[c]; m++)
        for (int n = 0; n < emu_colsb[c] / 4; n++) {
            float s;
            memcpy(&s, &emu_tiles[c][m][4 * n], 4);
            for (int k = 0; k < emu_colsb[a] / 4; k++)
                for (int i = 0; i < 2; i++) s += emu_from_bf16(&emu_tiles[a][m][4 * k + 2 * i]) * emu_from_bf16(&emu_tiles[b][k][4 * n + 2 * i]);
            memcpy(&emu_tiles[c][m][4 * n], &s, 4);
        }
}
"""
LDTILECFG = '__asm__ volatile("ldtilecfg %0" : : "m"(c));'


class _WMat(ctypes.Structure):
    _fields_ = [("fmt", ctypes.c_int), ("rows", ctypes.c_int), ("cols", ctypes.c_int), ("rows_padded", ctypes.c_int),
                ("tile_bytes", ctypes.c_size_t), ("data", ctypes.c_void_p)]


@pytest.fixture(scope="module")
def emulated_avx512(tmp_path_factory):
    cc = shutil.which(os.environ.get("CC", "gcc")) or shutil.which("cc")
    if platform.machine().lower() not in ("x86_64", "amd64") or not cc:
        pytest.skip("needs an x86-64 C compiler")
    if K.isa_missing("avx2"):
        pytest.skip(f"the emulation runs on AVX2; CPU lacks {K.isa_missing('avx2')}")
    csrc = Path(__file__).resolve().parent.parent / "csrc"
    out = tmp_path_factory.mktemp("emu512")
    src = (csrc / "kern_avx512.c").read_text()
    assert "#include <immintrin.h>" in src
    src = re.sub(r"#pragma GCC target\(.*\)", '#pragma GCC target("avx2,fma,f16c")', src)
    src = src.replace("#include <immintrin.h>", '#include "emu512.h"').replace("__m512i", "E512").replace("__m512", "E512")
    src = src.replace("_mm512_", "emu_").replace("_mm256_dpbusd_epi32", "emu256_dpbusd_epi32")
    left = set(re.findall(r"_mm512\w*|__m512\w*|_mm256_dpbus\w*|_mm256_mask\w*|__mmask\w*|_k\w+_mask\w*", src))
    assert not left, f"intrinsics without a stand-in: {left}"
    amx = (csrc / "kern_amx.c").read_text()
    assert "#include <immintrin.h>" in amx and LDTILECFG in amx
    amx = re.sub(r"#pragma GCC target\(.*\)", '#pragma GCC target("avx2,fma,f16c")', amx)
    amx = amx.replace("#include <immintrin.h>", '#include "emuamx.h"').replace("_tile_", "emu_tile_")
    amx = amx.replace(LDTILECFG, "emu_tile_loadconfig(&c);")
    amx = amx.replace("__m512i", "E512").replace("__m512", "E512").replace("__mmask16", "emask16").replace("_mm512_", "emu_")
    left = set(re.findall(r"_mm512\w*|__m512\w*|__mmask\w*|_k\w+_mask\w*|(?<!emu)_tile_\w*|__asm__", amx))
    assert not left, f"intrinsics without a stand-in: {left}"
    attn = (csrc / "attn_avx512.c").read_text()
    assert "#include <immintrin.h>" in attn
    attn = re.sub(r"#pragma GCC target\(.*\)", '#pragma GCC target("avx2,fma,f16c")', attn)
    attn = attn.replace("#include <immintrin.h>", '#include "emuamx.h"').replace("__m512", "E512").replace("_mm512_", "emu_")
    left = set(re.findall(r"_mm512\w*|__m512\w*|__mmask\w*", attn))
    assert not left, f"intrinsics without a stand-in: {left}"
    (out / "emu512.h").write_text(EMU512_H)
    (out / "emuamx.h").write_text(EMUAMX_H)
    (out / "kern_avx512_emu.c").write_text(src)
    (out / "kern_amx_emu.c").write_text(amx)
    (out / "attn_avx512_emu.c").write_text(attn)
    sources = [str(csrc / f) for f in ("cpu.c", "pack.c", "kern_generic.c", "kern_avx2.c")] + [
        str(out / f) for f in ("kern_avx512_emu.c", "kern_amx_emu.c", "attn_avx512_emu.c")]
    lib = out / "libkern_emu.so"
    cmd = [cc, "-O1", "-std=gnu11", "-fno-strict-aliasing", "-DKILN_X86=1", "-shared", "-fPIC", f"-I{csrc}", f"-I{out}",
           *sources, "-o", str(lib), "-lm"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    return ctypes.CDLL(str(lib))


@pytest.mark.parametrize("t", ALL_TYPES, ids=lambda t: t.name)
def test_avx512_kernel_logic_under_emulation(t, emulated_avx512):
    before = K.ISAS[K._native.isa_active()]
    K.force_isa("generic")
    try:
        cols_list = COLS_K if t in K_TYPES else (32, 96, 160, 224, 576, 640)  # short groups of 1..7 blocks
        for i, cols in enumerate(cols_list):
            rows, n = ROWS[i % len(ROWS)], NTOK[(i + 2) % len(NTOK)] if i % 2 else 17  # 17: two token blocks
            rng = rng_for("emu", t, cols)
            pm = K.pack(t, random_weights(t, rows, cols, rng), rows, cols)
            act = K.quantize_act(pm.fmt, activations(t, n, cols, rng))
            ref = K.matmul(pm, act, n)
            y = np.zeros((n, rows), np.float32)
            w = _WMat(int(pm.fmt), rows, cols, pm.rows_padded, pm.tile_bytes, pm.data.ctypes.data)
            emulated_avx512.kiln_matmul_avx512(ctypes.byref(w), ctypes.c_void_p(act.ctypes.data), n,
                                               ctypes.c_void_p(y.ctypes.data), rows, 0, pm.tiles)
            assert np.array_equal(y, ref), ctx(t.name, "emulated avx512", f"rows {rows}", f"cols {cols}", f"n_tok {n}")
    finally:
        K.force_isa(before)


# ---- AMX ---------------------------------------------------------------------------------------------------
# kern_amx.c unpacks 16 rows at a time and runs a call's tokens in blocks of 16 (runs of 128): shapes with a
# partial slab (rows 67, 5), a partial token block (33, 130: a second run), short groups of 1..7 blocks and
# the shared tail (576), against the generic kernel bit for bit.
AMX_SHAPES = [(67, 33), (5, 17), (20, 130)]


def _amx_cases(t):
    cols_list = COLS_K if t in K_TYPES else (32, 96, 160, 224, 576, 640)
    for i, cols in enumerate(cols_list):
        rows, n = AMX_SHAPES[i % len(AMX_SHAPES)]
        yield rows, cols, n


@pytest.mark.parametrize("t", BLOCK32_TYPES + K_TYPES, ids=lambda t: t.name)
def test_amx_kernel_logic_under_emulation(t, emulated_avx512):
    before = K.ISAS[K._native.isa_active()]
    K.force_isa("generic")
    try:
        for rows, cols, n in _amx_cases(t):
            rng = rng_for("emu-amx", t, cols)
            pm = K.pack(t, random_weights(t, rows, cols, rng), rows, cols)
            act = K.quantize_act(pm.fmt, activations(t, n, cols, rng))
            ref = K.matmul(pm, act, n)
            y = np.zeros((n, rows), np.float32)
            w = _WMat(int(pm.fmt), rows, cols, pm.rows_padded, pm.tile_bytes, pm.data.ctypes.data)
            for t0, t1 in ((0, pm.tiles // 2), (pm.tiles // 2, pm.tiles)):  # two calls, as two chunks
                emulated_avx512.kiln_matmul_amx(ctypes.byref(w), ctypes.c_void_p(act.ctypes.data), n,
                                                ctypes.c_void_p(y.ctypes.data), rows, t0, t1)
            assert np.array_equal(y, ref), ctx(t.name, "emulated amx", f"rows {rows}", f"cols {cols}", f"n_tok {n}")
    finally:
        K.force_isa(before)


@pytest.mark.parametrize("t", BLOCK32_TYPES + K_TYPES, ids=lambda t: t.name)
def test_amx_matches_generic_bit_for_bit(t):
    """The real tiles, with enough tokens that kiln_matmul picks them; any split of the tiles into chunks."""
    if K.isa_missing("amx"):
        pytest.skip(f"CPU lacks {K.isa_missing('amx')}")
    before = K.ISAS[K._native.isa_active()]
    try:
        for rows, cols, n in _amx_cases(t):
            n = max(n, K._native.amx_min_tokens())
            rng = rng_for("amx", t, cols)
            pm = K.pack(t, random_weights(t, rows, cols, rng), rows, cols)
            x = activations(t, n, cols, rng)
            K.force_isa("generic")
            act = K.quantize_act(pm.fmt, x)
            ref = K.matmul(pm, act, n)
            K.force_isa("amx")
            where = ctx(t.name, f"rows {rows}", f"cols {cols}", f"n_tok {n}")
            assert np.array_equal(K.matmul(pm, act, n), ref), where
            y = np.zeros((n, rows), np.float32)
            cut = 1 + int(rng.integers(0, max(1, pm.tiles - 1)))  # a chunk boundary inside a 16-row slab
            K.matmul(pm, act, n, y, 0, cut)
            K.matmul(pm, act, n, y, cut, pm.tiles)
            assert np.array_equal(y, ref), where + f", chunks split at tile {cut}"
    finally:
        K.force_isa(before)


# ---- AMX prefill: bf16 tiles --------------------------------------------------------------------------------
# kiln_bf16_tiles lays a Q8 activation out as bf16 once per op, kiln_matmul_bf16 multiplies the weights as bf16
# on it: each product rounds both factors to 8 significant bits, so it matches the int8 kernels within that
# rounding, not bit for bit (PERF.md, "AMX prefill on bf16 tiles"). Precise pairs are summed into one row.
BF16_TOLERANCE = 1e-2  # of the largest output: the rounding measured 2-3e-3 on these shapes


def _bf16_matmul(lib, pm, act, n, paired, cut):
    tiles = np.zeros(lib.kiln_bf16_tiles_bytes(pm.cols, n) // 2 + 32, np.uint16)
    assert lib.kiln_bf16_tiles(int(pm.fmt), ctypes.c_void_p(act.ctypes.data), pm.cols, n, int(paired),
                               ctypes.c_void_p(tiles.ctypes.data)) == 0
    y = np.full((n, pm.rows), np.nan, np.float32)
    w = _WMat(int(pm.fmt), pm.rows, pm.cols, pm.rows_padded, pm.tile_bytes, pm.data.ctypes.data)
    for t0, t1 in ((0, cut), (cut, pm.tiles)):  # two calls, as two chunks
        assert lib.kiln_matmul_bf16(ctypes.byref(w), ctypes.c_void_p(tiles.ctypes.data), n,
                                    ctypes.c_void_p(y.ctypes.data), pm.rows, t0, t1) == 0
    return y


def _check_bf16(lib, t, label):
    lib.kiln_bf16_tiles_bytes.restype = ctypes.c_size_t
    for i, (rows, cols, n) in enumerate(_amx_cases(t)):
        rng = rng_for("bf16", label, t, cols)
        pm = K.pack(t, random_weights(t, rows, cols, rng), rows, cols)
        paired = i % 2 == 1
        x = activations(t, n, cols, rng)
        act = K.quantize_act(pm.fmt, np.concatenate([x, x * np.float32(1 / 64)]) if paired else x)
        ref = K.matmul(pm, act, 2 * n if paired else n)
        ref = ref[:n] + ref[n:] if paired else ref
        y = _bf16_matmul(lib, pm, act, n, paired, 1 + int(rng.integers(0, max(1, pm.tiles - 1))))
        err = float(np.abs(y - ref).max() / np.abs(ref).max())
        assert err < BF16_TOLERANCE, ctx(t.name, label, f"rows {rows}", f"cols {cols}", f"n_tok {n}", f"paired {paired}", f"error {err:.2e}")


@pytest.mark.parametrize("t", BLOCK32_TYPES + K_TYPES, ids=lambda t: t.name)
def test_amx_bf16_logic_under_emulation(t, emulated_avx512):
    _check_bf16(emulated_avx512, t, "emulated amx bf16")


@pytest.mark.parametrize("t", BLOCK32_TYPES + K_TYPES, ids=lambda t: t.name)
def test_amx_bf16_tiles_match_the_int8_kernels(t):
    if K.isa_missing("amx"):
        pytest.skip(f"CPU lacks {K.isa_missing('amx')}")
    import kiln._native

    _check_bf16(ctypes.CDLL(kiln._native.__file__), t, "amx bf16")


# ---- attention over the fp16 cache: the AVX-512 kernels for many queries -------------------------------------
# attn_avx512.c converts a tile to fp32 once and runs the same FMA chain per lane as the AVX2 kernels, so scores
# and weighted values are the AVX2 bits: checked on shapes with partial 32-key chunks, query counts that are not
# whole passes of 8, and head dims of an odd number of 16s.
_SCORES = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                           ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
_ACCUMULATE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                               ctypes.c_void_p)


class _KVKernels(ctypes.Structure):
    _fields_ = [("scores", _SCORES), ("accumulate", _ACCUMULATE)]


ATTN_TILE = 64
ATTN_SHAPES = [(5, 8, 16), (9, 24, 48), (16, 40, 64), (32, 64, 80), (13, 56, 128), (33, 64, 256)]  # (nq, nk, hd)


def _native_lib():
    import kiln._native

    lib = ctypes.CDLL(kiln._native.__file__)
    lib.kiln_f16_kernels.restype = ctypes.POINTER(_KVKernels)
    return lib


def _attention_case(nq, nk, hd, rng):
    q = rng.standard_normal((nq, hd)).astype(np.float32)
    keys = rng.standard_normal((nk // 8, hd, 8)).astype(np.float16)  # groups of 8 positions, [dim][8] each
    values = rng.standard_normal((nk, hd)).astype(np.float16)
    p = rng.random((nq, ATTN_TILE)).astype(np.float32)
    o = rng.standard_normal((nq, hd)).astype(np.float32)
    return q, keys, values, p, o


def _run_attention(kernels, nq, nk, hd, q, keys, values, p, o):
    s = np.full((nq, ATTN_TILE), np.nan, np.float32)
    kernels.scores(q.ctypes.data, nq, hd, keys.ctypes.data, nk, values.ctypes.data, keys.ctypes.data, s.ctypes.data)
    out = o.copy()
    kernels.accumulate(p.ctypes.data, nq, nk, values.ctypes.data, hd, out.ctypes.data)
    return s[:, :nk], out


# a decode step's few queries (a GQA group): nk with a lone last group of 8, head dims not whole 64s
FEW_SHAPES = [(1, 8, 16), (2, 24, 48), (3, 40, 64), (4, 64, 80), (3, 56, 128), (1, 64, 256), (2, 64, 64), (4, 16, 96)]


def _check_avx2_bits(kernels, label, shapes=ATTN_SHAPES):
    avx2 = _native_lib().kiln_f16_kernels(1, 1, 64).contents  # ISA_AVX2, a decode step's few queries
    for nq, nk, hd in shapes:
        rng = rng_for("attn-avx512", label, nq, nk, hd)
        case = _attention_case(nq, nk, hd, rng)
        want_s, want_o = _run_attention(avx2, nq, nk, hd, *case)
        got_s, got_o = _run_attention(kernels, nq, nk, hd, *case)
        where = ctx(label, f"nq {nq}", f"nk {nk}", f"hd {hd}")
        assert np.array_equal(got_s.view(np.uint32), want_s.view(np.uint32)), where + ", scores"
        assert np.array_equal(got_o.view(np.uint32), want_o.view(np.uint32)), where + ", weighted values"
        q, keys, values, p, o = (a.astype(np.float64) for a in case)
        assert np.allclose(got_s, q @ keys.transpose(0, 2, 1).reshape(nk, hd).T, rtol=1e-5, atol=1e-4), where + ", scores"
        assert np.allclose(got_o, o + p[:, :nk] @ values, rtol=1e-5, atol=1e-4), where + ", weighted values"


def test_avx512_attention_kernels_give_the_avx2_bits():
    if K.isa_missing("avx512"):
        pytest.skip(f"CPU lacks {K.isa_missing('avx512')}")
    lib = _native_lib()

    def scores_at(isa, nq, hd):
        return ctypes.cast(lib.kiln_f16_kernels(isa, nq, hd).contents.scores, ctypes.c_void_p).value

    # ISA 1 is AVX2, 2 AVX-512: a few queries (decode) take the in-register kernels at any head dim, more
    # the tile-converting ones up to head dim 256, past it the AVX2 kernels
    few, wide = scores_at(2, 4, 128), scores_at(2, 5, 128)
    assert len({few, wide, scores_at(1, 4, 128)}) == 3 and scores_at(2, 1, 512) == few
    assert scores_at(2, 64, 512) == scores_at(1, 64, 512)
    _check_avx2_bits(lib.kiln_f16_kernels(2, 64, 128).contents, "avx512 wide")
    _check_avx2_bits(lib.kiln_f16_kernels(2, 4, 128).contents, "avx512 few", FEW_SHAPES)


def test_avx512_attention_logic_under_emulation(emulated_avx512):
    if K.isa_missing("avx2"):
        pytest.skip(f"CPU lacks {K.isa_missing('avx2')}")
    wide = _KVKernels(_SCORES(("kiln_scores_avx512", emulated_avx512)), _ACCUMULATE(("kiln_accumulate_avx512", emulated_avx512)))
    _check_avx2_bits(wide, "emulated avx512 wide")
    few = _KVKernels(_SCORES(("kiln_scores_few_avx512", emulated_avx512)),
                     _ACCUMULATE(("kiln_accumulate_few_avx512", emulated_avx512)))
    _check_avx2_bits(few, "emulated avx512 few", FEW_SHAPES)


def _quant_attention_case(kv, nq, nk, hd, rng):
    """A quantized cache's keys and values as kiln stores them, with queries, probabilities and outputs."""
    lib = _native_lib()
    kv_index = KV_TYPES.index(kv)
    lib.kiln_kv_head_bytes.restype = ctypes.c_size_t
    keys = np.zeros(lib.kiln_kv_head_bytes(kv_index, nk, hd), np.uint8)
    values = np.zeros_like(keys)
    for pos in range(nk):
        for fn, buf in ((lib.kiln_store_key_quant, keys), (lib.kiln_store_value_quant, values)):
            row = rng.standard_normal(hd).astype(np.float32)
            fn(kv_index, row.ctypes.data_as(ctypes.c_void_p), buf.ctypes.data_as(ctypes.c_void_p), pos, hd)
    q = rng.standard_normal((nq, hd)).astype(np.float32)
    p = rng.random((nq, ATTN_TILE)).astype(np.float32)
    o = rng.standard_normal((nq, hd)).astype(np.float32)
    return q, keys, values, p, o


@pytest.mark.parametrize("kv", ["q8_0", "q4_0"])
def test_quantized_attention_kernels_give_the_avx2_bits(kv):
    """Tiles of 64 keys and shorter ones (a lone last group), 1 to 9 queries (a decode step's group and
    prefill's blocks), head dims of one to eight blocks."""
    if K.isa_missing("avx512"):
        pytest.skip(f"CPU lacks {K.isa_missing('avx512')}")
    lib = _native_lib()
    lib.kiln_kv_quant_kernels.restype = ctypes.POINTER(_KVKernels)
    before = K.active_isa()
    try:
        K.force_isa("avx2")
        avx2 = lib.kiln_kv_quant_kernels(KV_TYPES.index(kv)).contents
        K.force_isa("avx512")
        avx512 = lib.kiln_kv_quant_kernels(KV_TYPES.index(kv)).contents
    finally:
        K.force_isa(before)
    for nq, nk, hd in [(1, 8, 32), (3, 64, 64), (2, 40, 128), (4, 56, 64), (5, 64, 96), (9, 24, 256), (3, 16, 32)]:
        case = _quant_attention_case(kv, nq, nk, hd, rng_for("attn-quant", kv, nq, nk, hd))
        want_s, want_o = _run_attention(avx2, nq, nk, hd, *case)
        got_s, got_o = _run_attention(avx512, nq, nk, hd, *case)
        where = ctx(kv, f"nq {nq}", f"nk {nk}", f"hd {hd}")
        assert np.isfinite(want_s).all() and np.isfinite(want_o).all(), where
        assert np.array_equal(got_s.view(np.uint32), want_s.view(np.uint32)), where + ", scores"
        assert np.array_equal(got_o.view(np.uint32), want_o.view(np.uint32)), where + ", weighted values"


# ---- MXFP4's exponents -------------------------------------------------------------------------------------
def test_mxfp4_rows_dequantize_as_gguf_does_at_every_exponent():
    """The embedding path's C dequantization: every e8m0 byte (0 and 1 give subnormal scales) and nibble."""
    rng = rng_for("mxfp4-rows")
    raw = rng.integers(0, 256, (256, 17), dtype=np.uint8)
    raw[:, 0] = np.arange(256)
    got = np.frombuffer(K._native.dequant_rows(int(QT.MXFP4), raw.ravel(), 256 * 32), np.float32)
    with np.errstate(over="ignore"):  # past e = 252 the largest values overflow float32 to inf, in C alike
        want = quants.dequantize(raw.ravel(), QT.MXFP4).ravel()
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), ctx("e8m0 rows")


@pytest.mark.parametrize("exponents,magnitude", [((0, 1, 2, 3), 1e30), ((249, 250, 251, 252), 1e-30)], ids=("smallest", "largest"))
def test_mxfp4_extreme_exponents(exponents, magnitude, isa):
    """Block scales at both ends of e8m0's range (2^-128 and 2^-127 are subnormal; past 2^124 the weights
    themselves overflow float32) against activations that bring the products back into normal floats, so a
    wrong scale shows in the result; 65 tokens reach AMX."""
    rng = rng_for("mxfp4-exp", exponents, isa)
    rows, cols = 9, 576
    raw = random_weights(QT.MXFP4, rows, cols, rng).reshape(rows, -1, 17)
    raw[:, :, 0] = rng.choice(exponents, raw.shape[:2])
    raw = raw.reshape(rows, -1)
    w = dequant(QT.MXFP4, raw, rows, cols)
    pm = K.pack(QT.MXFP4, raw, rows, cols)
    for n in (1, 3, 65):
        x = (activations(QT.MXFP4, n, cols, rng) * np.float32(magnitude)).astype(np.float32)
        y = K.matmul_f32(pm, x).astype(np.float64)
        ref = quantized_act(x) @ w.T
        scale = np.sqrt((quantized_act(x) ** 2) @ (w**2).T).max()
        assert np.isfinite(y).all() and np.abs(y - ref).max() <= 1e-5 * scale, ctx(isa, exponents, f"n_tok {n}")
