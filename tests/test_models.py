"""The oracle against transformers on the same GGUF: logits and greedy continuations."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.engine.oracle import OracleEngine
from kiln.gguf import GGUFFile
from kiln.models import family_for
from kiln.synth import write_random_gguf
from tests.reference import hf_greedy, hf_logits, oracle, oracle_greedy, rel_err

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a land far away, there lived a",
]




@pytest.mark.slow
@pytest.mark.parametrize("model", ["smollm2_path", "gemma3_path"])
def test_real_model_matches_transformers(model, request):
    path = request.getfixturevalue(model)
    from kiln.tokenizer import Tokenizer

    engine = oracle(path)
    tok = Tokenizer.from_gguf(engine.gguf)
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        ref = hf_logits(path, ids)[-1]
        assert rel_err(engine.forward(ids), ref) <= 1e-4, prompt
        assert oracle_greedy(engine, ids, 32) == hf_greedy(path, ids, 32), prompt


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-gemma3"])
def test_random_family_matches_transformers(shape, tmp_path):
    path = write_random_gguf(tmp_path / f"{shape}.gguf", shape, seed=7)
    engine = oracle(path)
    ids = [int(i) for i in np.random.default_rng(3).integers(10, 500, 24)]  # longer than gemma's window of 4
    ref = hf_logits(path, ids)
    assert rel_err(engine.forward(ids, all_logits=True), ref) <= 1e-4
    engine = oracle(path)
    assert oracle_greedy(engine, ids, 32) == hf_greedy(path, ids, 32)


def test_decode_continues_prefill_exactly(tmp_path):
    """Feeding tokens one at a time through the KV cache gives the logits of one long prefill."""
    path = write_random_gguf(tmp_path / "g.gguf", "tiny-gemma3", seed=1)
    ids = list(range(20, 40))
    whole = oracle(path).forward(ids, all_logits=True)
    engine = oracle(path)
    steps = [engine.forward(ids[:5], 0, 0)] + [engine.forward([t], 0, 5 + i) for i, t in enumerate(ids[5:])]
    assert rel_err(np.stack(steps), whole[4:]) < 1e-5


def test_slots_are_independent(tmp_path):
    path = write_random_gguf(tmp_path / "q.gguf", "tiny-qwen3", seed=2)
    engine = OracleEngine(GGUFFile(path), family_for(GGUFFile(path)), n_ctx=64, n_slots=2)
    a = engine.forward([5, 6, 7], slot=0)
    engine.forward([9, 9, 9, 9], slot=1)
    batch = engine.decode([8, 10], [0, 1], [3, 4])
    assert rel_err(batch[0], oracle(path).forward([5, 6, 7, 8])) < 1e-5
    assert not np.allclose(a, batch[0])
