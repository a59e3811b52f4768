"""`kiln trace TAG`: the critical path of a request, decomposed from inside the engine (see kiln/trace.py)."""

from __future__ import annotations

import json
import sys


def register(sub) -> None:
    p = sub.add_parser("trace", help="where the time of a request goes: TTFT and per-token decomposition",
                       description="Run a chat request in-process with the engine's per-op timers on and break its "
                                   "time to first token and each decode token into parts; runs the same request with "
                                   "tracing off to measure the tracer's own cost. Records the result in the bench "
                                   "history.")
    p.add_argument("model", help="tag or .gguf path")
    p.add_argument("--prompt", help="the user message (default: a short question)")
    p.add_argument("-n", "--tokens", type=int, default=64, help="decode tokens per request (default 64)")
    p.add_argument("-r", "--reps", type=int, default=6,
                   help="traced requests after a warm-up one; half trace one decode plan, half the other (default 6)")
    p.add_argument("-t", "--threads", type=int, help="native threads (default: physical cores)")
    p.add_argument("-c", "--ctx", type=int, help="context length (default min(model's, 4096))")
    p.add_argument("--chrome", metavar="PATH", help="also write a Chrome/Perfetto trace (per-op slices of a prefill "
                                                     "and the first decode steps) to PATH")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_trace)


def cmd_trace(args) -> int:
    from kiln import trace
    from kiln import history

    if args.threads is not None and args.threads < 1:
        raise SystemExit("kiln trace: --threads must be at least 1")
    report, events = trace.run(args.model, args.prompt or trace.DEFAULT_PROMPT, args.tokens, args.reps, args.threads,
                               args.ctx, chrome=bool(args.chrome),
                               progress=lambda msg: print(f"kiln trace: {msg}", file=sys.stderr))
    if events is not None:
        with open(args.chrome, "w") as f:
            json.dump(events, f)
        report["chrome_trace"] = args.chrome
    report["history_id"] = history.record("trace", report, model_sha256=report["model_sha256"],
                                          command=" ".join(["kiln trace", *sys.argv[2:]]))
    if args.json:
        sys.stdout.write(json.dumps(report, indent=1) + "\n")
    else:
        render(report)
    return 0


def _pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:5.1f}%" if whole else ""


