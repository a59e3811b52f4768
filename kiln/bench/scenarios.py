"""`kiln bench scenarios`: lemonade bench's scenarios against kiln in-process or any OpenAI-compatible
endpoint, so kiln, llama-server, Ollama, FastFlowLM and lemonade are measured the same way.

Each run is one chat request, timed the same way for both kinds of target, as a client sees it: TTFT
from just before the prompt is rendered (in-process) or the request is sent (HTTP) to the first
generated text (content, or reasoning where a server streams it apart); duration to the end of the
response; tps = (output tokens − 1) / (end − first text), the decode rate after the first token.
Greedy sampling (temperature 0). A short unique run id opens the first message so that no run reuses
the KV of another's content: servers that cache prompt prefixes (kiln serve, llama-server) and the
in-process target alike reuse only the chat template's fixed opening (`reported.cache_n` says how
much). Timings the server reports itself (llama-server's `timings`, FastFlowLM's `usage` fields) are
kept beside the client's. The JSON is lemonade's layout plus per-run values and provenance, and
validates against kiln/bench/schema/scenarios.schema.json.
"""

from __future__ import annotations

import json
import os
import resource
import secrets
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from urllib.parse import urlparse

from kiln.bench.common import command_line, dump_json, model_context, provenance, summary, utc_now, write_output
from kiln.errors import KilnError

FILLER = "{filler}"  # where a context scenario's filler text goes
RUN_ID_LENGTH = 8  # hex digits

CODE_EXPLAIN = '''def merge_intervals(intervals):
    if not intervals:
        return []
    intervals = sorted(intervals, key=lambda pair: pair[0])
    merged = [list(intervals[0])]
    for start, end in intervals[1:]:
        last = merged[-1]
        if start <= last[1]:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    return [tuple(pair) for pair in merged]


def free_slots(busy, day_start, day_end, minimum):
    slots, cursor = [], day_start
    for start, end in merge_intervals(busy):
        if start - cursor >= minimum:
            slots.append((cursor, start))
        cursor = max(cursor, end)
    if day_end - cursor >= minimum:
        slots.append((cursor, day_end))
    return slots'''

CODE_DEBUG = '''import json
from collections import defaultdict


class Inventory:
    """Stock levels per warehouse, loaded from and saved to a JSON file."""

    def __init__(self, path):
        self.path = path
        self.stock = defaultdict(dict)

    def load(self):
        with open(self.path) as f:
            data = json.load(f)
        for warehouse, items in data.items():
            for sku, count in items.items():
                self.stock[warehouse][sku] = count

    def add(self, warehouse, sku, count):
        if count <= 0:
            raise ValueError("count must be positive")
        self.stock[warehouse][sku] = self.stock[warehouse].get(sku, 0) + count

    def remove(self, warehouse, sku, count):
        have = self.stock[warehouse].get(sku, 0)
        if count > have:
            raise ValueError(f"only {have} of {sku} in {warehouse}")
        self.stock[warehouse][sku] = have - count
        if self.stock[warehouse][sku] == 0:
            del self.stock[warehouse]

    def transfer(self, source, target, sku, count):
        self.remove(source, sku, count)
        self.add(target, sku, count)

    def total(self, sku):
        return sum(items.get(sku, 0) for items in self.stock.values())

    def save(self):
        with open(self.path, "w") as f:
            json.dump(self.stock, f, indent=2)


inventory = Inventory("stock.json")
inventory.load()
inventory.transfer("north", "south", "bolt-m6", 40)
print(inventory.total("bolt-m6"))
inventory.save()'''

# Text to fill a context scenario; kiln's own prose, repeated as needed.
FILLER_TEXT = (
    "The survey ship spent the winter mapping the northern coast. Each morning the crew lowered the launch, "
    "sounded the channel between the islands and wrote the depths into a ledger that grew heavier every week. "
    "The cook kept a tally of the seals on the rocks, the carpenter mended the boats, and the captain copied the "
    "day's soundings onto a chart pinned to the wardroom table. When the ice came early the ship anchored in a "
    "sheltered bay, and the crew spent the dark months checking their numbers against each other. "
)


@dataclass(frozen=True)
class Scenario:
    name: str
    category: str
    messages: tuple[dict, ...]
    output_tokens: int
    input_tokens: int | None = None  # a context scenario: fill FILLER in its messages to this many prompt tokens
    source: str = "built-in"


