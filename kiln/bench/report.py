"""`kiln report`: one static HTML page from the bench history, with its figures inlined (SVG), so it can
be mailed, archived or opened from disk.

Sections: decode and prefill tok/s vs context (`kiln bench sweep`), TTFT vs prompt length (sweep stages
and `kiln bench scenarios`), the per-scenario results, where a decode token's time goes (`kiln trace`:
the payload's `decode.parts_ms_per_token`, ms per part, and `ttft.warm_median.parts_ms`), decode tok/s
over time per model (every kind that measures it), the latest `kiln bench compare` tables, and the
history rows behind every figure. Each figure's caption says what measured it, how, and on which host;
a section without data says which command produces it.
"""

from __future__ import annotations

import base64
import html
import io
import re
import sys
from collections import OrderedDict
from datetime import datetime
from pathlib import Path

TITLE = "kiln performance report"
MAX_SERIES = 8  # lines or bars per figure before it stops being readable: the latest ones are kept


# --- reading the history ------------------------------------------------------------------------------
def load(db: Path | None, model: str | None) -> dict[str, list[dict]]:
    """History rows by kind, oldest first; `model` keeps rows whose model name contains it."""
    from kiln import history

    rows: dict[str, list[dict]] = {}
    for row in history.query(path=db):
        if model and model not in str(row["payload"].get("model", "")):
            continue
        rows.setdefault(row["kind"], []).append(row)
    return rows


def latest(rows: list[dict], key) -> list[dict]:
    """The newest row per key(row), newest first, at most MAX_SERIES."""
    keep: OrderedDict = OrderedDict()
    for row in reversed(rows):
        keep.setdefault(key(row), row)
    return list(keep.values())[:MAX_SERIES]


def _short_model(name: str) -> str:
    return Path(name).name if "/" in name else name


def _host(row: dict) -> str:
    m = row["payload"].get("machine") or {}
    return f"{m.get('cpu', 'unknown CPU')}, {m.get('physical_cores', '?')} cores"


def _sweep_label(row: dict) -> str:
    p = row["payload"]
    return f"{_short_model(p['model'])} · {p['threads']} thr · #{row['id']}"


def _scenarios_label(row: dict) -> str:
    p = row["payload"]
    target = (p.get("provenance") or {}).get("target") or {}
    where = target.get("url") or f"in-process {target.get('threads')} thr"
    return f"{_short_model(p['model'])} · {where} · #{row['id']}"


def _target_key(row: dict):
    p = row["payload"]
    target = (p.get("provenance") or {}).get("target") or {}
    return p.get("model"), target.get("url"), target.get("threads"), row["machine"]


# --- figures -------------------------------------------------------------------------------------------
def _figure(width: float = 7.5, height: float = 4.0):
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def _svg(fig) -> str:
    import matplotlib

    buf = io.BytesIO()
    with matplotlib.rc_context({"svg.fonttype": "none"}):  # text stays text: smaller, selectable, searchable
        fig.savefig(buf, format="svg")
    return base64.b64encode(buf.getvalue()).decode()


def plot_vs_context(sweeps: list[dict], key: str, ylabel: str):
    fig = _figure()
    ax = fig.add_subplot()
    for row in sweeps:
        stages = sorted(row["payload"]["stages"], key=lambda s: s["context_length"])
        x = [s["context_length"] for s in stages]
        ax.errorbar(x, [s[key]["mean"] for s in stages], yerr=[s[key]["sd"] for s in stages], marker="o",
                    capsize=3, label=_sweep_label(row))
    from matplotlib.ticker import FuncFormatter

    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v / 1024:g}k" if v >= 1024 else f"{v:g}"))
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return fig


