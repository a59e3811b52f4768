"""`kiln eval`: the statistics against their definitions, the reference file, the sandbox, the data
fetchers, and the checks themselves on SmolLM2 — including that they fail when a layer is broken."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest
from conftest import TEST_HOME

from kiln import cli
from kiln.errors import KilnError
from kiln.eval import humaneval, kld, verify
from kiln.eval.data import CORPORA, load_text

SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

# ---- statistics -----------------------------------------------------------------------------------


def random_values(n=2000, seed=0) -> kld.TokenValues:
    rng = np.random.default_rng(seed)
    nll_base = rng.gamma(2.0, 1.5, n)
    nll = nll_base + rng.normal(0.01, 0.05, n)
    return kld.TokenValues(nll, nll_base, rng.gamma(0.5, 0.01, n), np.exp(-nll) - np.exp(-nll_base),
                           rng.random(n) < 0.97)


def test_stats_follow_llama_perplexity_definitions():
    v = random_values()
    s = kld.kld_stats(v)
    n = len(v.nll)
    sem = lambda x: np.std(x) / np.sqrt(n - 1)  # noqa: E731 — population std over n-1: llama's estimator
    assert s["tokens"] == n
    assert s["ppl_q"] == pytest.approx(np.exp(v.nll.mean()), rel=1e-12)
    assert s["ppl_q_unc"] == pytest.approx(np.exp(v.nll.mean()) * sem(v.nll), rel=1e-9)
    assert s["ppl_base"] == pytest.approx(np.exp(v.nll_base.mean()), rel=1e-12)
    # covariance of the means over the product of their uncertainties is Pearson's r
    assert s["cor_ln_ppl"] == pytest.approx(np.corrcoef(v.nll, v.nll_base)[0, 1], rel=1e-9)
    assert s["ln_ppl_ratio_unc"] == pytest.approx(sem(v.nll - v.nll_base), rel=1e-6)
    assert s["ppl_ratio"] == pytest.approx(np.exp(v.nll.mean() - v.nll_base.mean()), rel=1e-12)
    assert s["kld_mean"] == pytest.approx(v.kld.mean()) and s["kld_unc"] == pytest.approx(sem(v.kld), rel=1e-9)
    assert s["kld_median"] == pytest.approx(np.median(v.kld)) and s["kld_max"] == v.kld.max()
    assert s["kld_p99"] == pytest.approx(np.sort(v.kld)[int(0.99 * (n - 1))], rel=0.05)
    assert s["dp_p25"] <= s["dp_median"] <= s["dp_p75"]
    assert s["rms_dp"] == pytest.approx(np.sqrt(np.mean(v.dp**2)), rel=1e-12)
    same = v.same_top.mean()
    assert s["same_top"] == same and s["same_top_unc"] == pytest.approx(np.sqrt(same * (1 - same) / (n - 1)))


def test_uncertainty_needs_more_than_ten_values():
    assert kld.mean_unc(np.arange(10.0)) == (4.5, 0.0)
    assert kld.mean_unc(np.arange(11.0))[1] > 0


def softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def test_exact_comparison():
    rng = np.random.default_rng(1)
    ref = rng.normal(0, 3, (40, 300)).astype(np.float32)
    targets = rng.integers(0, 300, 40)
    same = kld.compare_exact(ref, ref, targets)
    assert np.abs(same.kld).max() < 1e-12 and np.abs(same.dp).max() < 1e-12 and same.same_top.all()
    cand = ref + rng.normal(0, 0.3, ref.shape).astype(np.float32)
    v = kld.compare_exact(cand, ref, targets)
    p, q = softmax(ref.astype(np.float64)), softmax(cand.astype(np.float64))
    rows = np.arange(40)
    np.testing.assert_allclose(v.kld, (p * np.log(p / q)).sum(axis=1), rtol=1e-9)
    np.testing.assert_allclose(v.nll, -np.log(q[rows, targets]), rtol=1e-9)
    np.testing.assert_allclose(v.dp, q[rows, targets] - p[rows, targets], atol=1e-12)
    np.testing.assert_array_equal(v.same_top, q.argmax(1) == p.argmax(1))
    assert v.kld.min() > 0 and not v.same_top.all()


def test_top_k_summary_is_a_lower_bound_and_exact_when_it_holds_everything():
    rng = np.random.default_rng(2)
    ref = rng.normal(0, 3, (50, 300)).astype(np.float32)
    cand = ref + rng.normal(0, 0.3, ref.shape).astype(np.float32)
    targets = rng.integers(0, 300, 50)
    exact = kld.compare_exact(cand, ref, targets)
    whole = kld.compare_summary(cand, kld.summarize(ref, targets, k=300), targets)
    np.testing.assert_allclose(whole.kld, exact.kld, rtol=1e-5, atol=1e-9)
    part = kld.compare_summary(cand, kld.summarize(ref, targets, k=20), targets)
    assert (part.kld <= exact.kld + 1e-9).all() and part.kld.mean() > 0.5 * exact.kld.mean()
    for field in ("nll", "nll_base", "dp", "same_top"):  # these do not depend on k
        np.testing.assert_allclose(getattr(part, field), getattr(exact, field), rtol=1e-6, atol=1e-9)


def test_reference_file_round_trip(tmp_path):
    rng = np.random.default_rng(3)
    windows = rng.integers(0, 300, (2, 16)).astype(np.int32)
    path = tmp_path / "ref.npz"
    writer = kld.ReferenceWriter(path, {"n_vocab": 300}, windows, top_k=8)
    summaries = [kld.summarize(rng.normal(0, 2, (7, 300)), windows[i, 9:].astype(np.int64), 8) for i in range(2)]
    for i, s in enumerate(summaries):
        writer.add(i, s)
    assert not path.exists()  # visible only once complete
    writer.close(complete=True)
    ref = kld.ReferenceFile(path)
    assert ref.meta["top_k"] == 8 and ref.meta["n_vocab"] == 300
    np.testing.assert_array_equal(ref.windows, windows)
    for i, s in enumerate(summaries):
        got = ref.summary(i)
        for key in ("ids", "logp", "target_logp", "tail_logp"):
            np.testing.assert_array_equal(getattr(got, key), getattr(s, key))
    with pytest.raises(KilnError, match="window 2 is missing"):
        ref.summary(2)

    broken = kld.ReferenceWriter(tmp_path / "broken.npz", {}, windows)
    broken.close(complete=False)
    assert list(tmp_path.iterdir()) == [path]  # an interrupted run leaves nothing behind
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(KilnError, match="junk.npz: not a kiln eval reference file"):
        kld.ReferenceFile(tmp_path / "junk.npz")


def test_windows_put_bos_first_and_check_the_text_is_long_enough():
    w = kld.make_windows(list(range(10, 60)), 16, 0, bos_id=1)
    assert w.shape == (3, 16) and (w[:, 0] == 1).all() and w[1, 1] == 27
    assert kld.make_windows(list(range(10, 60)), 16, 2, bos_id=None)[1, 0] == 26
    with pytest.raises(KilnError, match="--chunks 4 needs 64 tokens; the text has 50"):
        kld.make_windows(list(range(50)), 16, 4, None)
    with pytest.raises(KilnError, match="less than one window"):
        kld.make_windows(list(range(10)), 16, 1, None)


def test_unknown_text_names_the_corpora(tmp_path):
    with pytest.raises(KilnError, match="not a known corpus \\(moby-dick\\)"):
        load_text(str(tmp_path / "missing.txt"), home=tmp_path)


# ---- sandbox --------------------------------------------------------------------------------------


def test_sandbox_kills_an_infinite_loop():
    t0 = time.perf_counter()
    out = humaneval.run_sandboxed("while True:\n    pass\n", timeout=1.0)
    assert out.status == "timed out" and not out.passed
    assert time.perf_counter() - t0 < 5


def test_sandbox_reports_pass_fail_and_enforces_memory():
    assert humaneval.run_sandboxed("assert 1 + 1 == 2\n").passed
    failed = humaneval.run_sandboxed("def f():\n    return 3\nassert f() == 4, 'wrong answer'\n")
    assert failed.status == "failed" and "AssertionError: wrong answer" in failed.detail
    hog = humaneval.run_sandboxed("x = bytearray(2 << 30)\n", memory_bytes=256 << 20)
    assert hog.status == "failed" and "MemoryError" in hog.detail


def test_sandbox_kills_what_the_program_started():
    program = ("import os, time\npid = os.fork()\nif pid == 0:\n    time.sleep(60)\n    os._exit(0)\n"
               "raise SystemExit(f'child {pid}')\n")
    out = humaneval.run_sandboxed(program, timeout=5.0)
    child = int(out.detail.split()[-1])
    deadline = time.time() + 5
    while alive(child):
        if time.time() > deadline:
            os.kill(child, 9)
            pytest.fail(f"the sandboxed program's child {child} outlived it")
        time.sleep(0.05)


def alive(pid: int) -> bool:
    """Running, not merely a zombie waiting for whichever process adopted it to reap it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_stop_sequences_end_the_function():
    assert humaneval.cut_at_stop("    return x\n\n\ndef main():\n") == "    return x\n\n"
    assert humaneval.cut_at_stop("    return x\n# done") == "    return x"
    assert humaneval.cut_at_stop("    # a comment inside\n    return x") is None


