"""`kiln bench sweep TAG`: FastFlowLM's `flm bench` on kiln's engine, in-process.

Context stages (default 1k … 32k, capped by the model's context and `--max-ctx`) run largest first.
A stage of N tokens is a prompt of N − 32 tokens, cut from a story repeated to length, followed by 32
greedily generated tokens (end-of-sequence ignored), so each run ends with exactly N tokens in the
context. Every run starts from an empty KV cache; flm's 1 s pause separates runs. Per run: TTFT,
prefill tok/s, decode tok/s from the engine's own timings; per stage: mean ± sd, min, max. Output: a
table, flm's CSV columns, and JSON; the JSON is also appended to the bench history.
"""

from __future__ import annotations

import csv
import io
import sys
import time

from kiln.bench.common import command_line, dump_json, model_context, provenance, summary, write_output
from kiln.errors import KilnError

DEFAULT_STAGES = "1k,2k,4k,8k,16k,32k"
GENERATED_TOKENS = 32

# The text repeated to each stage's length; any prose works, this one is kiln's own.
STORY = (
    "The potter of the valley kept a kiln at the edge of the orchard. Every autumn she fired the year's "
    "work in one long night, feeding the fire with apple wood and listening to the clay. Children from the "
    "village came to watch the sparks rise into the dark, and the old men argued about the weather, the "
    "price of salt and whether the river would freeze before the solstice. Near dawn the potter opened the "
    "spy hole, read the colour of the flame and let the fire die. Two days later, when the bricks were cool "
    "enough to touch, she unloaded bowls, jugs and a single blue vase that nobody had asked for. She set it "
    "on the windowsill, where it caught the morning light, and began to plan the next year's firing."
)

FIGURES = {
    "ttft_ms": "measured in-process: engine time from the start of the request to the first sampled token "
               "(prefill of the whole prompt from an empty KV cache, plus sampling); tokenization excluded",
    "prefill_tps": "derived: prompt tokens / prefill time (the engine's forward pass over the prompt)",
    "decode_tps": "measured in-process: (generated tokens − 1) / time from the first to the last sampled token",
    "stage statistics": "derived: mean, sample sd, min, max over the stage's iterations",
}


def parse_size(text: str) -> int:
    """'4k' → 4096, '512' → 512."""
    t = text.strip().lower()
    try:
        value = int(t[:-1]) * 1024 if t.endswith("k") else int(t)
    except ValueError:
        raise KilnError(f"bad context size {text!r}: expected a token count such as 512 or 4k") from None
    if value < 1:
        raise KilnError(f"bad context size {text!r}: must be at least 1 token")
    return value


def add_arguments(p) -> None:
    p.description = __doc__.split("\n\n")[0]
    p.add_argument("model", help="tag or .gguf path")
    p.add_argument("--stages", default=DEFAULT_STAGES,
                   help=f"context sizes in tokens, comma-separated, 'k' = 1024 (default {DEFAULT_STAGES})")
    p.add_argument("--max-ctx", type=parse_size, help="drop stages above this many tokens (e.g. 8k)")
    p.add_argument("--iterations", "-r", type=int, default=3,
                   help="runs per stage (default 3; flm runs 8)")
    p.add_argument("--gen-tokens", type=int, default=GENERATED_TOKENS,
                   help=f"tokens generated per run (default {GENERATED_TOKENS}, as flm)")
    p.add_argument("--sleep", type=float, default=1.0, help="seconds between runs (default 1, as flm)")
    p.add_argument("-t", "--threads", type=int, help="native threads (default: physical cores)")
    p.add_argument("--format", choices=["md", "csv", "json"], default="md", help="what goes to -o (default md)")
    p.add_argument("-o", "--output", help="write the --format output here instead of stdout")
    p.add_argument("--csv", help="also write flm's CSV to this file")
    p.add_argument("--json", help="also write the JSON to this file")