def plot_ttft(sweeps: list[dict], scenarios: list[dict]):
    fig = _figure()
    ax = fig.add_subplot()
    for row in sweeps:
        stages = sorted(row["payload"]["stages"], key=lambda s: s["prompt_tokens"])
        ax.plot([s["prompt_tokens"] for s in stages], [s["ttft_ms"]["mean"] for s in stages], marker="o",
                label=f"sweep: {_sweep_label(row)}")
    for row in scenarios:
        points = [(s["input_tokens"], s["ttft_ms"]["mean"]) for s in row["payload"]["results"][0]["scenarios"]
                  if s.get("input_tokens") and s.get("ttft_ms")]
        if points:
            points.sort()
            ax.plot(*zip(*points), marker="s", linestyle=":", label=f"scenarios: {_scenarios_label(row)}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT (ms)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize="small")
    return fig


def plot_scenarios(scenarios: list[dict]):
    import numpy as np

    names = list(OrderedDict.fromkeys(s["name"] for row in scenarios for s in row["payload"]["results"][0]["scenarios"]))
    fig = _figure(height=4.5)
    axes = fig.subplots(1, 2)
    width = 0.8 / len(scenarios)
    for i, row in enumerate(scenarios):
        by_name = {s["name"]: s for s in row["payload"]["results"][0]["scenarios"]}
        x = np.arange(len(names)) + i * width
        for ax, key in zip(axes, ("tps", "ttft_ms")):
            stats = [by_name.get(n, {}).get(key) for n in names]
            means = [s["mean"] if s else 0.0 for s in stats]
            low = [s["mean"] - s["min"] if s else 0.0 for s in stats]
            high = [s["max"] - s["mean"] if s else 0.0 for s in stats]
            ax.bar(x, means, width, yerr=[low, high], capsize=2, label=_scenarios_label(row))
    for ax, label in zip(axes, ("decode tok/s (bars: mean, whiskers: min–max)", "TTFT ms (mean, min–max)")):
        ax.set_xticks(np.arange(len(names)) + 0.4 - width / 2, names, rotation=30, ha="right", fontsize="small")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize="x-small")
    return fig


def trace_parts(payload: dict) -> tuple[dict, dict]:
    """A trace's decode parts (ms per token) and warm TTFT parts (ms), each empty when absent."""
    decode = (payload.get("decode") or {}).get("parts_ms_per_token") or {}
    ttft = ((payload.get("ttft") or {}).get("warm_median") or {}).get("parts_ms") or {}
    return decode, ttft


def plot_decomposition(traces: list[dict]):
    import matplotlib
    import numpy as np

    panels = [("decode", "ms per decode token", 0), ("TTFT (warm)", "ms to the first token", 1)]
    panels = [p for p in panels if any(trace_parts(r["payload"])[p[2]] for r in traces)]
    # Tall enough for each panel's bars and for its legend (one line per part) beside it.
    n_parts = [len({k for r in traces for k in trace_parts(r["payload"])[p[2]]}) for p in panels]
    fig = _figure(width=9.0, height=sum(max(0.9 + 0.45 * len(traces), 0.6 + 0.2 * n) for n in n_parts))
    axes = fig.subplots(len(panels), 1, squeeze=False)[:, 0]
    labels = [f"{_short_model(r['payload'].get('model', '?'))} · {r['payload'].get('threads', '?')} thr · #{r['id']}"
              for r in traces]
    for ax, (title, xlabel, index) in zip(axes, panels):
        parts = list(OrderedDict.fromkeys(k for r in traces for k in trace_parts(r["payload"])[index]))
        colors = matplotlib.colormaps["tab20"].colors  # a trace has more parts than the default cycle's 10 colours
        left = np.zeros(len(traces))
        for i, part in enumerate(parts):
            values = np.array([trace_parts(r["payload"])[index].get(part, 0.0) for r in traces])
            ax.barh(labels, values, left=left, color=colors[i % len(colors)], label=part)
            left += values
        ax.set_title(title, fontsize="medium")
        ax.set_xlabel(xlabel)
        ax.legend(fontsize="x-small", loc="center left", bbox_to_anchor=(1.01, 0.5))
    return fig


def history_points(rows: dict[str, list[dict]]) -> dict[tuple[str, str], list[tuple[datetime, float]]]:
    """Decode tok/s over time per (model, source): llama-bench's tg at depth 0 and batch 1, the sweep's
    smallest stage, the mean of a scenarios run's per-scenario means, and the trace's median."""
    points: dict[tuple[str, str], list[tuple[datetime, float]]] = {}

    def add(model: str, source: str, created: str, value):
        if value is not None:
            points.setdefault((_short_model(model), source), []).append((datetime.fromisoformat(created), value))

    for row in rows.get("bench", []):
        p = row["payload"]
        for r in p.get("results", []):
            if r.get("test", "").startswith("tg") and r.get("depth") == 0 and r.get("batch") == 1:
                add(p["model"], f"bench {r['test']} t{r['threads']}", row["created"], r["avg_ts"])
    for row in rows.get("sweep", []):
        p = row["payload"]
        smallest = min(p["stages"], key=lambda s: s["context_length"])
        add(p["model"], f"sweep {smallest['context_length']} t{p['threads']}", row["created"],
            smallest["decode_tps"]["mean"])
    for row in rows.get("scenarios", []):
        p = row["payload"]
        means = [s["tps"]["mean"] for s in p["results"][0]["scenarios"] if s.get("tps")]
        target = (p.get("provenance") or {}).get("target") or {}
        where = "http" if target.get("url") else f"in-process t{target.get('threads')}"
        add(p["model"], f"scenarios {where}", row["created"], sum(means) / len(means) if means else None)
    for row in rows.get("trace", []):
        p = row["payload"]
        add(p.get("model", "?"), f"trace t{p.get('threads')}", row["created"],
            (p.get("decode") or {}).get("tokens_per_s_median"))
    return points


