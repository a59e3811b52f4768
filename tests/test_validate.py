"""`kiln validate`: the platform checks, the fit check against what loading really allocates, the
self-test bindings, readiness and the JSON output."""

from __future__ import annotations

import json
import math

import pytest
from gguf import GGMLQuantizationType as QT

from kiln import _native
from kiln import validate as V
from kiln.native import kernels as K
from kiln.synth import SHAPES, write_random_gguf
from tests.test_trace import expected_weight_bytes

REQUIRED_KEYS = {"object", "kiln_version", "ready", "threads", "machine", "model_fit", "checks"}
CHECKS = ["native extension", "machine load", "cpu", "kernel variant", "threads", "huge pages", "memlock",
          "memory", "kernel correctness", "GEMM", "GEMV bandwidth", "int8 peaks", "dispatch latency"]
MiB2 = 2 << 20


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture(scope="module")
def quick_report():
    return V.validate(quick=True)


def test_report_shape_and_readiness(quick_report):
    assert REQUIRED_KEYS <= set(quick_report) and quick_report["object"] == "kiln_validation"
    assert [c["name"] for c in quick_report["checks"]] == CHECKS
    for c in quick_report["checks"]:
        assert c["status"] in (V.PASSED, V.FAILED, V.WARNING, V.INFO), c
        assert c["result"] and c["method"], c["name"]
    by_name = {c["name"]: c for c in quick_report["checks"]}
    assert by_name["native extension"]["status"] == V.PASSED
    assert by_name["kernel correctness"]["status"] == V.PASSED
    assert quick_report["model_fit"] is None
    assert quick_report["ready"] is True
    json.dumps(quick_report)


def test_kernel_variant_names_what_is_missing(quick_report):
    fig = next(c for c in quick_report["checks"] if c["name"] == "kernel variant")["figures"]
    assert fig["variants"][fig["active"]] == "selected"
    assert fig["active"] == K.active_isa()
    for name in K.ISAS:
        missing = K.isa_missing(name)
        if missing:
            assert fig["variants"][name] == f"CPU lacks {missing}"