# ---- data from the registries ---------------------------------------------------------------------


@pytest.mark.slow
def test_moby_dick_is_fetched_verified_and_cached(tmp_path):
    text = load_text("moby-dick", home=tmp_path)
    assert text.text.startswith("CHAPTER 1. Loomings.\n\nCall me Ishmael.")
    assert text.sha256 == CORPORA["moby-dick"].sha256
    cached = tmp_path / "eval" / CORPORA["moby-dick"].filename
    cached.write_text("tampered")
    assert load_text("moby-dick", home=tmp_path).sha256 == CORPORA["moby-dick"].sha256  # fetched again


@pytest.mark.slow
def test_humaneval_data_and_canonical_solutions_pass(tmp_path):
    from kiln.eval.data import humaneval_problems

    problems = humaneval_problems(home=tmp_path)
    assert len(problems) == 164 and problems[0]["task_id"] == "HumanEval/0"
    for p in problems[:3]:
        assert humaneval.run_sandboxed(humaneval.check_program(p, p["canonical_solution"])).passed, p["task_id"]
        assert not humaneval.run_sandboxed(humaneval.check_program(p, "    return None\n")).passed, p["task_id"]


# ---- the checks on a real model -------------------------------------------------------------------


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """SmolLM2 on the native engine, and the fp32 oracle on the same file (n_ctx 512)."""
    from kiln.engine.model import load
    from kiln.eval.cli import _oracle
    from kiln.store import Store

    model = load("smollm2:135m", backend="native", n_ctx=512, store=Store(home=TEST_HOME), progress=False)
    yield model, _oracle(model)
    model.close()


