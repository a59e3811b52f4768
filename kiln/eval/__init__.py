"""Accuracy you can check: `kiln eval kld|ppl|verify|humaneval`.

- `kld`: the candidate engine's next-token distributions against a reference's, with llama-perplexity's
  `--kl-divergence` statistics (kiln.eval.kld).
- `ppl`: perplexity with llama-perplexity's windowing (kiln.eval.kld).
- `verify`: the greedy-decoding gate between candidate and reference (kiln.eval.verify).
- `humaneval`: HumanEval pass@1, the generated code run in a sandboxed subprocess (kiln.eval.humaneval).

Corpora and data sets come from package registries, verified by sha256 and cached (kiln.eval.data).
"""
