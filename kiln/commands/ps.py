"""`kiln ps` and `kiln stop`: ask a running `kiln serve` what it has loaded, or unload a model (as
`ollama ps` / `ollama stop` do). The server is found the way `kiln serve` binds: KILN_HOST, KILN_PORT, or
--url; KILN_API_KEY is sent when set."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from datetime import datetime, timezone

from kiln.errors import KilnError

FOREVER_YEAR = 2318  # the year the server writes for a model kept loaded forever (Ollama's convention)


def register(sub) -> None:
    p = sub.add_parser("ps", help="models loaded by the running server",
                       description="Ask the running `kiln serve` which model it holds, its requests and when it unloads.")
    add_url(p)
    p.add_argument("--json", action="store_true", help="print the server's /api/ps answer")
    p.set_defaults(func=cmd_ps)

    p = sub.add_parser("stop", help="unload a model from the running server",
                       description="Unload MODEL from the running `kiln serve` once its running requests finish.")
    p.add_argument("model", metavar="TAG")
    add_url(p)
    p.set_defaults(func=cmd_stop)


def add_url(p) -> None:
    p.add_argument("--url", help="the server (default: http://KILN_HOST:KILN_PORT, as `kiln serve` binds)")


def server_url(url: str | None) -> str:
    if url:
        return url.rstrip("/")
    from kiln.commands.serve import DEFAULT_PORT

    host = os.environ.get("KILN_HOST") or "127.0.0.1"
    if host in ("0.0.0.0", "::", "[::]"):  # a wildcard bind is reached on loopback
        host = "127.0.0.1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{os.environ.get('KILN_PORT') or DEFAULT_PORT}"


def call(base: str, path: str, body: dict | None = None, timeout: float = 30.0) -> dict:
    """One JSON request to the server; a KilnError that says what went wrong and where."""
    headers = {"Content-Type": "application/json"}
    if os.environ.get("KILN_API_KEY"):
        headers["Authorization"] = f"Bearer {os.environ['KILN_API_KEY']}"
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(base + path, data=data, headers=headers, method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.load(response)
    except urllib.error.HTTPError as e:
        try:
            error = json.load(e).get("error")
        except (ValueError, AttributeError):
            error = None
        message = (error.get("message") if isinstance(error, dict) else error) or e.reason
        if e.code == 401:
            message += "; set KILN_API_KEY to the server's --api-key"
        raise KilnError(f"{base}{path}: HTTP {e.code}: {message}") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise KilnError(f"no kiln server answered at {base} ({reason}); start one with `kiln serve`, "
                        "or point KILN_HOST / KILN_PORT / --url at it") from None


def until(expires_at: str, now: datetime | None = None) -> str:
    """When a model unloads, as `ollama ps` says it: "Forever", "4 minutes from now"."""
    when = datetime.fromisoformat(expires_at.replace("Z", "+00:00"))
    if when.year >= FOREVER_YEAR:
        return "Forever"
    seconds = (when - (now or datetime.now(timezone.utc))).total_seconds()
    if seconds <= 0:
        return "Stopping..."
    for unit, size in (("hour", 3600), ("minute", 60), ("second", 1)):
        if seconds >= size:
            n = int(seconds // size)
            return f"{n} {unit}{'s' if n != 1 else ''} from now"
    return "Less than a second from now"


def cmd_ps(args) -> int:
    from kiln.commands.models import human_bytes

    answer = call(server_url(args.url), "/api/ps")
    if args.json:
        print(json.dumps(answer, indent=2))
        return 0
    rows = [("NAME", "ID", "SIZE", "PROCESSOR", "CONTEXT", "SLOTS", "UNTIL")]
    for m in answer.get("models", []):
        slots = f"{m['running']}/{m['slots']} busy, {m['waiting']} waiting" if "slots" in m else ""
        rows.append((m["name"], (m.get("digest") or "")[:12], human_bytes(m.get("size", 0)), m.get("processor", "CPU"),
                     str(m.get("context_length", "")), slots, until(m["expires_at"])))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:  # plain columns, like `ollama ps`: piped output is not cut to a terminal's width
        print("   ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    return 0


def loaded_name(name: str, loaded: set[str]) -> str | None:
    """The loaded model `name` means: the tag itself, NAME:latest, or the one loaded tag of family NAME."""
    if name in loaded or f"{name}:latest" in loaded:
        return name if name in loaded else f"{name}:latest"
    same = [tag for tag in loaded if ":" not in name and tag.split(":")[0] == name]
    return same[0] if len(same) == 1 else None


def cmd_stop(args) -> int:
    base = server_url(args.url)
    loaded = {m["name"] for m in call(base, "/api/ps").get("models", [])}
    tag = loaded_name(args.model, loaded)
    if tag is None:
        raise KilnError(f"{args.model} is not loaded at {base}"
                        + (f" (loaded: {', '.join(sorted(loaded))})" if loaded else " (no model is loaded)"))
    call(base, "/api/generate", {"model": tag, "keep_alive": 0}, timeout=600)
    print(f"stopped {tag}")
    return 0
