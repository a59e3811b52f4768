"""`kiln bench sweep|scenarios|compare`: tiny random models in-process, a stand-in OpenAI-compatible
streaming server with known timing, seed 003's published numbers, and (slow) the real `kiln serve`
against kiln in-process."""

from __future__ import annotations

import json
import os
import re
import threading
import time
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from kiln import history
from kiln.bench import compare, scenarios, sweep
from kiln.bench.common import SCHEMA_DIR
from kiln.cli import main as kiln_main
from kiln.errors import KilnError
from kiln.synth import write_random_gguf


def validate(payload: dict, schema_name: str) -> None:
    schema = json.loads((SCHEMA_DIR / schema_name).read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.Draft202012Validator(schema).validate(payload)


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """A kiln home of its own, so results land in a history this test reads."""
    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_random_gguf(tmp_path_factory.mktemp("m") / "tiny.gguf", "tiny-llama", qtype=QT.Q8_0, seed=3)


# --- sweep ---------------------------------------------------------------------------------------------
def test_stages_are_capped_and_run_largest_first():
    keep, skipped = sweep.plan_stages([1024, 4096, 512, 32768, 2048, 16], model_ctx=2048, max_ctx=1024, gen=32)
    assert keep == [1024, 512]
    assert {s["context_length"]: s["reason"] for s in skipped} == {
        32768: "beyond the model's context of 2048 tokens", 4096: "beyond the model's context of 2048 tokens",
        2048: "beyond --max-ctx 1024", 16: "no room for a prompt before 32 generated tokens"}
    assert sweep.parse_size("4k") == 4096 and sweep.parse_size(" 300 ") == 300
    with pytest.raises(KilnError, match="bad context size 'lots'"):
        sweep.parse_size("lots")


def test_sweep_csv_json_and_history(tiny, home, tmp_path, capsys):
    csv_path, json_path = tmp_path / "sweep.csv", tmp_path / "sweep.json"
    assert kiln_main(["bench", "sweep", str(tiny), "--stages", "256,512,4k", "--iterations", "2", "--sleep", "0",
                      "--csv", str(csv_path), "--json", str(json_path)]) == 0
    table = capsys.readouterr().out
    assert "| 512 | 480 |" in table and "skipped 4k: beyond the model's context of 2048 tokens" in table

    lines = csv_path.read_text().splitlines()
    assert lines[0] == ("context_length_k,ttft_avg_s,ttft_std_s,ttft_min_s,ttft_max_s,prefill_avg_toks_per_s,"
                        "prefill_std_toks_per_s,prefill_min_toks_per_s,prefill_max_toks_per_s,decoding_avg_toks_per_s,"
                        "decoding_std_toks_per_s,decoding_min_toks_per_s,decoding_max_toks_per_s")
    assert [line.split(",")[0] for line in lines[1:]] == ["0.5", "0.25"]  # largest first, as flm

    report = json.loads(json_path.read_text())
    validate(report, "sweep.schema.json")
    assert [s["context_length"] for s in report["stages"]] == [512, 256]
    for stage in report["stages"]:
        assert stage["prompt_tokens"] == stage["context_length"] - 32
        assert len(stage["runs"]) == 2
        for run in stage["runs"]:
            assert run["prompt_tokens"] == stage["prompt_tokens"] and run["generated_tokens"] == 32
            assert run["ttft_ms"] >= run["prefill_ms"] > 0
            assert run["prefill_tps"] == pytest.approx(run["prompt_tokens"] / run["prefill_ms"] * 1e3)
            assert run["decode_tps"] == pytest.approx(31 / run["decode_ms"] * 1e3)
        ttft = [r["ttft_ms"] for r in stage["runs"]]
        assert stage["ttft_ms"]["mean"] == pytest.approx(sum(ttft) / 2)
        assert stage["ttft_ms"]["min"] == min(ttft) and stage["ttft_ms"]["max"] == max(ttft)
        # the CSV carries the same figures, TTFT in seconds
        row = next(line.split(",") for line in lines[1:] if float(line.split(",")[0]) == stage["context_length_k"])
        assert float(row[1]) == pytest.approx(stage["ttft_ms"]["mean"] / 1e3, rel=1e-5)
        assert float(row[9]) == pytest.approx(stage["decode_tps"]["mean"], rel=1e-5)
    assert report["provenance"]["target"]["kind"] == "in-process"
    rows = history.query("sweep")
    assert len(rows) == 1 and rows[0]["payload"]["stages"] == report["stages"]
    assert rows[0]["command"].startswith(f"kiln bench sweep {tiny} --stages 256,512,4k --iterations 2")


def test_sweep_names_why_no_stage_fits(tiny, home):
    with pytest.raises(KilnError, match=r"no stage of 4096,8192 fits \(model context 2048\)"):
        sweep.run(str(tiny), [4096, 8192], iterations=1, sleep=0)


def test_story_prompt_has_exact_length(tiny):
    from kiln.engine.model import load

    model = load(str(tiny), n_ctx=64, progress=False)
    try:
        for n in (5, 300, 1500):
            ids = sweep.story_prompt(model.tokenizer, n)
            assert len(ids) == n
        assert ids[:10] == model.tokenizer.encode(sweep.STORY)[:10]
    finally:
        model.close()


# --- scenario selection and files ------------------------------------------------------------------------
def test_selection():
    names = lambda chosen: [s.name for s in chosen]  # noqa: E731
    assert names(scenarios.select(None, [])) == list(scenarios.DEFAULT_SELECTION)
    assert names(scenarios.select(["code"], [])) == ["code-short", "code-explain", "code-debug"]
    assert names(scenarios.select(["context-3k"], []))[0] == "context-3k"
    assert scenarios.select(["context-3k"], [])[0].input_tokens == 3072
    assert {"context-4k", "multi-turn", "chat-short"} <= set(names(scenarios.select(["all"], [])))
    with pytest.raises(KilnError, match="unknown scenario 'chat-tiny'"):
        scenarios.select(["chat-tiny"], [])


GOOD_FILE = {"scenarios": [
    {"name": "haiku", "prompt": "Write a haiku about kilns.", "output_tokens": 24},
    {"name": "long-doc", "category": "context", "output_tokens": 8, "input_tokens": 400,
     "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "{filler}\n\nSummarize."}]},
]}


@pytest.mark.parametrize("entry, message, schema_says", [
    ({"name": "x", "output_tokens": 5}, "give exactly one of 'prompt' and 'messages'", True),
    ({"name": "x", "prompt": "hi", "output_tokens": 0}, "output_tokens: expected an integer >= 1", True),
    ({"name": "x", "prompt": "hi", "output_tokens": 5, "max_tokens": 5}, "unknown field(s) max_tokens", True),
    ({"name": "x", "messages": [{"role": "robot", "content": "hi"}], "output_tokens": 5}, "messages: expected", True),
    # the {filler} rules tie a field to the text of another, beyond what the schema expresses
    ({"name": "x", "prompt": "{filler}", "output_tokens": 5}, "input_tokens (the size to fill to) is missing", False),
    ({"name": "x", "prompt": "no filler", "output_tokens": 5, "input_tokens": 90}, "exactly one {filler}", False),
])
def test_scenario_file_errors_name_the_fault(tmp_path, entry, message, schema_says):
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"scenarios": [entry]}))
    with pytest.raises(KilnError, match=f"scenario .*{re.escape(message)}"):
        scenarios.load_scenario_file(path)
    if schema_says:
        with pytest.raises(jsonschema.ValidationError):
            validate({"scenarios": [entry]}, "scenario-file.schema.json")
    else:
        validate({"scenarios": [entry]}, "scenario-file.schema.json")


