"""The HTTP layer in-process, with an empty store (no model is loaded): auth, CORS, error shapes, spec."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from kiln.server.app import create_app
from kiln.server.runtime import Settings
from kiln.store import Store


@pytest.fixture
def make_client(tmp_path):
    def make(**options):
        return TestClient(create_app(Settings(), store=Store(home=tmp_path), **options), base_url="http://127.0.0.1:11500")

    return make


def test_api_key_guards_everything_but_health(make_client):
    with make_client(api_key="s3cret") as client:
        assert client.get("/health").json() == {"status": "ok"}
        r = client.get("/v1/models")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert r.headers["www-authenticate"] == "Bearer"
        assert client.get("/api/tags").json() == {"error": "a valid API key is required: send it as "
                                                            "'Authorization: Bearer <key>' (or 'x-api-key: <key>')"}
        r = client.post("/v1/messages/count_tokens", json={})
        assert r.status_code == 401 and r.json()["type"] == "error" and r.json()["error"]["type"] == "authentication_error"
        assert client.get("/metrics").status_code == 401
        assert client.get("/openapi.json").status_code == 401
        assert client.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        ok = {"Authorization": "Bearer s3cret"}
        assert client.get("/v1/models", headers=ok).json() == {"object": "list", "data": []}
        assert client.get("/api/tags", headers=ok).json() == {"models": []}
        assert client.get("/api/tags", headers={"x-api-key": "s3cret"}).json() == {"models": []}  # Anthropic's header
        assert client.get("/api/tags", headers={"x-api-key": "wrong"}).status_code == 401


def test_cors_is_off_unless_an_origin_is_given(make_client):
    preflight = {"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST"}
    with make_client() as client:
        assert "access-control-allow-origin" not in client.get("/v1/models", headers={"Origin": "http://x"}).headers
    with make_client(cors=["http://localhost:3000"], api_key="k") as client:
        r = client.options("/v1/chat/completions", headers=preflight)  # preflight needs no key
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:3000"
        r = client.get("/v1/models", headers={"Origin": "http://localhost:3000", "Authorization": "Bearer k"})
        assert r.headers["access-control-allow-origin"] == "http://localhost:3000"


def test_errors_take_the_shape_of_each_api(make_client):
    with make_client() as client:
        r = client.post("/v1/chat/completions", json={"model": "ghost:1b", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 404
        assert r.json()["error"] | {"message": None} == {"message": None, "type": "invalid_request_error",
                                                         "param": "model", "code": "model_not_found"}
        assert "ghost" in r.json()["error"]["message"]
        r = client.post("/api/chat", json={"model": "ghost:1b", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 404 and "ghost" in r.json()["error"]
        r = client.post("/api/generate", json={"model": "/etc/passwd", "prompt": "hi"})
        assert r.status_code == 404 and "file path" in r.json()["error"]
        r = client.post("/v1/chat/completions", json={"model": "m", "messages": []})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        r = client.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "robot", "content": "x"}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].role"
        r = client.post("/v1/completions", json={"model": "m", "prompt": [1, 2], "suffix": "y"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"
        r = client.post("/api/generate", json={"model": "m", "prompt": "x", "keep_alive": "soon"})
        assert r.status_code == 400 and "keep_alive" in r.json()["error"]
        r = client.post("/api/generate", content='{"model": "m", "prompt": "x", "think": "very"}',
                        headers={"content-type": "application/x-www-form-urlencoded"})  # as `curl -d` sends it
        assert r.status_code == 400 and "think" in r.json()["error"]
        r = client.get("/v1/nothing")
        assert r.status_code == 404 and "/v1/nothing" in r.json()["error"]["message"]
        assert client.get("/api/ps").json() == {"models": []}
        assert client.get("/").text == "kiln is running"


@pytest.mark.parametrize("flags,message", [(["--port", "70000"], "--port must be 1..65535"),
                                           (["--port", "0"], "--port must be at least 1"),
                                           (["--parallel", "0"], "--parallel must be at least 1"),
                                           (["--max-queue", "-1"], "--max-queue must be >= 0"),
                                           (["--prefill-chunk", "0"], "--prefill-chunk must be at least 1"),
                                           (["--replicas", "2", "--no-affinity", "--ray-proxy", "--stream-interval", "0"],
                                            "--replicas, --no-affinity, --ray-proxy, --stream-interval: not used "
                                            "without --ray"),
                                           (["m", "--draft-model", "d", "--max-memory", "1G", "--ray"],
                                            "--max-memory, --draft-model: not used with --ray")])
def test_kiln_serve_refuses_bad_options_before_binding(flags, message, capsys):
    from kiln.cli import main

    assert main(["serve", *flags]) == 1
    assert message in capsys.readouterr().err


def test_hosts_and_origins_are_allowlists(make_client):
    with make_client(allowed_hosts=["kiln.lan"], cors=["https://app.example", "http://*.corp.example"]) as client:
        for host, status in (("kiln.lan:8080", 200), ("KILN.LAN", 200), ("localhost", 200), ("127.0.0.2:1", 200),
                             ("other.lan", 403), ("0.0.0.0:11500", 403), ("127.0.0.1.evil.example", 403)):
            r = client.get("/api/tags", headers={"Host": host})
            assert r.status_code == status, host
        r = client.get("/v1/models", headers={"Host": "other.lan"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed"
        copy = {"source": "a", "destination": "b"}
        for origin in ("https://app.example", "http://x.corp.example", "http://localhost:5173", "http://127.0.0.1"):
            assert client.post("/api/copy", json=copy, headers={"Origin": origin}).status_code != 403, origin
        for origin in ("null", "https://app.example.evil", "http://localhost.evil:80", "file://"):
            r = client.post("/api/copy", json=copy, headers={"Origin": origin})
            assert r.status_code == 403 and "--cors" in r.json()["error"], origin
            assert client.delete("/api/delete", headers={"Origin": origin}).status_code == 403
        # a read is not refused (the browser keeps the page from seeing it: no CORS header)
        r = client.get("/api/tags", headers={"Origin": "https://evil.example"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
        r = client.get("/api/tags", headers={"Origin": "http://localhost:5173"})
        assert r.headers["access-control-allow-origin"] == "http://localhost:5173"
    with make_client(allowed_hosts=["*"], cors=["*"]) as client:
        assert client.get("/api/tags", headers={"Host": "anything.example"}).status_code == 200
        assert client.post("/api/copy", json={"source": "a", "destination": "b"},
                           headers={"Origin": "https://anywhere.example"}).status_code != 403
    with make_client(bind_host="0.0.0.0") as client:  # reachable from the network, still answering only loopback names
        assert client.get("/api/tags", headers={"Host": "192.168.7.7:11500"}).status_code == 403
        assert client.get("/api/tags", headers={"Host": "localhost:11500"}).status_code == 200
    with make_client(bind_host="192.168.7.7") as client:
        assert client.get("/api/tags", headers={"Host": "192.168.7.7:11500"}).status_code == 200
        assert client.get("/api/tags", headers={"Host": "192.168.7.8:11500"}).status_code == 403


def test_bodies_are_typed_bounded_and_strict(make_client):
    body = '{"model": "m", "prompt": "x", "think": true}'
    with make_client(max_body_bytes=1000) as client:
        r = client.post("/api/generate", content=body, headers={"content-type": "application/x-www-form-urlencoded",
                                                                 "Origin": "http://localhost:3000"})
        assert r.status_code == 415  # what `curl -d` sends is fine, but not from a browser
        r = client.post("/v1/chat/completions", content=body, headers={"content-type": "multipart/form-data; boundary=x"})
        assert r.status_code == 415 and "multipart/form-data" in r.json()["error"]["message"]
        r = client.post("/api/generate", content="x" * 1001, headers={"content-type": "application/json"})
        assert r.status_code == 413 and "1000 bytes" in r.json()["error"]
        r = client.post("/api/chat", content=b'{"model": "m", "messages": [{"role": "user", "content": "\\udc00"}]}',
                        headers={"content-type": "application/json"})
        assert r.status_code == 400 and "messages[0].content" in r.json()["error"]
        r = client.post("/v1/embeddings", content=b'{"model": "m", "input": "x", "dimensions": -Infinity}',
                        headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "dimensions"
        r = client.post("/api/generate", json={"model": "m" * 300, "prompt": "x"})
        assert r.status_code == 400 and "too long" in r.json()["error"]
    with make_client(max_upload_bytes=1000) as client:
        r = client.post("/api/chat", content=b"[" * 100_000 + b"]" * 100_000, headers={"content-type": "application/json"})
        assert r.status_code == 400 and "nests too deeply" in r.json()["error"]
        digest = "sha256:" + "0" * 64
        r = client.post(f"/api/blobs/{digest}", content=b"x" * 1001)
        assert r.status_code == 413 and "--max-upload-bytes" in r.json()["error"]
        r = client.post(f"/api/blobs/{digest}", content=iter([b"x" * 600, b"x" * 600]))  # no length: counted
        assert r.status_code == 413 and not client.head(f"/api/blobs/{digest}").status_code == 200


@pytest.mark.parametrize("flags,message", [(["--max-body-bytes", "0"], "--max-body-bytes must be a positive size"),
                                           (["--max-upload-bytes", "lots"], "--max-upload-bytes must be a positive size")])
def test_kiln_serve_refuses_bad_sizes(flags, message, capsys):
    from kiln.cli import main

    assert main(["serve", *flags]) == 1
    assert message in capsys.readouterr().err


def test_sizes_and_listed_settings_parse(monkeypatch):
    from kiln.cli import build_parser
    from kiln.commands.serve import parse_size

    assert [parse_size(s, "x") for s in ("1048576", "8M", "8MiB", "2g", "16K")] == [1 << 20, 8 << 20, 8 << 20, 2 << 30, 16 << 10]
    monkeypatch.setenv("KILN_ALLOWED_HOSTS", "a.lan, b.lan")
    monkeypatch.setenv("KILN_ORIGINS", "https://app.example")
    args = build_parser().parse_args(["serve", "--allowed-hosts", "c.lan", "--cors", "https://two.example"])
    assert args.allowed_hosts == ["a.lan", "b.lan", "c.lan"] and args.cors == ["https://app.example", "https://two.example"]


def test_a_full_disk_is_one_line_without_paths(monkeypatch, capsys, tmp_path):
    import errno

    from kiln.cli import main
    from kiln.errors import without_paths
    from kiln.store import Store

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", "/home/someone/.local/share/kiln/tmp/1-x/model.gguf")

    monkeypatch.setattr(Store, "pull", full)
    assert main(["pull", "smollm2:135m"]) == 1
    err = capsys.readouterr().err
    assert err == "kiln: error: kiln pull: the disk is full (model.gguf); free some space and try again\n"
    message = f"{tmp_path}/blobs/sha256-ab: bad; upload it (POST /api/blobs/sha256:ab)"
    assert without_paths(message) == "sha256-ab: bad; upload it (POST /api/blobs/sha256:ab)"


def test_a_swap_waits_for_busy_requests_only_so_long(tmp_path, monkeypatch):
    import asyncio
    from types import SimpleNamespace

    from kiln.engine.scheduler import QueueFullError
    from kiln.server import runtime as rt

    monkeypatch.setattr(rt, "SWAP_WAIT_S", 0.2)
    runtime = rt.Runtime(Settings(), Store(home=tmp_path))
    busy = runtime.models["busy:latest"] = rt.Loaded(model=None, scheduler=None,
                                                     record=SimpleNamespace(tag="busy:latest"), active=1)
    with pytest.raises(QueueFullError, match=r"busy:latest is still answering 1 request\(s\) after 0.2 s"):
        asyncio.run(runtime.unload())
    assert runtime.loaded is busy and busy.active == 1 and not busy.retiring  # nothing was unloaded under it