def test_figures_are_consistent(quick_report):
    by_name = {c["name"]: c["figures"] for c in quick_report["checks"]}
    hp = by_name["huge pages"]
    if "share" in hp:  # smaps_rollup readable
        assert 0 <= hp["huge_bytes"] <= hp["arena_bytes"]
        status = next(c["status"] for c in quick_report["checks"] if c["name"] == "huge pages")
        assert (status == V.PASSED) == (hp["share"] >= 0.5)
    gemv = by_name["GEMV bandwidth"]["by_threads"]
    for fig in gemv.values():
        assert fig["gemv_gb_s"] > 0 and fig["read_gb_s"] > 0
        ratios = sorted(g / r for g, r in zip(fig["gemv_passes"], fig["read_passes"]))
        assert fig["ratio"] == pytest.approx(ratios[len(ratios) // 2])  # median of pass-by-pass ratios (3 passes)
    assert by_name["GEMV bandwidth"]["bytes"] > (V.l3_bytes() or 0)  # streams from DRAM, not the cache
    for kind in ("int8", "int4", "bf16"):
        assert all(v > 0 for v in by_name["GEMM"]["gops"][kind].values())
    peaks = by_name["int8 peaks"]
    assert set(peaks["gmacs_per_core"]) | set(peaks["missing"]) == {"avx2", "avx512_vnni", "avx_vnni", "amx"}
    assert all(g > 0 for g in peaks["gmacs_per_core"].values())
    assert ("avx512_vnni" in peaks["gmacs_per_core"]) == (K.isa_missing("avx512") is None)
    assert ("amx" in peaks["gmacs_per_core"]) == (K.isa_missing("amx") is None)
    threads = quick_report["threads"]
    assert peaks["gemm_gmacs"] == pytest.approx(by_name["GEMM"]["gops"]["int4"][f"{threads}_threads"] / 2)
    for unit, share in peaks["gemm_share_of_peak"].items():
        assert share == pytest.approx(peaks["gemm_gmacs"] / (threads * peaks["gmacs_per_core"][unit]))
    d = by_name["dispatch latency"]
    assert d["noop_call_ns"] < d["empty_step_ns"]  # the step entry does strictly more than an empty call
    for key in ("dispatch", "fork_join"):
        assert d[key]["median_ns"] > 0


def test_kernel_check_fails_on_a_wrong_kernel(monkeypatch):
    """The check has teeth: a kernel off by a factor is reported as failed."""
    real = K.matmul_f32
    monkeypatch.setattr(K, "matmul_f32", lambda w, x: real(w, x) * 1.001)
    check = V.check_kernels()
    assert check.status == V.FAILED
    assert "limit 1e-5" in check.result


def test_pool_region_binding():
    ns, on_workers, timeouts = _native.pool_region_ns(2, 50, 0, True)
    assert len(ns) == 50 and min(ns) > 0
    assert on_workers == 50 or timeouts > 0  # each region gave the worker one of two chunks, unless one timed out
    ns, _, timeouts = _native.pool_region_ns(1, 10, 0, False)
    assert len(ns) == 10 and timeouts == 0
    with pytest.raises(ValueError, match="threads=0"):
        _native.pool_region_ns(0, 10, 0, False)
    assert _native.noop() is None
    assert _native.build_info()["op_struct_bytes"] == _native.op_layout()[1]


def test_read_loop_splits_the_buffer():
    buf = K.huge_empty(8 << 20)
    buf[:] = 1
    for threads in (1, 3):
        loop = V.ReadLoop(threads, buf=buf)
        assert len(loop.work) == threads
        r = loop.figures([loop.pass_gb_s(), loop.pass_gb_s()], "back to back")
        assert r["gb_s"] == pytest.approx(sum(r["passes"]) / 2)  # the median of two
        assert r["gb_s"] > 0 and r["bytes"] == buf.size and r["threads"] == threads
    assert V._slices(10, 3) == [(0, 3), (3, 6), (6, 10)]  # contiguous, covering everything once


def kv_bytes(shape, n_ctx, slots=1) -> int:
    return 2 * 2 * shape.n_layers * slots * n_ctx * shape.n_kv_heads * shape.head_dim


@pytest.mark.parametrize("shape,qtype", [("tiny-llama", QT.F32), ("tiny-gemma3", QT.F32), ("tiny-qwen3", QT.Q4_0)])
def test_footprint_against_what_load_allocates(shape, qtype, tmp_path, home):
    from kiln.engine.model import load

    path = write_random_gguf(tmp_path / "m.gguf", shape, qtype=qtype)
    fp = V.footprint(str(path), 256, n_slots=2)
    # weights: each matrix at a 4 KiB boundary, the arena in whole huge pages; at least the packed bytes
    assert fp["weights_bytes"] % MiB2 == 0 and fp["weights_bytes"] >= expected_weight_bytes(path)
    assert fp["kv_bytes"] == math.ceil(kv_bytes(SHAPES[shape], 256, 2) / MiB2) * MiB2
    model = load(str(path), backend="native", n_ctx=256, threads=2, progress=False)
    e = model.engine
    plans = e.decode_plan.arena.nbytes + e.prefill_plan.arena.nbytes
    model.close()
    assert fp["weights_bytes"] == math.ceil(e.weights.nbytes / MiB2) * MiB2
    assert fp["working_bytes_estimate"] >= plans
    assert fp["total_bytes"] == fp["weights_bytes"] + fp["kv_bytes"] + fp["working_bytes_estimate"]


def test_fit_check(tmp_path, home):
    from kiln.machine import facts

    path = write_random_gguf(tmp_path / "m.gguf", "tiny-llama", qtype=QT.Q8_0)
    f = facts()
    check, fit = V.check_memory(f, str(path), 64, 1)
    assert check.status == V.PASSED and fit["fits"]
    assert fit["need_bytes"] == fit["total_bytes"] + fit["process_rss_bytes"]
    tiny = dict(f, mem_available_gib=fit["need_bytes"] / 2**30 * 0.99)
    check, fit = V.check_memory(tiny, str(path), 64, 1)
    assert check.status == V.FAILED and not fit["fits"] and "DOES NOT FIT" in check.result
    check, fit = V.check_memory(f, str(path), 10**7, 1)  # more than the model's context
    assert check.status == V.FAILED and "context length" in check.result and not fit["fits"]
    check, fit = V.check_memory(f, "nosuch:model", None, 1)
    assert check.status == V.FAILED and "nosuch:model" in check.result


def test_cli(tmp_path, home, capsys):
    from kiln.cli import main

    path = write_random_gguf(tmp_path / "m.gguf", "tiny-llama", qtype=QT.Q8_0)
    assert main(["validate", "--quick", "--json", "--model", str(path), "--ctx", "128"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert REQUIRED_KEYS <= set(report) and report["ready"]
    assert report["model_fit"]["n_ctx"] == 128 and report["model_fit"]["fits"]
    assert main(["validate", "--quick", "--model", "nosuch:model"]) == 1
    text = capsys.readouterr().out
    assert "Not ready" in text and "nosuch:model" in text


@pytest.mark.slow
def test_smollm2_fit_matches_the_engine(smollm2_path, home):
    from kiln.engine.model import load

    fp = V.footprint(str(smollm2_path), 4096)
    model = load(str(smollm2_path), backend="native", n_ctx=4096, threads=2, progress=False)
    e = model.engine
    assert fp["weights_bytes"] == math.ceil(e.weights.nbytes / MiB2) * MiB2
    assert fp["kv_bytes"] == math.ceil(e.kv_arena.nbytes / MiB2) * MiB2 == 90 * 2**20
    assert fp["working_bytes_estimate"] >= e.decode_plan.arena.nbytes + e.prefill_plan.arena.nbytes
    model.close()
    assert fp["gguf_bytes"] == smollm2_path.stat().st_size