def test_scenario_file_loads(tmp_path):
    path = tmp_path / "s.json"
    path.write_text(json.dumps(GOOD_FILE))
    validate(GOOD_FILE, "scenario-file.schema.json")
    haiku, doc = scenarios.load_scenario_file(path)
    assert haiku.messages == ({"role": "user", "content": "Write a haiku about kilns."},) and haiku.category == "custom"
    assert doc.input_tokens == 400 and doc.source == str(path)
    assert [s.name for s in scenarios.select(None, [haiku, doc])] == ["haiku", "long-doc"]
    assert [s.name for s in scenarios.select(["chat-short"], [haiku])] == ["haiku", "chat-short"]


# --- scenarios in-process -------------------------------------------------------------------------------
def test_scenarios_in_process(tiny, home, tmp_path):
    out = tmp_path / "r.json"
    assert kiln_main(["bench", "scenarios", "--model", str(tiny), "--scenarios", "chat-short,multi-turn,context-700",
                      "--runs", "2", "--warmup", "1", "--format", "json", "-o", str(out)]) == 0
    report = json.loads(out.read_text())
    validate(report, "scenarios.schema.json")
    assert report["config"] == {**report["config"], "warmup_runs": 1, "measurement_runs": 2, "memory_tracking": True}
    result = report["results"][0]
    assert result["recipe"] == "kiln" and result["backend"] == "native" and result["ctx_size"] == 2048
    by_name = {s["name"]: s for s in result["scenarios"]}
    assert list(by_name) == ["chat-short", "multi-turn", "context-700"]
    for s in by_name.values():
        assert s["failed_runs"] == 0 and len(s["runs"]) == 2 and s["errors"] == []
        assert s["ttft_ms"]["min"] <= s["ttft_ms"]["mean"] <= s["ttft_ms"]["max"]
        assert s["duration_ms"]["min"] >= s["ttft_ms"]["min"]
        assert all(1 <= r["output_tokens"] <= s["output_tokens"] for r in s["runs"])
        assert s["memory_peak_gb"] > 0 and "ru_maxrss" in s["memory_note"]
        assert s["reported"]["source"].startswith("kiln engine timings")
        # the engine's own TTFT excludes rendering and tokenizing, which the client-side one includes
        assert all(r["reported"]["ttft_ms"] <= r["ttft_ms"] for r in s["runs"])
    assert 700 - 40 <= by_name["context-700"]["input_tokens"] <= 700
    assert by_name["multi-turn"]["input_tokens"] > by_name["chat-short"]["input_tokens"]
    rows = history.query("scenarios")
    assert len(rows) == 1 and rows[0]["model_sha256"] == report["provenance"]["target"]["model_sha256"]


