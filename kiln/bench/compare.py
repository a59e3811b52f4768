"""`kiln bench compare A.json B.json …`: seed 003's comparison tables from `kiln bench scenarios` or
`lemonade bench --json` results.

The first file is the baseline. Per scenario: means and min–max ranges of decode tok/s and TTFT, Δ%
against the baseline on the unrounded means, run-to-run spread ((max − min) / mean), and a verdict:
do the ranges overlap, and is the difference larger than both spreads. Then duration, peak memory,
per-run values and where every input came from. Each column carries a provenance tag: [m] measured
(read from a result file), [d] derived (computed here), [h] host (the measuring machine's facts as
the file recorded them). Markdown or a standalone HTML page.
"""

from __future__ import annotations

import html
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from kiln.bench.common import command_line, utc_now, write_output
from kiln.errors import KilnError

TAGS = {
    "m": "measured: read from the result file",
    "d": "derived: computed here from the files' unrounded values",
    "h": "host: the measuring machine's facts as recorded in the result file",
}


# --- reading results -----------------------------------------------------------------------------------
def load_sources(paths: list[str], labels: list[str] | None) -> list[dict]:
    """One source per backend entry of each file: label, file, model, settings, provenance and scenarios."""
    sources = []
    for path in paths:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except OSError as e:
            raise KilnError(f"cannot read {path}: {e.strerror}") from None
        except json.JSONDecodeError as e:
            raise KilnError(f"{path} is not JSON: {e}") from None
        results = data.get("results") if isinstance(data, dict) else None
        if not isinstance(results, list) or not results:
            raise KilnError(f"{path} is not a scenarios result: expected 'results' with at least one entry, as "
                            "`kiln bench scenarios --json` and `lemonade bench --json` write")
        for i, result in enumerate(results):
            scenarios = result.get("scenarios") if isinstance(result, dict) else None
            if not isinstance(scenarios, list):
                raise KilnError(f"{path}: results[{i}] has no 'scenarios' list")
            for j, s in enumerate(scenarios):
                if not isinstance(s, dict) or not isinstance(s.get("name"), str):
                    raise KilnError(f"{path}: results[{i}].scenarios[{j}] has no name")
            stem = Path(path).stem
            sources.append({
                "label": stem if len(results) == 1 else f"{stem}:{result.get('backend', i)}",
                "file": str(path), "model": data.get("model"), "timestamp": data.get("timestamp"),
                "config": data.get("config"), "recipe": result.get("recipe"), "backend": result.get("backend"),
                "ctx_size": result.get("ctx_size"), "provenance": data.get("provenance"),
                "machine": data.get("machine"), "scenarios": {s["name"]: s for s in scenarios},
            })
    if len(sources) < 2:
        raise KilnError("kiln bench compare needs at least two results (files, or backends within a file)")
    if labels:
        if len(labels) != len(sources):
            raise KilnError(f"--labels gives {len(labels)} names for {len(sources)} results: "
                            f"{', '.join(s['label'] for s in sources)}")
        for s, label in zip(sources, labels):
            s["label"] = label
    seen = set()
    for s in sources:
        if s["label"] in seen:
            raise KilnError(f"two results are labelled {s['label']!r}: name them with --labels")
        seen.add(s["label"])
    return sources


def build(paths: list[str], labels: list[str] | None = None, command: str = "kiln bench compare") -> dict:
    sources = load_sources(paths, labels)
    return {"tool": "kiln bench compare", "command": command, "created": utc_now(), "sources": sources}


# --- arithmetic --------------------------------------------------------------------------------------------
def spread(stat: dict | None) -> float | None:
    """Run-to-run spread, (max − min) / mean."""
    if not stat or not stat.get("mean"):
        return None
    return (stat["max"] - stat["min"]) / stat["mean"]


def delta(a: dict | None, b: dict | None) -> float | None:
    """(B − A) / A on the unrounded means."""
    if not a or not b or not a.get("mean"):
        return None
    return (b["mean"] - a["mean"]) / a["mean"]


