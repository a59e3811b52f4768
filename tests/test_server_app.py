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
        return TestClient(create_app(Settings(), store=Store(home=tmp_path), **options))

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
        r = client.post("/api/generate", content='{"model": "m", "prompt": "x", "think": true}',
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
                                           (["--prefill-chunk", "0"], "--prefill-chunk must be at least 1")])
def test_kiln_serve_refuses_bad_options_before_binding(flags, message, capsys):
    from kiln.cli import main

    assert main(["serve", *flags]) == 1
    assert message in capsys.readouterr().err
