"""Builds kiln's native core, a CPython extension. Kernels for each instruction set are compiled from
their own files with target attributes and chosen at run time, so one build runs on any x86-64 CPU."""

import platform
from glob import glob

from setuptools import Extension, setup

x86 = platform.machine().lower() in ("x86_64", "amd64")
# Python's own CFLAGS carry -fwrapv (CPython relies on wrapping signed overflow; kiln's C does not, and a
# UBSan build passes the kernel tests). It costs the kernels' address arithmetic (docs/PERF.md, "Built
# with -fno-wrapv"), so it is undone.
native = Extension(
    "kiln._native",
    sources=sorted(glob("csrc/*.c")),
    include_dirs=["csrc"],
    extra_compile_args=["-O3", "-std=gnu11", "-fno-strict-aliasing", "-Wall", "-Wno-unused-function", "-fno-wrapv"]
    + (["-DKILN_X86=1"] if x86 else []),
    extra_link_args=["-lpthread"],
)
setup(ext_modules=[native])