def plot_history(points: dict):
    models = sorted({model for model, _ in points})
    fig = _figure(height=2.2 + 2.2 * len(models))
    axes = fig.subplots(len(models), 1, squeeze=False)[:, 0]
    for ax, model in zip(axes, models):
        for (m, source), series in sorted(points.items()):
            if m == model:
                series.sort()
                ax.plot([t for t, _ in series], [v for _, v in series], marker="o", label=source)
        ax.set_title(model, fontsize="medium")
        ax.set_ylabel("decode tok/s")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="x-small")
        for label in ax.get_xticklabels():
            label.set_rotation(20)
    return fig


# --- the page -------------------------------------------------------------------------------------------
CSS = """
figure{margin:1rem 0 2rem}figure img{max-width:100%;border:1px solid #eee}
figcaption{color:#444;max-width:60rem;font-size:.9rem}
.note{background:#fff8e5;border-left:4px solid #e0b300;padding:.4rem .8rem}
code{background:#f4f4f6;padding:0 .2rem}
"""


class Page:
    def __init__(self):
        self.parts: list[str] = []
        self.figures = 0
        self.used: dict[int, dict] = {}  # history rows behind the page, by id

    def section(self, anchor: str, title: str) -> None:
        self.parts.append(f'<h2 id="{anchor}">{html.escape(title)}</h2>')

    def figure(self, fig, alt: str, caption: str, rows: list[dict]) -> None:
        self.figures += 1
        self.used.update({r["id"]: r for r in rows})
        ids = ", ".join(f"#{r['id']}" for r in rows)
        self.parts.append(f'<figure><img alt="{html.escape(alt)}" src="data:image/svg+xml;base64,{_svg(fig)}">'
                          f"<figcaption>Figure {self.figures}. {_text(caption)} History rows: {ids}."
                          "</figcaption></figure>")

    def note(self, text: str) -> None:
        self.parts.append(f'<p class="note">{_text(text)}</p>')

    def raw(self, text: str) -> None:
        self.parts.append(text)


def _text(caption: str) -> str:
    """Escaped, with `command` spans as <code>."""
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(caption))


def _hosts(rows: list[dict]) -> str:
    return "; ".join(sorted({_host(r) for r in rows}))


