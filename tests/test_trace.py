"""`kiln trace`: its figures against independent calculations from the model's shapes, its checks,
its overhead control and its outputs (table, JSON, Chrome trace, history)."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from kiln import trace
from kiln.gguf import GGUFFile
from kiln.synth import SHAPES, Shape, write_random_gguf

# Bytes of one packed row, from the layouts documented in csrc/kernels.h (not from kiln's code): integer
# formats keep GGUF's block sizes except the k-quants' decoded scales; float formats pad columns to 16.
PACKED_BLOCK = {QT.Q4_0: (32, 18), QT.Q4_1: (32, 20), QT.Q5_0: (32, 22), QT.Q8_0: (32, 34),
                QT.Q4_K: (256, 148), QT.Q5_K: (256, 180), QT.Q6_K: (256, 210)}
FLOAT_BYTES = {QT.F32: 4, QT.F16: 2, QT.BF16: 2}
MATRICES = re.compile(r"blk\.\d+\.(attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down)\.weight|output\.weight")

REQUIRED_KEYS = {"object", "model", "model_sha256", "architecture", "threads", "n_ctx", "prompt_tokens",
                 "decode_tokens_per_request", "requests", "machine", "load", "ttft", "prefill", "decode",
                 "decode_profile", "read_bandwidth", "overhead", "checks", "method"}
DECODE_KEYS = {"tokens", "wall_ms_per_token", "parts_ms_per_token", "parts_cover_pct", "ops_cover_native_pct",
               "native_ms_by_layer", "native_calls_per_token", "ops_per_token", "ops_run_per_token",
               "parallel_regions_per_token", "bytes_per_token", "gb_per_s", "pct_of_read_bandwidth"}
PROFILE_KEYS = {"by_class_ms", "by_class_pct", "wait_pct", "matrix_share_pct"}


def packed_row_bytes(t: QT, cols: int) -> int:
    if t in FLOAT_BYTES:
        return math.ceil(cols / 16) * 16 * FLOAT_BYTES[t]
    block, nbytes = PACKED_BLOCK[t]
    return cols // block * nbytes


def expected_weight_bytes(path) -> int:
    """Packed bytes of every matrix one decode token multiplies: the projections and FFN of each block,
    then the lm head (the embedding table when tied), rows padded to tiles of 4. An int8 head counts its
    first pass, the top 5 bits (Q5_0)."""
    g = GGUFFile(path)
    names = [n for n in g.tensors if MATRICES.fullmatch(n)]
    head = "output.weight" if "output.weight" in names else "token_embd.weight"
    names = [n for n in names if n != head] + [head]
    total = 0
    for n in names:
        t = g.info(n)
        rows, cols = t.shape[0], int(np.prod(t.shape[1:]))
        qtype = QT.Q5_0 if n == head and t.type == QT.Q8_0 else QT(int(t.type))
        total += math.ceil(rows / 4) * 4 * packed_row_bytes(qtype, cols)
    g.close()
    return total


def expected_kv_read(shape, position: int) -> int:
    """fp16 K and V of every layer from the window's start (Gemma 3: five sliding layers in six) to the
    token's own position."""
    total = 0
    for i in range(shape.n_layers):
        span = position + 1
        if shape.arch == "gemma3" and (i + 1) % 6:
            span = min(span, shape.sliding_window)
        total += 2 * shape.n_kv_heads * shape.head_dim * 2 * span
    return total


def ops_per_token(shape) -> int:
    """embedding; per block norm+quantize, QKV, attention, quantize, output projection, norm+quantize,
    GLU, quantize, down projection (Gemma 3 adds two post-norms); final norm and lm head."""
    per_block = 9 + (2 if shape.arch == "gemma3" else 0)
    return 1 + per_block * shape.n_layers + 2


def regions_per_token(shape, threads: int) -> int:
    """Ops that fan out to the pool: QKV, the two matrix ops and the GLU of each block, the lm head, and
    attention when there is more than one kv head to split over."""
    if threads == 1:
        return 0
    return (4 + (shape.n_kv_heads > 1)) * shape.n_layers + 1


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def load_tiny(tmp_path, shape="tiny-llama", qtype=QT.Q8_0, threads=2):
    from kiln.engine.model import load

    path = write_random_gguf(tmp_path / f"{shape}.gguf", shape, qtype=qtype, seed=3)
    return path, load(str(path), backend="native", n_ctx=128, threads=threads, progress=False)


@pytest.mark.parametrize("shape,qtype", [("tiny-llama", QT.Q8_0), ("tiny-llama", QT.Q4_1), ("tiny-gemma3", QT.F16),
                                         ("tiny-qwen3", QT.Q4_0)])
def test_dispatch_figures_match_the_shapes(shape, qtype, tmp_path, home):
    path, model = load_tiny(tmp_path, shape, qtype)
    d = trace.dispatch_figures(model.engine)
    assert d["weight_bytes"] == expected_weight_bytes(path)
    assert d["ops_per_call"] == ops_per_token(SHAPES[shape])
    assert d["parallel_regions_per_call"] == regions_per_token(SHAPES[shape], 2)
    nplan = model.engine.decode_plan
    for position in (0, 3, 50):
        assert trace.kv_read_bytes(nplan, position) == expected_kv_read(SHAPES[shape], position)
    model.close()