def verdict(a: dict | None, b: dict | None) -> dict | None:
    """Whether B's range overlaps A's, and whether |Δ| is larger than both run-to-run spreads."""
    d = delta(a, b)
    if d is None:
        return None
    sa, sb = spread(a), spread(b)
    overlap = not (b["max"] < a["min"] or b["min"] > a["max"])
    exceeds = abs(d) > max(sa or 0.0, sb or 0.0)
    if overlap:
        where = "ranges overlap"
    else:
        where = "B max < A min" if b["max"] < a["min"] else "B min > A max"
    if exceeds:
        size = f"|Δ| > both spreads ({_pct(sa, sign=False)}, {_pct(sb, sign=False)})"
    else:
        wider, spread_ = ("A", sa) if (sa or 0.0) >= (sb or 0.0) else ("B", sb)
        size = f"|Δ| ≤ {wider} spread {_pct(spread_, sign=False)}"
    return {"delta": d, "spread_a": sa, "spread_b": sb, "overlap": overlap, "exceeds_both_spreads": exceeds,
            "text": f"{where}; {size}"}


# --- formatting -------------------------------------------------------------------------------------------
def _num(value, digits: int) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _range(stat: dict | None, digits: int) -> str:
    return "—" if not stat else f"{stat['min']:.{digits}f}–{stat['max']:.{digits}f}"


def _pct(value: float | None, sign: bool = True) -> str:
    if value is None:
        return "—"
    return f"{('+' if value >= 0 else '−') if sign else ''}{abs(value) * 100:.2f}%"


def _signed(value: float | None, digits: int = 0) -> str:
    if value is None:
        return "—"
    return f"{'+' if value >= 0 else '−'}{abs(value):,.{digits}f}"


def _mean(stat: dict | None) -> float | None:
    return stat["mean"] if stat else None


def _name(text: str, a: str, b: str) -> str:
    """A verdict's A and B, named."""
    return text.replace("A ", f"{a} ").replace("B ", f"{b} ")


@dataclass
class Table:
    title: str
    caption: str
    columns: list[tuple[str, str]]  # header, provenance tag ("" for labels)
    rows: list[list[str]]
    numeric: bool = True  # right-align the tagged columns


def _common(sources: list[dict]) -> tuple[list[str], list[str]]:
    """Scenarios every source has, in the baseline's order, and the ones some source lacks."""
    names = [n for n in sources[0]["scenarios"] if all(n in s["scenarios"] for s in sources)]
    missing = sorted({n for s in sources for n in s["scenarios"]} - set(names))
    return names, missing


def _figure_note(sources: list[dict], key: str) -> str:
    """How each source measured `key`, from its provenance; lemonade's own files carry none."""
    notes: dict[str, list[str]] = {}
    for s in sources:
        figures = (s.get("provenance") or {}).get("figures") or {}
        notes.setdefault(figures.get(key, "as the file reports it (no provenance recorded)"), []).append(s["label"])
    if len(notes) == 1:
        return f"all: {next(iter(notes))}"
    return "; ".join(f"{', '.join(labels)}: {note}" for note, labels in notes.items())


def _pair_summary(names: list[str], a: dict, b: dict, key: str, what: str) -> str:
    verdicts = [(n, verdict(a["scenarios"][n].get(key), b["scenarios"][n].get(key))) for n in names]
    verdicts = [(n, v) for n, v in verdicts if v]
    if not verdicts:
        return f"{b['label']} vs {a['label']}: no {what} to compare."
    deltas = [v["delta"] for _, v in verdicts]
    apart = [n for n, v in verdicts if not v["overlap"]]
    exceed = [n for n, v in verdicts if v["exceeds_both_spreads"]]
    return (f"{what}, {b['label']} vs {a['label']}: Δ {_pct(min(deltas))} to {_pct(max(deltas))}; ranges apart in "
            f"{len(apart)} of {len(verdicts)}" + (f" ({', '.join(apart)})" if 0 < len(apart) < len(verdicts) else "")
            + f"; |Δ| larger than both spreads in {len(exceed)} of {len(verdicts)}.")