def render(r: dict, file=None) -> None:
    from rich.console import Console
    from rich.table import Table

    from kiln.trace import CLASSES

    con = Console(file=file or sys.stdout)
    m, d = r["machine"], r["decode"]
    con.print(f"[bold]kiln trace {r['model']}[/] · {r['architecture']} · {r['threads']} threads · "
              f"ctx {r['n_ctx']} · "
              f"prompt {r['prompt_tokens']} tokens · {r['requests']} requests × {r['decode_tokens_per_request']} "
              f"decode tokens · {m['cpu']} ({m['kernel_isa']} kernels)")

    t = Table(title="model load", title_justify="left")
    for col in ("", "wall ms", "engine ms", "GGUF + tokenizer + store ms", "weights"):
        t.add_column(col, justify="right" if "ms" in col else "left")
    for name in ("cold", "warm"):
        x = r["load"][name]
        t.add_row(name, f"{x['wall_ms']:.1f}", f"{x['engine_ms']:.1f}", f"{x['gguf_tokenizer_store_ms']:.1f}",
                  x["weights"])
    con.print(t)

    cold, warm = r["ttft"]["cold_start"], r["ttft"]["warm_median"]
    t = Table(title="time to first token", title_justify="left")
    t.add_column("part")
    t.add_column("cold start ms", justify="right")
    t.add_column("warm ms", justify="right")
    for part, ms in cold["parts_ms"].items():
        w = warm["parts_ms"].get(part)
        t.add_row(part + (" (in-process: no queue)" if part == "queue wait" else ""), f"{ms:.3f}",
                  "model resident" if w is None else f"{w:.3f}")
    t.add_row("unaccounted", f"{cold['unaccounted_ms']:.3f}", f"{warm['unaccounted_ms']:.3f}")
    t.add_row("[bold]wall[/]", f"[bold]{cold['wall_ms']:.1f}[/]", f"[bold]{warm['wall_ms']:.1f}[/]")
    con.print(t)
    tt = r["ttft"]["warm_ttft_ms"]
    con.print(f"cold start: the first load in this process, then the first request on it. warm: the request with the "
              f"median TTFT of {r['requests']} (TTFT {tt['min']:.1f}–{tt['max']:.1f} ms, median "
              f"{tt['median']:.1f}); prefill {r['prefill']['tokens']} tokens at "
              f"{r['prefill']['tokens_per_s_median']:.0f} tok/s (median)")

    wall = d["wall_ms_per_token"]
    t = Table(title=f"one decode token: mean of {d['tokens']} traced tokens ({d['untraced_tokens']} untraced ones "
                    "between them are the overhead control)", title_justify="left")
    t.add_column("part")
    t.add_column("ms/token", justify="right")
    t.add_column("of wall", justify="right")
    for part, ms in d["parts_ms_per_token"].items():
        t.add_row(part, f"{ms:.4f}", _pct(ms, wall["mean"]))
    t.add_row("[bold]wall[/]", f"[bold]{wall['mean']:.4f}[/]", "")
    con.print(t)
    con.print(f"wall per token: median {wall['median']:.3f} ms ({d['tokens_per_s_median']:.1f} tok/s), mean "
              f"{wall['mean']:.3f}, p90 {wall['p90']:.3f}; the per-op timers cover {d['ops_cover_native_pct']:.1f}% of "
              f"the native call time (prefill: {warm['ops_cover_native_pct']:.1f}%)")

    pre, dec = r["prefill"], r["decode_profile"]
    t = Table(title="native time by op class: prefill (per request) and decode (per token)", title_justify="left")
    for col in ("op class", "prefill ms", "prefill %", "decode ms/token", "decode %"):
        t.add_column(col, justify="left" if col == "op class" else "right")
    for c in CLASSES:
        t.add_row(c, f"{pre['by_class_ms'].get(c, 0):.3f}", f"{pre['by_class_pct'].get(c, 0):.1f}",
                  f"{dec['by_class_ms'].get(c, 0):.4f}", f"{dec['by_class_pct'].get(c, 0):.1f}")
    t.add_row("of which barrier wait", "", f"{pre['wait_pct']:.1f}", "", f"{dec['wait_pct']:.1f}")
    t.add_row("matrix ops (GEMM | GEMV)", "", f"{pre['matrix_share_pct']:.1f}", "", f"{dec['matrix_share_pct']:.1f}")
    con.print(t)

    t = Table(title="decode native ms/token by layer (each class less its barrier wait)", title_justify="left")
    for col in ("layer", "total", *CLASSES[:3], "barrier wait"):
        t.add_column(col, justify="right")
    for row in d["native_ms_by_layer"]:
        t.add_row(str(row["layer"]), f"{row['total']:.4f}", *(f"{row[c]:.4f}" for c in CLASSES[:3]),
                  f"{row['barrier wait']:.4f}")
    con.print(t)

    b, gb, pct = d["bytes_per_token"], d["gb_per_s"], d["pct_of_read_bandwidth"]
    bw = r["read_bandwidth"]
    con.print(f"[bold]dispatch[/]: {d['native_calls_per_token']:.2f} native calls/token × {d['ops_per_call']} ops = "
              f"{d['ops_per_token']:.0f} ops/token (executor ran {d['ops_run_per_token']:.0f}); "
              f"{d['parallel_regions_per_token']:.0f} parallel regions/token")
    con.print(f"[bold]bytes/token[/]: weights {b['weights'] / 1e6:.2f} MB + embedding row {b['embedding_row']} B + "
              f"KV read {b['kv_read_mean'] / 1e6:.3f} MB (mean over positions from {d['start_position']}); KV written "
              f"{b['kv_write'] / 1e3:.1f} kB")
    con.print(f"[bold]bandwidth[/]: {gb['effective']:.2f} GB/s effective ({pct['effective']:.0f}% of the plain read), "
              f"{gb['matrix_ops']:.2f} GB/s inside matrix ops ({pct['matrix_ops']:.0f}%); plain read "
              f"{bw['gb_s']:.2f} GB/s with {bw['threads']} threads, this run")

    ck, ov = r["checks"], r["overhead"]
    covers = ", ".join(f"{k} {v:.1f}%" for k, v in ck["parts_cover_pct"].items())
    ok = "[green]PASS[/]" if ck["parts_within_5pct"] else "[red]FAIL[/]"
    con.print(f"[bold]check[/]: parts sum to wall within 5%: {covers} {ok}")
    ok = "[green]PASS[/]" if ck["tracer_overhead_below_3pct"] else "[red]FAIL[/]"
    con.print(f"[bold]check[/]: tracer overhead {ck['tracer_overhead_pct']:+.2f}% (below 3%) {ok} — median of "
              f"{ov['ratios']} traced/plain-neighbour ratios (p10–p90 {ov['ratio_p10_p90'][0]:.3f}–"
              f"{ov['ratio_p10_p90'][1]:.3f}); median ms/token: plain {ov['plain_ms_per_token_median']:.3f}, traced "
              f"{ov['traced_ms_per_token_median']:.3f}; readout between tokens "
              f"{d['readout_ms_per_token'] * 1e3:.1f} us per traced token, outside both")
    if r.get("experts"):
        x = r["experts"]
        worst = max(x["busiest_over_mean"], key=x["busiest_over_mean"].get)
        con.print(f"[bold]experts[/]: the busiest expert of a layer got {x['busiest_over_mean_max']:.2f}× an even "
                  f"share of the rows (layer {worst}); rows per expert, layer {worst}: "
                  + " ".join(map(str, x["rows_per_expert"][worst])))
    for key, text in r["method"].items():
        con.print(f"[dim]how ({key}): {text}[/]")
    if r.get("chrome_trace"):
        con.print(f"Chrome trace: {r['chrome_trace']} (open in ui.perfetto.dev or chrome://tracing)")
    con.print(f"[dim]recorded in the bench history as #{r['history_id']}[/]")
