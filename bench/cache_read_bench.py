"""What checking the repack cache costs a load: `Arena.read_file` (1 MiB reads, each chunk's crc32c lanes
computed while it is in cache) against a plain read of the same file into an arena, alternating in one
process, from the page cache (or, with --cold, with the file evicted from it before every read).

    python bench/cache_read_bench.py MODEL.gguf [--rounds 40] [--cold] [--other-native PATH.so]

The model's weights are packed once into a temporary repack cache. --other-native adds another build's
`Arena.read_file` (e.g. one from before the checksum) to the rotation.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import tempfile
import time
from pathlib import Path

from kiln import _native
from kiln.engine.native import NativeEngine
from kiln.gguf import GGUFFile
from kiln.models import family_for


def plain_read(native, path: str, nbytes: int):
    arena = native.Arena(nbytes)
    with open(path, "rb", buffering=0) as f:
        view, at = memoryview(arena), 0
        while at < nbytes:
            at += f.readinto(view[at:])
    return arena


def other_build(path: str):
    spec = importlib.util.spec_from_file_location("kiln._native", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--cold", action="store_true", help="evict the file from the page cache before each read")
    ap.add_argument("--other-native", help="another build's kiln._native to time its read_file too")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        gguf = GGUFFile(args.model)
        NativeEngine(gguf, family_for(gguf), n_ctx=16, cache_dir=Path(cache)).close()
        path = str(Path(cache) / "packed.bin")
        nbytes = os.path.getsize(path)
        variants = {"plain read": lambda: plain_read(_native, path, nbytes),
                    "read_file (checked)": lambda: _native.Arena(nbytes).read_file(path)}
        if args.other_native:
            other = other_build(args.other_native)
            variants["other build's read_file"] = lambda: other.Arena(nbytes).read_file(path)
        names, times = list(variants), {name: [] for name in variants}
        for i in range(args.rounds):
            for name in names[i % len(names):] + names[: i % len(names)]:
                if args.cold:
                    fd = os.open(path, os.O_RDONLY)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    os.close(fd)
                start = time.perf_counter()
                variants[name]()
                times[name].append(time.perf_counter() - start)
    base = statistics.median(times["plain read"])
    print(f"{nbytes / 1e6:.0f} MB arena{' (cold)' if args.cold else ''}, {args.rounds} rounds, medians:")
    for name in names:
        ratios = [t / p for t, p in zip(times[name], times["plain read"])]
        print(f"  {name:<24} {statistics.median(times[name]) * 1e3:7.1f} ms  "
              f"{statistics.median(times[name]) / base:.3f}x (median per-round ratio {statistics.median(ratios):.3f})")


if __name__ == "__main__":
    main()
