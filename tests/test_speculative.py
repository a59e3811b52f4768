"""Speculative decoding: the drafters, the accept/reject rule's exactness (against the exact target
distribution, with deliberately bad drafts), the scheduler's rows and prompt cache, greedy outputs
identical with and without speculation on SmolLM2, and the per-request options of both APIs."""

from __future__ import annotations

import itertools
import math
import re
import statistics
from types import SimpleNamespace

import numpy as np
import pytest

from kiln.engine.generate import generate
from kiln.engine.interface import Limits
from kiln.engine.sampler import SamplingParams, apply_penalties, filtered_probs
from kiln.engine.scheduler import Request, Scheduler, Token
from kiln.engine.sequence import Sequence
from kiln.engine.speculative import (Draft, LookupDrafter, ModelDrafter, SpecOptions, Speculation, speculation, verify,
                                     vocabulary_mismatch)
from kiln.errors import KilnError, RequestError
from tests.test_scheduler import Letters, ScriptedEngine, run_steps


# --- chi-square, without scipy ------------------------------------------------------------------------
def upper_gamma(a: float, x: float) -> float:
    """The regularized upper incomplete gamma function Q(a, x) (Numerical Recipes' gser / gcf)."""
    if x <= 0:
        return 1.0
    front = math.exp(-x + a * math.log(x) - math.lgamma(a))
    if x < a + 1:
        term = total = 1.0 / a
        for n in range(1, 1000):
            term *= x / (a + n)
            total += term
            if term < total * 1e-15:
                break
        return 1.0 - total * front
    tiny = 1e-300
    b, c, d = x + 1 - a, 1 / tiny, 1 / (x + 1 - a)
    h = d
    for i in range(1, 1000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        h *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return front * h


def chi_square_p(counts: dict, probs: dict, n: int) -> float:
    """Goodness of fit of `counts` (n samples) to `probs`; cells expected fewer than 5 times are pooled.
    A sample in a cell of probability 0 fails outright."""
    impossible = [cell for cell in counts if probs.get(cell, 0.0) == 0.0]
    assert not impossible, f"sampled outcomes the target never produces: {impossible[:5]}"
    cells, pooled_o, pooled_e, stat = 0, 0, 0.0, 0.0
    for cell, p in probs.items():
        o, e = counts.get(cell, 0), n * p
        if e < 5:
            pooled_o, pooled_e = pooled_o + o, pooled_e + e
            continue
        stat += (o - e) ** 2 / e
        cells += 1
    if pooled_e > 0:
        stat += (pooled_o - pooled_e) ** 2 / pooled_e
        cells += 1
    return upper_gamma((cells - 1) / 2, stat / 2)


def test_chi_square_p_values_match_the_tables():
    assert upper_gamma(0.5, 3.841 / 2) == pytest.approx(0.05, abs=2e-4)  # 1 degree of freedom
    assert upper_gamma(5.0, 18.307 / 2) == pytest.approx(0.05, abs=2e-4)  # 10
    assert upper_gamma(15.0, 59.703 / 2) == pytest.approx(0.001, abs=2e-5)  # 30


# --- a bigram model: exact distributions, sampled thousands of times ------------------------------------
V = 5


class BigramEngine:
    """Logits depend only on a row's own token, so the target's exact distribution of whole outputs can be
    enumerated. Speaks the engine API that the scheduler uses."""

    n_ctx = 64
    limits = Limits(out_rows=Limits.rows)
    pool = threads = None

    def __init__(self, seed: int = 1):
        self.table = np.random.default_rng(seed).normal(0, 1.5, (V, V)).astype(np.float32)

    def forward(self, tokens, slot=0, start=0, all_logits=False):
        return self.table[tokens[-1]]

    def step(self, tokens, slots, positions, out_rows):
        return self.table[[tokens[r] for r in out_rows]]

    def resume_point(self, slot, position):
        return position

    def snapshot(self, slot, position):
        pass

    def checkpoint(self, slot, position):
        pass


class SkewedDrafter:
    """Drafts from a fixed distribution q that disagrees with the target (it favours the target's least
    likely tokens, some of which the filters remove), reporting q as a draft model does."""

    def __init__(self, q):
        self.q = np.asarray(q, dtype=np.float64)

    def propose(self, jobs):
        ids = np.arange(V)
        return [Draft([int(seq.sampler.rng.choice(ids, p=self.q)) for _ in range(k)], [(ids, self.q)] * k)
                for seq, k in jobs]


SAMPLED = SamplingParams(temperature=0.9, top_k=3, top_p=0.95, min_p=0.05, repeat_penalty=1.3, repeat_last_n=64)
PROMPT = [0, 1, 2, 0, 1]  # prompt lookup finds earlier n-grams here


def exact_outputs(step_probs, prompt, n_tokens, params):
    """Probability of every output of `n_tokens` tokens, sampling each from step_probs(history)."""
    out = {(): 1.0}
    for _ in range(n_tokens):
        nxt = {}
        for seq, p in out.items():
            probs = step_probs(prompt + list(seq), params)
            for t in np.flatnonzero(probs):
                nxt[seq + (int(t),)] = p * probs[t]
        out = nxt
    return out


def sample_outputs(engine, n, n_tokens, params, make_speculation, prompt):
    """How often each output came out of n seeded runs, and the draft tokens (proposed, accepted)."""
    counts, drafted, accepted = {}, 0, 0
    scheduler = Scheduler(engine, n_slots=1, max_queue=0)
    for seed in range(n):
        seq = Sequence(list(prompt), params.replace(seed=seed), Letters(), n_tokens,
                       speculation=make_speculation())
        for _ in generate(scheduler, seq):
            pass
        key = tuple(seq.output_ids)
        counts[key] = counts.get(key, 0) + 1
        drafted, accepted = drafted + seq.timings.draft_tokens, accepted + seq.timings.draft_accepted
    return counts, drafted, accepted


@pytest.mark.parametrize("drafter", ["skewed q", "prompt lookup"])
def test_the_accept_rule_leaves_the_target_distribution_exact(drafter):
    engine = BigramEngine()

    def target(history, params):
        return filtered_probs(apply_penalties(engine.table[history[-1]], history, params), params)

    make = {"skewed q": lambda: Speculation(SkewedDrafter([0.05, 0.05, 0.1, 0.2, 0.6]), 3),
            "prompt lookup": lambda: Speculation(LookupDrafter(2), 3)}[drafter]
    n = 6000
    counts, drafted, accepted = sample_outputs(engine, n, 4, SAMPLED, make, PROMPT)
    assert 0 < accepted < drafted  # both ways out of the rule were taken, many times
    probs = exact_outputs(target, PROMPT, 4, SAMPLED)
    assert chi_square_p(counts, probs, n) > 1e-3


def test_greedy_verification_takes_the_argmax_chain():
    engine = ScriptedEngine()  # greedy counts upwards: after t comes t + 1
    seq = Sequence([1, 2, 3], SamplingParams.greedy(), Letters(), 10, logprobs=0, speculation=Speculation(None, 4))
    seq.append(4)
    engine.step([1, 2, 3], [0] * 3, range(3), [2])  # the prompt's KV
    rows = engine.step([4, 5, 6, 9, 10], [0] * 5, range(3, 8), range(5))
    assert verify(seq, Draft([5, 6, 9, 10]), rows) == [5, 6, 7]  # 9 rejected: the target's 7 instead
    t = seq.timings
    assert (t.draft_tokens, t.draft_accepted, t.decode_passes) == (4, 2, 1)
    assert [r["id"] for r in seq.token_logprobs] == [5, 6, 7]
    assert seq.speculation.length == 3  # one more than accepted
    rows = engine.step([4, 5, 6], [0] * 3, range(3, 6), range(3))
    assert verify(seq, Draft([5, 6]), rows) == [5, 6, 7]  # all accepted, then the bonus token
    assert seq.speculation.length == 4  # doubled, capped at the maximum


# --- prompt lookup --------------------------------------------------------------------------------------
def test_lookup_proposes_what_followed_the_latest_longest_match():
    d = LookupDrafter(3)
    seq = SimpleNamespace(all_ids=[1, 2, 3, 4, 9, 2, 3, 5, 6, 2, 3])
    assert d.propose([(seq, 2)])[0].tokens == [5, 6]  # "2 3" last seen before 5 6, not before 4
    seq.all_ids += [5, 6, 1]
    assert d.propose([(seq, 4)])[0].tokens == [2, 3, 4, 9]  # the index grew with the sequence
    seq.all_ids += [7]
    assert d.propose([(seq, 3)])[0].tokens == []  # 7 never occurred before
    seq.all_ids = [8, 1, 2, 3, 8, 1, 2]
    assert LookupDrafter(1).propose([(seq, 3)])[0].tokens == [3, 8, 1]  # unigram "2"
    assert LookupDrafter(3).propose([(seq, 9)])[0].tokens == [3, 8, 1, 2]  # up to the end of the context


# --- the scheduler ----------------------------------------------------------------------------------------
class Client:
    def __init__(self, prompt, max_tokens, spec=None, stop_ids=frozenset()):
        self.seq = Sequence(list(prompt), SamplingParams.greedy(), Letters(), max_tokens, stop_ids=stop_ids,
                            speculation=spec)
        self.tokens: list[str] = []
        self.request = Request(self.seq, self.sink)

    def sink(self, event):
        if isinstance(event, Token):
            self.tokens.append(event.text)


def run_clients(prompts, max_tokens, spec, stop_ids=frozenset(), n_slots=4):
    engine = ScriptedEngine(n_slots=n_slots, max_batch=4, prefill_rows=8)
    s = Scheduler(engine, n_slots=n_slots, max_queue=8)
    clients = [Client(p, max_tokens, spec() if spec else None, stop_ids) for p in prompts]
    for c in clients:
        s.submit(c.request)
    run_steps(s)
    return s, engine, clients


def test_the_scheduler_feeds_drafts_and_keeps_only_accepted_tokens_in_the_cache():
    prompt = [1, 2, 3, 4, 1, 2]  # after 3, lookup drafts 4 1 2 3; the target (counting up) wants 4 5 6 7
    s, engine, (c,) = run_clients([prompt], 6, lambda: Speculation(LookupDrafter(2), 4), n_slots=1)
    _, _, (plain,) = run_clients([prompt], 6, None, n_slots=1)
    assert c.seq.output_ids == plain.seq.output_ids == [3, 4, 5, 6, 7, 8]
    assert len(c.tokens) == 6  # one event per token
    first = engine.steps[1]  # after the prefill: the last token and a draft, every row with logits
    assert first["tokens"] == [3, 4, 1, 2, 3] and first["positions"] == [6, 7, 8, 9, 10]
    assert first["out_rows"] == [0, 1, 2, 3, 4]
    assert engine.steps[2]["positions"][0] == 8  # 4 accepted, 1 rejected: position 8 is fed again
    assert c.seq.timings.draft_tokens > c.seq.timings.draft_accepted > 0
    assert s.slot_tokens[c.seq.slot] == c.seq.all_ids[:-1]  # what the KV holds: never a rejected draft
    follow = Client(c.seq.all_ids + [9], 1)
    s.submit(follow.request)
    n = len(engine.steps)
    run_steps(s)
    assert follow.seq.timings.cached_tokens == len(c.seq.all_ids) - 1
    assert engine.steps[n]["positions"][0] == len(c.seq.all_ids) - 1


def test_stops_and_limits_cut_a_draft_short():
    prompt = [1, 2, 3, 4, 5, 6, 1, 2]  # after 3, lookup drafts 4 5 6 1 2; the target accepts 4 5 6
    spec = lambda: Speculation(LookupDrafter(2), 5)  # noqa: E731
    s, engine, (c,) = run_clients([prompt], 9, spec, frozenset({5}), n_slots=1)
    assert engine.steps[1]["tokens"] == [3, 4, 5, 6, 1, 2]  # 4 5 6 accepted, but 5 is a stop token
    assert c.seq.output_ids == [3, 4, 5] and c.seq.finish_reason == "stop"
    assert s.slot_tokens[0] == prompt + [3, 4, 5]  # 5 was fed as a draft row, so its KV is there too
    s, engine, (c,) = run_clients([prompt], 3, spec, n_slots=1)
    assert engine.steps[1]["tokens"] == [3, 4]  # two tokens left to generate: a draft of one, plus the target's
    assert c.seq.output_ids == [3, 4, 5] and c.seq.finish_reason == "length"
    assert s.slot_tokens[0] == prompt + [3, 4]


def test_many_speculating_sequences_share_one_step_within_its_limits():
    prompts = [[i, i + 1, i + 2, i, i + 1] for i in range(0, 24, 6)]
    s, engine, clients = run_clients(prompts, 12, lambda: Speculation(LookupDrafter(2), 8))
    _, _, plain = run_clients(prompts, 12, None)
    assert [c.seq.output_ids for c in clients] == [p.seq.output_ids for p in plain]
    assert all(len(st["tokens"]) <= 8 and len(st["out_rows"]) <= 8 for st in engine.steps)  # the step's limits
    assert any(len(set(st["slots"])) == 4 and len(st["tokens"]) > 4 for st in engine.steps)  # all four drafted


# --- vocabularies ---------------------------------------------------------------------------------------
def fake_model(tag, tokens, bos=1, eos=2, stops=frozenset({2}), logits=None):
    tok = SimpleNamespace(vocab_size=len(tokens), id_to_token=tokens.__getitem__, bos_id=bos, eos_id=eos,
                          stop_ids=frozenset(stops))
    return SimpleNamespace(tag=tag, tokenizer=tok, config=SimpleNamespace(vocab_size=logits or len(tokens)),
                           engine=SimpleNamespace(n_slots=1))


def test_incompatible_vocabularies_are_refused_with_what_differs():
    base = ["<s>", "</s>", "<eos>", "a", "b"]
    target = fake_model("big:7b", base)
    assert vocabulary_mismatch(fake_model("small:1b", list(base)), target) is None
    cases = [(fake_model("d", base + ["c"]), "vocabulary sizes differ (6 tokens, 6 logits vs 5 tokens, 5 logits)"),
             (fake_model("d", base, logits=8), "vocabulary sizes differ (5 tokens, 8 logits vs 5 tokens, 5 logits)"),
             (fake_model("d", base[:3] + ["x", "b"]), "token strings differ (first at id 3: 'x' vs 'a')"),
             (fake_model("d", base, eos=1), "special tokens differ (eos_id 1 vs 2)"),
             (fake_model("d", base, stops={2, 4}), "special tokens differ (stop_ids [2, 4] vs [2])")]
    for draft, message in cases:
        assert vocabulary_mismatch(draft, target) == message
    with pytest.raises(KilnError, match=r"draft model d cannot draft for big:7b: token strings differ"):
        ModelDrafter(cases[2][0], target)


@pytest.mark.slow
def test_a_draft_model_with_another_tokenizer_is_refused(tmp_path, smollm2_path):
    from kiln.engine.model import load
    from kiln.synth import write_random_gguf

    own = load(str(write_random_gguf(tmp_path / "tiny.gguf", "tiny-llama")), progress=False)
    target = load(str(smollm2_path), n_ctx=256, progress=False)
    with pytest.raises(KilnError) as e:
        ModelDrafter(own, target)
    assert str(e.value) == (f"draft model {own.tag} cannot draft for {target.tag}: vocabulary sizes differ "
                            "(512 tokens, 512 logits vs 49152 tokens, 49152 logits)")


# --- options --------------------------------------------------------------------------------------------
def test_options_are_checked_and_errors_name_the_parameter():
    assert SpecOptions().replace(mode="lookup", max=None) == SpecOptions("lookup", 8, 4)
    names = ("options.draft", "options.draft_max", "options.draft_ngram")
    for change, param in (({"mode": "ngram"}, "options.draft"), ({"max": 0}, "options.draft_max"),
                          ({"max": 33}, "options.draft_max"), ({"ngram": 9}, "options.draft_ngram")):
        with pytest.raises(RequestError) as e:
            SpecOptions().replace(names, **change)
        assert e.value.param == param and param in str(e.value)
    with pytest.raises(RequestError, match="needs a draft model") as e:
        speculation(SpecOptions("model"), None, "speculative.mode")
    assert e.value.param == "speculative.mode"
    assert speculation(SpecOptions("none"), None) is None
    assert isinstance(speculation(SpecOptions("lookup", 5, 2), None).drafter, LookupDrafter)


def test_cli_flags():
    from kiln.cli import build_parser
    from kiln.commands.run import spec_from_args

    def spec(*flags):
        return spec_from_args(build_parser().parse_args(["run", "m", *flags]))

    assert spec() == SpecOptions("none")
    assert spec("--draft", "lookup", "--draft-max", "4", "--ngram", "2") == SpecOptions("lookup", 4, 2)
    assert spec("--draft-model", "small:1b").mode == "model"
    with pytest.raises(KilnError, match="--draft model needs --draft-model"):
        spec("--draft", "model")
    with pytest.raises(RequestError, match="--draft-max must be an integer from 1 to 32"):
        spec("--draft", "lookup", "--draft-max", "0")


# --- SmolLM2: greedy outputs are identical ---------------------------------------------------------------
PROMPTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n\n"
    "def factorial(n):\n",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "import numpy as np\n\nx = np.arange(10)\ny = x * 2\nprint(x, y)\nz = np.arange(10)\n",
    "Monday, Tuesday, Wednesday, Thursday,",
    "1, 2, 3, 4, 5, 6, 7, 8,",
    "<html>\n<head><title>Test</title></head>\n<body>\n<p>Hello</p>\n<p>",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\nclass Vector:\n",
    "Roses are red, violets are blue,",
    "SELECT name, age FROM users WHERE age > 30;\nSELECT name, age FROM",
    "Once upon a time there was a little robot who",
    "for i in range(10):\n    print(i)\nfor j in range(10):\n",
    "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is",
    "a b c d e f g a b c",
    "Dear Sir or Madam,\n\nI am writing to",
    "x = [1, 2, 3]\nx = [1, 2, 3]\nx = [1, 2, 3]\n",
    "The mitochondria is the powerhouse of the cell. The mitochondria",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "To be, or not to be, that is the question:",
    "red green blue red green blue red",
    "JSON: {\"name\": \"kiln\", \"kind\": \"runtime\"}\nJSON: {\"name\":",
]