def plan_stages(requested: list[int], model_ctx: int, max_ctx: int | None, gen: int) -> tuple[list[int], list[dict]]:
    """The stages to run, largest first, and the ones dropped with the reason."""
    keep, skipped = [], []
    for n in sorted(set(requested), reverse=True):
        if n > model_ctx:
            skipped.append({"context_length": n, "reason": f"beyond the model's context of {model_ctx} tokens"})
        elif max_ctx is not None and n > max_ctx:
            skipped.append({"context_length": n, "reason": f"beyond --max-ctx {max_ctx}"})
        elif n <= gen:
            skipped.append({"context_length": n, "reason": f"no room for a prompt before {gen} generated tokens"})
        else:
            keep.append(n)
    return keep, skipped


def story_prompt(tokenizer, n_tokens: int) -> list[int]:
    """Exactly `n_tokens` ids: the story (with BOS where the model wants one), then the story again
    and again, cut at the length."""
    first = tokenizer.encode(STORY + "\n\n")
    again = tokenizer.encode(STORY + "\n\n", add_bos=False)
    repeats = max(0, -(-(n_tokens - len(first)) // len(again)))
    return (first + again * repeats)[:n_tokens]


def run_once(model, prompt: list[int], gen: int) -> dict:
    from dataclasses import asdict

    from kiln.engine.generate import generate
    from kiln.engine.request import GenerationRequest, prepare
    from kiln.engine.scheduler import Scheduler
    from kiln.sampling import SamplingParams

    # Greedy, no stops: every run generates exactly `gen` tokens, as flm's fixed 32. A scheduler of its
    # own, whose empty prompt cache makes every run prefill the whole prompt.
    seq, _ = prepare(model, GenerationRequest(prompt=prompt, sampling=asdict(SamplingParams.greedy()), max_tokens=gen,
                                              ignore_eos=True))
    for _ in generate(Scheduler(model.engine, n_slots=1, max_queue=0), seq):
        pass
    t = seq.timings
    if t.completion_tokens != gen:
        raise KilnError(f"the engine stopped after {t.completion_tokens} of {gen} tokens ({seq.finish_reason})")
    return {"prompt_tokens": t.prompt_tokens, "generated_tokens": t.completion_tokens, "ttft_ms": t.ttft_ms,
            "prefill_ms": t.prefill_ms, "prefill_tps": t.prefill_tps, "decode_ms": t.decode_ms,
            "decode_tps": t.decode_tps}


def run(model_ref: str, stages: list[int], iterations: int, gen: int = GENERATED_TOKENS, max_ctx: int | None = None,
        threads: int | None = None, sleep: float = 1.0, command: str = "kiln bench sweep", progress=None) -> dict:
    from kiln.engine.model import load
    from kiln.machine import facts
    from kiln.store.fetch import sha256_file

    if iterations < 1 or gen < 2:
        raise KilnError("kiln bench sweep: --iterations must be at least 1 and --gen-tokens at least 2 "
                        "(decode speed needs a second token)")
    model_ctx = model_context(model_ref, progress=progress is not None)
    keep, skipped = plan_stages(stages, model_ctx, max_ctx, gen)
    for s in skipped:
        _say(progress, f"skipping stage {s['context_length']}: {s['reason']}")
    if not keep:
        raise KilnError(f"kiln bench sweep: no stage of {','.join(map(str, stages))} fits "
                        f"(model context {model_ctx}" + (f", --max-ctx {max_ctx}" if max_ctx else "") + ")")
    model = load(model_ref, backend="native", n_ctx=keep[0], threads=threads, progress=False)
    try:
        results = []
        for n in keep:
            prompt = story_prompt(model.tokenizer, n - gen)
            runs = []
            for i in range(iterations):
                if runs and sleep > 0:
                    time.sleep(sleep)
                r = run_once(model, prompt, gen)
                runs.append(r)
                _say(progress, f"stage {_k(n)} run {i + 1}/{iterations}: TTFT {r['ttft_ms'] / 1e3:.3f} s, "
                               f"prefill {r['prefill_tps']:.1f} tok/s, decode {r['decode_tps']:.1f} tok/s")
            results.append({"context_length": n, "context_length_k": n / 1024, "prompt_tokens": len(prompt),
                            "generated_tokens": gen, "runs": runs,
                            **{key: summary([r[key] for r in runs]) for key in ("ttft_ms", "prefill_tps", "decode_tps")}})
        sha = model.sha256 or sha256_file(model.path)
        about = {"model": model.tag, "model_sha256": sha, "architecture": model.config.architecture,
                 "n_ctx": model.n_ctx, "threads": model.engine.threads}
    finally:
        model.close()
    target = {"kind": "in-process", "backend": "native", **about}
    return {"tool": "kiln bench sweep", **about, "backend": "native", "generated_tokens": gen,
            "iterations": iterations, "sleep_s": sleep,
            "method": f"flm bench: stages largest first, prompt = stage − {gen} tokens of a repeated story, {gen} "
                      f"greedy tokens, empty KV cache per run, {sleep:g} s between runs",
            "stages": results, "skipped_stages": skipped, "machine": facts(),
            "provenance": provenance("kiln bench sweep", command, FIGURES, target)}


def _say(progress, message: str) -> None:
    if progress:
        progress(message)


def _k(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


CSV_COLUMNS = ["context_length_k",
               "ttft_avg_s", "ttft_std_s", "ttft_min_s", "ttft_max_s",
               "prefill_avg_toks_per_s", "prefill_std_toks_per_s", "prefill_min_toks_per_s", "prefill_max_toks_per_s",
               "decoding_avg_toks_per_s", "decoding_std_toks_per_s", "decoding_min_toks_per_s", "decoding_max_toks_per_s"]


def to_csv(report: dict) -> str:
    """flm bench's CSV: one row per stage, TTFT in seconds."""
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(CSV_COLUMNS)
    for s in report["stages"]:
        row = [f"{s['context_length_k']:g}"]
        for key, scale in (("ttft_ms", 1e-3), ("prefill_tps", 1.0), ("decode_tps", 1.0)):
            st = s[key]
            row += [f"{st[k] * scale:.6g}" for k in ("mean", "sd", "min", "max")]
        w.writerow(row)
    return out.getvalue()


def to_markdown(report: dict) -> str:
    m = report["machine"]
    lines = [f"model: {report['model']} ({report['architecture']}) · native, {report['threads']} threads · "
             f"{m['cpu']} · kiln {report['provenance']['kiln_version']}", "",
             "| context | prompt tokens | TTFT ms | prefill tok/s | decode tok/s |",
             "| ---: | ---: | ---: | ---: | ---: |"]
    for s in report["stages"]:
        cells = [f"{s[k]['mean']:.1f} ± {s[k]['sd']:.1f} ({s[k]['min']:.1f}–{s[k]['max']:.1f})"
                 for k in ("ttft_ms", "prefill_tps", "decode_tps")]
        lines.append(f"| {_k(s['context_length'])} | {s['prompt_tokens']} | " + " | ".join(cells) + " |")
    lines += ["", f"mean ± sd (min–max) over {report['iterations']} runs per stage; {report['method']}. "
                  "TTFT and decode measured by the engine in-process; prefill tok/s derived from them."]
    lines += [f"skipped {_k(s['context_length'])}: {s['reason']}" for s in report["skipped_stages"]]
    return "\n".join(lines) + "\n"


def main(args) -> int:
    from kiln import history

    stages = [parse_size(s) for s in args.stages.split(",") if s.strip()]
    command = command_line("kiln bench sweep", args, positional=("model",))
    report = run(args.model, stages, args.iterations, args.gen_tokens, args.max_ctx, args.threads, args.sleep,
                 command=command, progress=lambda msg: print(f"kiln bench sweep: {msg}", file=sys.stderr))
    history.record("sweep", report, model_sha256=report["model_sha256"], command=command)
    write_output({"md": to_markdown, "csv": to_csv, "json": dump_json}[args.format](report), args.output)
    if args.csv:
        write_output(to_csv(report), args.csv)
    if args.json:
        write_output(dump_json(report), args.json)
    return 0
