"""Hostile GGUF files: every mutated header is refused with a one-line KilnError or loads and runs on the
native engine; none kills the process, hangs, or ends in a traceback.

The cases run in worker processes (tests/fuzz.py), so a signal or an AddressSanitizer report fails the test
with the input kept. KILN_FUZZ_CASES sets how many (CI's AddressSanitizer step runs thousands against
the extension built with -fsanitize=address, named by KILN_FUZZ_NATIVE); KILN_FUZZ_KEEP, where failing
inputs are written (default: the test's temporary directory). Every input that ever failed is in
tests/fuzz_corpus.json, replayed by test_every_recorded_input.
"""

from __future__ import annotations

import collections
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests import fuzz

N_CASES = int(os.environ.get("KILN_FUZZ_CASES", "200"))
BASE_SEED = int(os.environ.get("KILN_FUZZ_SEED", "0"))
WORKERS = 2  # the machine's cores
CORPUS = Path(__file__).parent / "fuzz_corpus.json"

pytestmark = pytest.mark.skipif(not __import__("kiln.engine.native", fromlist=["x"]).available(),
                                reason="the native core is not built")


@pytest.fixture(scope="module")
def seeds(tmp_path_factory) -> dict[str, fuzz.Header]:
    root = tmp_path_factory.mktemp("seeds")
    headers = {}
    for name in fuzz.SEEDS:
        raw = fuzz.write_seed(name, root / f"{name}.gguf").read_bytes()
        headers[name] = fuzz.parse(raw)
        assert fuzz.serialize(headers[name]) == raw, f"the fuzzer's writer does not round-trip the {name} seed"
    return headers


def run(seeds, cases: list[tuple[str, list[dict]]], root: Path) -> list[fuzz.Outcome]:
    """Write the cases' files and run them on WORKERS workers; outcomes in case order."""
    paths = []
    for i, (seed, ops) in enumerate(cases):
        path = root / f"case-{i}.gguf"
        path.write_bytes(fuzz.serialize(fuzz.apply(seeds[seed], ops)))
        paths.append(path)
    env = fuzz.worker_env(os.environ.get("KILN_FUZZ_NATIVE"))
    shares = [list(range(w, len(paths), WORKERS)) for w in range(WORKERS)]
    with ThreadPoolExecutor(WORKERS) as pool:
        results = list(pool.map(lambda share: fuzz.run_cases([paths[i] for i in share], env), shares))
    outcomes = [None] * len(paths)
    for share, result in zip(shares, results):
        for outcome in result:
            outcome.case = share[outcome.case]
            outcomes[outcome.case] = outcome
    return outcomes


def failures(cases, outcomes, keep: Path) -> str:
    """A report of every case that crashed, hung or raised a traceback; their files and ops kept in `keep`."""
    keep.mkdir(parents=True, exist_ok=True)
    lines = []
    for o in outcomes:
        if o.status in ("refused", "loaded"):
            continue
        seed, ops = cases[o.case]
        (keep / f"case-{o.case}.json").write_text(json.dumps({"seed": seed, "ops": ops}))
        lines.append(f"case {o.case} ({o.status}), kept in {keep}/case-{o.case}.json: {json.dumps(ops)}\n{o.detail}")
    return "\n".join(lines)


def test_mutated_files_are_refused_or_run(seeds, tmp_path):
    cases = fuzz.generate(seeds, N_CASES, BASE_SEED)
    outcomes = run(seeds, cases, tmp_path)
    keep = Path(os.environ.get("KILN_FUZZ_KEEP", tmp_path / "failed"))
    report = failures(cases, outcomes, keep)
    counts = collections.Counter(o.status for o in outcomes)
    print(f"{len(cases)} mutated files: {dict(counts)}; native core {outcomes[0].native}")
    assert not report, report
    # both paths are exercised: files refused, and files that still load and run
    assert counts["refused"] > len(cases) // 2 and counts["loaded"] > len(cases) // 50, counts
    expected_native = os.environ.get("KILN_FUZZ_NATIVE")
    if expected_native:
        assert all(o.native == expected_native for o in outcomes if o.native), "the workers ran another build"


def test_every_recorded_input(seeds, tmp_path):
    """Every input the fuzzer (or a person) found breaking kiln, with what it must now be answered with."""
    corpus = json.loads(CORPUS.read_text())
    cases = [(entry["seed"], entry["ops"]) for entry in corpus]
    outcomes = run(seeds, cases, tmp_path)
    problems = []
    for entry, o in zip(corpus, outcomes):
        if o.status != entry["expect"] or entry.get("match", "") not in o.detail:
            problems.append(f"{entry['why']}: expected {entry['expect']} ({entry.get('match', '')!r}), got "
                            f"{o.status}: {o.detail}")
    assert not problems, "\n".join(problems)
