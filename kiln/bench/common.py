"""What `kiln bench sweep|scenarios|compare` and `kiln report` share: summary statistics, the
provenance block every result file carries, the command line as recorded in the history, and writing
output to a file or stdout."""

from __future__ import annotations

import json
import shlex
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

SCHEMA_DIR = Path(__file__).parent / "schema"


def summary(values: list[float]) -> dict | None:
    """lemonade's `{mean, min, max, p50, p95}` plus the sample sd and n; percentiles interpolate
    linearly between order statistics (numpy's default). None when there is nothing to summarize."""
    values = [float(v) for v in values if v is not None]
    if not values:
        return None
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values),
            "p50": float(np.percentile(values, 50)), "p95": float(np.percentile(values, 95)),
            "sd": statistics.stdev(values) if len(values) > 1 else 0.0, "n": len(values)}


def utc_now() -> str:
    """An ISO 8601 UTC time with a Z that means UTC (seed 003's caveat: lemonade stamps local time with a Z)."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def command_line(prog: str, args, positional: tuple[str, ...] = (), secret: tuple[str, ...] = ()) -> str:
    """The command rebuilt from parsed options and shell-quoted, so the history shows every setting
    actually used and pastes back into a shell; `secret` options (API keys) show as *** so result files
    and the history never hold them."""
    parts = [prog] + [shlex.quote(str(v)) for name in positional for v in _as_list(getattr(args, name))]
    for key, value in vars(args).items():
        if key in positional or value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            parts.append(flag)
        elif key in secret:
            parts += [flag, "***"]
        else:
            parts += [flag, shlex.quote(",".join(map(str, value)) if isinstance(value, list) else str(value))]
    return " ".join(parts)


def _as_list(value) -> list:
    return value if isinstance(value, list) else [] if value is None else [value]


def provenance(tool: str, command: str, figures: dict[str, str], target: dict) -> dict:
    """Where every figure in a result came from: the tool and command, what was measured (the target)
    and how each figure was measured. The host's facts sit beside it, in the result's `machine`, where
    the history looks for them."""
    from kiln import __version__

    return {"tool": tool, "kiln_version": __version__, "command": command, "created": utc_now(),
            "target": target, "figures": figures}


def write_output(text: str, path: str | None) -> None:
    """`text` to `path`, or to stdout when `path` is None or '-'."""
    if path in (None, "-"):
        sys.stdout.write(text)
        sys.stdout.flush()
    else:
        Path(path).write_text(text, encoding="utf-8")


def dump_json(payload: dict) -> str:
    return json.dumps(payload, indent=1) + "\n"


def model_context(model_ref: str, progress: bool = False) -> int:
    """The context length a model was trained for, read from its file header (pulling a catalog tag
    that is not installed): callers size the engine's KV cache from it before loading."""
    from kiln.gguf import GGUFFile
    from kiln.models import family_for
    from kiln.store import Store

    g = GGUFFile(Store().ensure(model_ref, progress=progress).path)
    try:
        return family_for(g).config.context_length
    finally:
        g.close()
