"""The native engine against the oracle.

Float weights take the float32 activation path, so with the oracle storing its KV cache in fp16 like the
native engine does, every op of the plan (embedding, norms, q/k norm, rope, attention with windows and
GQA, GLU, residuals, logits) must agree to float32 tolerance. Quantized weights add int8 activations:
those are held to a KL divergence and top-1 agreement bound."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT

from kiln.engine.native import NativeEngine
from kiln.engine.oracle import OracleEngine
from kiln.gguf import GGUFFile
from kiln.models import family_for
from kiln.native import kernels
from kiln.synth import write_random_gguf
from tests.reference import rel_err

FAMILIES = ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-gemma3"]


def engines(path, n_slots=1, threads=2, n_ctx=96, **native_options):
    gguf = GGUFFile(path)
    fam = family_for(gguf)
    native = NativeEngine(gguf, fam, n_ctx=n_ctx, n_slots=n_slots, threads=threads, **native_options)
    return native, OracleEngine(gguf, fam, n_ctx=n_ctx, n_slots=n_slots, kv_dtype=np.float16)


def kld(p_logits, q_logits):
    """KL(P || Q) per row, P the reference."""
    p = np.exp(p_logits - p_logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    lq = q_logits - q_logits.max(-1, keepdims=True)
    lq -= np.log(np.exp(lq).sum(-1, keepdims=True))
    lp = np.log(p)
    return (p * (lp - lq)).sum(-1)


@pytest.mark.parametrize("shape", FAMILIES)
def test_float_model_matches_oracle_exactly(shape, tmp_path, isa):
    path = write_random_gguf(tmp_path / f"{shape}.gguf", shape, qtype=QT.F32, seed=11)
    # a small prefill plan, so a 40-token prompt runs as several chunks
    native, oracle = engines(path, prefill_rows=17, max_batch=4)
    ids = [int(i) for i in np.random.default_rng(5).integers(3, 500, 40)]
    assert rel_err(native.forward(ids, all_logits=True), oracle.forward(ids, all_logits=True)) < 1e-4
    for i, t in enumerate([7, 99, 300, 12, 45]):  # decode steps alternate between the two decode plans
        assert rel_err(native.forward([t], 0, 40 + i), oracle.forward([t], 0, 40 + i)) < 1e-4


def test_mixed_batch_of_slots_matches_oracle(tmp_path):
    """One step carrying decode rows of two sequences and a prefill chunk of a third."""
    path = write_random_gguf(tmp_path / "g.gguf", "tiny-gemma3", qtype=QT.F16, seed=3)
    native, oracle = engines(path, n_slots=3)
    for engine in (native, oracle):
        engine.forward([5, 6, 7, 8], slot=0)
        engine.forward([9, 10], slot=1)
    tokens, slots, positions = [11, 12, 20, 21, 22, 23, 24], [0, 1, 2, 2, 2, 2, 2], [4, 2, 0, 1, 2, 3, 4]
    out_rows = [0, 1, 6]
    got = native.step(tokens, slots, positions, out_rows)
    want = oracle.step(tokens, slots, positions, out_rows)
    assert rel_err(got, want) < 1e-4
    # the output head's input for the same rows, in order: what embeddings are made of
    hidden = native.hidden(len(out_rows))
    assert hidden.shape == (3, native.config.dim) and rel_err(hidden, oracle.hidden(len(out_rows))) < 1e-4
    assert rel_err(native.hidden(2), hidden[:2]) == 0


@pytest.mark.parametrize("qtype,runs_as", [(QT.Q5_1, QT.Q8_0), (QT.Q2_K, QT.Q8_0), (QT.Q3_K, QT.Q6_K),
                                           (QT.IQ4_NL, QT.Q8_0), (QT.IQ4_XS, QT.Q8_0)])
def test_types_without_kernels_run_requantized(qtype, runs_as, tmp_path):
    """Their values (the gguf package's dequantization) run as Q8_0, or rewritten exactly into the kernel
    type that holds them (Q3_K as Q6_K, IQ4_NL as Q8_0); an untied embedding table too, read from the arena
    as a tied one is."""
    path = write_random_gguf(tmp_path / "r.gguf", "tiny-llama", qtype=qtype, seed=4, dim=256, ffn_dim=512,
                             head_dim=64)  # K-quant rows are whole 256-weight blocks
    native, oracle = engines(path)
    block, block_bytes = GGML_QUANT_SIZES[runs_as]
    assert native.weights.row_format("token_embd.weight") == (int(runs_as), 256 // block * block_bytes)
    ids = [int(i) for i in np.random.default_rng(8).integers(3, 500, 48)]
    a, b = native.forward(ids, all_logits=True), oracle.forward(ids, all_logits=True)
    assert kld(b, a).mean() < 0.002 and (a.argmax(-1) == b.argmax(-1)).mean() >= 0.9
    for loads_from_cache in (False, True):  # the repack cache keeps the requantized rows and their format
        again = engines(path, cache_dir=tmp_path / "cache")[0]
        assert again.weights.from_cache == loads_from_cache
        assert again.weights.row_format("token_embd.weight")[0] == int(runs_as)
        assert np.array_equal(again.forward(ids, all_logits=True), a)


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q8_0, QT.MXFP4])
def test_quantized_model_is_close_to_oracle(qtype, tmp_path, isa):
    path = write_random_gguf(tmp_path / "q.gguf", "tiny-qwen3", qtype=qtype, seed=4)
    native, oracle = engines(path)
    ids = [int(i) for i in np.random.default_rng(8).integers(3, 500, 48)]
    a, b = native.forward(ids, all_logits=True), oracle.forward(ids, all_logits=True)
    assert kld(b, a).mean() < 0.01
    assert (a.argmax(-1) == b.argmax(-1)).mean() >= 0.9


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_1, QT.Q8_0, QT.MXFP4])
def test_amx_prefill_runs_on_bf16_tiles(qtype, tmp_path):
    """A prompt long enough for the AMX tiles (on both pool threads, each with its own tile state): the
    dense ops' products run on bf16 tiles (kern_amx.c), so the logits leave the AVX-512 kernels' bits by
    the bf16 rounding only, and stay as close to the oracle. (All rows' logits would run in chunks of the
    logits rows, too few for the tiles.)"""
    if kernels.isa_missing("amx"):
        pytest.skip(f"CPU lacks {kernels.isa_missing('amx')}")
    path = write_random_gguf(tmp_path / "q.gguf", "tiny-qwen3", qtype=qtype, seed=6)
    native, oracle = engines(path)
    ids = [int(i) for i in np.random.default_rng(2).integers(3, 500, kernels._native.amx_min_tokens() + 21)]
    before = kernels.active_isa()
    try:
        kernels.force_isa("avx512")
        want = native.forward(ids)
        kernels.force_isa("amx")
        got = native.forward(ids)
    finally:
        kernels.force_isa(before)
    assert not np.array_equal(got, want)  # the tiles ran
    assert np.abs(got - want).max() < 0.02 * np.abs(want).max()
    ref = oracle.forward(ids)
    assert kld(ref, got).mean() < 1e-3 and got.argmax() == ref.argmax()


@pytest.mark.parametrize("family,vocab", [("tiny-qwen2", 509), ("tiny-gemma3", 512)])
def test_int8_head_runs_split(family, vocab, tmp_path, isa, monkeypatch):
    """A Q8_0 output head runs as its top 5 bits, then the low 3 for the logits near each row's best
    (csrc/op_logits.c): those come out as the whole head gives them, the rest within the first pass's bound.
    Both heads are tied, so the embedding rows unpack from the split pair too; 509 rows end in a partial
    tile. (Untied split heads run in the Q8_0 cases of the tests above and below.)"""
    head = "token_embd.weight"
    from kiln.engine import native as native_module

    path = write_random_gguf(tmp_path / "h.gguf", family, qtype=QT.Q8_0, seed=13, vocab_size=vocab)
    split, oracle = engines(path)
    monkeypatch.setattr(native_module, "heads_of", lambda root: set())
    whole, _ = engines(path)
    assert split.weights.remainder(head) is not None and whole.weights.remainder(head) is None
    assert split.weights.row_format(head)[0] == int(QT.Q8_0)
    ids = [int(i) for i in np.random.default_rng(3).integers(3, 500, 24)]
    a, b = split.forward(ids), whole.forward(ids)
    scales = np.repeat(np.abs(GGUFFile(path).dequantize(head).reshape(-1, 32)).max(-1) / 127,
                       32).reshape(b.shape[-1], -1)  # each weight's block scale d
    for step, t in enumerate([7, 99, 300, 12, 45, 250, 401, 3]):
        a, b = split.forward([t], 0, 24 + step), whole.forward([t], 0, 24 + step)
        hidden = whole.hidden(1)[0]
        near = b >= b.max() - 8  # within the refining margin (10) of the first pass's best, with room
        assert np.abs(a - b)[near].max() <= 1e-5 * np.abs(b).max(), ctx_step(step)
        # elsewhere each weight errs by at most 4d (its low bits taken as 3.5; block sums rounded)
        assert (np.abs(a - b) <= 4.2 * scales @ np.abs(hidden) + 1e-4).all(), ctx_step(step)
        assert a.argmax() == b.argmax() and (~near).any()
    assert kld(oracle.forward([9], 0, 32), split.forward([9], 0, 32)).mean() < 0.01


def ctx_step(step: int) -> str:
    return f"decode step {step}"


def test_threads_give_bit_identical_logits(tmp_path):
    """Kernels are deterministic and chunks never split a dot product, so the thread count (and any
    chunk the caller re-runs for a stalled worker) cannot change a single bit."""
    path = write_random_gguf(tmp_path / "q.gguf", "tiny-llama", qtype=QT.Q4_1, seed=9)
    ids = list(range(30, 70))
    runs = []
    for threads in (1, 2, 3):
        native, _ = engines(path, threads=threads)
        logits = [native.forward(ids)] + [native.forward([t], 0, 40 + i) for i, t in enumerate(range(80, 100))]
        runs.append(np.stack(logits))
    assert np.array_equal(runs[0], runs[1]) and np.array_equal(runs[0], runs[2])


def test_engines_sharing_a_pool_step_at_once_each_on_its_own_thread(tmp_path):
    """With the pool's jobs kept on the stepping thread (scheduler.Turns, while several models have work), two
    engines on one two-thread pool step concurrently and give the logits a one-thread engine gives."""
    import threading

    from kiln import _native

    paths = [write_random_gguf(tmp_path / f"{q.name}.gguf", "tiny-llama", qtype=q, seed=9) for q in (QT.Q4_1, QT.Q8_0)]
    first, _ = engines(paths[0], n_slots=8, threads=2)
    shared = [first, engines(paths[1], n_slots=8, pool=first.pool)[0]]
    single = [engines(p, n_slots=8, threads=1)[0] for p in paths]
    rows, got, errors = list(range(8)), [[], []], []

    def run(k):
        try:
            assert _native.pool_alone(True) is False
            for i in range(12):
                got[k].append(shared[k].step([40 + i + r for r in rows], rows, [i] * 8, rows))
            _native.pool_alone(False)
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for k in range(2):
        want = [single[k].step([40 + i + r for r in rows], rows, [i] * 8, rows) for i in range(12)]
        assert np.array_equal(np.stack(got[k]), np.stack(want)), paths[k].name


# Q8_0: a split head; tiny-llama's logits all lie within its refining margin, Gemma 2's about half of them,
# so there the rows refine different tiles and the streamed remainder is kept only where a row's own are
@pytest.mark.parametrize("family,qtype", [("tiny-llama", QT.Q4_1), ("tiny-llama", QT.Q8_0), ("tiny-gemma2", QT.Q8_0)])
def test_batch_gives_bit_identical_logits(family, qtype, tmp_path):
    """A sequence's logits do not depend on what shares its step: its own rows decide which output-head
    logits get refined, and kernels give a token the same result in any call."""
    path = write_random_gguf(tmp_path / "q.gguf", family, qtype=qtype, seed=9)
    native, _ = engines(path, n_slots=3)
    prompts = [list(range(30, 50)), list(range(60, 75)), list(range(100, 130))]
    for slot, ids in enumerate(prompts):
        native.forward(ids, slot, 0)
    nexts, positions = [7, 8, 9], [len(p) for p in prompts]
    together = native.step(nexts, [0, 1, 2], positions, [0, 1, 2])
    alone = [native.step([nexts[s]], [s], [positions[s]], [0])[0] for s in range(3)]
    assert np.array_equal(together, np.stack(alone))


@pytest.mark.parametrize("family", ["tiny-llama", "tiny-gemma3", "tiny-gemma2"])
def test_long_context_attention_in_parts(family, tmp_path):
    """Past 512 keys attention splits a context into parts that the threads share, then merges them
    (prefill blocks straddle part boundaries here, Gemma3 mixes windowed and global layers, and Gemma 2's
    parts take their running maxima over soft-capped scores): the logits still match the oracle, and the
    thread count changes no bit."""
    path = write_random_gguf(tmp_path / "g.gguf", family, qtype=QT.F32, seed=12)
    ids = [int(i) for i in np.random.default_rng(5).integers(3, 500, 1100)]
    runs = []
    for threads in (1, 2, 3):
        native, oracle = engines(path, threads=threads, n_ctx=1200)
        runs.append(np.stack([native.forward(ids)] + [native.forward([7 + i], 0, 1100 + i) for i in range(3)]))
    want = np.stack([oracle.forward(ids)] + [oracle.forward([7 + i], 0, 1100 + i) for i in range(3)])
    assert rel_err(runs[0], want) < 1e-4
    assert np.array_equal(runs[0], runs[1]) and np.array_equal(runs[0], runs[2])


def test_slot_copy_and_rewind(tmp_path):
    path = write_random_gguf(tmp_path / "q.gguf", "tiny-qwen2", qtype=QT.F32, seed=2)
    native, oracle = engines(path, n_slots=2)
    native.forward([4, 5, 6, 7, 8], slot=0)
    native.copy_slot(0, 1, 5)
    assert rel_err(native.forward([9], 1, 5), oracle.forward([4, 5, 6, 7, 8, 9])) < 1e-4
    # rewinding a slot overwrites positions the previous step wrote
    assert rel_err(native.forward([10, 11], 0, 3), oracle.forward([4, 5, 6, 10, 11], 0, 0)) < 1e-4


def test_bad_token_is_a_request_error(tmp_path):
    from kiln.errors import RequestError

    native, _ = engines(write_random_gguf(tmp_path / "q.gguf", "tiny-qwen3", seed=1))
    with pytest.raises(RequestError, match="token id 512 is outside the vocabulary of 512"):
        native.forward([1, 512])


def test_debug_negate_breaks_the_model(tmp_path):
    path = write_random_gguf(tmp_path / "q.gguf", "tiny-llama", qtype=QT.F32, seed=6)
    native, oracle = engines(path)
    native.set_debug_negate(1)
    assert rel_err(native.forward([3, 4, 5, 6]), oracle.forward([3, 4, 5, 6])) > 0.05


@pytest.mark.slow
@pytest.mark.parametrize("model", ["smollm2_path", "gemma3_path"])
def test_real_model_kld_and_greedy_agreement(model, request):
    """Whole-model KL divergence to the fp32 oracle, and the verify gate on greedy continuations:
    identical, or at the first difference each side's token is in the other's top 5."""
    from kiln.tokenizer import Tokenizer

    path = request.getfixturevalue(model)
    gguf = GGUFFile(path)
    fam = family_for(gguf)
    native = NativeEngine(gguf, fam, n_ctx=512)
    oracle = OracleEngine(gguf, fam, n_ctx=512)
    tok = Tokenizer.from_gguf(gguf)
    text = ("It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
            "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, "
            "it was the season of Darkness, it was the spring of hope, it was the winter of despair.")
    ids = tok.encode(text)
    a, b = native.forward(ids, all_logits=True), oracle.forward(ids, all_logits=True)
    assert kld(b, a).mean() < 0.01
    assert (a.argmax(-1) == b.argmax(-1)).mean() >= 0.9
    for prompt in ("The capital of France is", "def add(a, b):\n    "):
        ids = tok.encode(prompt)
        steps = []
        for engine in (native, oracle):
            logits, out = engine.forward(ids), []
            for i in range(32):
                out.append((int(np.argmax(logits)), set(np.argsort(-logits)[:5].tolist())))
                logits = engine.forward([out[-1][0]], 0, len(ids) + i)
            steps.append(out)
        for (n_tok, n_top), (o_tok, o_top) in zip(*steps):
            if n_tok != o_tok:
                assert n_tok in o_top and o_tok in n_top, prompt
                break