@pytest.fixture
def broken(smollm2):
    """Layer `n`'s attention output negated on the native engine, undone afterwards."""
    model, _ = smollm2
    yield model.engine.set_debug_negate
    model.engine.set_debug_negate(None)


@pytest.fixture(scope="session")
def moby_dick():
    return load_text("moby-dick", home=TEST_HOME).text


@pytest.mark.slow
def test_ppl_agrees_with_transformers(smollm2, smollm2_path, moby_dick):
    """The default windowing (512 tokens, second half scored) on a few windows: the native engine within
    1% of transformers' fp32 perplexity, and the oracle, which shares kiln's harness, within 1e-5."""
    from tests.reference import hf_logits

    def hf_nll(windows):
        first = windows.shape[1] // 2
        return np.concatenate([kld.token_nll(hf_logits(smollm2_path, [int(t) for t in w[:-1]])[first:],
                                             w[first + 1 :].astype(np.int64)) for w in windows])

    model, oracle = smollm2
    windows = kld.text_windows(model, moby_dick, 512, 3)
    stats, _ = kld.perplexity(kld.EngineScorer(model.engine, "native"), windows)
    reference = hf_nll(windows)
    assert stats["tokens"] == len(reference) == 3 * 255
    assert stats["ppl"] == pytest.approx(np.exp(reference.mean()), rel=0.01)
    assert 0 < stats["ppl_unc"] < stats["ppl"]
    short = kld.text_windows(model, moby_dick, 128, 1)
    exact, _ = kld.perplexity(kld.EngineScorer(oracle, "oracle"), short)
    assert exact["ppl"] == pytest.approx(np.exp(hf_nll(short).mean()), rel=1e-5)


class Cached:
    """A reference scorer that computes each window once (the oracle is the slow part)."""

    def __init__(self, scorer):
        self.scorer, self.memo = scorer, {}

    def logits(self, window, first):
        key = window.tobytes()
        if key not in self.memo:
            self.memo[key] = self.scorer.logits(window, first)
        return self.memo[key]