def test_one_kv_head_splits_attention_past_one_span(tmp_path, home):
    """With one KV head, attention is one chunk until a row sees keys in two spans of the context; sliding
    window layers whose window stays inside one span remain one chunk."""
    from kiln import _native

    _, model = load_tiny(tmp_path, "tiny-gemma3", QT.F16)
    shape = SHAPES["tiny-gemma3"]
    assert shape.n_kv_heads == 1
    base = 4 * shape.n_layers + 1
    assert trace.dispatch_figures(model.engine)["parallel_regions_per_call"] == base
    global_layers = sum((i + 1) % 6 == 0 for i in range(shape.n_layers))
    position = _native.ATTN_SPAN + 10
    assert trace.dispatch_figures(model.engine, position)["parallel_regions_per_call"] == base + global_layers
    model.close()


def test_one_thread_has_no_parallel_regions(tmp_path, home):
    _, model = load_tiny(tmp_path, threads=1)
    assert trace.dispatch_figures(model.engine)["parallel_regions_per_call"] == 0
    model.close()


@pytest.mark.parametrize("shape", ["tiny-llama", "tiny-gemma3"])
def test_every_block_op_gets_its_layer(shape, tmp_path, home):
    _, model = load_tiny(tmp_path, shape)
    infos = trace.describe(model.engine, model.engine.decode_plan)
    per_block = (ops_per_token(SHAPES[shape]) - 3) // SHAPES[shape].n_layers
    assert infos[0].kind == "EMBED" and infos[0].layer is None
    assert [i.kind for i in infos[-2:]] == ["NORM_QUANT", "LOGITS"] and all(i.layer is None for i in infos[-2:])
    layers = [i.layer for i in infos[1:-2]]
    assert layers == sorted(layers)
    assert [layers.count(n) for n in range(SHAPES[shape].n_layers)] == [per_block] * SHAPES[shape].n_layers
    model.close()


def test_overhead_ratios_pair_each_traced_token_with_its_plain_neighbours():
    r = trace.Request()
    walls = [5, 10, 20, 30, 40, 60, 70]
    r.token_start = [0] * len(walls)
    r.token_end = walls
    r.traced = [True, False, True, False, True, False, True]
    assert trace.overhead_ratios(r) == [20 / 20, 40 / 45]  # the first and last have one neighbour only
    r.traced[3] = True  # tokens 2 and 4 now have a traced neighbour
    assert trace.overhead_ratios(r) == []


def test_traced_request_alternates_traced_and_plain_tokens(tmp_path, home):
    from kiln.engine.sampler import SamplingParams

    _, model = load_tiny(tmp_path)
    msgs = [{"role": "user", "content": "hello there"}]
    n_ops = model.engine.decode_plan.plan.n_ops
    for first in (True, False):
        r = trace.traced_request(model, msgs, SamplingParams.greedy(), 9, trace_first=first)
        assert r.traced == [(i % 2 == 0) == first for i in range(9)]
        ns, wait, runs = r.decode_ops[0]
        assert runs == sum(r.traced)  # the executor timed one decode step per traced token, no more
        assert len(ns) == n_ops and (ns > 0).all() and (wait <= ns).all()
        assert all(r.calls[i] == 1 for i in r.traced_tokens())
        assert all(r.forward[i] is None for i in range(9) if not r.traced[i])
    assert trace.traced_request(model, msgs, SamplingParams.greedy(), 4, trace_first=None).traced == [True] * 4
    model.close()


