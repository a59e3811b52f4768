"""`kiln ps` / `kiln stop` without a server: where they look for it, how they word time and errors."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from kiln.cli import main as kiln_main
from kiln.commands.ps import loaded_name, server_url, until
from tests.serving import free_port

NOW = datetime(2026, 11, 30, 12, 0, 0, tzinfo=timezone.utc)


def iso(delta: timedelta) -> str:
    return (NOW + delta).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@pytest.mark.parametrize("delta,said", [(timedelta(minutes=4, seconds=59), "4 minutes from now"),
                                        (timedelta(hours=1, minutes=2), "1 hour from now"),
                                        (timedelta(seconds=1.5), "1 second from now"),
                                        (timedelta(seconds=-3), "Stopping...")])
def test_until_reads_like_ollama_ps(delta, said):
    assert until(iso(delta), NOW) == said


def test_a_model_kept_forever_says_so():
    assert until("2318-01-01T00:00:00Z", NOW) == "Forever"


def test_the_server_is_found_where_kiln_serve_binds(monkeypatch):
    monkeypatch.delenv("KILN_HOST", raising=False)
    monkeypatch.delenv("KILN_PORT", raising=False)
    assert server_url(None) == "http://127.0.0.1:11500"
    monkeypatch.setenv("KILN_HOST", "0.0.0.0")  # a wildcard bind is reached on loopback
    monkeypatch.setenv("KILN_PORT", "9")
    assert server_url(None) == "http://127.0.0.1:9"
    monkeypatch.setenv("KILN_HOST", "::1")
    assert server_url(None) == "http://[::1]:9"
    assert server_url("http://box:8000/") == "http://box:8000"


def test_stop_names_resolve_to_the_loaded_tag():
    loaded = {"smollm2:135m"}
    assert loaded_name("smollm2:135m", loaded) == "smollm2:135m"
    assert loaded_name("smollm2", loaded) == "smollm2:135m"
    assert loaded_name("mine", {"mine:latest"}) == "mine:latest"
    assert loaded_name("gemma3", loaded) is None
    assert loaded_name("smollm2:360m", loaded) is None


@pytest.mark.parametrize("command", [["ps"], ["stop", "smollm2:135m"]])
def test_no_server_is_an_error_naming_where_it_looked(command, capsys):
    url = f"http://127.0.0.1:{free_port()}"
    assert kiln_main([*command, "--url", url]) == 1
    err = capsys.readouterr().err
    assert f"no kiln server answered at {url}" in err and "kiln serve" in err
