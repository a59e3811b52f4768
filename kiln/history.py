"""Every bench, trace and eval result, appended to a SQLite database in the kiln home, with what it
was measured on: machine fingerprint, kiln version, model sha256, command and time."""

from __future__ import annotations

import hashlib
import json
import sqlite3
from datetime import datetime, timezone
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS results (
    id INTEGER PRIMARY KEY,
    kind TEXT NOT NULL,
    created TEXT NOT NULL,
    kiln_version TEXT NOT NULL,
    machine TEXT NOT NULL,
    model_sha256 TEXT,
    command TEXT NOT NULL,
    payload TEXT NOT NULL
)"""


def database_path() -> Path:
    from kiln.store import Store

    return Store().home / "history.sqlite"


def machine_fingerprint(facts: dict) -> str:
    key = json.dumps([facts.get(k) for k in ("cpu", "arch", "physical_cores", "mem_total_gib", "kernel_isa")])
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def _connect(path: Path | None) -> sqlite3.Connection:
    path = path or database_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(path)
    db.execute(SCHEMA)
    return db


def record(kind: str, payload: dict, model_sha256: str | None, command: str, path: Path | None = None) -> int:
    from kiln import __version__
    from kiln.machine import facts

    machine = payload.get("machine") or facts()
    with _connect(path) as db:
        cur = db.execute(
            "INSERT INTO results (kind, created, kiln_version, machine, model_sha256, command, payload) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)",
            (kind, datetime.now(timezone.utc).isoformat(timespec="seconds"), __version__,
             machine_fingerprint(machine), model_sha256, command, json.dumps(payload)),
        )
        return int(cur.lastrowid)


def query(kind: str | None = None, model_sha256: str | None = None, path: Path | None = None) -> list[dict]:
    sql, args = "SELECT id, kind, created, kiln_version, machine, model_sha256, command, payload FROM results", []
    where = [(c, v) for c, v in (("kind", kind), ("model_sha256", model_sha256)) if v is not None]
    if where:
        sql += " WHERE " + " AND ".join(f"{c} = ?" for c, _ in where)
        args = [v for _, v in where]
    with _connect(path) as db:
        rows = db.execute(sql + " ORDER BY id", args).fetchall()
    keys = ("id", "kind", "created", "kiln_version", "machine", "model_sha256", "command")
    return [dict(zip(keys, row[:-1]), payload=json.loads(row[-1])) for row in rows]
