"""The repack cache: a model's packed weights arena written beside the model, so that a later load is one
sequential read instead of a repack.

A cache directory holds `packed.bin`, the arena, and `packed.json`, its index: the key (kiln's cache
version, the GGUF file's sha256, the packing choices), the arena's size and checksum (csrc/checksum.h:
crc32c lanes computed chunk by chunk as the file is read) and every matrix's layout, sealed by a sha256 of
the index itself. A load trusts the arena only if the key is this model's and the bytes it just read give
the recorded checksum; anything else is repacked and written over (a damaged cache with a warning).

The GGUF's sha256 comes from the store, which names every blob by it. A file used in place (`kiln run
./x.gguf`) is hashed once, at its first load, and the index remembers that sha256 together with the file's
identity (device, inode, size, mtime, ctime): a later load that finds the same identity takes the
remembered sha256, and one that does not hashes the file again. ctime cannot be set back by hand, so a
file that was rewritten, replaced or copied over is hashed afresh.

Files are written as `<name>.<pid>-<random>.kiln-tmp` in the cache directory and renamed into place;
`clean_temps` removes those a dead process left (each load, for its own directory; the store, for all).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import secrets
from pathlib import Path

from kiln.gguf import GGUFFile
from kiln.store import TMP_SUFFIX, clean_temps

try:
    from kiln import _native
except ImportError:  # no native engine: nothing writes or reads a repack cache
    _native = None

INDEX, ARENA = "packed.json", "packed.bin"
_CHUNK = 1 << 20

log = logging.getLogger("kiln.cache")


class RepackCache:
    """One model's repack cache in `directory`. `version` names the packed layouts (kiln's cache version);
    `split` the packing choices the arena depends on; `sha256` is the GGUF's when the store knows it."""

    def __init__(self, directory: Path, gguf: GGUFFile, version: str, split: list[str], sha256: str | None = None):
        self.dir = Path(directory)
        self.gguf = gguf
        self.version = version
        self.split = split
        self._sha256 = sha256
        self._identity = None if sha256 else file_identity(os.fstat(gguf.fileno()))
        clean_temps(self.dir)

    def load(self, names: list[str]):
        """(arena, layouts of `names`) read from the cache, or None when it has to be repacked. A damaged
        cache, or one of another model, is removed with a warning that names it."""
        index, problem = read_index(self.dir, self.version)
        if index is None:
            return self._discard(problem) if problem else None
        arena = _native.Arena(index["nbytes"])
        problem = arena_problem(self.dir, index, self._gguf_sha256(index),
                                lambda nbytes: arena.read_file(str(self.dir / ARENA)))
        if problem:
            return self._discard(problem)
        if index["key"]["split"] != self.split or not set(names) <= set(index["matrices"]):
            log.info("repack cache %s was packed for another graph; repacking", self.dir)
            return None
        return arena, {n: index["matrices"][n] for n in names}

    def save(self, arena, layouts: dict) -> None:
        """Write the arena and its index atomically; a failure (a full disk, a read-only store) leaves no
        partial file and costs only a repack at the next load."""
        key = {"version": self.version, "gguf_sha256": self._gguf_sha256(None), "split": self.split}
        body = {"key": key, "nbytes": arena.nbytes, "checksum": _native.checksum(arena), "matrices": layouts}
        if self._identity is not None:
            body["source"] = {"sha256": self._sha256, "identity": self._identity}
        temps = []
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            # what is there is being replaced: its space is freed first, and a load that comes between
            # the two renames below finds no cache rather than an index of another arena
            remove(self.dir)
            temps = [self._temp(ARENA), self._temp(INDEX)]
            write_file(temps[0], memoryview(arena))
            write_file(temps[1], json.dumps({**body, "digest": _digest(body)}).encode())
            os.replace(temps[0], self.dir / ARENA)
            os.replace(temps[1], self.dir / INDEX)
        except OSError as e:
            log.warning("cannot write the repack cache %s (%s); the model runs from memory and its next "
                        "load repacks", self.dir / ARENA, e.strerror or e)
        finally:
            for temp in temps:
                temp.unlink(missing_ok=True)

    def _gguf_sha256(self, index: dict | None) -> str:
        if self._sha256 is None:
            source = (index or {}).get("source") or {}
            if source.get("identity") == self._identity and isinstance(source.get("sha256"), str):
                self._sha256 = source["sha256"]
            else:
                self._sha256 = sha256_of_fd(self.gguf.fileno())
        return self._sha256

    def _discard(self, problem: str) -> None:
        log.warning("repack cache %s %s; repacking", self.dir / ARENA, problem)
        remove(self.dir)
        return None

    def _temp(self, name: str) -> Path:
        return self.dir / f"{name}.{os.getpid()}-{secrets.token_hex(4)}{TMP_SUFFIX}"


def read_index(directory: Path, version: str) -> tuple[dict | None, str | None]:
    """(index, None) for a whole index of `version`; (None, None) when there is none or it is of another
    version (repacked over, not a fault); (None, what is wrong) when it is damaged."""
    try:
        index = json.loads((Path(directory) / INDEX).read_bytes())
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError):
        return None, "has an unreadable index"
    if not isinstance(index, dict) or not isinstance(index.get("key"), dict):
        return None, "has a damaged index"
    if index["key"].get("version") != version:
        return None, None
    if index.get("digest") != _digest({k: v for k, v in index.items() if k != "digest"}):
        return None, "has a damaged index"
    return index, None


def arena_problem(directory: Path, index: dict, gguf_sha256: str, read_checksum) -> str | None:
    """What is wrong with the arena of a whole index, or None: `read_checksum(nbytes)` reads it."""
    arena = Path(directory) / ARENA
    if index["key"]["gguf_sha256"] != gguf_sha256:
        return f"is of another model (a GGUF of sha256 {index['key']['gguf_sha256']})"
    try:
        size = arena.stat().st_size
        if size != index["nbytes"]:
            return f"is {size} bytes, its index says {index['nbytes']}"
        if read_checksum(index["nbytes"]) != index["checksum"]:
            return "fails its checksum"
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    return None


def verify(directory: Path, gguf_sha256: str, version: str) -> tuple[bool, str]:
    """`kiln check` of one model's cache: (ok, what was found). A damaged cache, or one of another model, is
    removed so that the next load repacks."""
    index, problem = read_index(directory, version)
    if index is not None:
        problem = arena_problem(directory, index, gguf_sha256,
                                lambda nbytes: _native.file_checksum(str(Path(directory) / ARENA), nbytes))
    if problem:
        remove(directory)
        return False, f"repack cache {Path(directory) / ARENA} {problem}; removed, the next load repacks"
    if index is None:
        return True, "no repack cache of this kiln version"
    return True, f"repack cache ok ({index['nbytes'] / 1e6:.0f} MB, checksum {index['checksum']})"


def remove(directory: Path) -> None:
    for name in (INDEX, ARENA):  # the index first: an arena without one is never read
        with contextlib.suppress(OSError):
            (Path(directory) / name).unlink()


def file_identity(st: os.stat_result) -> list[int]:
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def sha256_of_fd(fd: int) -> str:
    digest, buf, at = hashlib.sha256(), bytearray(_CHUNK), 0
    while n := os.preadv(fd, [buf], at):
        digest.update(memoryview(buf)[:n])
        at += n
    return digest.hexdigest()


def write_file(path: Path, data) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _digest(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
