"""A real `kiln serve` process on a free loopback port, for the server, schema and load tests."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx


@dataclass
class Server:
    url: str
    process: subprocess.Popen
    log: Path

    def metric(self, name: str, labels: str = "") -> float:
        """One sample from /metrics (the sum when `labels` is empty and there are several)."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        pattern = rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$"
        return sum(float(m.group(2)) for m in re.finditer(pattern, text, re.M) if labels in (m.group(1) or ""))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def kiln_server(home: Path, *args: str, timeout: float = 180.0, env: dict | None = None):
    """Start `kiln serve ARGS` with KILN_HOME=home; yield once /health says ok; stop it afterwards."""
    port = free_port()
    log = Path(tempfile.mkstemp(prefix="kiln-serve-", suffix=".log")[1])
    command = [sys.executable, "-m", "kiln", "serve", *args, "--port", str(port), "--log-level", "warning"]
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                   env={**os.environ, "KILN_HOME": str(home), **(env or {})})
    server = Server(f"http://127.0.0.1:{port}", process, log)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"kiln serve exited with {process.returncode}:\n{log.read_text()}")
            try:
                if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"kiln serve did not become healthy in {timeout:.0f} s:\n{log.read_text()}")
            time.sleep(0.2)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.unlink(missing_ok=True)


@contextlib.contextmanager
def store_server(home: Path, models: dict, *args: str):
    """`kiln serve ARGS` over a store at `home` with each of `models` (tag: .gguf path) installed."""
    from kiln.modelfile import Recipe
    from kiln.store import Store

    store = Store(home=home)
    for tag, path in models.items():
        store.create(tag, Recipe(str(path)), progress=False)
    with kiln_server(home, *args) as server:
        yield server
