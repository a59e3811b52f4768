"""`kiln bench`: engine throughput like llama-bench (`kiln bench TAG`), plus the subcommands of the
measurement program (`kiln bench sweep|scenarios|compare|spec`)."""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys

SUBCOMMANDS: dict[str, str] = {  # name → module with `add_arguments(parser)` and `main(args)`
    "sweep": "kiln.bench.sweep",
    "scenarios": "kiln.bench.scenarios",
    "compare": "kiln.bench.compare",
    "spec": "kiln.bench.spec",
}


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"values must be >= 0, got {text!r}")
    return values


def perf_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kiln bench", description=__doc__.splitlines()[0],
                                epilog="subcommands: " + ", ".join(f"kiln bench {name}" for name in SUBCOMMANDS)
                                + " (each takes -h)")
    p.add_argument("model", help="tag or .gguf path")
    p.add_argument("-p", "--n-prompt", type=int, default=512, help="prompt tokens of the pp test (0: skip)")
    p.add_argument("-n", "--n-gen", type=int, default=128, help="generated tokens of the tg test (0: skip)")
    p.add_argument("-t", "--threads", type=_ints, default=None, help="thread counts, e.g. 1,2 (default: cores)")
    p.add_argument("-d", "--depth", type=_ints, default=[0], help="tokens already in the cache, e.g. 0,1024")
    p.add_argument("-b", "--batch", type=_ints, default=[1], help="sequences decoding together, e.g. 1,8")
    p.add_argument("-r", "--repetitions", type=int, default=5)
    p.add_argument("-o", "--output", choices=["md", "json", "csv"], default="md")
    p.add_argument("--kv-cache", help="KV cache type: f16, q8_0 or q4_0 (env KILN_KV_CACHE_TYPE; default f16)")
    p.add_argument("--tokens", choices=["random", "greedy"], default="random",
                   help="what the tg test feeds: random ids (llama-bench) or each sequence's greedy continuation")
    return p


def register(sub) -> None:
    p = sub.add_parser("bench", help="measure engine throughput (llama-bench style) and more",
                       description="kiln bench TAG [-p 512 -n 128 -t 1,2 -r 5 -d 0,1024 -b 1,8 -o md|json|csv "
                                   "--tokens random|greedy]",
                       add_help=False)
    # The arguments go to the perf parser or a subcommand's parser untouched (kiln.cli forwards them raw),
    # so options may come before the model and `kiln bench -h` reaches the perf parser's help.
    p.set_defaults(func=cmd_bench, forwards_raw_args=True)


def cmd_bench(args) -> int:
    argv = args.args
    if argv and argv[0] in SUBCOMMANDS:
        import importlib

        module = importlib.import_module(SUBCOMMANDS[argv[0]])
        parser = argparse.ArgumentParser(prog=f"kiln bench {argv[0]}")
        module.add_arguments(parser)
        return module.main(parser.parse_args(argv[1:]))
    a = perf_parser().parse_args(argv)
    return run_perf(a)


def run_perf(a) -> int:
    from kiln.bench import perf
    from kiln.engine.kv import kv_cache_type
    from kiln.engine.native import physical_cores

    threads = a.threads or [physical_cores()]
    if min(threads) < 1 or min(a.batch) < 1:
        raise SystemExit("kiln bench: threads and batch sizes must be at least 1")
    if a.n_prompt < 0 or a.n_gen < 0 or a.repetitions < 1:  # -d, -t and -b are checked as they are parsed
        raise SystemExit("kiln bench: -p and -n must be at least 0, -r at least 1")
    if a.n_prompt == 0 and a.n_gen == 0:
        raise SystemExit("kiln bench: -p 0 -n 0 leaves nothing to measure")
    report = perf.run(a.model, a.n_prompt, a.n_gen, threads, a.depth, a.batch, a.repetitions,
                      progress=lambda msg: print(f"kiln bench: {msg}", file=sys.stderr), tokens=a.tokens,
                      kv_cache=kv_cache_type(a.kv_cache))
    sys.stdout.write({"json": to_json, "csv": to_csv, "md": to_markdown}[a.output](report))
    from kiln import history

    history.record("bench", report, model_sha256=report["model_sha256"], command=" ".join(["kiln bench", *sys.argv[2:]]))
    return 0


def to_json(report: dict) -> str:
    return json.dumps(report, indent=1) + "\n"


def to_csv(report: dict) -> str:
    out = io.StringIO()
    cols = ["model", "test", "threads", "depth", "batch", "n_tokens", "avg_ts", "stddev_ts", "avg_ns", "stddev_ns"]
    w = csv.writer(out)
    w.writerow(cols)
    for r in report["results"]:
        w.writerow([report["model"]] + [r[c] for c in cols[1:]])
    return out.getvalue()


def to_markdown(report: dict) -> str:
    m = report["machine"]
    lines = [
        f"model: {report['model']} ({report['architecture']}, {report['model_size'] / 2**20:.1f} MiB, "
        f"{report['n_params'] / 1e6:.1f} M params) · {m['cpu']} · kernels {m['kernel_isa']}",
        "",
        "| test | threads | t/s | host % | GB/s (of plain read) | GMAC/s (of int8 peak) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in report["results"]:
        host = f"{100 * r['host_fraction']:.1f}" if r["host_fraction"] is not None else ""
        bw = ""
        if r.get("gb_s") is not None:
            bw = f"{r['gb_s']:.2f}" + (f" ({100 * r['of_plain_read']:.0f}%)" if "of_plain_read" in r else "")
        macs = ""
        if r.get("gmacs") is not None:
            macs = f"{r['gmacs']:.0f}" + (f" ({100 * r['of_peak']:.0f}%)" if "of_peak" in r else "")
            if r.get("pair_macs"):
                macs += f"; run {r['run_gmacs']:.0f}" + (f" ({100 * r['run_of_peak']:.0f}%)" if "run_of_peak" in r else "")
        lines.append(f"| {r['test']} | {r['threads']} | {r['avg_ts']:.2f} ± {r['stddev_ts']:.2f} | {host} | {bw} | {macs} |")
    lines += ["", f"{report['method']}; GB/s: bytes a decode step reads (packed weights, embedding rows, KV "
              "cache) at the median step time; of a split output head only the first pass, since how much of "
              "its low bits a step reads depends on the logits; GMAC/s: a prompt token's matrix products, each once "
              "(not the output head, not attention, not precise activations' second rows) at the median rate; run: "
              "with the second rows, the products the kernels do"]
    peak = report.get("int8_peak")
    if peak:
        lines[-1] += f", of the {peak['unit']} int8 peak ({peak['gmacs_per_core']:.0f} GMAC/s a core x threads)."
    else:
        lines[-1] += "."
    for t, read in report.get("plain_read", {}).items():
        lines.append(f"plain read, {t} thread(s): {read['gb_s']:.2f} GB/s ({read['method']}).")
    for t, mem in report.get("memory", {}).items():
        if mem["rss_growth_bytes"] is not None:
            lines.append(f"memory, {t} thread(s): resident growth {mem['rss_growth_bytes'] / 2**20:.1f} MiB = "
                         f"{mem['growth_over_weights_kv']:.2f} x (packed weights {mem['weights_bytes'] / 2**20:.1f} MiB "
                         f"+ KV cache {mem['kv_bytes'] / 2**20:.1f} MiB).")
    return "\n".join(lines) + "\n"
