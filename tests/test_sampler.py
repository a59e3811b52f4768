"""Samplers and per-sequence stopping, against direct computations."""

from __future__ import annotations

import numpy as np
import pytest

from kiln import _native
from kiln.engine.sampler import Sampler, SamplingParams, apply_penalties, filtered_probs, sample_rows
from kiln.engine.sequence import Sequence, plan_budget
from kiln.errors import ContextLengthError, RequestError
from kiln.native import kernels


def test_greedy_picks_argmax():
    logits = np.random.default_rng(0).standard_normal(100).astype(np.float32)
    assert Sampler(SamplingParams.greedy())(logits) == int(np.argmax(logits))


def test_top_k_keeps_exactly_k():
    logits = np.arange(10, dtype=np.float32)
    probs = filtered_probs(logits, SamplingParams(temperature=1.0, top_k=3, top_p=1.0))
    assert set(np.nonzero(probs)[0]) == {7, 8, 9}
    assert probs.sum() == pytest.approx(1.0)


def test_top_p_keeps_smallest_nucleus():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    probs = filtered_probs(logits, SamplingParams(temperature=1.0, top_k=0, top_p=0.75))
    assert set(np.nonzero(probs)[0]) == {0, 1}
    probs = filtered_probs(logits, SamplingParams(temperature=1.0, top_k=0, top_p=0.85))
    assert set(np.nonzero(probs)[0]) == {0, 1, 2}


def test_min_p_is_relative_to_the_best():
    logits = np.log(np.array([0.6, 0.3, 0.07, 0.04]))
    probs = filtered_probs(logits, SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.1))
    assert set(np.nonzero(probs)[0]) == {0, 1, 2}


def test_temperature_sharpens():
    logits = np.array([1.0, 2.0, 3.0])
    cold = filtered_probs(logits, SamplingParams(temperature=0.5, top_k=0, top_p=1.0))
    hot = filtered_probs(logits, SamplingParams(temperature=2.0, top_k=0, top_p=1.0))
    assert cold[2] > hot[2]
    assert cold[2] == pytest.approx(np.exp(6) / np.exp([2, 4, 6]).sum())


def test_repetition_penalty_matches_llama_cpp_rule():
    logits = np.array([2.0, -2.0, 1.0, 5.0])
    out = apply_penalties(logits, [0, 1, 1], SamplingParams(repeat_penalty=2.0, repeat_last_n=64))
    assert out.tolist() == [1.0, -4.0, 1.0, 5.0]
    windowed = apply_penalties(logits, [0, 1, 1], SamplingParams(repeat_penalty=2.0, repeat_last_n=1))
    assert windowed.tolist() == [2.0, -4.0, 1.0, 5.0]


def test_seed_makes_sampling_repeatable_and_distribution_right():
    logits = np.log(np.array([0.7, 0.2, 0.1]))
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, repeat_penalty=1.0, seed=42)
    a = [Sampler(params)(logits) for _ in range(5)]
    s1, s2 = Sampler(params), Sampler(params)
    assert [s1(logits) for _ in range(50)] == [s2(logits) for _ in range(50)]
    counts = np.bincount([s1(logits) for _ in range(20000)], minlength=3) / 20000
    assert np.abs(counts - [0.7, 0.2, 0.1]).max() < 0.015
    assert len(a) == 5


def test_invalid_parameter_names_the_field():
    with pytest.raises(RequestError, match="top_p") as e:
        SamplingParams(top_p=1.5)
    assert e.value.param == "top_p"


def test_budget_raises_instead_of_truncating():
    assert plan_budget(10, None, 100) == 90
    assert plan_budget(10, 20, 100) == 20
    assert plan_budget(90, 20, 100) == 10  # beyond the room left: until the context is full
    with pytest.raises(ContextLengthError, match="prompt is 100 tokens"):
        plan_budget(100, None, 100)
    with pytest.raises(RequestError, match="max_tokens"):
        plan_budget(10, -1, 100)


class CharTokenizer:
    """Token i is chr(i): enough to test text handling without a model."""

    def stream(self):
        class D:
            def feed(self, i):
                return chr(i)

            def flush(self):
                return ""

        return D()

    def decode(self, ids, skip_special=True):
        return "".join(map(chr, ids))


def run(seq, text):
    out = ""
    for ch in text:
        out += seq.append(ord(ch))
        if seq.finished:
            break
    return out


def seq(stop=(), max_tokens=100, stop_ids=frozenset()):
    return Sequence([1], SamplingParams.greedy(), CharTokenizer(), max_tokens, list(stop), frozenset(stop_ids))


def test_stop_string_is_cut_and_never_streamed():
    s = seq(stop=["END"])
    streamed = run(s, "hello EN! and END tail")
    assert streamed == "hello EN! and " and s.text == streamed and s.finish_reason == "stop"


def test_held_back_text_is_released_at_length_limit():
    s = seq(stop=["XYZ"], max_tokens=4)
    assert run(s, "abXY") == "abXY" and s.finish_reason == "length"


def test_stop_token_ends_without_text():
    s = seq(stop_ids={ord("#")})
    assert run(s, "ab#cd") == "ab" and s.finish_reason == "stop" and s.output_ids[-1] == ord("#")


def test_penalties_in_place_leave_the_logits_unchanged():
    """The sampler penalizes the window's ids in the caller's array and puts them back: the logits come
    back as they were, and every draw equals one from a penalized copy."""
    rng = np.random.default_rng(3)
    logits = rng.standard_normal(1000).astype(np.float32)
    before = logits.copy()
    history = [int(t) for t in rng.integers(0, 1000, 100)]
    p = SamplingParams(repeat_penalty=1.3, presence_penalty=0.2, frequency_penalty=0.1, top_k=0, top_p=1.0, seed=7)
    in_place, from_copy = Sampler(p), Sampler(p)
    draws = [in_place(logits, history) for _ in range(200)]
    assert draws == [from_copy(apply_penalties(logits, history, p)) for _ in range(200)]
    assert np.array_equal(logits, before)
    assert len(set(draws)) > 20  # a real distribution, not one token