def _user(text: str) -> tuple[dict, ...]:
    return ({"role": "user", "content": text},)


BUILTIN: dict[str, Scenario] = {s.name: s for s in [
    Scenario("chat-short", "chat", _user("Why is the sky blue? Answer in two sentences."), 20),
    Scenario("chat-long-output", "chat", _user(
        "Write a long, detailed story about a lighthouse keeper who finds a message in a bottle. "
        "Describe the setting, the message and what the keeper decides to do."), 256),
    Scenario("code-short", "code", _user(
        "Write a Python function that returns True when a string is a palindrome, ignoring case and spaces."), 60),
    Scenario("code-explain", "code", _user(
        f"Explain what this Python code does, step by step:\n\n```python\n{CODE_EXPLAIN}\n```"), 128),
    Scenario("code-debug", "code", _user(
        "This program sometimes loses a whole warehouse's stock after a transfer. Find the bug and show the "
        f"fix:\n\n```python\n{CODE_DEBUG}\n```"), 100),
    Scenario("multi-turn", "multi-turn", (
        {"role": "system", "content": "You are a concise assistant for a small bakery."},
        {"role": "user", "content": "We bake 120 loaves a day. How much flour is that if a loaf takes 450 g?"},
        {"role": "assistant", "content": "120 loaves × 450 g = 54,000 g, so 54 kg of flour a day."},
        {"role": "user", "content": "Flour comes in 25 kg sacks. How many sacks a week, baking six days?"},
        {"role": "assistant", "content": "54 kg × 6 = 324 kg a week; 324 / 25 = 12.96, so 13 sacks."},
        {"role": "user", "content": "If we add 30 loaves on Saturdays only, how does the order change?"},
    ), 64),
    *[Scenario(f"context-{k}k", "context", _user(
        f"{FILLER}\n\nIn one sentence, what did the survey ship's crew do during the winter?"), 32, k * 1024)
      for k in (4, 16, 32)],
]}
DEFAULT_SELECTION = ("chat-short", "chat-long-output", "code-short", "code-explain", "code-debug", "multi-turn")

FIGURES = {
    "ttft_ms": "measured client-side: from just before the prompt is rendered (in-process) or the request is "
               "sent (HTTP) to the first non-empty content or reasoning delta (streaming)",
    "duration_ms": "measured client-side: from the same start to the end of the response",
    "tps": "derived per run: (output tokens − 1) / (end of response − first generated text)",
    "input_tokens": "measured: prompt tokens as the engine tokenized them (in-process) or as the server's usage "
                    "reports them (HTTP); null when the server reports no usage",
    "output_tokens": "the scenario's max_tokens; runs[].output_tokens holds what was generated",
    "memory_peak_gb": "measured, 10^9 bytes: peak resident memory of the serving process up to the end of the "
                      "scenario (in-process: getrusage ru_maxrss of this process; HTTP with --pid: VmHWM of that "
                      "process from /proc); null with memory_note otherwise",
    "reported": "server-reported: the engine's own timings (in-process), llama-server/kiln `timings` or "
                "FastFlowLM `usage` fields, as the target sent them; not measured by this tool",
    "statistics": "derived: mean, min, max, p50, p95 (linear interpolation), sample sd over the measured runs",
}


# --- scenario selection and files ---------------------------------------------------------------------
def context_scenario(name: str) -> Scenario | None:
    """`context-N` for any size N (tokens, 'k' = 1024): a built-in shape with that target."""
    from kiln.bench.sweep import parse_size

    if not name.startswith("context-") or name == "context-multi-turn":
        return None
    size = parse_size(name[len("context-"):])
    return replace(BUILTIN["context-4k"], name=name, input_tokens=size)


def select(names: list[str] | None, extra: list[Scenario]) -> list[Scenario]:
    """Scenarios by name, category, `all` or `context-N`; with nothing named, the default set (or only the
    scenario file's, when there is one)."""
    if not names:
        return list(extra) if extra else [BUILTIN[n] for n in DEFAULT_SELECTION]
    pool = {**BUILTIN, **{s.name: s for s in extra}}
    chosen: dict[str, Scenario] = {s.name: s for s in extra}
    for name in names:
        if name == "all":
            chosen.update(pool)
        elif name in pool:
            chosen[name] = pool[name]
        elif any(s.category == name for s in pool.values()):
            chosen.update({s.name: s for s in pool.values() if s.category == name})
        elif (s := context_scenario(name)) is not None:
            chosen[name] = s
        else:
            categories = sorted({s.category for s in pool.values()})
            raise KilnError(f"unknown scenario {name!r}: choose from {', '.join(pool)}, a category "
                            f"({', '.join(categories)}), all, or context-N (e.g. context-8k)")
    return list(chosen.values())