def _metric_table(sources, names, key, title, digits, count_key, count_header) -> Table:
    base, others = sources[0], sources[1:]
    columns = [("Scenario", ""), (count_header, "m")]
    for s in sources:
        columns += [(f"{s['label']} mean", "m"), (f"{s['label']} min–max", "m")]
    for s in others:
        suffix = f" {s['label']}" if len(others) > 1 else ""
        columns += [(f"Δ{suffix}", "d"), (f"Verdict{suffix}", "d")]
    rows = []
    for n in names:
        counts = {str(s["scenarios"][n].get(count_key)) for s in sources}
        row = [n, " / ".join(str(s["scenarios"][n].get(count_key)) for s in sources) if len(counts) > 1 else counts.pop()]
        for s in sources:
            stat = s["scenarios"][n].get(key)
            row += [_num(_mean(stat), digits), _range(stat, digits)]
        for s in others:
            v = verdict(base["scenarios"][n].get(key), s["scenarios"][n].get(key))
            row += [_pct(v["delta"]) if v else "—", _name(v["text"], base["label"], s["label"]) if v else "—"]
        rows.append(row)
    caption = (f"Δ is derived: (B − A) / A on the unrounded means, A = {base['label']}. "
               + " ".join(_pair_summary(names, base, s, key, title.split(" by ")[0]) for s in others)
               + f" How it was measured — {_figure_note(sources, key)}.")
    return Table(f"{title}: mean and range over the runs", caption, columns, rows)


def _duration_table(sources, names) -> Table:
    others = sources[1:]
    columns = [("Scenario", "")] + [(f"{s['label']} mean ms", "m") for s in sources]
    for s in others:
        suffix = f" {s['label']}" if len(others) > 1 else ""
        columns += [(f"Δ ms{suffix}", "d"), (f"Δ{suffix}", "d")]
    rows, totals = [], [0.0] * len(sources)
    for n in names:
        means = [_mean(s["scenarios"][n].get("duration_ms")) for s in sources]
        row = [n] + [_num(m, 0) for m in means]
        for i in range(1, len(sources)):
            d = None if means[0] is None or means[i] is None else means[i] - means[0]
            row += [_signed(d), _pct(d / means[0]) if d is not None and means[0] else "—"]
        rows.append(row)
        totals = [t + (m or 0.0) for t, m in zip(totals, means)]
    total_row = ["sum (derived)"] + [f"{t:.0f}" for t in totals]
    for i in range(1, len(sources)):
        total_row += [_signed(totals[i] - totals[0]), _pct((totals[i] - totals[0]) / totals[0]) if totals[0] else "—"]
    rows.append(total_row)
    return Table("Wall-clock duration per run: mean",
                 f"ms from each file's duration_ms; Δ columns and the sum are derived. How it was measured — "
                 f"{_figure_note(sources, 'duration_ms')}.", columns, rows)


def _memory_table(sources, names) -> Table:
    columns = [("Scenario", "")] + [(f"{s['label']} GB", "m") for s in sources]
    rows = [[n] + [_num(s["scenarios"][n].get("memory_peak_gb"), 2) for s in sources] for n in names]
    notes = []
    for s in sources:
        found = {s["scenarios"][n].get("memory_note") for n in names} - {None}
        notes.append(f"{s['label']}: {'; '.join(sorted(found)) if found else 'memory_peak_gb as the file reports it'}")
    return Table("Peak memory by scenario", "memory_peak_gb as each file reports it (— where it could not be read). "
                 + "; ".join(notes) + ".", columns, rows)


def _spread_table(sources, names) -> Table:
    columns = [("Scenario", "")]
    for s in sources:
        columns += [(f"{s['label']} tok/s spread", "d"), (f"{s['label']} TTFT spread", "d")]
    rows = []
    for n in names:
        row = [n]
        for s in sources:
            row += [_pct(spread(s["scenarios"][n].get("tps"))).lstrip("+"),
                    _pct(spread(s["scenarios"][n].get("ttft_ms"))).lstrip("+")]
        rows.append(row)
    return Table("Run-to-run spread", "Spread is (max − min) / mean over each scenario's runs, derived from the "
                 "files. A difference between sources smaller than a spread is within the noise of that source.",
                 columns, rows)