@pytest.fixture(scope="module")
def smollm2_models(smollm2_path):
    from kiln.engine.model import load

    target = load(str(smollm2_path), n_ctx=512, n_slots=4, progress=False)
    draft = load(str(smollm2_path), n_ctx=512, n_slots=4, progress=False)  # itself: every greedy draft agrees
    yield target, ModelDrafter(draft, target)
    target.close()
    draft.close()


def serve_all(model, spec, max_tokens=40):
    s = Scheduler(model.engine, n_slots=4, max_queue=len(PROMPTS))
    tok = model.tokenizer
    seqs = [Sequence(tok.encode(p), SamplingParams.greedy(), tok, max_tokens, stop_ids=tok.stop_ids,
                     speculation=spec()) for p in PROMPTS]
    for seq in seqs:
        s.submit(Request(seq, lambda event: None))
    run_steps(s)
    return seqs


@pytest.mark.slow
def test_greedy_outputs_are_identical_with_and_without_speculation(smollm2_models):
    target, drafter = smollm2_models
    plain = [seq.output_ids for seq in serve_all(target, lambda: None)]
    lookup = serve_all(target, lambda: Speculation(LookupDrafter(4), 8))
    assert [seq.output_ids for seq in lookup] == plain
    drafted = sum(s.timings.draft_tokens for s in lookup)
    accepted = sum(s.timings.draft_accepted for s in lookup)
    assert drafted > accepted > 0
    itself = serve_all(target, lambda: Speculation(drafter, 6))
    assert [seq.output_ids for seq in itself] == plain
    assert sum(s.timings.draft_accepted for s in itself) == sum(s.timings.draft_tokens for s in itself) > 0
    for i in (0, 3, 6):  # the single-sequence loop of `kiln run`, which a new sequence's slot 0 reuses
        for spec in (Speculation(LookupDrafter(4), 8), Speculation(drafter, 4)):
            tok = target.tokenizer
            seq = Sequence(tok.encode(PROMPTS[i]), SamplingParams.greedy(), tok, 40, stop_ids=tok.stop_ids,
                           speculation=spec)
            for _ in generate(Scheduler(target.engine, n_slots=1, max_queue=0), seq):
                pass
            assert seq.output_ids == plain[i]