def test_run_on_a_tiny_model(tmp_path, home):
    path = write_random_gguf(tmp_path / "m.gguf", "tiny-llama", qtype=QT.Q4_0, seed=1)
    shape = SHAPES["tiny-llama"]
    report, events = trace.run(str(path), n_decode=12, reps=2, threads=2, chrome=True, read_bytes=16 << 20)
    assert REQUIRED_KEYS <= set(report)
    d = report["decode"]
    assert DECODE_KEYS <= set(d)
    assert d["ops_per_token"] == ops_per_token(shape) == d["ops_run_per_token"]
    assert d["native_calls_per_token"] == 1
    assert d["parallel_regions_per_token"] == regions_per_token(shape, 2)
    b = d["bytes_per_token"]
    assert b["weights"] == expected_weight_bytes(path)
    assert b["kv_read_mean"] == expected_kv_read(shape, b["kv_mean_position"])
    mean_s = d["wall_ms_per_token"]["mean"] / 1e3
    assert d["gb_per_s"]["effective"] == pytest.approx(b["total"] / mean_s / 1e9, rel=1e-9)
    assert d["pct_of_read_bandwidth"]["effective"] == pytest.approx(
        100 * d["gb_per_s"]["effective"] / report["read_bandwidth"]["gb_s"], rel=1e-9)
    assert d["tokens"] == 2 * 6  # every other one of each request's 12 tokens is traced
    for cover in report["checks"]["parts_cover_pct"].values():
        assert abs(cover - 100) <= 5
    assert report["checks"]["parts_within_5pct"]
    parts = d["parts_ms_per_token"]
    assert sum(parts.values()) == pytest.approx(d["wall_ms_per_token"]["mean"], rel=1e-9)
    assert PROFILE_KEYS <= set(report["decode_profile"]) and PROFILE_KEYS <= set(report["prefill"])
    by_class = report["decode_profile"]["by_class_ms"]
    layers = d["native_ms_by_layer"]  # every op but the embedding and the lm head's two belongs to a block
    assert sum(row["total"] for row in layers) == pytest.approx(sum(by_class[c] for c in trace.CLASSES[:3]), rel=1e-9)
    for row in layers:
        assert row["total"] == pytest.approx(sum(row[c] for c in trace.CLASSES[:3]) + row["barrier wait"], rel=1e-9)
    assert report["ttft"]["cold_start"]["parts_ms"]["model load"] == report["load"]["cold"]["wall_ms"]
    assert report["ttft"]["warm_median"]["parts_ms"]["queue wait"] == 0
    json.dumps(report)  # serializable as it is recorded
    check_chrome(events, report)


def check_chrome(doc: dict, report: dict) -> None:
    events = doc["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    assert all(e["ts"] >= 0 and e["dur"] >= 0 for e in slices)
    steps = [e for e in slices if e["name"] == "engine.step"]
    assert len(steps) == 1 + trace.CHROME_DECODE_STEPS  # one prefill chunk, then one step per decode token
    ops = [e for e in slices if e["cat"] in trace.CLASSES]
    assert len(ops) == len(steps) * report["decode"]["ops_per_call"]
    # slices on one thread must nest for the viewers to draw them: each lies inside or after the last open one
    stack = []
    for e in sorted(slices, key=lambda e: (e["ts"], -e["dur"])):
        start, end = e["ts"], e["ts"] + e["dur"]
        while stack and stack[-1] <= start + 1e-6:  # µs with ns decimals: allow float rounding
            stack.pop()
        assert not stack or end <= stack[-1] + 1e-6, e
        stack.append(end)


def test_cli_json_chrome_and_history(tmp_path, home, capsys):
    from kiln import history
    from kiln.cli import main

    path = write_random_gguf(tmp_path / "m.gguf", "tiny-qwen3", qtype=QT.Q8_0, seed=2)
    out = tmp_path / "trace.json"
    assert main(["trace", str(path), "-n", "6", "-r", "2", "-t", "2", "--json", "--chrome", str(out)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert REQUIRED_KEYS <= set(report) and report["object"] == "kiln_trace"
    assert report["chrome_trace"] == str(out)
    check_chrome(json.loads(out.read_text()), report)
    rows = history.query(kind="trace")
    assert [r["id"] for r in rows] == [report["history_id"]]
    assert rows[0]["payload"]["decode"]["ops_per_token"] == report["decode"]["ops_per_token"]


def test_table_output(tmp_path, home, capsys):
    from kiln.cli import main

    path = write_random_gguf(tmp_path / "m.gguf", "tiny-llama", qtype=QT.Q8_0, seed=2)
    assert main(["trace", str(path), "-n", "5", "-r", "1", "-t", "2"]) == 0
    text = capsys.readouterr().out
    for needle in ("time to first token", "one decode token", "ops/token", "parts sum to wall within 5%",
                   "tracer overhead", "bytes/token", "plain read"):
        assert needle in text, needle


def test_refuses_too_few_tokens(tmp_path, home):
    from kiln.errors import KilnError

    path = write_random_gguf(tmp_path / "m.gguf", "tiny-llama", qtype=QT.Q8_0)
    with pytest.raises(KilnError, match="at least 3 decode tokens"):
        trace.run(str(path), n_decode=2)


@pytest.mark.slow
def test_smollm2(smollm2_path, home):
    """The acceptance run: defaults, on the real model."""
    report, _ = trace.run(str(smollm2_path), threads=2)
    d = report["decode"]
    shape = Shape("llama", 576, 30, 9, 3, 64, 1536, 49152)  # SmolLM2-135M
    # the Q8_0 head's 30,081,024 bytes (of 96,436,224) are streamed as their top 5 bits: 19,464,192
    assert d["bytes_per_token"]["weights"] == expected_weight_bytes(smollm2_path) == 85819392
    assert d["ops_per_token"] == d["ops_run_per_token"] == ops_per_token(shape) == 273
    assert d["parallel_regions_per_token"] == regions_per_token(shape, 2) == 151
    assert d["bytes_per_token"]["kv_read_mean"] == expected_kv_read(shape, d["bytes_per_token"]["kv_mean_position"])
    assert report["checks"]["parts_within_5pct"], report["checks"]
    assert report["checks"]["tracer_overhead_below_3pct"], report["overhead"]
