"""`kiln serve` against hostile clients and files, end to end over a real server with synth models:
foreign Hosts and Origins, non-JSON and oversized bodies, a model upload kiln cannot load, a chat
template that never finishes, a 50 MB prompt, lone surrogates, NaN, and SIGTERM in the middle of a request."""

from __future__ import annotations

import hashlib
import json
import signal
import socket
import struct
import threading
import time

import httpx
import pytest

from kiln.chat import RENDER_SECONDS
from kiln.synth import CHATML_TEMPLATE, write_random_gguf
from tests.serving import kiln_server

CHAT = [{"role": "user", "content": "hi"}]
BOMB = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


def upload(url: str, data: bytes) -> str:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    r = httpx.post(f"{url}/api/blobs/{digest}", content=data, headers={"content-type": "application/octet-stream"})
    assert r.status_code == 201, r.text
    return digest


def create(url: str, tag: str, digest: str) -> httpx.Response:
    return httpx.post(f"{url}/api/create", json={"model": tag, "files": {"m.gguf": digest}, "stream": False}, timeout=60)


def with_template(data: bytes, template: str) -> bytes:
    """The synth file with its chat template replaced in place (padded to the same length, so every
    offset after it holds)."""
    old = CHATML_TEMPLATE.encode()
    new = template + "{#" + " " * (len(old) - len(template) - 4) + "#}"
    assert data.count(old) == 1 and len(new) == len(old)
    return data.replace(old, new.encode())


@pytest.fixture(scope="module")
def synth(tmp_path_factory) -> bytes:
    return write_random_gguf(tmp_path_factory.mktemp("synth") / "tiny.gguf", "tiny-llama", seed=5).read_bytes()


@pytest.fixture(scope="module")
def server(tmp_path_factory, synth):
    home = tmp_path_factory.mktemp("home")
    with kiln_server(home, "--max-body-bytes", "64M", "--ctx-len", "256", "--parallel", "2") as s:
        assert create(s.url, "tiny", upload(s.url, synth)).status_code == 200
        assert create(s.url, "bomb", upload(s.url, with_template(synth, BOMB))).status_code == 200
        yield s


def generate(url: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/api/generate", json={"model": "tiny", "prompt": "hi", "stream": False,
                                                   "options": {"num_predict": 2}, **body}, timeout=60)