# --- a tiny random model and its draft: sampled output distribution --------------------------------------
@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    from kiln.engine.model import load
    from kiln.synth import write_random_gguf

    root = tmp_path_factory.mktemp("spec")
    target_path = write_random_gguf(root / "target.gguf", "tiny-llama", seed=0)
    draft_path = write_random_gguf(root / "draft.gguf", "tiny-llama", seed=7, tokenizer_from=target_path)
    target = load(str(target_path), backend="native", n_ctx=64, progress=False)
    draft = load(str(draft_path), backend="native", n_ctx=64, progress=False)
    yield target, ModelDrafter(draft, target)
    target.close()
    draft.close()


@pytest.mark.slow
def test_sampled_outputs_keep_their_distribution_end_to_end(tiny_pair):
    """A random-weight model drafting for another: q and p differ everywhere, so every path of the rule
    runs. (Prompt lookup's one-hot drafts are exercised by the bigram test: a random model never repeats
    its context, so lookup drafts would all be rejected here.)"""
    target, drafter = tiny_pair
    engine = target.engine
    params = SamplingParams(temperature=1.0, top_k=3, top_p=1.0, repeat_penalty=1.2)
    prompt = [5, 9, 17, 5, 9, 17, 5, 9]

    def step_probs(history, p):
        logits = engine.forward(history, 0, 0)
        return filtered_probs(apply_penalties(logits, history, p), p)

    probs = exact_outputs(step_probs, prompt, 4, params)
    n = 2500
    counts, drafted, accepted = sample_outputs(engine, n, 4, params, lambda: Speculation(drafter, 3), prompt)
    assert 0 < accepted < drafted
    assert chi_square_p(counts, probs, n) > 1e-3


