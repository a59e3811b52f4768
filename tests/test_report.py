"""`kiln report`: a page built from a real history (sweep, scenarios at two thread counts, their
comparison, a trace) on a tiny random model; its structure; and how it renders in headless chromium."""

from __future__ import annotations

import base64
import html
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from kiln import history
from kiln.bench import report
from kiln.cli import main as kiln_main
from kiln.synth import write_random_gguf

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"]


@pytest.fixture(scope="module")
def filled_home(tmp_path_factory) -> Path:
    """A kiln home whose history holds one result of every kind the report draws."""
    home = tmp_path_factory.mktemp("home")
    model = write_random_gguf(home / "tiny.gguf", "tiny-llama", qtype=QT.Q8_0, seed=5)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KILN_HOME", str(home))
        assert kiln_main(["bench", "sweep", str(model), "--stages", "256,512,1k", "--iterations", "2", "--sleep", "0",
                          "-o", str(home / "sweep.md")]) == 0
        for threads in (1, 2):
            assert kiln_main(["bench", "scenarios", "--model", str(model), "-t", str(threads), "--runs", "2",
                              "--warmup", "0", "--scenarios", "chat-short,code-short,context-600", "--format", "json",
                              "-o", str(home / f"t{threads}.json")]) == 0
        assert kiln_main(["bench", "compare", str(home / "t1.json"), str(home / "t2.json"), "--labels", "1 thread,2 threads",
                          "-o", str(home / "compare.md")]) == 0
        assert kiln_main(["trace", str(model), "--tokens", "8", "--reps", "1"]) == 0
    return home


def build_page(home: Path, tmp_path: Path) -> tuple[str, Path]:
    out = tmp_path / "report.html"
    assert kiln_main(["report", "--db", str(home / "history.sqlite"), "-o", str(out)]) == 0
    return out.read_text(), out


class Structure(HTMLParser):
    """Elements properly nested; titles, headings, images and captions collected."""

    VOID = {"meta", "img", "br"}

    def __init__(self):
        super().__init__()
        self.stack: list[str] = []
        self.title = self.h1 = ""
        self.h2: list[str] = []
        self.images: list[str] = []
        self.captions: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "img":
            self.images.append(dict(attrs)["src"])
        if tag == "figcaption":
            self.captions.append("")
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        assert self.stack and self.stack.pop() == tag, f"</{tag}> closes nothing open"

    def handle_data(self, data):
        where = self.stack[-1] if self.stack else ""
        if where == "title":
            self.title += data
        elif where == "h1":
            self.h1 += data
        elif where == "h2":
            self.h2.append(data)
        elif "figcaption" in self.stack:
            self.captions[-1] += data


def test_report_from_a_real_history(filled_home, tmp_path, capsys):
    page, _ = build_page(filled_home, tmp_path)
    assert "(6 figures)" in capsys.readouterr().err
    s = Structure()
    s.feed(page)
    assert s.stack == []
    assert s.title == s.h1 == "kiln performance report"
    assert s.h2 == ["Decode and prefill throughput vs context", "Time to first token vs prompt length",
                    "Scenarios: latest result per target", "Where a token's time goes", "Decode throughput over time",
                    "Latest comparisons", "History rows behind this page"]
    assert len(s.images) == 6 and all(src.startswith("data:image/svg+xml;base64,") for src in s.images)
    for src in s.images:
        svg = base64.b64decode(src.split(",", 1)[1]).decode()
        assert svg.lstrip().startswith("<?xml") and "<svg" in svg and svg.count("<path") > 10
    # every figure says what measured it, on which host, and which history rows it drew
    assert len(s.captions) == 6
    for caption in s.captions:
        assert re.search(r"kiln (bench (sweep|scenarios)|trace)", caption), caption
        assert re.search(r"History rows: #\d+", caption), caption
    assert all("Host: " in c for c in s.captions[:5])
    # the decomposition reads the trace's own parts
    trace = history.query("trace", path=filled_home / "history.sqlite")[-1]["payload"]
    decomposition_svg = base64.b64decode(s.images[4].split(",", 1)[1]).decode()
    for part in list(trace["decode"]["parts_ms_per_token"]) + list(trace["ttft"]["warm_median"]["parts_ms"]):
        assert f">{html.escape(part, quote=False)}<" in decomposition_svg, part
    # the latest comparison, with its verdicts
    assert "1 thread vs 2 threads" in page and "Verdict" in page and "ranges" in page
    rows = history.query(path=filled_home / "history.sqlite")
    for row in rows:
        assert f"<td>{row['id']}</td>" in page  # every row feeds some figure or table


def test_report_on_an_empty_history_says_what_to_run(tmp_path, capsys):
    out = tmp_path / "empty.html"
    assert kiln_main(["report", "--db", str(tmp_path / "none.sqlite"), "-o", str(out)]) == 1
    assert "no history database at" in capsys.readouterr().err
    history.record("bench", {"model": "m", "results": []}, None, "kiln bench m", path=tmp_path / "h.sqlite")
    assert kiln_main(["report", "--db", str(tmp_path / "h.sqlite"), "-o", str(out)]) == 0
    page = out.read_text()
    s = Structure()
    s.feed(page)
    assert s.images == [] and s.title == "kiln performance report"
    for hint in ("run <code>kiln bench sweep TAG</code>", "<code>kiln bench scenarios --model TAG</code>",
                 "run <code>kiln trace TAG</code>", "No decode measurements in the history yet",
                 "run <code>kiln bench compare A.json B.json</code>"):
        assert hint in page


def test_trace_without_parts_is_skipped_with_a_note(tmp_path):
    db = tmp_path / "h.sqlite"
    history.record("trace", {"model": "m", "threads": 1, "decode": {"tokens": 3}}, None, "kiln trace m", path=db)
    text, figures = report.build(report.load(db, None), str(db))
    assert figures == 0
    assert "(1 trace rows lack decode.parts_ms_per_token)" in text


def test_report_renders_in_headless_chromium(filled_home, tmp_path):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium is not installed (Debian: apt-get install -y chromium)")
    _, path = build_page(filled_home, tmp_path)
    profile, shot = tmp_path / "profile", tmp_path / "shot.png"
    url = path.resolve().as_uri()
    common = [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}"]
    dom = subprocess.run([*common, "--dump-dom", url], capture_output=True, text=True, timeout=180)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert "<title>kiln performance report</title>" in dom.stdout
    assert "<h1>kiln performance report</h1>" in dom.stdout
    shot_run = subprocess.run([*common, "--window-size=1200,2600", f"--screenshot={shot}", url],
                              capture_output=True, text=True, timeout=180)
    assert shot_run.returncode == 0 and shot.exists(), shot_run.stderr[-2000:]

    import matplotlib.image

    pixels = matplotlib.image.imread(str(shot))[..., :3]
    assert pixels.shape[:2] == (2600, 1200)
    assert pixels.std() > 0.05, "the screenshot is blank"
    # The plots drew: matplotlib's first line colour (#1f77b4) covers a visible area, which text and
    # tables (black, grey, white) never do.
    blue = np.abs(pixels - np.array([0x1F, 0x77, 0xB4]) / 255).max(axis=-1) < 0.08
    assert blue.sum() > 500, f"only {blue.sum()} pixels of the plots' blue"