def test_scenarios_skips_what_does_not_fit(tiny, home):
    target = scenarios.InProcess(str(tiny), 256, 1, "native")
    try:
        report = scenarios.run(target, scenarios.select(["chat-short", "code-debug"], []), runs=1, warmup=0,
                               memory=False, ignore_eos=True, command="test")
    finally:
        target.close()
    validate(report, "scenarios.schema.json")
    assert [s["name"] for s in report["results"][0]["scenarios"]] == ["chat-short"]
    (skipped,) = report["skipped_scenarios"]
    assert skipped["name"] == "code-debug" and skipped["reason"].endswith("exceed the context of 256")
    chat = report["results"][0]["scenarios"][0]
    assert chat["runs"][0]["output_tokens"] == 20  # --ignore-eos: the full budget
    assert chat["memory_peak_gb"] is None and chat["memory_note"] == "memory tracking off (--no-memory)"


# --- a stand-in OpenAI-compatible server ---------------------------------------------------------------------
class StandIn:
    """Streams `max_tokens` one-word deltas: the first after `ttft_s`, then one every `token_s`. Counts
    prompt tokens as words. Options: no usage/timings, HTTP 500 on every `fail_every`-th request."""

    def __init__(self, ttft_s=0.05, token_s=0.004, usage=True, fail_every=0, keep_alive=True):
        self.ttft_s, self.token_s, self.usage, self.fail_every = ttft_s, token_s, usage, fail_every
        self.keep_alive = keep_alive
        self.requests: list[dict] = []
        self.authorization: list[str | None] = []
        standin = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                standin.requests.append(body)
                standin.authorization.append(self.headers.get("Authorization"))
                if self.path != "/v1/chat/completions":
                    return self._json(404, {"error": {"message": f"no route {self.path}"}})
                if standin.fail_every and len(standin.requests) % standin.fail_every == 0:
                    return self._json(500, {"error": {"message": "stand-in failure"}})
                prompt = sum(len(m["content"].split()) for m in body["messages"])
                usage = {"prompt_tokens": prompt, "completion_tokens": body["max_tokens"],
                         "total_tokens": prompt + body["max_tokens"]}
                if not body.get("stream"):
                    return self._json(200, {"choices": [{"message": {"content": "w"}}], "usage": usage})
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                self._event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
                time.sleep(standin.ttft_s)
                for i in range(body["max_tokens"]):
                    if i:
                        time.sleep(standin.token_s)
                    self._event({"choices": [{"index": 0, "delta": {"content": "w "}}]})
                final = {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
                if standin.usage:
                    final["timings"] = {"prompt_n": prompt, "prompt_ms": 1000 * standin.ttft_s,
                                        "predicted_per_second": 1 / standin.token_s}
                self._event(final)
                if standin.usage and (body.get("stream_options") or {}).get("include_usage"):
                    self._event({"choices": [], "usage": usage})
                self._chunk(b"data: [DONE]\n\n")
                self._chunk(b"")
                # as an idle keep-alive timeout does: close without saying so
                self.close_connection = not standin.keep_alive

            def _event(self, payload):
                self._chunk(f"data: {json.dumps(payload)}\n\n".encode())

            def _chunk(self, data: bytes):
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()

            def _json(self, status, payload):
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def standin():
    servers = []

    def start(**options) -> StandIn:
        servers.append(StandIn(**options))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def test_http_target_measures_what_the_server_does(standin, home, tmp_path):
    server = standin(ttft_s=0.05, token_s=0.004)
    out = tmp_path / "r.json"
    assert kiln_main(["bench", "scenarios", "--url", server.url, "--model", "standin", "--pid", str(os.getpid()),
                      "--scenarios", "chat-short,code-short", "--runs", "3", "--warmup", "1",
                      "--api-key", "sk-standin-secret", "--format", "json", "-o", str(out)]) == 0
    assert set(server.authorization) == {"Bearer sk-standin-secret"}
    # the key reaches the server, never the result file or the history
    assert "sk-standin-secret" not in out.read_text()
    assert "--api-key ***" in history.query("scenarios")[0]["command"]
    report = json.loads(out.read_text())
    validate(report, "scenarios.schema.json")
    result = report["results"][0]
    assert result["recipe"] == "openai-compatible" and result["backend"] == server.url and result["ctx_size"] is None
    assert report["provenance"]["target"] == {"kind": "url", "url": server.url, "model": "standin",
                                              "server_local": True, "pid": os.getpid()}
    for s in result["scenarios"]:
        assert s["failed_runs"] == 0
        # The server holds the first content back 50 ms and spaces tokens 4 ms apart: nothing can beat that.
        assert s["ttft_ms"]["min"] >= 50
        assert s["tps"]["max"] <= 1 / 0.004 * 1.02
        assert s["tps"]["min"] > 1 / 0.004 / 4  # a loaded machine slows it, not by 4x
        assert s["duration_ms"]["min"] >= 50 + 4 * (s["output_tokens"] - 1)
        assert all(r["output_tokens"] == s["output_tokens"] and r["output_tokens_source"] == "usage" for r in s["runs"])
        assert s["reported"]["predicted_per_second"]["mean"] == pytest.approx(250)
        assert "VmHWM" in s["memory_note"] and s["memory_peak_gb"] > 0
    # 4 streamed requests per scenario (1 warm-up + 3), each with its own run id and the stream options
    streamed = [r for r in server.requests if r["stream"]]
    assert len(streamed) == 8 and all(r["stream_options"] == {"include_usage": True} for r in streamed)
    assert len({r["messages"][0]["content"][:10] for r in streamed}) == 8
    assert all(r["temperature"] == 0 and "ignore_eos" not in r for r in streamed)
    chat = next(s for s in result["scenarios"] if s["name"] == "chat-short")
    words = len(scenarios.BUILTIN["chat-short"].messages[0]["content"].split()) + 1  # + the run id
    assert chat["input_tokens"] == words
    assert history.query("scenarios")[0]["payload"]["results"] == report["results"]


def run_against(server, chosen, runs: int, memory: bool = False, ignore_eos: bool = False) -> dict:
    """scenarios.run against a stand-in server, the HTTP target closed afterwards."""
    target = scenarios.HTTP(server.url, "standin", None, 30, None)
    try:
        return scenarios.run(target, chosen, runs=runs, warmup=0, memory=memory, ignore_eos=ignore_eos,
                             command="test")
    finally:
        target.close()


def test_http_target_without_usage_or_pid(standin, home):
    server = standin(usage=False, ttft_s=0.01, token_s=0.001)
    report = run_against(server, [scenarios.BUILTIN["chat-short"]], runs=2, memory=True, ignore_eos=True)
    validate(report, "scenarios.schema.json")
    s = report["results"][0]["scenarios"][0]
    assert s["input_tokens"] is None and s["reported"] is None
    assert all(r["output_tokens"] == 20 and r["output_tokens_source"] == "content chunks" for r in s["runs"])
    assert s["memory_peak_gb"] is None and "pass --pid PID" in s["memory_note"]
    assert all(r["ignore_eos"] is True for r in server.requests)


def test_http_failures_are_counted_not_fatal(standin, home):
    server = standin(fail_every=2, ttft_s=0.0, token_s=0.001)
    report = run_against(server, [scenarios.BUILTIN["chat-short"]], runs=4)
    validate(report, "scenarios.schema.json")
    s = report["results"][0]["scenarios"][0]
    assert s["failed_runs"] == 2 and len(s["runs"]) == 2 and s["ttft_ms"]["n"] == 2
    assert s["errors"] == [f"run {i}: HTTP 500 from {server.url}/chat/completions: "
                           '{"error": {"message": "stand-in failure"}}' for i in (2, 4)]


def test_http_context_filler_is_sized_by_the_server(standin, home):
    server = standin(ttft_s=0.0, token_s=0.001)
    report = run_against(server, scenarios.select(["context-2k"], []), runs=2)
    (s,) = report["results"][0]["scenarios"]
    assert 2048 - 40 <= s["input_tokens"] <= 2048
    assert [r["max_tokens"] for r in server.requests if not r["stream"]] == [1] * len(
        [r for r in server.requests if not r["stream"]])


def test_a_connection_the_server_closed_is_reopened(standin, home):
    server = standin(keep_alive=False, ttft_s=0.0, token_s=0.001)
    report = run_against(server, [scenarios.BUILTIN["chat-short"]], runs=3)
    s = report["results"][0]["scenarios"][0]
    assert s["failed_runs"] == 0 and len(server.requests) == 3


def test_unreachable_url_is_named(home):
    target = scenarios.HTTP("http://127.0.0.1:9/v1", "x", None, 5, None)
    with pytest.raises(KilnError, match=r"cannot reach http://127.0.0.1:9/v1/chat/completions"):
        target.run([{"role": "user", "content": "hi"}], 4, False)
    with pytest.raises(KilnError, match="is not an http"):
        scenarios.HTTP("ftp://host/v1", "x", None, 5, None)


# --- compare ---------------------------------------------------------------------------------------------
def stat(mean, lo, hi):
    return {"mean": mean, "min": lo, "max": hi, "p50": mean, "p95": hi}


# seed 003, state 3 (idle box, performance profile): scenario, input tokens, output tokens,
# decode tok/s (XRT mean, min, max; HRX mean, min, max), TTFT ms (the same), duration ms (XRT, HRX),
# peak memory GB (XRT, HRX)
SEED_003 = [
    ("chat-short", 28, 20, (12.07, 12.01, 12.17), (11.42, 11.28, 11.62), (1585.8, 1567.6, 1602.9),
     (1658.4, 1592.1, 1705.9), (3287, 3466), (17.2, 17.5)),
    ("chat-long-output", 44, 256, (11.89, 11.88, 11.90), (11.4, 11.31, 11.57), (1570, 1558.1, 1580.6),
     (1645.4, 1570.2, 1721.6), (23288, 24407), (16.7, 18.4)),
    ("code-short", 35, 60, (12.03, 11.98, 12.10), (11.47, 11.47, 11.48), (1589.2, 1581.6, 1593.7),
     (1665.8, 1657.2, 1672.0), (6646, 6997), (16.8, 17.3)),
    ("code-explain", 208, 128, (11.75, 11.75, 11.75), (11.27, 11.27, 11.28), (1609.8, 1604.4, 1618.3),
     (1711.5, 1693.7, 1735.8), (12610, 13244), (16.8, 17.5)),
    ("code-debug", 363, 100, (11.6, 11.58, 11.62), (11.07, 11.06, 11.08), (1900.4, 1892.0, 1912.2),
     (1982.4, 1957.9, 2026.0), (10613, 11159), (16.8, 17.8)),
]


def lemonade_file(path: Path, which: int) -> Path:
    """A `lemonade bench --json` file holding seed 003's numbers for XRT (0) or HRX (1)."""
    scenarios_ = [{"name": name, "category": "chat" if name.startswith("chat") else "coding", "input_tokens": n_in,
                   "output_tokens": n_out, "failed_runs": 0, "tps": stat(*(tx, th)[which]),
                   "ttft_ms": stat(*(fx, fh)[which]), "duration_ms": stat(dur[which], dur[which], dur[which]),
                   "memory_peak_gb": mem[which]}
                  for name, n_in, n_out, tx, th, fx, fh, dur, mem in SEED_003]
    path.write_text(json.dumps({"model": "gemma4-it-e4b-FLM", "timestamp": "2026-09-04T20:11:25Z",
                                "config": {"warmup_runs": 0, "measurement_runs": 3, "memory_tracking": True},
                                "results": [{"recipe": "flm", "backend": "npu", "ctx_size": 131072,
                                             "scenarios": scenarios_}]}))
    return path


def md_rows(markdown: str, title: str) -> list[list[str]]:
    section = markdown.split(f"## {title}", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    return [[c.strip().replace("\\|", "|") for c in row.strip("|").split(" | ")] for row in rows]


def test_compare_reproduces_seed_003(tmp_path):
    xrt, hrx = lemonade_file(tmp_path / "xrt.json", 0), lemonade_file(tmp_path / "hrx.json", 1)
    comparison = compare.build([str(xrt), str(hrx)], ["XRT", "HRX"])
    md = compare.to_markdown(comparison)

    decode = md_rows(md, "Decode throughput by scenario (tok/s): mean and range over the runs")
    assert decode[0] == ["Scenario", "Output tokens [m]", "XRT mean [m]", "XRT min–max [m]", "HRX mean [m]",
                         "HRX min–max [m]", "Δ [d]", "Verdict [d]"]
    assert decode[2][:7] == ["chat-short", "20", "12.07", "12.01–12.17", "11.42", "11.28–11.62", "−5.39%"]
    # "In every scenario the HRX maximum is below the XRT minimum", and the gap exceeds every spread
    assert all(row[7].startswith("HRX max < XRT min; |Δ| > both spreads") for row in decode[2:])

    ttft = md_rows(md, "Time to first token by scenario (ms): mean and range over the runs")
    assert ttft[0][:2] == ["Scenario", "Input tokens [m]"]
    assert ttft[6][:7] == ["code-debug", "363", "1900.4", "1892.0–1912.2", "1982.4", "1957.9–2026.0", "+4.31%"]
    verdicts = {row[0]: row[7] for row in ttft[2:]}
    # "The ranges overlap in chat-short and chat-long-output, where HRX's three runs spread 6.9% and 9.2%;
    # in the three coding scenarios the HRX minimum is above the XRT maximum."
    assert verdicts["chat-short"] == "ranges overlap; |Δ| ≤ HRX spread 6.86%"
    assert verdicts["chat-long-output"] == "ranges overlap; |Δ| ≤ HRX spread 9.20%"
    assert all(verdicts[n].startswith("HRX min > XRT max") for n in ("code-short", "code-explain", "code-debug"))

    duration = md_rows(md, "Wall-clock duration per run: mean")
    assert duration[3] == ["chat-long-output", "23288", "24407", "+1,119", "+4.81%"]
    assert duration[-1] == ["sum (derived)", "56444", "59273", "+2,829", "+5.01%"]
    memory = md_rows(md, "Peak memory by scenario")
    assert memory[2] == ["chat-short", "17.20", "17.50"]
    spreads = md_rows(md, "Run-to-run spread")
    assert spreads[3][4] == "9.20%"  # HRX chat-long-output TTFT: the widest spread of the seed's state 3
    assert "Per-run values" not in md  # lemonade's files carry none
    assert "HRX: as the file reports it (no provenance recorded)" not in md  # same note for both: said once
    assert "all: as the file reports it (no provenance recorded)" in md
    assert md.count("[d]") > 10 and "Provenance tags: [m] measured" in md


def test_verdict_on_unrounded_means():
    a, b = stat(12.0749, 12.0, 12.1), stat(11.4249, 11.3, 11.5)
    v = compare.verdict(a, b)
    assert v["delta"] == pytest.approx((11.4249 - 12.0749) / 12.0749)  # not the rounded 12.07 / 11.42
    assert not v["overlap"] and v["exceeds_both_spreads"]
    v = compare.verdict(stat(100, 90, 110), stat(104, 101, 115))
    assert v["overlap"] and not v["exceeds_both_spreads"] and v["text"] == "ranges overlap; |Δ| ≤ A spread 20.00%"
    v = compare.verdict(stat(100, 99, 101), stat(103, 101.5, 200))
    assert not v["overlap"] and not v["exceeds_both_spreads"]  # apart, but B's own runs spread wider than Δ
    assert compare.verdict(None, a) is None


def test_compare_thread_counts_md_and_html(tiny, home, tmp_path):
    """Two real result files: kiln in-process with 1 and with 2 threads."""
    from html.parser import HTMLParser

    files = []
    for threads in (1, 2):
        files.append(tmp_path / f"t{threads}.json")
        assert kiln_main(["bench", "scenarios", "--model", str(tiny), "-t", str(threads), "--runs", "2",
                          "--warmup", "0", "--scenarios", "chat-short,code-short", "--format", "json",
                          "-o", str(files[-1])]) == 0
    md_path, html_path = tmp_path / "c.md", tmp_path / "c.html"
    assert kiln_main(["bench", "compare", *map(str, files), "--labels", "1t,2t", "-o", str(md_path)]) == 0
    assert kiln_main(["bench", "compare", *map(str, files), "--format", "html", "-o", str(html_path)]) == 0
    md = md_path.read_text()
    decode = md_rows(md, "Decode throughput by scenario (tok/s): mean and range over the runs")
    assert [row[0] for row in decode[2:]] == ["chat-short", "code-short"]
    reports = [json.loads(f.read_text()) for f in files]
    for row, name in zip(decode[2:], ("chat-short", "code-short")):
        a, b = (r["results"][0]["scenarios"][[s["name"] for s in r["results"][0]["scenarios"]].index(name)]["tps"]
                for r in reports)
        assert row[2] == f"{a['mean']:.2f}" and row[3] == f"{a['min']:.2f}–{a['max']:.2f}"
        assert row[6] == compare._pct((b["mean"] - a["mean"]) / a["mean"])
        assert row[7].startswith(("ranges overlap", "2t max < 1t min", "2t min > 1t max"))
    runs = md_rows(md, "Per-run values")
    assert len(runs) == 2 + 4 and runs[2][:2] == ["chat-short", "1t"]
    sources = md_rows(md, "Sources")
    assert "in-process native, threads: 1" in sources[2][3] and "kiln bench scenarios" in sources[2][6]

    page = html_path.read_text()

    class Check(HTMLParser):
        """Every element closed, in order; counts the tables."""

        def __init__(self):
            super().__init__()
            self.stack: list[str] = []
            self.tables = 0

        def handle_starttag(self, tag, attrs):
            if tag not in ("meta", "br", "img"):
                self.stack.append(tag)
            self.tables += tag == "table"

        def handle_endtag(self, tag):
            assert self.stack.pop() == tag

    checker = Check()
    checker.feed(page)
    assert checker.stack == [] and checker.tables == 7
    assert "<title>t1 vs t2</title>" in page and 'class="tag tag-d"' in page
    rows = history.query("compare")
    assert len(rows) == 2 and [s["label"] for s in rows[0]["payload"]["sources"]] == ["1t", "2t"]


def test_compare_input_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"stages": []}))
    good = lemonade_file(tmp_path / "x.json", 0)
    with pytest.raises(KilnError, match=f"{bad} is not a scenarios result"):
        compare.build([str(good), str(bad)])
    with pytest.raises(KilnError, match="--labels gives 1 names for 2 results"):
        compare.build([str(good), str(good)], ["a"])
    with pytest.raises(KilnError, match="two results are labelled 'x'"):
        compare.build([str(good), str(good)])
    with pytest.raises(KilnError, match="at least two results"):
        compare.build([str(good)])


