"""Ollama's Modelfile, for `kiln create` and /api/create: a model made from another (or from a .gguf
file) with its own system message, sampling defaults and stop strings. The weights are shared, never
copied; the chat template stays the GGUF's own (Jinja), so TEMPLATE, ADAPTER and MESSAGE are errors."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from kiln.errors import RequestError, StoreError
from kiln.sampling import SamplingParams

# PARAMETER names kiln applies, with their types: SamplingParams' fields, and the stop strings.
SAMPLING = {"temperature": float, "top_k": int, "top_p": float, "min_p": float, "repeat_penalty": float,
            "repeat_last_n": int, "presence_penalty": float, "frequency_penalty": float, "seed": int}
# Hardware and context knobs that Modelfiles written for Ollama carry: accepted and reported as ignored
# (kiln serve --ctx-len / --threads and kiln run -c / -t set these).
IGNORED = {"num_ctx", "num_gpu", "num_thread", "num_batch", "main_gpu", "use_mmap", "use_mlock", "numa",
           "low_vram", "f16_kv", "num_keep"}
UNSUPPORTED = {"TEMPLATE": "kiln applies the model's own chat template (Jinja, from the GGUF file)",
               "ADAPTER": "kiln does not apply LoRA adapters", "MESSAGE": "kiln does not store example messages"}


@dataclass
class Recipe:
    """What a Modelfile (or /api/create's fields) asks for."""

    base: str  # a tag, or a .gguf path
    system: str | None = None
    parameters: dict = field(default_factory=dict)  # SAMPLING values, and "stop": [str, ...]
    license: str | None = None
    ignored: list[str] = field(default_factory=list)  # parameter names accepted but not applied


def check_parameters(raw: dict, where: str) -> tuple[dict, list[str]]:
    """Typed parameters (stop always a list of strings) and the names ignored; errors name `where`."""
    out, ignored = {}, []
    for name, value in raw.items():
        if name in IGNORED:
            ignored.append(name)
        elif name == "stop":
            stops = [value] if isinstance(value, str) else value
            if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
                raise StoreError(f"{where}: stop must be a string or a list of non-empty strings")
            out["stop"] = list(stops)
        elif name in SAMPLING:
            kind = SAMPLING[name]
            try:
                if isinstance(value, bool) or (kind is int and isinstance(value, float) and not value.is_integer()):
                    raise ValueError
                out[name] = kind(value)
            except (TypeError, ValueError):
                raise StoreError(f"{where}: {name} must be {'an integer' if kind is int else 'a number'}, "
                                 f"got {value!r}") from None
        else:
            known = ", ".join(sorted([*SAMPLING, "stop"]))
            raise StoreError(f"{where}: unknown parameter {name!r} (kiln applies {known})")
    try:  # the ranges, as a request's own values are checked
        SamplingParams().replace(**{k: v for k, v in out.items() if k in SAMPLING})
    except RequestError as e:
        raise StoreError(f"{where}: {e}") from None
    return out, ignored


_TRIPLE = '"""'


def parse(text: str, where: str = "Modelfile") -> Recipe:
    """A Modelfile: FROM, SYSTEM, PARAMETER (repeatable; stop accumulates), LICENSE; `#` comments;
    values may be quoted, or span lines inside triple quotes."""
    base, system, license_, parameters, ignored = None, None, None, {}, []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        number, line = i + 1, lines[i].strip()
        i += 1
        if not line or line.startswith("#"):
            continue
        command, _, rest = line.partition(" ")
        command, rest = command.upper(), rest.strip()
        if rest.startswith(_TRIPLE):  # a value over several lines, up to the closing triple quote
            value = rest[3:]
            while _TRIPLE not in value:
                if i == len(lines):
                    raise StoreError(f"{where}, line {number}: {command}'s value has no closing {_TRIPLE}")
                value += "\n" + lines[i]
                i += 1
            value, _, after = value.partition(_TRIPLE)
            if after.strip():
                raise StoreError(f"{where}, line {number}: text after the closing {_TRIPLE}")
        else:
            value = _unquote(rest)
        at = f"{where}, line {number}"
        if command in UNSUPPORTED:
            raise StoreError(f"{at}: {command} is not supported: {UNSUPPORTED[command]}")
        if command == "FROM":
            if not value:
                raise StoreError(f"{at}: FROM needs a model tag or a .gguf path")
            base = value
        elif command == "SYSTEM":
            system = value
        elif command == "LICENSE":
            license_ = value if license_ is None else f"{license_}\n{value}"
        elif command == "PARAMETER":
            name, _, arg = value.partition(" ")
            arg = arg.strip()
            if not name or not arg:
                raise StoreError(f"{at}: PARAMETER needs a name and a value")
            if name == "stop":  # repeatable: each line adds one
                parameters.setdefault("stop", []).append(_stop_string(arg))
                continue
            if name in parameters or name in ignored:
                raise StoreError(f"{at}: parameter {name} is set twice")
            typed, names = check_parameters({name: _number(arg)}, at)
            parameters.update(typed)
            ignored += names
        else:
            raise StoreError(f"{at}: unknown instruction {command!r} (kiln reads FROM, SYSTEM, PARAMETER, LICENSE)")
    if base is None:
        raise StoreError(f"{where}: no FROM line: name the model (a tag or a .gguf path) to build on")
    return Recipe(base, system, parameters, license_, ignored)


def _stop_string(text: str) -> str:
    """A stop string as written: quoted with JSON's escapes (how `render` writes "\\n"), or plain."""
    if len(text) >= 2 and text[0] == text[-1] == '"':
        try:
            return json.loads(text)
        except ValueError:
            pass
    return _unquote(text)


def _unquote(text: str) -> str:
    return text[1:-1] if len(text) >= 2 and text[0] == text[-1] == '"' else text


def _number(text: str):
    if re.fullmatch(r"[+-]?\d+", text):
        return int(text)
    try:
        return float(text)
    except ValueError:
        return text  # check_parameters says what was expected


def parameter_items(parameters: dict) -> list[tuple[str, str]]:
    """(name, value) as Modelfiles and Ollama's /api/show write them: the stop strings last, one each,
    JSON-quoted so that a newline in one stays on its line."""
    items = [(name, str(value)) for name, value in parameters.items() if name != "stop"]
    return items + [("stop", json.dumps(stop)) for stop in parameters.get("stop", [])]


def render(tag_or_path: str, system: str | None, parameters: dict, license_: str | None) -> str:
    """A Modelfile that recreates a model (what `kiln show --modelfile` prints)."""
    lines = ["# Modelfile generated by kiln", f"FROM {tag_or_path}"]
    if system is not None:
        lines.append(f"SYSTEM {_TRIPLE}{system}{_TRIPLE}")
    lines += [f"PARAMETER {name} {value}" for name, value in parameter_items(parameters)]
    if license_:
        lines.append(f"LICENSE {_TRIPLE}{license_}{_TRIPLE}")
    return "\n".join(lines) + "\n"