def test_foreign_hosts_and_origins_are_refused(server):
    url = server.url
    r = httpx.get(f"{url}/api/tags", headers={"Host": "attacker.example:11500"})
    assert r.status_code == 403 and "attacker.example" in r.json()["error"] and "--allowed-hosts" in r.json()["error"]
    for host in ("localhost:1", "127.0.0.1", "[::1]:8080", "kiln.localhost"):
        assert httpx.get(f"{url}/api/tags", headers={"Host": host}).status_code == 200

    r = httpx.post(f"{url}/api/copy", json={"source": "tiny", "destination": "stolen"},
                   headers={"Origin": "https://evil.example"})
    assert r.status_code == 403 and "evil.example" in r.json()["error"] and "--cors" in r.json()["error"]
    preflight = {"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"}
    assert httpx.options(f"{url}/api/chat", headers=preflight).status_code == 403
    r = httpx.options(f"{url}/api/chat", headers={**preflight, "Origin": "http://localhost:3000"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:3000"
    assert generate(url, model="tiny").status_code == 200  # Host 127.0.0.1:port, application/json: as clients send
    assert "stolen:latest" not in {m["name"] for m in httpx.get(f"{url}/api/tags").json()["models"]}


def test_json_only_as_application_json(server):
    body = '{"model": "tiny", "prompt": "hi", "stream": false, "options": {"num_predict": 1}}'
    # what a web page can send cross-site without a preflight: text/plain
    r = httpx.post(f"{server.url}/api/generate", content=body,
                   headers={"content-type": "text/plain", "Origin": "http://localhost:3000"})
    assert r.status_code == 415 and "application/json" in r.json()["error"]
    r = httpx.post(f"{server.url}/v1/completions", content=body,
                   headers={"content-type": "text/plain;charset=UTF-8"})
    assert r.status_code == 415 and r.json()["error"]["param"] == "body"
    r = httpx.post(f"{server.url}/api/generate", content=body,
                   headers={"content-type": "application/json; charset=utf-8"})
    assert r.status_code == 200 and r.json()["done"]


def test_bodies_over_the_limit_are_413(server):
    r = httpx.post(f"{server.url}/api/generate", content=b"x" * (65 << 20), headers={"content-type": "application/json"})
    assert r.status_code == 413 and "--max-body-bytes" in r.json()["error"]

    def chunks():  # no Content-Length: the limit holds while the body streams in
        for _ in range(70):
            yield b" " * (1 << 20)

    r = httpx.post(f"{server.url}/api/chat", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413


def test_an_upload_kiln_cannot_load_is_refused_at_create(server, synth):
    hostile = synth.replace(b"llama.block_count", b"llama.block_cOunt")  # a GGUF file, not a loadable model
    r = create(server.url, "hostile", upload(server.url, hostile))
    assert r.status_code == 400
    message = r.json()["error"]
    assert "block_count" in message and "not a model kiln can load" in message
    assert "/" not in message.split("(POST")[0]  # no server path
    assert generate(server.url).status_code == 200  # still answering
    assert "hostile:latest" not in {m["name"] for m in httpx.get(f"{server.url}/api/tags").json()["models"]}


def test_an_upload_whose_metadata_disagrees_with_its_tensors_is_refused_at_create(server, synth):
    # the width the kernels would size their buffers by, against tensors of the real width
    key = b"llama.embedding_length"
    at = synth.index(key) + len(key)
    assert struct.unpack_from("<I", synth, at)[0] == 4  # GGUF's UINT32
    hostile = synth[:at + 4] + struct.pack("<I", 4096) + synth[at + 8:]
    r = create(server.url, "wide", upload(server.url, hostile))
    assert r.status_code == 400
    assert "wrong shape" in r.json()["error"]
    assert generate(server.url).status_code == 200  # still answering


def test_a_template_bomb_is_a_400_in_its_budget_while_another_model_answers(server):
    results = {}

    def bomb():
        t0 = time.monotonic()
        results["bomb"] = httpx.post(f"{server.url}/api/chat", json={"model": "bomb", "messages": CHAT, "stream": False},
                                     timeout=60)
        results["bomb_s"] = time.monotonic() - t0

    thread = threading.Thread(target=bomb)
    thread.start()
    time.sleep(0.5)  # the bomb is rendering; this waits for it to give up the model, then swaps
    r = httpx.post(f"{server.url}/api/chat", json={"model": "tiny", "messages": CHAT, "stream": False,
                                                  "options": {"num_predict": 2}}, timeout=60)
    thread.join()
    assert r.status_code == 200 and r.json()["done"]
    assert results["bomb"].status_code == 400
    assert "bomb:latest" in results["bomb"].json()["error"] and "budget" in results["bomb"].json()["error"]
    assert results["bomb_s"] < RENDER_SECONDS + 10  # its budget, plus loading a model on a busy machine
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}


def test_a_50_mb_prompt_is_a_quick_context_error(server):
    t0 = time.monotonic()
    r = generate(server.url, prompt="word " * (10 << 20), raw=True)
    elapsed = time.monotonic() - t0
    assert r.status_code == 400 and "context" in r.json()["error"], r.text
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "tiny", "messages": [
        {"role": "user", "content": "word " * (10 << 20)}]}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["param"] == "messages"
    assert elapsed < 20  # encoding it whole took minutes; the transfer and JSON parsing are what is left


def test_bad_text_numbers_and_names_are_400(server):
    r = httpx.post(f"{server.url}/api/generate", content=b'{"model": "tiny", "prompt": "a\\ud800", "stream": false}',
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "prompt" in r.json()["error"] and "surrogate" in r.json()["error"]
    for options, field in (({"repeat_penalty": "NaN"}, "repeat_penalty"), ({"presence_penalty": "Infinity"}, "presence_penalty")):
        r = generate(server.url, options=options)
        assert r.status_code == 400 and field in r.json()["error"]
    r = httpx.post(f"{server.url}/api/generate", content=b'{"model": "tiny", "prompt": "hi", "keep_alive": NaN}',
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "keep_alive" in r.json()["error"]
    r = httpx.post(f"{server.url}/v1/chat/completions", content=b'{"model": "tiny", "messages": [], "temperature": 1e999}',
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    assert generate(server.url, keep_alive="NaN").status_code == 400
    r = generate(server.url, model="m" * 100_000)
    assert r.status_code == 400 and "too long" in r.json()["error"]
    r = httpx.post(f"{server.url}/api/show", json={"model": "x" * 100_000})
    assert r.status_code == 400


def test_an_abandoned_embedding_request_is_cancelled(server):
    inputs = [f"{i} " + "word " * 40 for i in range(8000)]  # distinct prompts: some tens of seconds of work
    body = json.dumps({"model": "tiny", "input": inputs}).encode()
    port = int(server.url.rsplit(":", 1)[1])

    def busy():
        model = httpx.get(f"{server.url}/api/ps").json()["models"]
        return bool(model) and model[0]["running"] + model[0]["waiting"] > 0

    with socket.create_connection(("127.0.0.1", port)) as client:
        client.sendall(b"POST /api/embed HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n" % len(body) + body)
        deadline = time.monotonic() + 30
        while not busy():  # its inputs are tokenized; now they run
            assert time.monotonic() < deadline
            time.sleep(0.05)
    deadline, idle_since = time.monotonic() + 6, None  # idle for a second on end: not a gap between batches
    while time.monotonic() < deadline and (idle_since is None or time.monotonic() - idle_since < 1.0):
        idle_since = None if busy() else idle_since or time.monotonic()
        time.sleep(0.05)
    assert idle_since is not None and time.monotonic() - idle_since >= 1.0, "the embeddings kept running"
    assert generate(server.url).status_code == 200


def test_sigterm_stops_the_server_mid_request(tmp_path):
    with kiln_server(tmp_path) as s:
        stop = threading.Event()

        def endless():  # an upload that never ends: no request could be waited out
            while not stop.is_set():
                yield b"\0" * 4096
                time.sleep(0.05)

        digest = "sha256:" + "0" * 64
        client = threading.Thread(target=lambda: _ignore(lambda: httpx.post(
            f"{s.url}/api/blobs/{digest}", content=endless(), headers={"content-type": "application/octet-stream"},
            timeout=30)))
        client.start()
        time.sleep(1.0)
        t0 = time.monotonic()
        s.process.send_signal(signal.SIGTERM)
        s.process.wait(timeout=10)
        elapsed = time.monotonic() - t0
        stop.set()
        client.join()
        assert elapsed < 5, f"SIGTERM took {elapsed:.1f} s"


def _ignore(call):
    try:
        call()
    except httpx.HTTPError:
        pass
