"""Several models resident in one `kiln serve`: alternating requests without reloads, eviction of the least
recently used idle model when the count or the memory budget (--max-memory) leaves no room, each model's
own keep-alive, and a loaded model answering while another is busy. Driven by the official `openai` and
`ollama` clients against tiny random models."""

from __future__ import annotations

import threading
import time

import httpx
import ollama
import openai
import pytest

from kiln.store import Store
from kiln.synth import write_random_gguf
from kiln.validate import footprint
from tests.serving import kiln_server

A, B, C = "alpha:tiny", "beta:tiny", "gamma:tiny"
CTX, SLOTS = "256", "2"
LONG = 8192  # the models' own context: room for a generation that outlasts another model's requests
STORY = LONG - 16  # tokens of a generation that outlasts a load's wait
FORCED = {"300": 100}  # a token that is never a stop token, pushed to the top: generation runs to its limit


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    store = Store(home=home)
    for seed, (tag, shape) in enumerate(((A, "tiny-qwen2"), (B, "tiny-llama"), (C, "tiny-qwen3"))):
        path = write_random_gguf(home / f"{seed}.gguf", shape, seed=seed, context_length=LONG)
        store.pull(str(path), progress=False, name=tag)
    return home


def loads(server, tag: str) -> float:
    return server.metric("kiln_model_loads_total", f'model="{tag}"')


def loaded(server) -> list[str]:
    """The loaded models, the most recently used first (as /api/ps lists them)."""
    return [m.model for m in ollama.Client(host=server.url).ps().models]


