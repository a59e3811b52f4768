"""`kiln run`'s single-stream decode speed, one source tree against another, interleaved so both see the
same machine load.

    python bench/ab_run.py --old /tmp/kiln-main --new . --pairs 20 [--model smollm2:135m]

Each pair runs `kiln run MODEL PROMPT --temperature 0 -n 128 --verbose` once from each tree (in
alternating order), in a fresh process with that tree first on PYTHONPATH, and reads the decode tok/s it
prints. It prints every run, the median of each tree and the median of the pairs' ratios.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys

PROMPT = "Write a short story about a lighthouse keeper."


def decode_tps(tree: str, model: str, tokens: int) -> float:
    command = [sys.executable, "-m", "kiln", "run", model, PROMPT, "--temperature", "0", "-n", str(tokens),
               "-c", "512", "--verbose"]
    # cwd "/": `python -m` puts the working directory first on sys.path, which must not hold a kiln
    done = subprocess.run(command, env={**os.environ, "PYTHONPATH": os.path.abspath(tree)}, capture_output=True,
                          text=True, cwd="/")
    found = re.search(r"decode:\s+([\d.]+) tok/s", done.stderr)
    if done.returncode != 0 or not found:
        sys.exit(f"{tree}: kiln run failed: {done.stderr.strip()[-500:]}")
    return float(found.group(1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--old", required=True, help="the source tree to compare against (a checkout's root)")
    p.add_argument("--new", required=True, help="the source tree under test")
    p.add_argument("--model", default="smollm2:135m")
    p.add_argument("--pairs", type=int, default=10)
    p.add_argument("-n", "--tokens", type=int, default=128)
    args = p.parse_args()
    runs: dict[str, list[float]] = {"old": [], "new": []}
    for i in range(args.pairs):
        for which in ("old", "new") if i % 2 == 0 else ("new", "old"):
            runs[which].append(decode_tps(getattr(args, which), args.model, args.tokens))
            print(f"{which} {runs[which][-1]:.1f} tok/s", flush=True)
    old, new = statistics.median(runs["old"]), statistics.median(runs["new"])
    pairs = statistics.median(n / o for o, n in zip(runs["old"], runs["new"]))
    print(f"medians: old {old:.2f}, new {new:.2f} tok/s; new/old {new / old:.3f}; median of pair ratios {pairs:.3f}")


if __name__ == "__main__":
    main()