def load_scenario_file(path: str | Path) -> list[Scenario]:
    """A user's scenarios (format: kiln/bench/schema/scenario-file.schema.json); errors name the entry and field."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise KilnError(f"cannot read scenario file {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise KilnError(f"scenario file {path} is not JSON: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("scenarios"), list) or not data["scenarios"]:
        raise KilnError(f"scenario file {path}: expected an object with a non-empty list 'scenarios'")
    out = []
    for i, entry in enumerate(data["scenarios"]):
        where = f"scenario file {path}: scenarios[{i}]"
        if not isinstance(entry, dict):
            raise KilnError(f"{where}: expected an object")
        unknown = set(entry) - {"name", "category", "prompt", "messages", "output_tokens", "input_tokens"}
        if unknown:
            raise KilnError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
        name = entry.get("name")
        if not isinstance(name, str) or not name:
            raise KilnError(f"{where}.name: expected a non-empty string")
        where = f"scenario file {path}: scenario {name!r}"
        if ("prompt" in entry) == ("messages" in entry):
            raise KilnError(f"{where}: give exactly one of 'prompt' and 'messages'")
        if "prompt" in entry:
            if not isinstance(entry["prompt"], str) or not entry["prompt"]:
                raise KilnError(f"{where}.prompt: expected a non-empty string")
            messages = _user(entry["prompt"])
        else:
            messages = entry["messages"]
            if not isinstance(messages, list) or not messages or not all(
                    isinstance(m, dict) and set(m) == {"role", "content"} and m["role"] in ("system", "user", "assistant")
                    and isinstance(m["content"], str) for m in messages):
                raise KilnError(f"{where}.messages: expected a non-empty list of {{role: system|user|assistant, "
                                "content: string}}")
            messages = tuple(dict(m) for m in messages)
        output = entry.get("output_tokens")
        if not isinstance(output, int) or isinstance(output, bool) or output < 1:
            raise KilnError(f"{where}.output_tokens: expected an integer >= 1, got {output!r}")
        target = entry.get("input_tokens")
        n_fillers = sum(m["content"].count(FILLER) for m in messages)
        if target is not None:
            if not isinstance(target, int) or isinstance(target, bool) or target < 1:
                raise KilnError(f"{where}.input_tokens: expected an integer >= 1, got {target!r}")
            if n_fillers != 1:
                raise KilnError(f"{where}: input_tokens needs exactly one {FILLER} in the messages, found {n_fillers}")
        elif n_fillers:
            raise KilnError(f"{where}: {FILLER} appears but input_tokens (the size to fill to) is missing")
        category = entry.get("category", "custom")
        if not isinstance(category, str) or not category:
            raise KilnError(f"{where}.category: expected a non-empty string")
        out.append(Scenario(name, category, messages, output, target, source=str(path)))
    return out


# --- prompts -------------------------------------------------------------------------------------------
def with_run_id(messages: tuple[dict, ...], run_id: str) -> list[dict]:
    """The messages with `[run_id]` opening the first one, so no two runs share a cacheable prefix
    beyond the template's opening tokens."""
    first, *rest = messages
    return [{**first, "content": f"[{run_id}] {first['content']}"}, *[dict(m) for m in rest]]


