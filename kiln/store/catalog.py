"""The model catalog (kiln/catalog.json): the tags kiln can pull, with their sources, sizes, hashes (null
until measured), KV shapes and sampling defaults."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from kiln.errors import StoreError

DEFAULT_MODEL = "smollm2:135m"
CATALOG_PATH = Path(__file__).parent.parent / "catalog.json"

TAG_RE = re.compile(r"^[a-z0-9][a-z0-9._-]*:[a-z0-9][a-z0-9._-]*$")
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_SOURCE_FIELDS = {"pypi": ("package", "version"), "hf": ("repo", "filename")}  # plus pypi's "parts"
_ENTRY_FIELDS = {"name": str, "family": str, "parameters": str, "quantization": str, "context_length": int,
                 "labels": list, "file": str, "size": int, "sha256": str, "sources": list}
# null until measured: the hub then reports them when the file is pulled (its Content-Length and LFS sha256)
_MEASURED_FIELDS = ("size", "sha256")
_SHAPE_FIELDS = ("layers", "kv_heads", "head_dim")


@dataclass(frozen=True)
class CatalogEntry:
    tag: str
    name: str
    family: str
    parameters: str
    quantization: str
    context_length: int
    labels: tuple[str, ...]
    file: str
    size: int | None  # None: the hub's Content-Length, at pull time
    sha256: str | None  # None: the LFS sha256 the hub reports for the file, at pull time
    sources: tuple[dict, ...]
    defaults: tuple[tuple[str, float], ...] = ()  # sampling defaults, like an Ollama Modelfile's PARAMETER lines
    origin: str = ""  # the catalog's "from": where the repo, file and figures were taken from
    shape: dict | None = None  # layers, kv_heads, head_dim: the KV cache's size before the file is here

    def details(self) -> dict:
        return {"family": self.family, "parameters": self.parameters, "quantization": self.quantization,
                "context_length": self.context_length, "labels": list(self.labels)}


def load_catalog(path: Path) -> tuple[dict[str, CatalogEntry], dict[str, str]]:
    """The catalog's entries by tag and its aliases (`name:latest` → tag); malformed input names the field."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise StoreError(f"{path}: cannot read the model catalog ({e.strerror})") from None
    except ValueError as e:
        raise StoreError(f"{path}: the model catalog is not valid JSON ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("models"), dict):
        raise StoreError(f"{path}: the model catalog needs a 'models' object")
    entries = {tag: _catalog_entry(f"{path}: model {tag!r}", tag, raw) for tag, raw in data["models"].items()}
    aliases = data.get("aliases", {})
    if not isinstance(aliases, dict):
        raise StoreError(f"{path}: 'aliases' must be an object of tag → tag")
    for alias, target in aliases.items():
        if not TAG_RE.match(alias) or target not in entries:
            raise StoreError(f"{path}: alias {alias!r} must be name:tag and point at a catalog tag, not {target!r}")
    return entries, aliases


def _catalog_entry(where: str, tag: str, raw) -> CatalogEntry:
    if not TAG_RE.match(tag):
        raise StoreError(f"{where}: tags look like name:tag, in a-z 0-9 . _ -")
    if not isinstance(raw, dict):
        raise StoreError(f"{where}: the entry must be an object")
    for key, kind in _ENTRY_FIELDS.items():
        if not isinstance(raw.get(key), kind) and not (key in _MEASURED_FIELDS and key in raw and raw[key] is None):
            unknown = " (or null, when not measured)" if key in _MEASURED_FIELDS else ""
            raise StoreError(f"{where}: field {key!r} is missing or not a {kind.__name__}{unknown}")
    if raw["sha256"] is not None and not SHA256_RE.match(raw["sha256"]):
        raise StoreError(f"{where}: field 'sha256' must be 64 lowercase hex digits")
    for i, source in enumerate(raw["sources"]):
        _check_source(f"{where}: sources[{i}]", source)
        if raw["sha256"] is None and source["kind"] != "hf":
            raise StoreError(f"{where}: sources[{i}]: an entry without a sha256 takes only Hugging Face sources, "
                             "whose metadata gives the digest to verify")
    if not isinstance(raw.get("from", ""), str):
        raise StoreError(f"{where}: field 'from' must be a string")
    shape = raw.get("shape")
    if shape is not None and not (isinstance(shape, dict) and set(shape) == set(_SHAPE_FIELDS) and all(
            isinstance(v, int) and v > 0 for v in shape.values())):
        raise StoreError(f"{where}: field 'shape' must map {', '.join(_SHAPE_FIELDS)} to positive integers")
    defaults = raw.get("defaults", {})
    if not isinstance(defaults, dict) or not all(isinstance(v, (int, float)) for v in defaults.values()):
        raise StoreError(f"{where}: field 'defaults' must map sampling parameters to numbers")
    fields = {key: raw[key] for key in _ENTRY_FIELDS if key not in ("labels", "sources")}
    return CatalogEntry(tag=tag, labels=tuple(raw["labels"]), sources=tuple(raw["sources"]),
                        defaults=tuple(defaults.items()), origin=raw.get("from", ""), shape=shape, **fields)


def _check_source(where: str, source) -> None:
    kind = source.get("kind") if isinstance(source, dict) else None
    if kind not in _SOURCE_FIELDS:
        raise StoreError(f"{where}: 'kind' must be 'pypi' or 'hf', not {kind!r}")
    for key in _SOURCE_FIELDS[kind]:
        if not isinstance(source.get(key), str):
            raise StoreError(f"{where}: field {key!r} is missing or not a string")
    if kind == "pypi":
        parts = source.get("parts")
        if not isinstance(parts, list) or not parts or not all(
            isinstance(p, dict) and isinstance(p.get("package"), str) and isinstance(p.get("path"), str) for p in parts
        ):
            raise StoreError(f"{where}: field 'parts' must be a non-empty list of {{package, path}}")