def test_every_output_of_the_enumeration_is_a_probability():
    probs = exact_outputs(lambda h, p: filtered_probs(BigramEngine().table[h[-1]], p), PROMPT, 3, SAMPLED)
    assert sum(probs.values()) == pytest.approx(1.0)
    assert all(len(k) == 3 for k in probs) and len(probs) <= 3 ** 3  # top-k 3 at every step
    assert set(itertools.chain.from_iterable(probs)) <= set(range(V))


# --- the server: per-request options, timings, metrics ----------------------------------------------------
@pytest.fixture(scope="module")
def client(smollm2_path):
    from fastapi.testclient import TestClient

    from kiln.server.app import create_app
    from kiln.server.runtime import Settings
    from kiln.store import Store
    from tests.conftest import TEST_HOME

    settings = Settings(parallel=2, ctx_len=512, draft_model=str(smollm2_path))  # itself, as the draft model
    with TestClient(create_app(settings, store=Store(home=TEST_HOME)), base_url="http://127.0.0.1") as c:
        yield c


def metric(client, name: str) -> float:
    line = next(line for line in client.get("/metrics").text.splitlines() if line.startswith(name + " "))
    return float(line.split()[1])


CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n"


@pytest.mark.slow
def test_the_apis_take_speculative_options_and_report_drafts(client):
    base = {"model": "smollm2:135m", "prompt": CODE, "max_tokens": 24, "temperature": 0}
    plain = client.post("/v1/completions", json={**base, "speculative": {"mode": "none"}}).json()
    assert plain["timings"]["draft_n"] == 0
    before = metric(client, "kiln_draft_tokens_total"), metric(client, "kiln_draft_accepted_tokens_total")
    drafted = accepted = 0
    for spec in ({"mode": "lookup", "max": 4, "ngram": 2}, {"mode": "model"}):
        r = client.post("/v1/completions", json={**base, "speculative": spec}).json()
        assert r["choices"][0]["text"] == plain["choices"][0]["text"]
        t = r["timings"]
        assert t["draft_n"] == t["draft_tokens"] > 0 and t["draft_n_accepted"] == t["draft_accepted"]
        drafted, accepted = drafted + t["draft_n"], accepted + t["draft_n_accepted"]
    assert t["draft_n_accepted"] == t["draft_n"]  # the model drafting for itself
    r = client.post("/api/generate", json={"model": "smollm2:135m", "prompt": CODE, "raw": True, "stream": False,
                                          "options": {"temperature": 0, "num_predict": 24, "draft": "lookup",
                                                      "draft_max": 6}}).json()
    assert r["response"] == plain["choices"][0]["text"]
    drafted, accepted = drafted + r["timings"]["draft_tokens"], accepted + r["timings"]["draft_accepted"]
    assert r["timings"]["draft_tokens"] > 0
    after = metric(client, "kiln_draft_tokens_total"), metric(client, "kiln_draft_accepted_tokens_total")
    assert (after[0] - before[0], after[1] - before[1]) == (drafted, accepted)