@pytest.mark.slow
def test_kld_is_small_for_native_and_explodes_when_a_layer_breaks(smollm2, broken, moby_dick):
    model, oracle = smollm2
    windows = kld.text_windows(model, moby_dick, 128, 2)
    reference = Cached(kld.EngineScorer(oracle, "oracle"))
    healthy, _ = kld.KLDRun(windows, kld.EngineScorer(model.engine, "native"), reference).run()
    assert healthy["tokens"] == 2 * 63
    assert healthy["kld_mean"] < 0.01 and healthy["same_top"] > 0.9
    assert abs(healthy["ln_ppl_ratio"]) < 0.05
    broken(15)  # a middle layer: the greedy gate can miss it (see the report), KLD does not
    bad, _ = kld.KLDRun(windows, kld.EngineScorer(model.engine, "native"), reference).run()
    assert bad["kld_mean"] > 30 * healthy["kld_mean"] and bad["same_top"] < 0.85


@pytest.mark.slow
def test_verify_passes_the_native_engine(smollm2):
    model, oracle = smollm2
    result = verify.run(model, model.engine, oracle, verify.PROMPTS[:2], 16)  # `kiln eval verify` runs 32
    assert result["passed"], result["prompts"]


@pytest.mark.slow
def test_cli_gate_fails_a_broken_layer_exits_1_and_records_history(smollm2_path, tmp_path, monkeypatch, capsys):
    from kiln import history

    monkeypatch.setenv("KILN_HOME", str(tmp_path))
    code = cli.main(["eval", "verify", str(smollm2_path), "--ctx", "128", "--steps", "4", "--diagnose",
                     "--debug-negate-layer", "0", "--json"])
    assert code == 1
    out = json.loads(capsys.readouterr().out)
    assert out["passed"] is False and out["debug_negate_layer"] == 0
    assert all(r["first_difference"] == 0 and not r["passed"] for r in out["prompts"])
    rows = out["diagnose"]
    assert len(rows) == 60 and rows[0]["residual"] == "blk.0 attn"
    assert rows[0]["cos_mean"] < 0.9  # the broken layer is the first to drop
    saved = history.query(kind="eval-verify", path=tmp_path / "history.sqlite")
    assert len(saved) == 1 and saved[0]["model_sha256"] == SMOLLM2_SHA256
    assert "--debug-negate-layer 0" in saved[0]["command"] and saved[0]["payload"]["passed"] is False


@pytest.mark.slow
def test_cli_kld_saves_and_reuses_a_reference(smollm2_path, moby_dick, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KILN_HOME", str(tmp_path))
    text = tmp_path / "excerpt.txt"
    text.write_text(moby_dick[:20000])
    ref = tmp_path / "ref.npz"
    base = ["eval", "kld", str(smollm2_path), "--json"]
    assert cli.main(base + ["--text", str(text), "--ctx", "64", "--chunks", "2", "--save-reference", str(ref)]) == 0
    live = json.loads(capsys.readouterr().out)
    assert cli.main(base + ["--reference-file", str(ref)]) == 0
    saved = json.loads(capsys.readouterr().out)
    assert live["kld_method"] == "exact" and saved["kld_method"].startswith("top-4096")
    assert saved["tokens"] == live["tokens"] == 2 * 31 and saved["windows"] == 2
    for key in ("ppl_base", "ppl_q", "same_top", "rms_dp"):
        assert saved[key] == pytest.approx(live[key], rel=1e-5), key
    assert 0.8 * live["kld_mean"] < saved["kld_mean"] <= live["kld_mean"] * (1 + 1e-6)
    with pytest.raises(SystemExit):
        cli.main(["eval", "kld", str(smollm2_path), "--chunks", "x"])


@pytest.mark.slow
def test_humaneval_end_to_end(smollm2):
    from kiln.eval.data import humaneval_problems

    model, _ = smollm2
    problems = humaneval_problems(home=TEST_HOME)[:2]
    result = humaneval.run(model, problems, max_tokens=48, timeout=5.0, memory_bytes=1 << 30)
    assert result["problems"] == 2 and 0 <= result["passed"] <= 2
    for r in result["results"]:
        assert r["result"] in ("passed", "failed", "timed out") and 0 <= r["tokens"] <= 48
        assert humaneval.cut_at_stop(r["completion"]) is None  # cut at the first stop sequence
