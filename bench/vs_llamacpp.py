"""kiln against llama.cpp on one model, interleaved so both see the same machine load.

    python bench/vs_llamacpp.py MODEL.gguf --llama-python /path/to/venv/bin/python -t 2 --rounds 5
    python bench/vs_llamacpp.py MODEL.gguf --llama-python ... -p 0 -n 32 --rounds 3    (decode only)

Each round runs llama.cpp (bench/llamacpp_bench.py, in the Python that has llama-cpp-python) and then
kiln (the engine in this process, loaded once), each measuring pp and tg like llama-bench: random
tokens, no tokenization, no sampling. It prints every round's figures, the median of each, and the
ratio of the medians — the figure to quote on a shared, noisy machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def llamacpp_round(python: str, model: str, threads: int, n_prompt: int, n_gen: int) -> dict[str, float]:
    out = subprocess.run([python, str(HERE / "llamacpp_bench.py"), model, "-p", str(n_prompt), "-n", str(n_gen),
                          "-t", str(threads), "-r", "1", "--json"], capture_output=True, text=True, check=True)
    return {r["test"].split()[0][:2]: r["avg_ts"] for r in json.loads(out.stdout)["results"]}


def kiln_round(engine, vocab: int, n_prompt: int, n_gen: int, rng) -> dict[str, float]:
    from kiln.bench.perf import bench_engine

    results = bench_engine(engine, vocab, n_prompt, n_gen, 0, 1, 1, rng)
    return {r.test[:2]: r.samples_ts[0] for r in results}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--llama-python", required=True, help="a Python with llama-cpp-python installed")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", help="write the rounds and medians here")
    a = ap.parse_args()

    from kiln.engine.model import load
    from kiln.machine import facts

    model = load(a.model, backend="native", n_ctx=max(a.p, a.n) + 1, threads=a.threads, progress=False)
    rng = np.random.default_rng(0)
    rounds = []
    kiln_round(model.engine, model.config.vocab_size, min(a.p, 64), 8, rng)  # warm-up
    for i in range(a.rounds):
        row = {"llama.cpp": llamacpp_round(a.llama_python, a.model, a.threads, a.p, a.n),
               "kiln": kiln_round(model.engine, model.config.vocab_size, a.p, a.n, rng)}
        rounds.append(row)
        print(f"round {i + 1}: " + "  ".join(f"{who} " + " ".join(f"{k}{v:.1f}" for k, v in r.items())
                                             for who, r in row.items()), file=sys.stderr)
    summary = {}
    for test in ("pp", "tg"):
        if test not in rounds[0]["kiln"]:  # -p 0 or -n 0 leaves that test out
            continue
        k = statistics.median(r["kiln"][test] for r in rounds)
        ll = statistics.median(r["llama.cpp"][test] for r in rounds)
        per_round = statistics.median(r["kiln"][test] / r["llama.cpp"][test] for r in rounds)
        summary[test] = {"kiln_median_ts": k, "llamacpp_median_ts": ll, "ratio_of_medians": k / ll,
                         "median_of_round_ratios": per_round}
        label = f"{test}{a.p if test == 'pp' else a.n}"
        print(f"{label}: kiln {k:.1f} t/s, llama.cpp {ll:.1f} t/s, ratio {k / ll:.2f} "
              f"(median of per-round ratios {per_round:.2f})")
    if a.json:
        Path(a.json).write_text(json.dumps({"model": a.model, "threads": a.threads, "rounds": rounds,
                                            "summary": summary, "machine": facts()}, indent=1))


if __name__ == "__main__":
    main()