def build(rows: dict[str, list[dict]], db_label: str, max_compares: int = 3) -> tuple[str, int]:
    """The page's HTML and the number of figures in it."""
    from kiln import __version__
    from kiln.bench import compare
    from kiln.bench.common import utc_now

    page = Page()
    sweeps = latest(rows.get("sweep", []), lambda r: (r["payload"]["model"], r["machine"], r["payload"]["threads"]))
    scenarios = latest([r for r in rows.get("scenarios", []) if r["payload"].get("results")], _target_key)

    page.section("context", "Decode and prefill throughput vs context")
    if sweeps:
        method = sweeps[0]["payload"]["provenance"]["figures"]
        page.figure(plot_vs_context(sweeps, "decode_tps", "decode tok/s"), "decode tok/s vs context",
                    "Decode tok/s at each context stage, mean ± sd over the stage's runs (measured by `kiln bench "
                    f"sweep`, in-process native engine: {method['decode_tps']}). Host: {_hosts(sweeps)}.", sweeps)
        page.figure(plot_vs_context(sweeps, "prefill_tps", "prefill tok/s"), "prefill tok/s vs context",
                    f"Prefill tok/s at each context stage, mean ± sd (derived by `kiln bench sweep`: "
                    f"{method['prefill_tps']}). Host: {_hosts(sweeps)}.", sweeps)
    else:
        page.note("No sweep results in the history yet: run `kiln bench sweep TAG`.")

    page.section("ttft", "Time to first token vs prompt length")
    if sweeps or scenarios:
        page.figure(plot_ttft(sweeps, scenarios), "TTFT vs prompt tokens",
                    "TTFT against prompt tokens, log–log. Lines: `kiln bench sweep` stage means (engine-measured, "
                    "prefill from an empty cache). Dotted: `kiln bench scenarios` scenario means (measured "
                    "client-side to the first generated text; for HTTP targets this includes the server's queue and "
                    f"transport). Host: {_hosts(sweeps + scenarios)}.", sweeps + scenarios)
    else:
        page.note("No sweep or scenarios results yet: run `kiln bench sweep TAG` or `kiln bench scenarios --model TAG`.")

    page.section("scenarios", "Scenarios: latest result per target")
    if scenarios:
        page.figure(plot_scenarios(scenarios), "per-scenario tok/s and TTFT",
                    "Per scenario, the latest `kiln bench scenarios` result of each target: bars are means, "
                    "whiskers min–max over the measured runs (client-side; tok/s = (output tokens − 1) / (end − "
                    f"first text)). Host: {_hosts(scenarios)}.", scenarios)
    else:
        page.note("No scenarios results yet: run `kiln bench scenarios --model TAG` (or `--url URL --model NAME`).")

    page.section("decomposition", "Where a token's time goes")
    traces = latest([r for r in rows.get("trace", []) if any(trace_parts(r["payload"]))],
                    lambda r: (r["payload"].get("model"), r["machine"], r["payload"].get("threads")))
    if traces:
        page.figure(plot_decomposition(traces), "per-token time by part",
                    "Decode: ms per token by part, means over the traced tokens; TTFT: ms by part for the median "
                    "warm request (measured by `kiln trace`: clock reads around each call from Python, native time "
                    f"from the engine's per-op timers). Host: {_hosts(traces)}.", traces)
    else:
        skipped = len(rows.get("trace", []))
        page.note("No `kiln trace` results with per-part times in the history"
                  + (f" ({skipped} trace rows lack decode.parts_ms_per_token)" if skipped else "")
                  + ": run `kiln trace TAG`.")

    page.section("history", "Decode throughput over time")
    points = history_points(rows)
    if points:
        used = [r for kind in ("bench", "sweep", "scenarios", "trace") for r in rows.get(kind, [])]
        page.figure(plot_history(points), "decode tok/s over time per model",
                    "Decode tok/s per model over time, one line per source: `kiln bench` tg tests at depth 0 and "
                    "batch 1 (mean over repetitions), the sweep's smallest stage (mean), the mean of a scenarios "
                    "run's per-scenario means, and `kiln trace`'s median. Sources measure differently (engine "
                    "alone, in-process requests, HTTP), so compare a line with itself over time.", used)
    else:
        page.note("No decode measurements in the history yet.")

    page.section("compare", "Latest comparisons")
    compares = list(reversed(rows.get("compare", [])))[:max_compares]
    for row in compares:
        page.raw(f"<h3>{html.escape(' vs '.join(s['label'] for s in row['payload']['sources']))} (#{row['id']})</h3>")
        page.raw(compare.html_fragment(row["payload"], level=4))
        page.used[row["id"]] = row
    if not compares:
        page.note("No comparisons yet: run `kiln bench compare A.json B.json`.")

    page.section("rows", "History rows behind this page")
    page.raw("<table class=\"text\"><thead><tr><th>#</th><th>kind</th><th>created (UTC)</th><th>kiln</th>"
             "<th>machine</th><th>command</th></tr></thead><tbody>")
    for row in sorted(page.used.values(), key=lambda r: r["id"]):
        page.raw(f"<tr><td>{row['id']}</td><td>{html.escape(row['kind'])}</td><td>{html.escape(row['created'])}</td>"
                 f"<td>{html.escape(row['kiln_version'])}</td><td>{html.escape(row['machine'])} "
                 f"({html.escape(_host(row))})</td><td><code>{html.escape(row['command'])}</code></td></tr>")
    page.raw("</tbody></table>")

    counts = ", ".join(f"{len(v)} {k}" for k, v in sorted(rows.items())) or "no results"
    head = (f"<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>{TITLE}</title>"
            f"<style>{compare.CSS}{CSS}</style></head><body><h1>{TITLE}</h1>"
            f"<p>Generated {utc_now()} by kiln {__version__} from {html.escape(db_label)} ({counts}). "
            "Every figure's caption says which command measured it, how, and on which host; the table at the end "
            "lists the history rows used.</p>")
    return head + "\n".join(page.parts) + "</body></html>\n", page.figures


def add_arguments(p) -> None:
    p.add_argument("-o", "--output", default="kiln-report.html", help="the HTML file to write (default kiln-report.html)")
    p.add_argument("--db", type=Path, help="history database (default: history.sqlite in the kiln home)")
    p.add_argument("--model", help="only results whose model name contains this")
    p.add_argument("--compares", type=int, default=3, help="how many of the latest comparisons to include (default 3)")


def main(args) -> int:
    from kiln import history

    db = args.db or history.database_path()
    if args.db and not args.db.exists():
        from kiln.errors import KilnError

        raise KilnError(f"no history database at {args.db}")
    text, figures = build(load(args.db, args.model), str(db), args.compares)
    Path(args.output).write_text(text, encoding="utf-8")
    print(f"kiln report: wrote {args.output} ({figures} figures)", file=sys.stderr)
    return 0