def new_run_id() -> str:
    return secrets.token_hex(RUN_ID_LENGTH // 2)


def fill(messages: tuple[dict, ...], text: str) -> tuple[dict, ...]:
    return tuple({**m, "content": m["content"].replace(FILLER, text)} for m in messages)


def filler_of(n_chars: int) -> str:
    repeats = n_chars // len(FILLER_TEXT) + 1
    return (FILLER_TEXT * repeats)[:n_chars]


def size_filler(scenario: Scenario, count) -> tuple[tuple[dict, ...], int]:
    """The messages with FILLER replaced by filler text sized so the prompt is at most (and close to)
    `scenario.input_tokens` tokens by `count(messages)`; returns them with their token count. Sized
    with a placeholder run id, RUN_ID_LENGTH + 3 tokens short of the target, so that whatever the
    real run ids tokenize to, no run's prompt exceeds it."""
    target = scenario.input_tokens - (RUN_ID_LENGTH + 3)
    base = count(with_run_id(fill(scenario.messages, ""), "0" * RUN_ID_LENGTH))
    if base >= target:
        raise KilnError(f"scenario {scenario.name}: the prompt without filler is already {base} tokens, "
                        f"too close to its target of {scenario.input_tokens}")
    sample = len(FILLER_TEXT) * 4
    per_char = (count(with_run_id(fill(scenario.messages, filler_of(sample)), "0" * RUN_ID_LENGTH)) - base) / sample
    if per_char <= 0:
        raise KilnError(f"scenario {scenario.name}: the filler text adds no tokens to the prompt")
    n_chars = int((target - base) / per_char)
    # A proportional guess lands within a few tokens; shrink until it fits (counting may be a request).
    for _ in range(8):
        messages = fill(scenario.messages, filler_of(n_chars))
        n = count(with_run_id(messages, "0" * RUN_ID_LENGTH))
        if n <= target:
            return messages, n
        n_chars -= int((n - target) / per_char) + 1
    raise KilnError(f"scenario {scenario.name}: could not size the filler to {target} tokens")


# --- targets ---------------------------------------------------------------------------------------------
@dataclass
class Run:
    ttft_ms: float
    duration_ms: float
    tps: float | None
    input_tokens: int | None
    output_tokens: int
    output_tokens_source: str  # "engine", "usage", or "content chunks" (a server that reports no usage)
    reported: dict = field(default_factory=dict)  # the target's own timings, llama-server names

    def as_dict(self) -> dict:
        return {"ttft_ms": self.ttft_ms, "duration_ms": self.duration_ms, "tps": self.tps,
                "input_tokens": self.input_tokens, "output_tokens": self.output_tokens,
                "output_tokens_source": self.output_tokens_source, "reported": self.reported or None}


def decode_rate(output_tokens: int, first: float | None, end: float) -> float | None:
    if first is None or output_tokens < 2 or end <= first:
        return None
    return (output_tokens - 1) / (end - first)


class InProcess:
    """kiln's engine in this process, driven as `kiln run` drives it, one request at a time through a
    scheduler of one slot: chat template, the model's sampling defaults with temperature 0, its stops,
    and reuse of the KV of the prefix a prompt shares with the last one (with the run id, that is the
    template's fixed opening, e.g. a default system prompt)."""

    recipe = "kiln"
    reported_source = "kiln engine timings (in-process): prompt_ms = prefill, ttft_ms = prefill + first sample"

    def __init__(self, model_ref: str, n_ctx: int, threads: int | None, backend: str):
        from kiln.engine.model import load
        from kiln.engine.scheduler import Scheduler
        from kiln.store.fetch import sha256_file

        self.model = load(model_ref, backend=backend, n_ctx=n_ctx, threads=threads, progress=False)
        self.backend = backend
        self.sha256 = self.model.sha256 or sha256_file(self.model.path)
        self.ctx_size = self.model.n_ctx
        self.scheduler = Scheduler(self.model.engine, n_slots=1, max_queue=0)

    def describe(self) -> dict:
        m = self.model
        return {"kind": "in-process", "model": m.tag, "model_sha256": self.sha256, "backend": self.backend,
                "engine": type(m.engine).__name__, "threads": m.engine.threads, "n_ctx": m.n_ctx}

    def count(self, messages) -> int:
        tok = self.model.tokenizer
        return len(tok.encode(tok.apply_chat_template(list(messages))))

    def fit_problem(self, messages, output_tokens: int) -> str | None:
        n = self.count(with_run_id(messages, "0" * RUN_ID_LENGTH))
        if n + output_tokens > self.ctx_size:
            return f"{n} prompt + {output_tokens} output tokens exceed the context of {self.ctx_size}"
        return None

    def run(self, messages: list[dict], max_tokens: int, ignore_eos: bool) -> Run:
        from kiln.engine.generate import generate
        from kiln.engine.request import GenerationRequest, prepare

        start = time.perf_counter()
        # a prompt that does not fit fails the run
        seq, _ = prepare(self.model, GenerationRequest(messages=list(messages), max_tokens=max_tokens,
                                                       sampling={"temperature": 0.0}, ignore_eos=ignore_eos))
        first = None
        for piece in generate(self.scheduler, seq):
            if first is None and piece:
                first = time.perf_counter()
        end = time.perf_counter()
        t = seq.timings
        if first is None:
            raise KilnError(f"the model generated no text ({t.completion_tokens} tokens, finish: {seq.finish_reason})")
        reported = {"cache_n": float(t.cached_tokens), "ttft_ms": t.ttft_ms, "prompt_ms": t.prefill_ms,
                    "prompt_per_second": t.prefill_tps, "predicted_per_second": t.decode_tps}
        return Run((first - start) * 1e3, (end - start) * 1e3,
                   decode_rate(t.completion_tokens, first, end), t.prompt_tokens, t.completion_tokens, "engine",
                   reported)

    def peak_memory(self) -> tuple[float | None, str]:
        # Linux reports ru_maxrss in KiB.
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return rss / 1e9, "getrusage(RUSAGE_SELF).ru_maxrss of this process (peak since it started)"

    def close(self) -> None:
        self.model.close()


class HTTP:
    """Any OpenAI-compatible server, through the public streaming chat API only. One persistent
    connection (as SDK clients keep one), reopened after a failure; the standard library only."""

    recipe = "openai-compatible"
    reported_source = "the server's response: `timings` (llama-server, kiln) or FastFlowLM `usage` fields"

    def __init__(self, url: str, model: str, api_key: str | None, timeout: float, pid: int | None):
        self.url, self.model_name, self.pid, self.timeout = url.rstrip("/"), model, pid, timeout
        parsed = urlparse(self.url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise KilnError(f"--url {url!r} is not an http(s) URL such as http://127.0.0.1:8080/v1")
        self.parsed = parsed
        self.local = parsed.hostname in ("127.0.0.1", "localhost", "::1")
        self.headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.ctx_size = None
        self.connection = None

    def describe(self) -> dict:
        return {"kind": "url", "url": self.url, "model": self.model_name, "server_local": self.local, "pid": self.pid}

    def fit_problem(self, messages, output_tokens: int) -> str | None:
        return None  # the server's context is not known here; a prompt that does not fit fails its runs

    def _body(self, messages, max_tokens: int, ignore_eos: bool, stream: bool) -> dict:
        body = {"model": self.model_name, "messages": list(messages), "max_tokens": max_tokens, "temperature": 0,
                "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        if ignore_eos:
            body["ignore_eos"] = True  # llama-server and vLLM honour it; other servers ignore unknown fields
        return body

    def _request(self, body: dict):
        """Send `body` to /chat/completions: the open response (status 200) and the time it was sent, or
        a KilnError naming the failure. A kept-alive connection the server has since closed is reopened
        and the request sent again, timed from the second send."""
        import http.client

        data = json.dumps(body)
        for attempt in (1, 2):
            reused = self.connection is not None
            if not reused:
                kind = http.client.HTTPSConnection if self.parsed.scheme == "https" else http.client.HTTPConnection
                self.connection = kind(self.parsed.hostname, self.parsed.port, timeout=self.timeout)
            sent = time.perf_counter()
            try:
                self.connection.request("POST", f"{self.parsed.path}/chat/completions", data, self.headers)
                response = self.connection.getresponse()
                break
            except (OSError, http.client.HTTPException) as e:
                self.close()
                stale = isinstance(e, (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected))
                if not (reused and stale and attempt == 1):
                    raise KilnError(f"cannot reach {self.url}/chat/completions: {e}") from None
        if response.status != 200:
            text = response.read().decode(errors="replace")[:300]
            raise KilnError(f"HTTP {response.status} from {self.url}/chat/completions: {text}")
        return response, sent

    def count(self, messages) -> int:
        """Prompt tokens as the server counts them: a one-token request, read from its usage."""
        response, _ = self._request(self._body(messages, 1, False, stream=False))
        try:
            usage = json.loads(response.read()).get("usage") or {}
        except (OSError, ValueError) as e:
            self.close()
            raise KilnError(f"{self.url}/chat/completions sent a response that is not JSON: {e}") from None
        if not isinstance(usage.get("prompt_tokens"), int):
            raise KilnError(f"{self.url} reports no usage.prompt_tokens, so a filler cannot be sized to a token "
                            "count there; use a scenario file with fixed text instead")
        return usage["prompt_tokens"]

    def run(self, messages: list[dict], max_tokens: int, ignore_eos: bool) -> Run:
        import http.client

        usage, timings, chunks, first = None, None, 0, None
        response, start = self._request(self._body(messages, max_tokens, ignore_eos, stream=True))
        try:
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    self.close()  # the rest of the stream is unknown
                    raise KilnError(f"{self.url} sent an error mid-stream: {json.dumps(chunk['error'])[:300]}")
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    # reasoning deltas (llama-server, Ollama) are generated tokens too, counted in usage
                    if any(delta.get(k) for k in ("content", "reasoning_content", "reasoning")):
                        chunks += 1
                        if first is None:
                            first = time.perf_counter()
                usage = chunk.get("usage") or usage
                timings = chunk.get("timings") or timings
            response.read()  # the rest (nothing after [DONE]), so the connection can be reused
        except (OSError, http.client.HTTPException, ValueError) as e:
            self.close()
            raise KilnError(f"the stream from {self.url}/chat/completions broke off: {e}") from None
        end = time.perf_counter()
        if first is None:
            raise KilnError(f"{self.url} streamed no content for model {self.model_name!r}")
        if usage and isinstance(usage.get("completion_tokens"), int):
            output, source = usage["completion_tokens"], "usage"
        else:
            output, source = chunks, "content chunks"
        input_tokens = usage.get("prompt_tokens") if usage else None
        return Run((first - start) * 1e3, (end - start) * 1e3, decode_rate(output, first, end), input_tokens,
                   output, source, server_reported(timings, usage))

    def peak_memory(self) -> tuple[float | None, str]:
        if self.pid is None:
            return None, ("the serving process is not observable from the client: pass --pid PID for a server "
                          "on this machine")
        try:
            status = Path(f"/proc/{self.pid}/status").read_text()
        except OSError as e:
            return None, f"cannot read /proc/{self.pid}/status: {e.strerror}"
        for line in status.splitlines():
            if line.startswith("VmHWM:"):  # in kB as /proc writes it, which are KiB
                note = f"VmHWM of process {self.pid} from /proc (peak since it started)"
                if not self.local:
                    note += f"; --url names {self.parsed.hostname}, so --pid is taken to be its server"
                return int(line.split()[1]) * 1024 / 1e9, note
        return None, f"/proc/{self.pid}/status has no VmHWM"

    def close(self) -> None:
        if self.connection is not None:
            self.connection.close()
            self.connection = None


def server_reported(timings: dict | None, usage: dict | None) -> dict:
    """The figures a server reports about itself, under llama-server's names."""
    out = {}
    if isinstance(timings, dict):
        for key in ("cache_n", "ttft_ms", "prompt_ms", "prompt_per_second", "predicted_ms", "predicted_per_second"):
            if isinstance(timings.get(key), (int, float)):
                out[key] = float(timings[key])
    if isinstance(usage, dict):
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        if "cache_n" not in out and isinstance(cached, int):  # OpenAI's name for the tokens served from cache
            out["cache_n"] = float(cached)
        # FastFlowLM's extra usage fields
        for theirs, ours in (("prefill_speed_tps", "prompt_per_second"), ("decoding_speed_tps", "predicted_per_second")):
            if ours not in out and isinstance(usage.get(theirs), (int, float)):
                out[ours] = float(usage[theirs])
    return out


# --- the benchmark ------------------------------------------------------------------------------------
def measure(target, scenario: Scenario, runs: int, warmup: int, ignore_eos: bool, progress=None) -> dict:
    """One scenario's entry in lemonade's layout, plus per-run values."""
    messages = scenario.messages
    if scenario.input_tokens is not None:
        messages, _ = size_filler(scenario, target.count)
    entry = {"name": scenario.name, "category": scenario.category, "source": scenario.source}
    problem = target.fit_problem(messages, scenario.output_tokens)
    if problem:
        return {**entry, "skipped": problem}
    records, errors = [], []
    for i in range(warmup + runs):
        try:
            r = target.run(with_run_id(messages, new_run_id()), scenario.output_tokens, ignore_eos)
        except KilnError as e:  # a failed run is data: counted, its error kept, the others still measured
            errors.append(f"{'warm-up' if i < warmup else 'run'} {i + 1}: {e}")
            _say(progress, f"{scenario.name}: {errors[-1]}")
            continue
        if i >= warmup:
            records.append(r)
            _say(progress, f"{scenario.name} run {len(records)}/{runs}: TTFT {r.ttft_ms:.1f} ms, "
                           f"{r.tps or 0:.1f} tok/s, {r.output_tokens} tokens")
    inputs = [r.input_tokens for r in records if r.input_tokens is not None]
    memory, memory_note = target.peak_memory()
    reported_keys = sorted({k for r in records for k in r.reported})
    reported = ({"source": target.reported_source,
                 **{k: summary([r.reported.get(k) for r in records]) for k in reported_keys}} if reported_keys else None)
    return {
        **entry,
        "input_tokens": round(sum(inputs) / len(inputs)) if inputs else None,
        "output_tokens": scenario.output_tokens,
        "failed_runs": runs - len(records),
        "ttft_ms": summary([r.ttft_ms for r in records]),
        "duration_ms": summary([r.duration_ms for r in records]),
        "tps": summary([r.tps for r in records]),
        "memory_peak_gb": memory,
        "memory_note": memory_note,
        "output_tokens_measured": summary([r.output_tokens for r in records]),
        "reported": reported,
        "runs": [r.as_dict() for r in records],
        "errors": errors,
    }


def default_ctx(model_ctx: int, scenarios: list[Scenario]) -> int:
    """The engine's context: room for the largest context scenario, at least kiln's usual 4096, at most the model's."""
    from kiln.engine.model import DEFAULT_CTX

    need = max([DEFAULT_CTX] + [s.input_tokens + s.output_tokens for s in scenarios if s.input_tokens])
    return min(model_ctx, need)


def run(target, scenarios: list[Scenario], runs: int, warmup: int, memory: bool, ignore_eos: bool,
        command: str, progress=None) -> dict:
    from kiln.machine import facts

    if runs < 1 or warmup < 0:
        raise KilnError("kiln bench scenarios: --runs must be at least 1 and --warmup at least 0")
    measured, skipped = [], []
    for s in scenarios:
        entry = measure(target, s, runs, warmup, ignore_eos, progress)
        if "skipped" in entry:
            _say(progress, f"skipping {s.name}: {entry['skipped']}")
            skipped.append({"name": s.name, "reason": entry["skipped"]})
            continue
        if not memory:
            entry["memory_peak_gb"], entry["memory_note"] = None, "memory tracking off (--no-memory)"
        measured.append(entry)
    about = target.describe()
    return {
        "model": about["model"],
        "timestamp": utc_now(),
        "config": {"warmup_runs": warmup, "measurement_runs": runs, "memory_tracking": memory,
                   "temperature": 0, "ignore_eos": ignore_eos,
                   "prompt_cache": "a unique run id opens the first message: only the template's fixed opening can be reused"},
        "results": [{"recipe": target.recipe, "backend": about.get("backend") or about.get("url"),
                     "ctx_size": target.ctx_size, "scenarios": measured}],
        "skipped_scenarios": skipped,
        "machine": facts(),
        "provenance": provenance("kiln bench scenarios", command, FIGURES, about),
    }


def _say(progress, message: str) -> None:
    if progress:
        progress(message)


# --- output ------------------------------------------------------------------------------------------
def _cell(stat: dict | None, digits: int) -> str:
    if not stat:
        return "—"
    return f"{stat['mean']:.{digits}f} ({stat['min']:.{digits}f}–{stat['max']:.{digits}f})"


def to_markdown(report: dict) -> str:
    p, result = report["provenance"], report["results"][0]
    where = p["target"].get("url") or f"in-process, {p['target']['backend']}, {p['target'].get('threads')} threads"
    lines = [f"model: {report['model']} · {where} · {report['config']['measurement_runs']} runs after "
             f"{report['config']['warmup_runs']} warm-up · kiln {p['kiln_version']} · {report['timestamp']}", "",
             "| scenario | input tokens | output tokens | TTFT ms | tok/s | duration ms | peak memory GB | failed |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for s in result["scenarios"]:
        out = s["output_tokens_measured"]
        memory = f"{s['memory_peak_gb']:.2f}" if s["memory_peak_gb"] is not None else "—"
        lines.append(f"| {s['name']} | {s['input_tokens'] if s['input_tokens'] is not None else '—'} | "
                     f"{s['output_tokens']}" + (f" ({out['mean']:.0f} made)" if out and out["mean"] != s["output_tokens"] else "")
                     + f" | {_cell(s['ttft_ms'], 1)} | {_cell(s['tps'], 2)} | {_cell(s['duration_ms'], 0)} | "
                     f"{memory} | {s['failed_runs']} |")
    lines += ["", "mean (min–max), measured client-side; tok/s = (output tokens − 1) / (end − first text). "
                  f"Peak memory: {result['scenarios'][0]['memory_note'] if result['scenarios'] else '—'}."]
    lines += [f"skipped {s['name']}: {s['reason']}" for s in report["skipped_scenarios"]]
    return "\n".join(lines) + "\n"


def add_arguments(p) -> None:
    p.description = __doc__.split("\n\n")[0]
    target = p.add_argument_group("target (one of)")
    target.add_argument("--model", "-m", required=True,
                        help="kiln in-process: a tag or .gguf path; with --url: the model name the server expects")
    target.add_argument("--url", help="an OpenAI-compatible base URL, e.g. http://127.0.0.1:8080/v1")
    target.add_argument("--api-key", default=os.environ.get("KILN_BENCH_API_KEY"),
                        help="bearer token for --url (env KILN_BENCH_API_KEY)")
    target.add_argument("--pid", type=int, help="with --url: the local server process whose peak memory to read")
    p.add_argument("--scenarios", help="comma-separated names, categories (chat, code, multi-turn, context), all, or "
                                       f"context-N; default: {','.join(DEFAULT_SELECTION)}")
    p.add_argument("--scenario-file", help="JSON file of your own scenarios (see kiln/bench/schema/scenario-file.schema.json)")
    p.add_argument("--runs", type=int, default=3, help="measured runs per scenario (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured runs before them (default 1)")
    p.add_argument("--no-memory", action="store_true", help="do not track peak memory")
    p.add_argument("--ignore-eos", action="store_true",
                   help="generate the full output_tokens (in-process; llama-server and vLLM honour it over HTTP)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request (default 300)")
    p.add_argument("--ctx-size", type=int, help="in-process context (default: fits the scenarios, at most the model's)")
    p.add_argument("-t", "--threads", type=int, help="in-process native threads (default: physical cores)")
    p.add_argument("--backend", choices=["native", "oracle"], help="in-process engine (default native)")
    p.add_argument("--format", choices=["md", "json"], default="md", help="what goes to -o (default md)")
    p.add_argument("-o", "--output", help="write the --format output here instead of stdout")
    p.add_argument("--json", help="also write the JSON to this file")


def main(args) -> int:
    from kiln import history

    extra = load_scenario_file(args.scenario_file) if args.scenario_file else []
    names = [n.strip() for n in args.scenarios.split(",") if n.strip()] if args.scenarios else None
    scenarios = select(names, extra)
    if args.url and (args.ctx_size or args.threads or args.backend):
        raise KilnError("--ctx-size, --threads and --backend apply to kiln in-process; the server at --url has its "
                        "own settings")
    if not args.url and args.pid:
        raise KilnError("--pid applies to --url targets; in-process, this process's own peak memory is read")
    if args.url:
        target = HTTP(args.url, args.model, args.api_key, args.timeout, args.pid)
    else:
        n_ctx = args.ctx_size or default_ctx(model_context(args.model, progress=True), scenarios)
        target = InProcess(args.model, n_ctx, args.threads, args.backend or "native")
    command = command_line("kiln bench scenarios", args, secret=("api_key",))
    try:
        report = run(target, scenarios, args.runs, args.warmup, not args.no_memory, args.ignore_eos, command,
                     progress=lambda msg: print(f"kiln bench scenarios: {msg}", file=sys.stderr))
    finally:
        target.close()
    history.record("scenarios", report, model_sha256=report["provenance"]["target"].get("model_sha256"),
                   command=command)
    write_output(to_markdown(report) if args.format == "md" else dump_json(report), args.output)
    if args.json:
        write_output(dump_json(report), args.json)
    return 0