@pytest.mark.parametrize("isa", [i for i in ("generic", "avx2") if kernels.isa_missing(i) is None])
def test_top_indices_match_a_stable_sort(isa):
    """The native top-k against numpy's stable argsort (largest first, ties to the lower index), on
    orders that defeat a rising floor (ascending), the k largest in k different blocks, ties, NaN and
    -inf, and lengths off the block size."""
    rng = np.random.default_rng(11)
    before = kernels.active_isa()
    kernels.force_isa(isa)
    try:
        for n in (1000, 1601, 49157):
            base = rng.standard_normal(n).astype(np.float32)
            cases = {"random": base, "ascending": np.sort(base), "descending": np.sort(base)[::-1].copy(),
                     "ties": np.round(base * 2).astype(np.float32)}
            holes = base.copy()
            holes[rng.integers(0, n, n // 10)] = np.nan
            holes[rng.integers(0, n, n // 10)] = -np.inf
            cases["nan and -inf"] = holes
            spread = base.copy()  # the k largest in k different blocks: the floor must be exactly right
            spread[np.arange(n // 16) * 16 + np.arange(n // 16) % 16] = 10 + rng.permutation(n // 16)
            cases["one per block"] = spread
            for name, x in cases.items():
                for k in (1, 40, n // 16):
                    want = np.argsort(-np.nan_to_num(x, nan=-np.inf), kind="stable")[:k]
                    got = np.frombuffer(_native.topk(x, k), dtype=np.int32)
                    assert np.array_equal(got, want), (isa, n, name, k)
    finally:
        kernels.force_isa(before)


def _random_params(rng, seed: int) -> SamplingParams:
    return SamplingParams(temperature=float(rng.choice([0.0, 0.2, 0.8, 1.5])), top_k=int(rng.choice([1, 5, 40, 100])),
                          top_p=float(rng.choice([1.0, 0.9, 0.5])), min_p=float(rng.choice([0.0, 0.05])),
                          repeat_penalty=float(rng.choice([1.0, 1.1, 1.5])), repeat_last_n=int(rng.choice([0, 16, 64, -1])),
                          presence_penalty=float(rng.choice([0.0, 0.5])),
                          frequency_penalty=float(rng.choice([0.0, 0.3, -0.5])), seed=seed)


def _logits_and_history(rng, n: int):
    """Logits whose best tokens are partly in the history, so the penalties decide what the top k is."""
    x = (rng.standard_normal(n) * rng.uniform(0.5, 4)).astype(np.float32)
    history = [int(t) for t in rng.integers(0, n, int(rng.integers(0, 120)))]
    for t in history[:6]:
        x[t] += 8
    x[rng.integers(0, n, 3)] = x.max()  # ties at the top
    return x, history


@pytest.mark.parametrize("isa", [i for i in ("generic", "avx2") if kernels.isa_missing(i) is None])
def test_native_sampler_draws_the_tokens_of_the_numpy_sampler(isa):
    """Same parameters, same generator state: the native path (penalties folded into top-k, softmax, top-p,
    min-p, the draw) picks the numpy reference's token, for vocabularies on and off the block size."""
    rng = np.random.default_rng(5)
    before = kernels.active_isa()
    kernels.force_isa(isa)
    try:
        for trial in range(150):
            x, history = _logits_and_history(rng, int(rng.choice([1000, 4099, 49152])))
            params = _random_params(rng, trial)
            native, reference = Sampler(params), Sampler(params)
            assert Sampler(params).native_spec(0, x, history) is not None or params.repeat_last_n == -1
            for _ in range(4):
                assert native(x, history) == reference.reference(x, history), (trial, params)
    finally:
        kernels.force_isa(before)


def test_step_rows_sampled_on_the_pool_match_one_by_one():
    """sample_rows on a pool of 2 threads: each row's token is the numpy reference's for that row, and the
    rows the native sampler does not take (whole-vocabulary candidates, a long window) come back as None."""
    rng = np.random.default_rng(6)
    pool = _native.Pool(2)
    n = 8192
    for trial in range(20):
        rows = [_logits_and_history(rng, n) for _ in range(9)]
        logits = np.stack([x for x, _ in rows])
        params = [_random_params(rng, 100 * trial + i) for i in range(9)]
        params[7] = params[7].replace(top_k=0, temperature=0.8)
        params[8] = params[8].replace(repeat_last_n=-1, repeat_penalty=1.1)
        history8 = [int(t) for t in rng.integers(0, n, _native.SAMPLE_MAX_WINDOW + 1)]
        histories = [h for _, h in rows[:8]] + [history8]
        got = sample_rows(pool, logits, [(Sampler(p), i, h) for i, (p, h) in enumerate(zip(params, histories))])
        want = [Sampler(p).reference(logits[i], h) for i, (p, h) in enumerate(zip(params, histories))]
        assert got[:7] == want[:7] and got[7:] == [None, None]


def test_native_sampler_leaves_the_logits_unchanged():
    rng = np.random.default_rng(7)
    x, history = _logits_and_history(rng, 4096)
    before = x.copy()
    Sampler(SamplingParams(repeat_penalty=1.3, presence_penalty=0.4, seed=1))(x, history)
    assert np.array_equal(x, before)
