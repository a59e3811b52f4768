"""Facts about this machine that every measurement should carry: CPU, ISA kiln selected, cores,
memory, huge pages."""

from __future__ import annotations

import os
import platform
import resource
from pathlib import Path

from kiln import __version__

ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx_vnni")


def _cpuinfo() -> dict[str, str]:
    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return info


def _meminfo_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def mem_available_bytes() -> int | None:
    kib = _meminfo_kib("MemAvailable")
    return kib * 1024 if kib is not None else None


def transparent_hugepages() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
        return text[text.index("[") + 1 : text.index("]")]
    except (OSError, ValueError):
        return "unavailable"


def memlock_limit() -> str:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return "unlimited" if soft == resource.RLIM_INFINITY else f"{soft // 1024} KiB"


def facts() -> dict:
    from kiln.engine import native

    cpu = _cpuinfo()
    flags = set(cpu.get("flags", "").split())
    total, avail = _meminfo_kib("MemTotal"), _meminfo_kib("MemAvailable")
    isa = None
    if native.available():
        from kiln.native import kernels

        isa = kernels.active_isa()
    return {
        "kiln_version": __version__,
        "cpu": cpu.get("model name", platform.processor() or platform.machine()),
        "arch": platform.machine(),
        "isa_flags": [f for f in ISA_FLAGS if f in flags],
        "kernel_isa": isa,
        "native_built": native.available(),
        "logical_cpus": os.cpu_count(),
        "physical_cores": native.physical_cores(),
        "mem_total_gib": round(total / 2**20, 2) if total else None,
        "mem_available_gib": round(avail / 2**20, 2) if avail else None,
        "transparent_hugepages": transparent_hugepages(),
        "memlock": memlock_limit(),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
    }