@pytest.mark.slow
def test_bad_speculative_options_name_the_field(client):
    base = {"model": "smollm2:135m", "prompt": "hi", "max_tokens": 2}
    r = client.post("/v1/completions", json={**base, "speculative": {"max": 0}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "speculative.max"
    r = client.post("/v1/completions", json={**base, "speculative": {"mode": "medusa"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "speculative.mode"
    r = client.post("/api/generate", json={"model": "smollm2:135m", "prompt": "hi", "stream": False,
                                          "options": {"draft_max": 99}})
    assert r.status_code == 400 and "draft_max" in r.json()["error"]
    from kiln.engine.request import GenerationRequest, prepare
    from kiln.errors import fields_named
    from kiln.server import ollama

    assert client.post("/v1/completions", json=base).status_code == 200  # loads the model
    model = client.app.state.runtime.loaded.model  # as on a server started without --draft-model:
    with pytest.raises(RequestError, match="needs a draft model") as e, fields_named(ollama.FIELDS):
        prepare(model, GenerationRequest(prompt="hi", speculative={"mode": "model"}))
    assert e.value.param == "options.draft"


@pytest.mark.slow
def test_kiln_run_speculates_with_the_same_answer(smollm2_path, capsys):
    from kiln.cli import main

    def run(*flags):
        assert main(["run", str(smollm2_path), CODE, "--raw", "--temperature", "0", "-n", "24", "-c", "256",
                     "--verbose", *flags]) == 0
        return capsys.readouterr()

    plain = run()
    assert "draft:" not in plain.err
    for flags in (("--draft", "lookup", "--draft-max", "4"), ("--draft-model", str(smollm2_path))):
        out = run(*flags)
        assert out.out == plain.out
        assert re.search(r"draft: +\d+ of \d+ tokens accepted \(\d+\.\d%\), \d+\.\d\d tokens per pass", out.err)


@pytest.mark.slow
def test_bench_spec_measures_both_interleaved_and_records_the_table(smollm2_path, tmp_path, monkeypatch):
    import json

    from kiln import history
    from kiln.cli import main

    monkeypatch.setenv("KILN_HOME", str(tmp_path))
    out = tmp_path / "spec.json"
    assert main(["bench", "spec", str(smollm2_path), "--datasets", "code-edit,chat", "--prompts", "1", "-n", "12",
                 "-r", "2", "--format", "json", "-o", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = {r["dataset"]: r for r in report["rows"]}
    assert list(rows) == ["code-edit", "chat", "all"]
    for r in rows.values():
        assert r["outputs_differ"] == 0
        assert r["speedup"] == pytest.approx(statistics.median(s / t for s, t in zip(r["spec_tps_runs"],
                                                                                      r["target_tps_runs"])))
        assert r["target_tps"] == statistics.median(r["target_tps_runs"])
        assert 1.0 <= r["tokens_per_pass"] <= 1 + report["draft"]["max"]
    code = report["runs"]["code-edit"][0]["spec"][0]
    assert rows["code-edit"]["acceptance"] == pytest.approx(code["accepted"] / code["drafted"])  # 1 prompt, greedy
    assert [r["payload"]["rows"] for r in history.query(kind="spec")] == [report["rows"]]
