"""What every hybrid family (a recurrent state beside attention: LFM2's short convolutions, Qwen3.5's Gated
DeltaNet) does alike on the native plan: transformers' greedy text, the oracle's logits in chunks and in
decode, layer by layer, quantized, and in a step that mixes decode rows with a chunk. Each family's own
file holds what is particular to it (its layers, its state's rewinding, its templates)."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from kiln.synth import write_random_gguf
from tests.reference import hf_greedy, register_builder, rel_err
from tests.test_lfm2 import engines
from tests.test_native import kld
from tests.test_qwen35 import _builder as qwen35_builder

IDS = [int(i) for i in np.random.default_rng(5).integers(3, 500, 40)]


@pytest.fixture(scope="module", params=["tiny-lfm2", "tiny-qwen35"])
def shape(request):
    return request.param


@pytest.fixture(scope="module")
def f32_path(shape, tmp_path_factory):
    path = write_random_gguf(tmp_path_factory.mktemp(shape) / "m.gguf", shape, qtype=QT.F32, seed=11)
    if shape == "tiny-qwen35":  # transformers' weights from the file's layout (value heads tiled)
        register_builder("qwen35", qwen35_builder(path))
    return path


def test_native_greedy_text_is_transformers(f32_path):
    native = engines(f32_path)[0]
    logits, out = native.forward(IDS[:12]), []
    for i in range(16):
        out.append(int(np.argmax(logits)))
        logits = native.forward([out[-1]], 0, 12 + i)
    assert out == hf_greedy(f32_path, IDS[:12], 16)


def test_float_model_matches_oracle_in_chunks_and_decode(f32_path, isa):
    # a small prefill plan, so a 40-token prompt runs as chunks of 17, 17 and 6
    native, oracle = engines(f32_path, prefill_rows=17, max_batch=4)
    assert rel_err(native.forward(IDS, all_logits=True), oracle.forward(IDS, all_logits=True)) < 1e-4
    for i, t in enumerate([7, 99, 300, 12, 45]):
        assert rel_err(native.forward([t], 0, 40 + i), oracle.forward([t], 0, 40 + i)) < 1e-4


def test_hidden_states_match_the_oracle_layer_by_layer(f32_path):
    native, oracle = engines(f32_path)
    got, want = native.hidden_states(IDS[:24]), oracle.hidden_states(IDS[:24])
    assert len(got) == len(want) == 2 * 4
    for a, b in zip(got, want):
        assert rel_err(a, b) < 1e-4


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q8_0])
def test_quantized_model_is_close_to_oracle(shape, qtype, tmp_path, isa):
    path = write_random_gguf(tmp_path / "q.gguf", shape, qtype=qtype, seed=4)
    native, oracle = engines(path)
    a, b = native.forward(IDS, all_logits=True), oracle.forward(IDS, all_logits=True)
    assert kld(b, a).mean() < 0.01 and (a.argmax(-1) == b.argmax(-1)).mean() >= 0.9


def test_mixed_step_of_decode_rows_and_a_chunk(f32_path):
    native, oracle = engines(f32_path, n_slots=3)
    for engine in (native, oracle):
        engine.forward([5, 6, 7, 8], slot=0)
        engine.forward([9, 10], slot=1)
    tokens, slots, positions = [11, 12, 20, 21, 22, 23, 24], [0, 1, 2, 2, 2, 2, 2], [4, 2, 0, 1, 2, 3, 4]
    got, want = native.step(tokens, slots, positions, [0, 1, 6]), oracle.step(tokens, slots, positions, [0, 1, 6])
    assert rel_err(got, want) < 1e-4