def wait_for(condition, timeout=20.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_two_models_alternate_without_reloading(home):
    with kiln_server(home, "--ctx-len", CTX, "--parallel", SLOTS) as server:
        oai = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        oll = ollama.Client(host=server.url)
        for round in range(3):
            r = oai.chat.completions.create(model=A, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
            assert r.model == A and r.usage.completion_tokens > 0
            chunks = list(oll.generate(model=B, prompt="hello", stream=True, options={"num_predict": 3}))
            assert chunks[-1].done and chunks[-1].model == B
            streamed = list(oai.completions.create(model=A, prompt="hey", max_tokens=3, stream=True))
            assert streamed[-1].choices[0].finish_reason in ("stop", "length")
            assert oll.chat(model=B, messages=[{"role": "user", "content": "yo"}], options={"num_predict": 3}).done
        assert (loads(server, A), loads(server, B)) == (1, 1)  # each loaded once, then both stayed
        assert loaded(server) == [B, A]
        ps = oll.ps().models
        assert all(m.context_length == int(CTX) and m.expires_at.timestamp() > time.time() + 200 for m in ps)
        slots = httpx.get(f"{server.url}/slots").json()
        assert sorted({s["model"] for s in slots}) == [A, B] and len(slots) == 2 * int(SLOTS)
        shown = kiln_cli_ps(server)
        assert [line.split()[0] for line in shown.splitlines()[1:]] == [B, A]


def kiln_cli_ps(server) -> str:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "kiln", "ps", "--url", server.url], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_least_recently_used_idle_model_is_evicted_past_max_loaded(home):
    with kiln_server(home, "--ctx-len", CTX, "--parallel", SLOTS, "--max-loaded", "2") as server:
        oll = ollama.Client(host=server.url)
        for tag in (A, B):
            assert oll.generate(model=tag, prompt="x", options={"num_predict": 2}).done
        assert oll.generate(model=A, prompt="x", options={"num_predict": 2}).done  # A is now the most recent
        assert oll.generate(model=C, prompt="x", options={"num_predict": 2}).done
        assert loaded(server) == [C, A]  # B, least recently used, made room
        assert oll.generate(model=B, prompt="x", options={"num_predict": 2}).done
        assert loaded(server) == [B, C]
        assert (loads(server, A), loads(server, B), loads(server, C)) == (1, 2, 1)


def test_a_model_past_the_memory_budget_evicts_an_idle_one(home):
    # Room for two of the tiny models by validate's estimate, not three; the count alone would allow three.
    need = [footprint(str(Store(home=home).resolve(tag).path), int(CTX), int(SLOTS))["total_bytes"]
            for tag in (A, B, C)]
    budget = need[0] + need[1] + min(need) // 2
    assert need[0] + need[1] + need[2] > budget
    with kiln_server(home, "--ctx-len", CTX, "--parallel", SLOTS, "--max-memory", str(budget)) as server:
        oai = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        for tag in (A, B):
            assert oai.completions.create(model=tag, prompt="x", max_tokens=2).usage.completion_tokens > 0
        assert loaded(server) == [B, A]
        stream = oai.chat.completions.create(model=C, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                             stream=True)
        assert [c.choices[0].finish_reason for c in stream if c.choices][-1] in ("stop", "length")
        assert loaded(server) == [C, B]  # A went: the least recently used
        assert loads(server, A) == 1 and loads(server, C) == 1


def test_each_model_expires_on_its_own_keep_alive(home):
    with kiln_server(home, "--ctx-len", CTX, "--parallel", SLOTS, "--keep-alive", "-1") as server:
        oll = ollama.Client(host=server.url)
        assert oll.generate(model=A, keep_alive="1s").done_reason == "load"
        assert oll.generate(model=B, prompt="x", options={"num_predict": 2}).done  # the server's: forever
        (b, a) = oll.ps().models
        assert (a.model, b.model) == (A, B) and b.expires_at.year >= 2318 and a.expires_at.timestamp() < time.time() + 5
        assert wait_for(lambda: loaded(server) == [B], timeout=15)
        oll.generate(model=A, keep_alive="10m")
        assert loaded(server) == [A, B] and loads(server, A) == 2 and loads(server, B) == 1
        oll.generate(model=B, keep_alive=0)  # unloads B alone
        assert wait_for(lambda: loaded(server) == [A], timeout=10)


def test_a_loaded_model_answers_while_another_is_busy(home):
    with kiln_server(home, "--ctx-len", str(LONG), "--parallel", SLOTS) as server:
        oai = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        oll = ollama.Client(host=server.url)
        for tag in (A, B):
            oll.generate(model=tag, keep_alive="10m")
        seen, enough = [], threading.Event()

        def story():  # longer than the test lasts: read until told, then hang up (the server cancels it)
            with oai.completions.create(model=A, prompt="a long story", max_tokens=LONG - 100, logit_bias=FORCED,
                                        stream=True) as chunks:
                for chunk in chunks:
                    seen.append(chunk)
                    if enough.is_set():
                        break

        thread = threading.Thread(target=story)
        thread.start()
        try:
            assert wait_for(lambda: len(seen) > 10)
            for stream in (False, True):
                if stream:
                    r = oai.chat.completions.create(model=B, messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=4, stream=True)
                    assert [c.choices[0].finish_reason for c in r if c.choices][-1] in ("stop", "length")
                else:
                    r = oai.completions.create(model=B, prompt="hi", max_tokens=4)
                    assert r.model == B and r.usage.completion_tokens > 0
                assert thread.is_alive() and server.metric("kiln_requests_running") == 1  # A is still generating
        finally:
            enough.set()
            thread.join()
        assert seen[-1].choices[0].finish_reason is None  # cut off by the client, not finished
        assert wait_for(lambda: server.metric("kiln_requests_running") == 0)
        assert (loads(server, A), loads(server, B)) == (1, 1)


def test_a_load_waits_for_a_busy_model_to_go_idle_before_evicting_it(home):
    # A's story fills the models' whole context, so it is still generating when B asks, on any machine
    with kiln_server(home, "--ctx-len", str(LONG), "--parallel", SLOTS, "--max-loaded", "1") as server:
        oai = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        oll = ollama.Client(host=server.url)
        oll.generate(model=A, keep_alive="10m")
        answers = {}
        story = threading.Thread(target=lambda: answers.setdefault(A, oai.completions.create(
            model=A, prompt="a long story", max_tokens=STORY, logit_bias=FORCED)))
        other = threading.Thread(target=lambda: answers.setdefault(B, oll.generate(
            model=B, prompt="x", options={"num_predict": 2})))
        story.start()
        try:
            assert wait_for(lambda: server.metric("kiln_requests_running") == 1)
            other.start()
            time.sleep(0.3)
            assert other.is_alive() and loaded(server) == [A]  # B waits: A is busy and there is room for one
            assert httpx.get(f"{server.url}/health").status_code == 200  # serving A meanwhile
        finally:
            story.join()
            other.join()
        a, b = answers[A], answers[B]
        assert a.choices[0].finish_reason == "length" and a.usage.completion_tokens == STORY  # never cut off
        assert b.done and b.load_duration > 0
        assert loaded(server) == [B] and (loads(server, A), loads(server, B)) == (1, 1)


def test_the_environment_sets_max_loaded_and_max_memory(home, monkeypatch):
    from kiln.cli import build_parser

    monkeypatch.setenv("KILN_MAX_LOADED_MODELS", "5")
    monkeypatch.setenv("KILN_MAX_MEMORY", "12G")
    args = build_parser().parse_args(["serve"])
    assert (args.max_loaded, args.max_memory) == (5, "12G")
    assert build_parser().parse_args(["serve", "--max-loaded", "2"]).max_loaded == 2  # the flag wins
    with kiln_server(home, "--ctx-len", CTX, "--parallel", SLOTS, env={"KILN_MAX_LOADED_MODELS": "1"}) as server:
        oll = ollama.Client(host=server.url)
        for tag in (A, B):
            assert oll.generate(model=tag, prompt="x", options={"num_predict": 1}).done
        assert loaded(server) == [B]