def _runs_table(sources, names) -> Table | None:
    if not all(isinstance(s["scenarios"][n].get("runs"), list) for s in sources for n in names):
        return None  # lemonade's files carry no per-run values
    most = max(len(s["scenarios"][n]["runs"]) for s in sources for n in names)
    columns = [("Scenario", ""), ("Source", "")] + [(f"Run {i + 1} TTFT", "m") for i in range(most)] \
        + [(f"Run {i + 1} tok/s", "m") for i in range(most)]
    rows = []
    for n in names:
        for s in sources:
            runs = s["scenarios"][n]["runs"]
            pad = [""] * (most - len(runs))
            rows.append([n, s["label"]] + [_num(r.get("ttft_ms"), 1) for r in runs] + pad
                        + [_num(r.get("tps"), 2) for r in runs] + pad)
    return Table("Per-run values", "TTFT (ms) and tok/s per run, in run order, from each file's runs[].", columns, rows)


def _sources_table(sources) -> Table:
    columns = [("Source", ""), ("File", "m"), ("Model", "m"), ("Target", "m"), ("Timestamp", "m"), ("Runs", "m"),
               ("Command", "m"), ("CPU", "h"), ("Cores", "h"), ("Memory GiB", "h"), ("kiln", "h")]
    rows = []
    for s in sources:
        p, m, c = s.get("provenance") or {}, s.get("machine") or {}, s.get("config") or {}
        target = p.get("target") or {}
        where = target.get("url") or (f"in-process {target.get('backend')}, threads: {target.get('threads')}"
                                      if target else f"{s.get('recipe')}/{s.get('backend')}")
        runs = f"{c.get('measurement_runs', '?')} (+{c.get('warmup_runs', '?')} warm-up)"
        rows.append([s["label"], s["file"], str(s.get("model")), where, str(s.get("timestamp")), runs,
                     f"`{p['command']}`" if p.get("command") else "not recorded", m.get("cpu", "not recorded"),
                     str(m.get("physical_cores", "—")), str(m.get("mem_total_gib", "—")),
                     p.get("kiln_version", "—")])
    return Table("Sources", "Where every input came from. Host facts are those the measuring program recorded; "
                 "for an HTTP target they describe the client's machine, which is the server's only when it is local.",
                 columns, rows, numeric=False)


def tables(comparison: dict) -> tuple[list[Table], list[str]]:
    sources = comparison["sources"]
    names, missing = _common(sources)
    out = [
        _metric_table(sources, names, "tps", "Decode throughput by scenario (tok/s)", 2, "output_tokens", "Output tokens"),
        _metric_table(sources, names, "ttft_ms", "Time to first token by scenario (ms)", 1, "input_tokens", "Input tokens"),
        _duration_table(sources, names), _memory_table(sources, names), _spread_table(sources, names),
    ]
    runs = _runs_table(sources, names)
    if runs:
        out.append(runs)
    out.append(_sources_table(sources))
    return out, missing


def headline(comparison: dict) -> list[str]:
    sources = comparison["sources"]
    names, _ = _common(sources)
    lines = []
    for s in sources[1:]:
        lines.append(_pair_summary(names, sources[0], s, "tps", "Decode"))
        lines.append(_pair_summary(names, sources[0], s, "ttft_ms", "TTFT"))
    return lines


# --- rendering ---------------------------------------------------------------------------------------------
def _md_cell(text: str) -> str:
    return text.replace("|", "\\|")


def to_markdown(comparison: dict) -> str:
    sources = comparison["sources"]
    ts, missing = tables(comparison)
    out = [f"# {' vs '.join(s['label'] for s in sources)}", "",
           f"Compared by `{comparison['command']}` at {comparison['created']}; baseline {sources[0]['label']}.", ""]
    out += [f"- {line} [d]" for line in headline(comparison)] + [""]
    for t in ts:
        out += [f"## {t.title}", "", t.caption, ""]
        out.append("| " + " | ".join(_md_cell(h + (f" [{tag}]" if tag else "")) for h, tag in t.columns) + " |")
        out.append("| " + " | ".join("---:" if t.numeric and tag else "---" for _, tag in t.columns) + " |")
        out += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in t.rows]
        out.append("")
    if missing:
        out += [f"Not in every source, so not compared: {', '.join(missing)}.", ""]
    out += ["Provenance tags: " + " · ".join(f"[{k}] {v}" for k, v in TAGS.items()) + "."]
    return "\n".join(out) + "\n"


