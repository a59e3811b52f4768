"""The model store: catalog tags and imported GGUF files, kept as content-addressed blobs plus one manifest per tag.
This module keeps the manifests and blobs; catalog.py reads the catalog, fetch.py gets a model's bytes, and
progress.py reports a pull's progress to the terminal or any other consumer.

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
import tempfile
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import BinaryIO, Iterator

from kiln.errors import KilnError, ModelNotFoundError, StoreError
from kiln.gguf import GGUFFile, as_int
from kiln.store.catalog import CATALOG_PATH, SHA256_RE, TAG_RE, CatalogEntry, load_catalog
from kiln.store.fetch import copy_files, fetch, one_line, sha256_file
from kiln.store.progress import Counted, PullProgress, TerminalBar


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


def looks_like_path(name_or_path: str) -> bool:
    return "/" in name_or_path or os.sep in name_or_path or name_or_path.lower().endswith(".gguf")


def gguf_details(gguf: GGUFFile) -> dict:
    """What `kiln list` shows about a model, read from the file itself (for imports and paths)."""
    arch = gguf.architecture
    n_params = sum(t.n_elements for t in gguf.tensors.values())
    return {"family": arch, "parameters": human_count(n_params), "quantization": quantization_name(gguf),
            "context_length": as_int(gguf.get(f"{arch}.context_length")),
            "labels": ["chat"] if isinstance(gguf.get("tokenizer.chat_template"), str) else ["base"]}


def quantization_name(gguf: GGUFFile) -> str:
    from gguf import LlamaFileType

    try:
        return LlamaFileType(as_int(gguf.get("general.file_type"), -1)).name.removeprefix("MOSTLY_")
    except (TypeError, ValueError):  # no or unknown file type: name the type holding most weights
        by_type: dict[str, int] = {}
        for t in gguf.tensors.values():
            by_type[t.type.name] = by_type.get(t.type.name, 0) + t.n_elements
        return max(by_type, key=by_type.get, default="?")


def human_count(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


MAX_TAG_CHARS = 200
TMP_SUFFIX = ".kiln-tmp"  # a file being written, named <name>.<pid>-<random>.kiln-tmp


def clean_temps(directory: Path) -> None:
    """Remove the temporary files that processes no longer running left in `directory`."""
    try:
        temps = [p for p in Path(directory).iterdir() if p.name.endswith(TMP_SUFFIX)]
    except OSError:
        return
    for temp in temps:
        pid = temp.name[: -len(TMP_SUFFIX)].rsplit(".", 1)[-1].split("-", 1)[0]
        if pid.isdigit() and pid_alive(int(pid)):
            continue
        with contextlib.suppress(OSError):  # another process cleaning at the same time, a read-only store
            temp.unlink()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


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
        """The installed models, damaged ones with their `problem`; reading only (`clean_stale` tidies)."""
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
        with TerminalBar(progress) as bar:
            for record in records:
                if record.problem:
                    results.append((record.tag, False, record.problem))
                    continue
                digest = sha256_file(record.path, Counted(bar, f"verify {record.tag}", record.size))
                if digest == record.sha256:
                    results.append((record.tag, True, f"sha256 {digest} ok"))
                else:
                    message = f"blob {record.path} has sha256 {digest}, expected {record.sha256}"
                    results.append((record.tag, False, message))
        return results

    # --- changes -------------------------------------------------------------------------------
    def pull(
        self, name_or_path: str, progress: bool = True, *, name: str | None = None, force: bool = False,
        report: PullProgress | None = None,
    ) -> ModelRecord:
        """Install a catalog tag (a no-op when installed, unless `force`) or import a .gguf file. A catalog
        pull's progress goes to `report` when given, else to a terminal bar (with `progress`)."""
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
        with self._pull_dir() as tmp, (nullcontext(report) if report else TerminalBar(progress)) as bar:
            if blob and blob.is_file() and blob.stat().st_size == entry.size and not force:
                source, sha256 = "existing blob", entry.sha256  # of another tag, or of a pull killed after placing it
            else:
                file, sha256, source = fetch(entry, tmp, bar)
                self._place_blob(file, sha256)
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
        return self.blob_path(digest).is_file()

    def blob_path(self, digest: str) -> Path:
        """Where the blob `digest` ("sha256:<hex>") is, or would be, stored."""
        return self._blob_path(_digest_hex(digest))

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
            if not isinstance(sha256, str) or not SHA256_RE.match(sha256):
                raise ValueError(f"bad sha256 {sha256!r}")
        except (OSError, ValueError, KeyError, TypeError) as e:
            problem = f"manifest {path} is unreadable ({one_line(e)})"
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
        self.clean_stale()
        root = self.home / "tmp"
        root.mkdir(parents=True, exist_ok=True)
        path = Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-", dir=root))
        try:
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)

    def clean_stale(self) -> None:
        """Remove what killed pulls left in tmp/, and killed repacks in cache/; what processes still running
        (live pid) are writing stays. `kiln list`, the server's start and every pull do it: it reads every
        cache directory, too slow for each listing a server answers."""
        for cache in (self.home / "cache").glob("*/"):
            clean_temps(cache)
        root = self.home / "tmp"
        if not root.is_dir():
            return
        for path in root.iterdir():
            pid = path.name.split("-", 1)[0]
            if path.is_dir() and pid.isdigit() and pid_alive(int(pid)):
                continue
            with contextlib.suppress(OSError):  # a read-only store, or another process cleaning at the same time
                if path.is_dir():
                    shutil.rmtree(path)
                else:
                    path.unlink()

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
        with self._pull_dir() as tmp, TerminalBar(progress) as bar:
            copied, digest = copy_files([path], tmp, bar)
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
    if not digest.startswith("sha256:") or not SHA256_RE.match(hex_):
        raise StoreError(f"{digest!r} is not a digest: expected sha256: and 64 lowercase hex digits")
    return hex_


def _canonical_tag(name: str, error: type[KilnError]) -> str:
    """Tags are case-insensitive and `name` alone means `name:latest`, as in Ollama."""
    if len(name) > MAX_TAG_CHARS:  # it names a file in the store
        raise error(f"a model name of {len(name)} characters is too long (at most {MAX_TAG_CHARS})")
    tag = name.strip().lower()
    tag = tag if ":" in tag else f"{tag}:latest"
    if not TAG_RE.match(tag):
        raise error(f"{name!r} is not a valid model tag (name[:tag], in a-z 0-9 . _ -) nor a .gguf path")
    return tag


def _tag_from_filename(path: Path) -> str:
    stem = path.name[: -len(".gguf")] if path.name.lower().endswith(".gguf") else path.name
    name = re.sub(r"[^a-z0-9._-]+", "-", stem.lower()).lstrip("._-") or "model"
    return f"{name}:latest"