# --- the real server against kiln in-process -----------------------------------------------------------
@pytest.mark.slow
def test_kiln_serve_and_in_process_measure_the_same_scenarios(smollm2_path, home):
    """`--url` against `kiln serve` and kiln in-process run the same scenarios: the same prompt token
    counts, the same reuse of the chat template's opening, every run valid against the schema and timed.
    The two targets take turns run by run, the first of each pair alternating; how their timings compare
    is measured by the benchmark, not asserted here."""
    from tests.conftest import TEST_HOME
    from tests.serving import kiln_server

    # code-short with 24 of its 60 output tokens: the test's time goes mostly to decoding
    chosen = [scenarios.BUILTIN["chat-short"], replace(scenarios.BUILTIN["code-short"], output_tokens=24)]
    pooled: dict[str, dict[str, list[dict]]] = {"url": {}, "in-process": {}}
    with kiln_server(TEST_HOME, "smollm2:135m", "--parallel", "1", "--ctx-len", "1024") as server:
        targets = {"url": scenarios.HTTP(f"{server.url}/v1", "smollm2:135m", None, 120, server.process.pid),
                   "in-process": scenarios.InProcess(str(smollm2_path), 1024, None, "native")}
        try:
            for s in chosen:  # the server's usage counts the prompt as the engine does
                messages = scenarios.with_run_id(s.messages, "0" * scenarios.RUN_ID_LENGTH)
                assert targets["url"].count(messages) == targets["in-process"].count(messages)
            for turn in range(6):
                for kind in ("url", "in-process") if turn % 2 else ("in-process", "url"):
                    report = scenarios.run(targets[kind], chosen, runs=1, warmup=0 if turn else 1, memory=True,
                                           ignore_eos=False, command="test")
                    validate(report, "scenarios.schema.json")
                    for s in report["results"][0]["scenarios"]:
                        assert s["failed_runs"] == 0, s["errors"]
                        pooled[kind].setdefault(s["name"], []).extend(s["runs"])
        finally:
            for target in targets.values():
                target.close()
    for name in ("chat-short", "code-short"):
        url, local = pooled["url"][name], pooled["in-process"][name]
        assert len(url) == len(local) == 6
        # Both reuse the chat template's fixed opening, and at most a few tokens more where two
        # random run ids happen to start alike, never the scenario's text.
        reused = {kind: [r["reported"]["cache_n"] for r in runs] for kind, runs in (("url", url), ("local", local))}
        head = min(reused["url"])
        assert min(reused["local"]) == head > 0
        assert max(reused["url"] + reused["local"]) <= head + scenarios.RUN_ID_LENGTH + 2
        # Both report every timing the schema asks for; whether they agree is a benchmark's question
        # (docs/PERF.md), not a unit test's: on a quiet machine the loopback HTTP path alone exceeds the spread.
        for key in ("ttft_ms", "tps"):
            assert all(r[key] > 0 for r in url + local), f"{name} {key}"