CSS = """
body{font-family:system-ui,sans-serif;margin:2rem auto;max-width:72rem;color:#1d1d1f;line-height:1.45}
table{border-collapse:collapse;margin:.5rem 0 1.5rem;font-size:.9rem}
th,td{border-bottom:1px solid #ddd;padding:.3rem .6rem;text-align:right;white-space:nowrap}
th:first-child,td:first-child{text-align:left}
th{background:#f4f4f6}
table.text th,table.text td{text-align:left;white-space:normal}
.tag{font-size:.7rem;padding:0 .3rem;border-radius:.3rem;margin-left:.25rem;color:#fff}
.tag-m{background:#2f6fb2}.tag-d{background:#8a5a00}.tag-h{background:#4b7f3a}
p.caption{color:#444;max-width:60rem}
"""


def _tag(tag: str) -> str:
    return f'<span class="tag tag-{tag}" title="{html.escape(TAGS[tag])}">{tag}</span>' if tag else ""


def html_fragment(comparison: dict, level: int = 2) -> str:
    """The comparison's tables as HTML, for a page of its own or for `kiln report`."""
    sources = comparison["sources"]
    ts, missing = tables(comparison)
    h = f"h{level}"
    out = [f"<p>Compared by <code>{html.escape(comparison['command'])}</code> at {html.escape(comparison['created'])}; "
           f"baseline {html.escape(sources[0]['label'])}.</p><ul>"]
    out += [f"<li>{html.escape(line)} {_tag('d')}</li>" for line in headline(comparison)] + ["</ul>"]
    for t in ts:
        css_class = "" if t.numeric else ' class="text"'
        out.append(f"<{h}>{html.escape(t.title)}</{h}><p class=\"caption\">{html.escape(t.caption)}</p>"
                   f"<table{css_class}><thead><tr>")
        out += [f"<th>{html.escape(head)}{_tag(tag)}</th>" for head, tag in t.columns]
        out.append("</tr></thead><tbody>")
        for row in t.rows:
            cells = [f'<td title="{html.escape(TAGS[tag])}">' if tag else "<td>" for _, tag in t.columns]
            out.append("<tr>" + "".join(f"{c}{html.escape(v)}</td>" for c, v in zip(cells, row)) + "</tr>")
        out.append("</tbody></table>")
    if missing:
        out.append(f"<p>Not in every source, so not compared: {html.escape(', '.join(missing))}.</p>")
    out.append("<p>Provenance tags: " + " · ".join(f"{_tag(k)} {html.escape(v)}" for k, v in TAGS.items()) + ".</p>")
    return "\n".join(out)


def to_html(comparison: dict) -> str:
    title = " vs ".join(s["label"] for s in comparison["sources"])
    return (f"<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{CSS}</style></head><body><h1>{html.escape(title)}</h1>\n{html_fragment(comparison)}\n</body></html>\n")


def add_arguments(p) -> None:
    p.description = __doc__.split("\n\n")[0]
    p.add_argument("files", nargs="+", help="result JSON files; the first is the baseline")
    p.add_argument("--labels", help="comma-separated names for the results, in order (default: file names)")
    p.add_argument("--format", choices=["md", "html"], default="md")
    p.add_argument("-o", "--output", help="write here instead of stdout")


def main(args) -> int:
    from kiln import history

    labels = [s.strip() for s in args.labels.split(",")] if args.labels else None
    command = command_line("kiln bench compare", args, positional=("files",))
    comparison = build(args.files, labels, command)
    write_output(to_markdown(comparison) if args.format == "md" else to_html(comparison), args.output)
    history.record("compare", comparison, model_sha256=None, command=command)
    if args.output:
        print(f"kiln bench compare: wrote {args.output}", file=sys.stderr)
    return 0