# --- kiln bench (llama-bench style) ----------------------------------------------------------------------

def test_bench_reports_rates_bytes_and_memory(tiny, home, capsys):
    from kiln.synth import SHAPES

    # options before the model, as llama-bench takes them
    assert kiln_main(["bench", "-p", "16", "-n", "8", "-b", "1,2", "-r", "1", "-o", "json", str(tiny)]) == 0
    report = json.loads(capsys.readouterr().out)
    by_test = {r["test"]: r for r in report["results"]}
    assert set(by_test) == {"pp16", "tg8", "tg8 b2"}
    for r in by_test.values():
        assert r["avg_ts"] > 0 and len(r["samples_ns"]) == 1
    one, two = by_test["tg8"], by_test["tg8 b2"]
    assert 0 <= one["host_fraction"] < 1
    # a second sequence adds its embedding row and its KV cache, computed here from the model's shape:
    # fp16 keys and values of every layer, positions 0..7 attending to 1..8 entries (mean 4.5)
    shape = SHAPES["tiny-llama"]
    kv_mean = shape.n_layers * 2 * shape.n_kv_heads * shape.head_dim * 2 * 4.5
    embed_row = shape.dim + 2 * (shape.dim // 32)  # one Q8_0 row: a fp16 scale and 32 int8 per block
    assert two["step_bytes"] - one["step_bytes"] == pytest.approx(kv_mean + embed_row)
    assert one["gb_s"] == pytest.approx(one["step_bytes"] * 8 / (one["samples_ns"][0] / 1e9) / 1e9)
    read = report["plain_read"][str(one["threads"])]
    assert read["gb_s"] > 0 and one["of_plain_read"] == pytest.approx(one["gb_s"] / read["gb_s"])
    pp = by_test["pp16"]  # the layers' matrices (q, k, v, o, gate, up, down), the head left out
    d, f, q, kv = shape.dim, shape.ffn_dim, shape.n_heads * shape.head_dim, shape.n_kv_heads * shape.head_dim
    assert pp["token_macs"] == shape.n_layers * (d * q + 2 * d * kv + q * d + 3 * d * f)
    assert pp["gmacs"] == pytest.approx(pp["token_macs"] * pp["median_ts"] / 1e9)
    # Q8_0 weights: the q, k, v and down projections take each token as a precise pair, two int8 rows
    assert pp["pair_macs"] == shape.n_layers * (d * q + 2 * d * kv + f * d)
    assert pp["run_gmacs"] == pytest.approx((pp["token_macs"] + pp["pair_macs"]) * pp["median_ts"] / 1e9)
    peak = report["int8_peak"]
    if peak is not None:
        assert pp["of_peak"] == pytest.approx(pp["gmacs"] / (peak["gmacs_per_core"] * pp["threads"]))
        assert pp["run_of_peak"] == pytest.approx(pp["run_gmacs"] / (peak["gmacs_per_core"] * pp["threads"]))
    mem = report["memory"][str(one["threads"])]
    assert mem["weights_bytes"] > 0 and mem["rss_growth_bytes"] > 0
    assert mem["growth_over_weights_kv"] == pytest.approx(mem["rss_growth_bytes"] / (mem["weights_bytes"] + mem["kv_bytes"]))


def test_pair_macs_leave_out_the_steps_amx_tiles_take(tiny, monkeypatch):
    """On AMX a step of amx_min_tokens rows or more sums each precise pair into one bf16 row, so only the
    prompt's shorter steps run second rows; elsewhere every step does."""
    from kiln.bench.perf import pair_macs
    from kiln.engine.native import NativeEngine
    from kiln.gguf import GGUFFile
    from kiln.models import family_for
    from kiln.native import kernels as K
    from kiln.synth import SHAPES

    g = GGUFFile(tiny)
    engine = NativeEngine(g, family_for(g), n_ctx=1024, n_slots=1, threads=1)
    shape = SHAPES["tiny-llama"]
    d, f, q, kv = shape.dim, shape.ffn_dim, shape.n_heads * shape.head_dim, shape.n_kv_heads * shape.head_dim
    every = shape.n_layers * (d * q + 2 * d * kv + f * d)
    rows, batch, least = engine.limits.rows, engine.limits.batch, 64
    tail = (batch + least) // 2  # a last step on the prefill plan, too short for the tiles
    assert batch < tail < least <= rows
    prompt = 2 * rows + tail
    monkeypatch.setattr(K, "amx_min_tokens", lambda: least)
    monkeypatch.setattr(K, "active_isa", lambda: "avx512")
    assert pair_macs(engine, prompt) == every
    monkeypatch.setattr(K, "active_isa", lambda: "amx")
    assert pair_macs(engine, prompt) == pytest.approx(every * tail / prompt)
    assert pair_macs(engine, least) == 0
    assert pair_macs(engine, batch) == every  # the decode plan's step: int8 rows
    engine.close()


def test_bench_greedy_tokens_feed_each_sequence_its_argmax(tiny, home, capsys):
    """`--tokens greedy`: every decode step after the first feeds each sequence the argmax of its last logits."""
    from kiln.bench import perf
    from kiln.engine.model import load

    model = load(str(tiny), backend="native", n_ctx=32, n_slots=2, threads=1, progress=False)
    fed, returned = [], []
    step = model.engine.step

    def recording_step(tokens, slots, positions, out_rows):
        logits = step(tokens, slots, positions, out_rows)
        fed.append(list(tokens))
        returned.append(logits.copy())
        return logits

    model.engine.step = recording_step
    (r,) = perf.bench_engine(model.engine, model.config.vocab_size, 0, 6, 0, 2, 1, np.random.default_rng(0),
                             tokens="greedy")
    model.close()
    assert r.test == "tg6 b2 greedy" and len(r.samples_ns) == 1 and len(fed) == 12  # warm-up + 1 repetition
    for rep in (0, 6):
        for i in range(rep + 1, rep + 6):
            assert fed[i] == returned[i - 1].argmax(axis=-1).tolist()
    assert kiln_main(["bench", "-p", "0", "-n", "4", "-r", "1", "--tokens", "greedy", "-o", "json", str(tiny)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["tokens"] == "greedy" and "greedy continuation" in report["method"]
    assert [x["test"] for x in report["results"]] == ["tg4 greedy"]


def test_bench_help_lists_options_and_subcommands(capsys):
    with pytest.raises(SystemExit) as exit_:
        kiln_main(["bench", "-h"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "--n-prompt" in out and "--batch" in out and "kiln bench sweep" in out


@pytest.mark.parametrize("flags,message", [(["-p", "-5"], "-p and -n must be at least 0"),
                                           (["-n", "-1"], "-p and -n must be at least 0"),
                                           (["-r", "0"], "-r at least 1"),
                                           (["-p", "0", "-n", "0"], "nothing to measure"),
                                           (["-t", "0"], "threads and batch sizes must be at least 1")])
def test_bench_refuses_bad_counts_before_loading(flags, message, tmp_path):
    with pytest.raises(SystemExit) as exit_:
        kiln_main(["bench", *flags, str(tmp_path / "never-opened.gguf")])
    assert message in str(exit_.value.code)
