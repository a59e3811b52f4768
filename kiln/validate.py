"""`kiln validate`: is this machine ready for kiln, and what does it deliver? The CPU counterpart of
`flm validate` and `xrt-smi validate`: the platform facts kiln depends on (extension, CPU features and the
kernel variant chosen, threads, huge pages, memlock, memory and whether a model fits), then self-tests
with figures — kernel correctness against numpy, GEMM throughput, GEMV bandwidth against a plain read of
the same memory, and what one native call and one parallel region cost.

Every figure carries how it was measured. Timings are medians of repeated runs; the machine's load
average is reported beside them, since other processes on the same cores move every figure.
"""

from __future__ import annotations

import inspect
import os
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

PASSED, FAILED, WARNING, INFO = "passed", "failed", "warning", "info"
MiB = 1 << 20
HUGE_PAGE = 2 * MiB  # arenas and the KV cache are whole huge pages
ARENA_PROBE_BYTES = 64 * MiB


@dataclass
class Check:
    name: str
    status: str
    result: str
    method: str
    figures: dict = field(default_factory=dict)


# ---- measurement helpers (also used by `kiln trace`) -----------------------------------------------

def median_seconds(fn: Callable[[], object], reps: int) -> float:
    """Median wall seconds of `reps` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_parallel(work: list[Callable[[], object]]) -> None:
    """Run the callables at once, one per thread, the first on this one. Worth it only for calls into C
    that release the GIL (the kernel bindings do); threads start together at a barrier."""
    if len(work) == 1:
        work[0]()
        return
    barrier = threading.Barrier(len(work))

    def body(fn):
        barrier.wait()
        fn()

    threads = [threading.Thread(target=body, args=(fn,)) for fn in work[1:]]
    for t in threads:
        t.start()
    barrier.wait()
    work[0]()
    for t in threads:
        t.join()


def l3_bytes() -> int | None:
    try:
        text = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
    except OSError:
        return None
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def stream_bytes(quick: bool = False) -> int:
    """A buffer size that streams from DRAM: well past the last-level cache."""
    l3 = l3_bytes() or 32 * MiB
    return max(2 * l3, 64 * MiB) if quick else max(8 * l3, 256 * MiB)


def _slices(n_items: int, parts: int) -> list[tuple[int, int]]:
    edges = [n_items * i // parts for i in range(parts + 1)]
    return list(zip(edges[:-1], edges[1:]))


class ReadLoop:
    """The plain read: kiln's C read loop (K.mem_read: the widest loads the CPU has, 32 bytes with AVX2)
    over a huge-page buffer much larger than the L3 cache, split into `threads` contiguous slices read at
    once."""

    def __init__(self, threads: int, nbytes: int | None = None, buf: np.ndarray | None = None):
        from kiln.native import kernels as K

        if buf is None:
            buf = K.huge_empty(nbytes or stream_bytes())
            buf[:] = 1  # fault every page in before timing
        self.buf, self.threads = buf, threads
        pages = buf.size // 4096
        parts = [buf[a * 4096 : b * 4096] for a, b in _slices(pages, threads)]
        self.work = [lambda p=p: K.mem_read(p) for p in parts]
        run_parallel(self.work)  # warm-up

    def pass_gb_s(self) -> float:
        t0 = time.perf_counter()
        run_parallel(self.work)
        return self.buf.size / (time.perf_counter() - t0) / 1e9

    def figures(self, passes: list[float], spread: str) -> dict:
        return {"gb_s": statistics.median(passes), "passes": passes, "threads": self.threads,
                "bytes": int(self.buf.size),
                "method": f"C read loop (kiln mem_read) over {self.buf.size / MiB:.0f} MiB on huge pages, "
                          f"{self.threads} thread(s) each reading a contiguous slice; median of {len(passes)} "
                          f"passes {spread}"}


# ---- platform checks -----------------------------------------------------------------------------

def check_extension() -> tuple[Check, dict | None]:
    try:
        from kiln import _native
    except ImportError as e:
        return Check("native extension", FAILED, f"not built: {e}; rebuild with `pip install -e .` or "
                     "`python setup.py build_ext --inplace`", "import kiln._native"), None
    info = _native.build_info()
    _, op_bytes = _native.op_layout()
    ok = info["op_struct_bytes"] == op_bytes
    result = (f"built with gcc {info['compiler']}; op struct {info['op_struct_bytes']} bytes, "
              f"{'matching' if ok else 'NOT matching'} the layout Python encodes plans with ({op_bytes})")
    return Check("native extension", PASSED if ok else FAILED, result,
                 f"import kiln._native ({Path(_native.__file__).name}); compiler and sizeof(kiln_op) compiled in",
                 {"path": _native.__file__, **info, "op_layout_bytes": op_bytes}), info


def check_load(facts: dict) -> Check:
    load1, load5, _ = os.getloadavg()
    cpus = facts["logical_cpus"] or 1
    busy = load1 / cpus > 0.5
    return Check("machine load", WARNING if busy else INFO,
                 f"load average {load1:.2f} (1 min), {load5:.2f} (5 min) on {cpus} CPUs"
                 + ("; other work shares these cores, so the figures below are low and noisy" if busy else ""),
                 "os.getloadavg() at the start of validation", {"load1": load1, "load5": load5, "cpus": cpus})


def check_cpu(facts: dict) -> Check:
    return Check("cpu", INFO, f"{facts['cpu']} ({facts['arch']}), {facts['physical_cores']} physical cores, "
                 f"{facts['logical_cpus']} logical CPUs; flags: {', '.join(facts['isa_flags']) or 'none of interest'}",
                 "/proc/cpuinfo and the CPU topology in /sys", {k: facts[k] for k in
                 ("cpu", "arch", "physical_cores", "logical_cpus", "isa_flags")})


def check_isa() -> Check:
    from kiln.native import kernels as K

    best, env_error = K.detect_isa(), K._native.isa_error()
    active = K.ISAS[K._native.isa_active()]
    why = {}
    for name in K.ISAS:
        missing = K.isa_missing(name)
        if name == active:
            why[name] = "selected"
        elif missing:
            why[name] = f"CPU lacks {missing}"
        elif K.ISAS.index(name) < K.ISAS.index(best):
            why[name] = f"usable, but {best} is faster"
        else:
            why[name] = "usable, not selected (KILN_ISA)"
    status = FAILED if env_error else PASSED if active == best else WARNING
    result = f"{active} kernels" + (f" ({env_error})" if env_error else "") + "; " + "; ".join(
        f"{k}: {v}" for k, v in why.items() if k != active)
    return Check("kernel variant", status, result,
                 "CPUID feature bits, XGETBV (OS support for the register state) and, for amx, the OS granting the tile "
                 "data (arch_prctl ARCH_REQ_XCOMP_PERM), as the kernels dispatch",
                 {"active": active, "best": best, "variants": why, "kiln_isa_env": os.environ.get("KILN_ISA")})


def check_threads() -> Check:
    from kiln.engine.native import physical_cores

    affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    n = physical_cores()
    return Check("threads", INFO, f"{n} (one per physical core this process may run on; override with -t)",
                 "sched_getaffinity and /sys thread_siblings_list: hyperthread siblings count once",
                 {"default_threads": n, "affinity": affinity})


def anon_huge_kib() -> int | None:
    """AnonHugePages of this process, from /proc/self/smaps_rollup."""
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def check_huge_pages() -> Check:
    from kiln import _native
    from kiln.machine import transparent_hugepages

    mode = transparent_hugepages()
    try:
        defrag = Path("/sys/kernel/mm/transparent_hugepage/defrag").read_text().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        defrag = "unavailable"
    before = anon_huge_kib()
    arena = _native.Arena(ARENA_PROBE_BYTES)
    np.frombuffer(arena, dtype=np.uint8)[::4096] = 1  # fault in every page
    after = anon_huge_kib()
    method = (f"allocate a {ARENA_PROBE_BYTES // MiB} MiB kiln arena (mmap + MADV_HUGEPAGE, as weights and KV "
              "cache are), touch every page, and read AnonHugePages from /proc/self/smaps_rollup before and after")
    figures = {"thp_enabled": mode, "thp_defrag": defrag}
    if before is None or after is None:
        return Check("huge pages", WARNING, f"THP {mode}; /proc/self/smaps_rollup is unreadable, so whether "
                     "arenas get huge pages is unknown", method, figures)
    got = (after - before) * 1024
    share = got / ARENA_PROBE_BYTES
    del arena
    figures.update(arena_bytes=ARENA_PROBE_BYTES, huge_bytes=got, share=share)
    status = PASSED if share >= 0.5 else WARNING
    result = (f"THP enabled={mode}, defrag={defrag}; a kiln arena got {got // MiB} of {ARENA_PROBE_BYTES // MiB} MiB "
              "on huge pages")
    if status == WARNING:
        result += " (without them weight streaming is 20-55% slower; enable THP 'madvise' or 'always')"
    return Check("huge pages", status, result, method, figures)


def check_memlock(facts: dict) -> Check:
    return Check("memlock", INFO, f"limit {facts['memlock']}; kiln does not lock memory, so any limit works",
                 "getrlimit(RLIMIT_MEMLOCK)", {"memlock": facts["memlock"]})


def process_rss_bytes() -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def kv_cache_bytes(n_layers: int, n_kv_heads: int, head_dim: int, n_ctx: int, n_slots: int = 1,
                   kv_type: str = "f16") -> int:
    """The engine's KV cache: keys and values (fp16, or q8_0's 34 or q4_0's 18 bytes a block of 32) per layer, slot,
    position and KV head, positions in whole groups of 8, in whole huge pages."""
    from kiln.engine.kv import kv_head_bytes

    kv_ctx = -(-n_ctx // 8) * 8
    per_head = kv_head_bytes(kv_type, kv_ctx, head_dim)
    return -(-2 * n_layers * n_slots * n_kv_heads * per_head // HUGE_PAGE) * HUGE_PAGE


# bits per weight of a whole file: the block formats' own; Q4_K_M mixes types, 4.58 GiB for Llama-3-8B's
# 8.03B weights in llama-quantize's table
_FILE_BITS_PER_WEIGHT = {"Q4_0": 4.5, "Q4_1": 5.0, "Q4_K_M": 4.9, "Q8_0": 8.5, "F16": 16.0, "BF16": 16.0,
                         "MXFP4": 4.25}


def catalog_need(entry) -> tuple[int | None, str]:
    """What loading a catalog model would take before its file is here, and what the figure rests on: its
    download size (or, unknown, its parameters at its quantization's bits per weight) plus the KV cache at
    the default context. None, and why, when the catalog cannot say."""
    from kiln.engine.model import DEFAULT_CTX

    if entry.shape is None:
        return None, "no shape in the catalog"
    kv = kv_cache_bytes(entry.shape["layers"], entry.shape["kv_heads"], entry.shape["head_dim"],
                        min(entry.context_length, DEFAULT_CTX))
    if entry.size is not None:
        return entry.size + kv, "download size + KV cache"
    count = entry.parameters.upper()
    bits = _FILE_BITS_PER_WEIGHT.get(entry.quantization.upper())
    try:
        n = float(count[:-1]) * {"B": 1e9, "M": 1e6}[count[-1]]
    except (ValueError, KeyError, IndexError):
        return None, f"size unknown, parameters {entry.parameters!r} unreadable"
    if bits is None:
        return None, f"size unknown, no bits per weight for {entry.quantization}"
    return int(n * bits / 8) + kv, "parameters x bits per weight + KV cache"


def footprint(ref: str, n_ctx: int | None, n_slots: int = 1, kv_cache: str | None = None) -> dict:
    """What loading `ref` allocates, computed from the GGUF without loading it: the packed weight arena
    (exact: each matrix's packed size rounded as the engine places it), the KV cache of type `kv_cache`
    (None: KILN_KV_CACHE_TYPE, else f16; exact) and the plans' working buffers (an upper-bound estimate
    from the shapes)."""
    from kiln.engine.compile import Recorder
    from kiln.engine.kv import check_kv_cache_type, kv_cache_type, recurrent_state_bytes
    from kiln.engine.model import DEFAULT_CTX
    from kiln.engine.native import NativeEngine, arena_bytes, heads_of, packed_names, packed_parts
    from kiln.errors import KilnError
    from kiln.gguf import GGUFFile
    from kiln.models import family_for
    from kiln.models.base import attention_layers
    from kiln.store import Store

    kv_type = kv_cache_type(kv_cache)
    record = Store().resolve(ref)
    gguf = GGUFFile(record.path)
    try:
        family = family_for(gguf)
        cfg = family.config
        n_ctx = min(cfg.context_length, DEFAULT_CTX) if n_ctx is None else n_ctx
        if not 1 <= n_ctx <= cfg.context_length:
            raise KilnError(f"context length {n_ctx} is outside 1..{cfg.context_length}, "
                            f"the most {record.tag} supports")
        root = family.forward(Recorder(), cfg)
        weights = 0
        for name in packed_names(gguf, root):
            t = gguf.info(name)
            rows, cols = t.shape[0], int(np.prod(t.shape[1:]))
            for ggml in packed_parts(int(t.type), rows, cols, split=name in heads_of(root)):
                weights += arena_bytes(ggml, rows, cols)
        weights = -(-max(weights, 1) // HUGE_PAGE) * HUGE_PAGE
        check_kv_cache_type(kv_type, cfg.head_dim)
        kv = kv_cache_bytes(len(attention_layers(cfg)), cfg.n_kv_heads, cfg.head_dim, n_ctx, n_slots, kv_type)
        defaults = {k: p.default for k, p in inspect.signature(NativeEngine.__init__).parameters.items()}
        # a hybrid's recurrent state: rings that reach back a step's rows (the prefill plan's)
        state = recurrent_state_bytes(cfg, n_slots, max(defaults["prefill_rows"], defaults["max_batch"] + 1))
        state = -(-state // HUGE_PAGE) * HUGE_PAGE
        # per row and layer at most: residual, norm and norm-add outputs (10 x dim), q, attention output and
        # its activations (3 x q width), the GLU output and its activations (2 x ffn), all fp32; the decode
        # plan as if no buffer were reused, the prefill plan with a few layers' worth live at once
        per_row = (10 * cfg.dim + 3 * cfg.n_heads * cfg.head_dim + 2 * cfg.ffn_dim) * 4
        decode = defaults["max_batch"] * (cfg.n_layers * per_row + cfg.vocab_size * 4)
        prefill = max(defaults["prefill_rows"], defaults["max_batch"] + 1) * per_row * 4 \
            + min(defaults["max_out"], defaults["prefill_rows"]) * cfg.vocab_size * 4
        return {"model": record.tag, "n_ctx": n_ctx, "n_slots": n_slots, "weights_bytes": weights, "kv_bytes": kv,
                "kv_type": kv_type, "state_bytes": state, "working_bytes_estimate": decode + prefill,
                "gguf_bytes": gguf.file_size(), "total_bytes": weights + kv + state + decode + prefill}
    finally:
        gguf.close()


def check_memory(facts: dict, model: str | None, n_ctx: int | None, n_slots: int,
                 kv_cache: str | None = None) -> tuple[Check, dict | None]:
    total, avail = facts["mem_total_gib"], facts["mem_available_gib"]
    base = f"{total} GiB total, {avail} GiB available"
    if not model:
        return Check("memory", INFO, base + " (give --model to check a fit)", "/proc/meminfo MemTotal, MemAvailable",
                     {"mem_total_gib": total, "mem_available_gib": avail}), None
    from kiln.errors import KilnError

    try:
        fp = footprint(model, n_ctx, n_slots, kv_cache)
    except KilnError as e:
        return Check("memory fit", FAILED, f"{model}: {e}", "read the model's GGUF from the store"), \
            {"model": model, "fits": False, "error": str(e)}
    rss = process_rss_bytes() or 0
    need = fp["total_bytes"] + rss
    fits = avail is not None and need <= avail * 2**30
    fp.update(process_rss_bytes=rss, need_bytes=need, available_bytes=int((avail or 0) * 2**30), fits=fits)
    result = (f"{fp['model']} at {fp['n_ctx']} tokens x {n_slots} slot(s) needs {need / 2**30:.2f} GiB: weights "
              f"{fp['weights_bytes'] / MiB:.0f} MiB + KV cache ({fp['kv_type']}) {fp['kv_bytes'] / MiB:.0f} MiB + "
              + (f"recurrent state {fp['state_bytes'] / MiB:.0f} MiB + " if fp["state_bytes"] else "") + "plan arenas "
              f"<= {fp['working_bytes_estimate'] / MiB:.0f} MiB + this process {rss / MiB:.0f} MiB; {base}: "
              + ("fits" if fits else "DOES NOT FIT"))
    method = ("packed sizes of every matrix the graph multiplies (kiln's pack_size, placed as the engine places "
              "them), KV = 2 x attention layers x slots x context (rounded up to 8) x kv heads x head dim x 2 bytes "
              "(fp16), 34/32 bytes (q8_0) or 18/32 bytes (q4_0), recurrent state = fp32 x slots x (a step's rows + taps - 1) x the "
              "convolution layers' widths, plan "
              "arenas an upper bound from the shapes, this process's VmRSS; against MemAvailable. The GGUF file itself "
              f"({fp['gguf_bytes'] / MiB:.0f} MiB) is memory-mapped: page cache, reclaimable, not counted")
    return Check("memory fit", PASSED if fits else FAILED, result, method, fp), fp


# ---- kernel self-tests ---------------------------------------------------------------------------

def _random_gguf_weights(t, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """GGUF bytes of a random tensor: random quants with finite fp16 scales of random sign."""
    from gguf import GGML_QUANT_SIZES, quants
    from gguf import GGMLQuantizationType as QT

    if t in (QT.F32, QT.F16, QT.BF16):
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        return quants.quantize(w, t) if t == QT.BF16 else w.astype(np.float16 if t == QT.F16 else np.float32)
    block, size = GGML_QUANT_SIZES[t]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    if t == QT.MXFP4:  # one e8m0 exponent byte a block: scales 2^-4 and 2^-3
        raw[:, :, 0] = rng.integers(124, 126, (rows, cols // block))
        return raw.reshape(rows, -1)
    scale_at = {QT.Q4_1: (0, 2), QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208,)}.get(t, (0,))
    for off in scale_at:
        d = (np.sign(rng.standard_normal((rows, cols // block))) * rng.uniform(0.01, 0.02, (rows, cols // block)))
        raw[:, :, off : off + 2] = d.astype(np.float16).view(np.uint8).reshape(rows, cols // block, 2)
    return raw.reshape(rows, -1)


def _as_kernel_sees(x: np.ndarray) -> np.ndarray:
    """fp32 activations as the integer kernels see them: int8 per block of 32, scale max|x|/127,
    rounded to nearest even."""
    n, c = x.shape
    xb = x.reshape(n, c // 32, 32)
    d = np.abs(xb).max(-1, keepdims=True) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    return (np.rint((xb * inv).astype(np.float32)).astype(np.float64) * d).reshape(n, c)


def check_kernels(seed: int = 0) -> Check:
    """Every weight format on the active kernels against numpy: the gguf package's dequantization
    times the same (rounded) activations in float64, so only summation order may differ."""
    from gguf import GGMLQuantizationType as QT
    from gguf import quants

    from kiln.native import kernels as K

    rng = np.random.default_rng(seed)
    rows, n = 67, 3
    errors = {}
    for t in (QT.F32, QT.F16, QT.BF16, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q8_0, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.MXFP4):
        cols = 768 if t in (QT.Q4_K, QT.Q5_K, QT.Q6_K) else 576
        raw = _random_gguf_weights(t, rows, cols, rng)
        w = raw.astype(np.float64) if t in (QT.F32, QT.F16) else \
            quants.dequantize(raw, t).astype(np.float64).reshape(rows, cols)
        x = rng.standard_normal((n, cols)).astype(np.float32)
        y = K.matmul_f32(K.pack(t, raw, rows, cols), x)
        xs = x.astype(np.float64) if t in (QT.F32, QT.F16, QT.BF16) else _as_kernel_sees(x)
        ref = xs @ w.T
        errors[t.name] = float(np.abs(y - ref).max() / np.abs(ref).max()) if np.isfinite(y).all() else float("inf")
    worst = max(errors, key=errors.get)
    ok = errors[worst] <= 1e-5
    return Check("kernel correctness", PASSED if ok else FAILED,
                 f"{len(errors)} weight formats on {K.active_isa()}: worst {worst} at {errors[worst]:.1e} of max |y|"
                 + ("" if ok else " (limit 1e-5)"),
                 f"{rows}x576 (k-quants 768) random GGUF weights x {n} tokens through kiln's pack + matmul, against "
                 "float64 numpy on the gguf package's dequantization and the activations as the kernel rounds them",
                 {"max_rel_error": errors, "limit": 1e-5, "isa": K.active_isa()})


def _gemm_gops(t, threads: int, reps: int, rng) -> float:
    from kiln import _native
    from kiln.native import kernels as K

    rows, cols, n = 1024, 3072, 512
    pm = K.pack(t, _random_gguf_weights(t, rows, cols, rng), rows, cols, out=K.huge_empty(K.pack_size(t, rows, cols)))
    act = K.quantize_act(pm.fmt, rng.standard_normal((n, cols)).astype(np.float32))
    y = np.empty((n, rows), np.float32)
    work = [lambda a=a, b=b: _native.matmul(int(pm.fmt), rows, cols, pm.tile_bytes, pm.data, act, n, y, rows, a, b)
            for a, b in _slices(pm.tiles, threads)]
    return 2 * rows * cols * n / median_seconds(lambda: run_parallel(work), reps) / 1e9


def check_gemm(threads: int, reps: int) -> Check:
    from gguf import GGMLQuantizationType as QT

    rng = np.random.default_rng(1)
    figures = {}
    for label, t in (("int8", QT.Q8_0), ("int4", QT.Q4_0), ("bf16", QT.BF16)):
        figures[label] = {f"{k}_threads": _gemm_gops(t, k, reps, rng) for k in sorted({1, threads})}
    best = {k: max(v.values()) for k, v in figures.items()}
    return Check("GEMM", INFO, f"int8 {best['int8']:.0f} GOPS, int4 {best['int4']:.0f} GOPS, "
                 f"bf16 {best['bf16']:.0f} GFLOPS ({threads} threads)",
                 f"1024x3072 weights (in cache) x 512 tokens, 2*rows*cols*tokens / time; median of {reps}. int8: Q8_0 "
                 "weights x int8 activations (VNNI dot products where the CPU has them); int4: Q4_0 weights x int8 "
                 "activations; bf16: bf16 weights widened to fp32 x fp32 activations with fp32 FMA — kiln has no "
                 "bf16 dot-product (vdpbf16ps) path. Threads split the rows, one kernel call each",
                 {"gops": figures, "shape": [1024, 3072, 512]})


def check_gemv(threads: int, reps: int, quick: bool) -> Check:
    """Q4_1 GEMV (SmolLM2's weight type) streaming packed weights from DRAM, against the plain read
    loop over the same buffer."""
    from gguf import GGMLQuantizationType as QT

    from kiln import _native
    from kiln.native import kernels as K

    rng = np.random.default_rng(2)
    t, rows, cols = QT.Q4_1, 8192, 2048
    size = K.pack_size(t, rows, cols)
    copies = max(1, -(-stream_bytes(quick) // size))
    buf = K.huge_empty(copies * size)
    first = K.pack(t, _random_gguf_weights(t, rows, cols, rng), rows, cols, out=buf[:size])
    for i in range(1, copies):
        buf[i * size : (i + 1) * size] = buf[:size]
    mats = [buf[i * size : (i + 1) * size] for i in range(copies)]
    act = K.quantize_act(first.fmt, rng.standard_normal((1, cols)).astype(np.float32))
    y = np.empty((1, rows), np.float32)
    streamed = copies * first.tiles * first.tile_bytes
    figures = {}
    for k in sorted({1, threads}):
        def part(a, b):
            for m in mats:
                _native.matmul(int(first.fmt), rows, cols, first.tile_bytes, m, act, 1, y, rows, a, b)
        work = [lambda a=a, b=b: part(a, b) for a, b in _slices(first.tiles, k)]
        read = ReadLoop(k, buf=buf)
        run_parallel(work)  # warm-up
        gemv, plain = [], []
        for _ in range(reps):  # alternating, so both see the same machine
            t0 = time.perf_counter()
            run_parallel(work)
            gemv.append(streamed / (time.perf_counter() - t0) / 1e9)
            plain.append(read.pass_gb_s())
        figures[f"{k}_threads"] = {"gemv_gb_s": statistics.median(gemv), "read_gb_s": statistics.median(plain),
                                   "ratio": statistics.median(g / p for g, p in zip(gemv, plain)),
                                   "gemv_passes": gemv, "read_passes": plain}
    top = figures[f"{threads}_threads"]
    return Check("GEMV bandwidth", INFO, f"Q4_1 GEMV {top['gemv_gb_s']:.1f} GB/s = {top['ratio']:.0%} of a plain read "
                 f"of the same memory ({top['read_gb_s']:.1f} GB/s), {threads} threads"
                 + (f"; 1 thread: {figures['1_threads']['gemv_gb_s']:.1f} of {figures['1_threads']['read_gb_s']:.1f}"
                    if threads > 1 else ""),
                 f"{copies} copies of a packed {rows}x{cols} Q4_1 matrix on huge pages ({buf.size / MiB:.0f} MiB, past "
                 "the L3 cache), one token; GB/s of packed bytes; the read loop reads the same buffer split the same "
                 f"way; {reps} GEMV and read passes alternating, medians of each and of the pass-by-pass ratios",
                 {"by_threads": figures, "bytes": int(buf.size)})


PEAK_PASSES, PEAK_ITERS = 5, 200_000


def int8_peaks() -> dict:
    """{unit: GMAC/s of one core} for each int8 dot-product unit the CPU has (csrc/peaks.c), and
    {unit: why not} for the others."""
    from kiln import _native

    got = _native.int8_peaks(PEAK_PASSES, PEAK_ITERS)
    return {"gmacs_per_core": {u: v for u, v in got.items() if isinstance(v, float)},
            "missing": {u: v for u, v in got.items() if isinstance(v, str)}}


def check_peaks(threads: int, gemm: Check, gemv: Check) -> Check:
    """The machine's int8 peaks, and what kiln's own GEMM (the int4 figure: Q4_0 x int8, 512 tokens) and GEMV
    reach of them."""
    from kiln.native import kernels as K

    peaks = int8_peaks()
    per_core = peaks["gmacs_per_core"]
    gemm_gmacs = gemm.figures["gops"]["int4"][f"{threads}_threads"] / 2
    share = {u: gemm_gmacs / (g * threads) for u, g in per_core.items() if g > 0}
    top = gemv.figures["by_threads"][f"{threads}_threads"]
    units = ", ".join(f"{u} {g:.0f}" for u, g in per_core.items()) or "none"
    shares = ", ".join(f"{v:.0%} of {u}" for u, v in share.items())
    missing = "; ".join(f"no {u}: {why}" for u, why in peaks["missing"].items())
    return Check("int8 peaks", INFO, f"GMAC/s per core: {units}. kiln's GEMM ({K.active_isa()}) {gemm_gmacs:.0f} GMAC/s on "
                 f"{threads} threads = {shares}; GEMV {top['gemv_gb_s']:.1f} GB/s = {top['ratio']:.0%} of the "
                 f"{top['read_gb_s']:.1f} GB/s read" + (f" ({missing})" if missing else ""),
                 f"each unit: a loop of independent accumulators doing only its int8 products (AVX2 vpmaddubsw + vpmaddwd "
                 f"+ vpaddd, 32 products each; AVX-512 VNNI vpdpbusd zmm, 64; AVX-VNNI vpdpbusd ymm, 32; AMX tdpbssd on "
                 f"4 tiles of 16 x 16 int32, K = 64), one core, the best of {PEAK_PASSES} passes; the peak of {threads} "
                 "threads is taken as threads x that. kiln's figures are the GEMM and GEMV checks' (medians)",
                 {"gmacs_per_core": per_core, "missing": peaks["missing"], "gemm_gmacs": gemm_gmacs,
                  "gemm_share_of_peak": share, "gemm_isa": K.active_isa(), "read_gb_s": top["read_gb_s"],
                  "gemv_gb_s": top["gemv_gb_s"], "gemv_share_of_read": top["ratio"]})


def _per_call_ns(fn: Callable, args: tuple = (), calls: int = 2000, batches: int = 15) -> float:
    """Median over batches of ns per call of fn(*args), minus the bare Python loop around it."""
    def batch(body) -> int:
        t0 = time.perf_counter_ns()
        body()
        return time.perf_counter_ns() - t0

    def calling():
        for _ in range(calls):
            fn(*args)

    def looping():
        for _ in range(calls):
            pass

    loop = statistics.median(batch(looping) for _ in range(batches))
    return (statistics.median(batch(calling) for _ in range(batches)) - loop) / calls


def check_dispatch(threads: int, quick: bool) -> Check:
    from kiln import _native

    pool = _native.Pool(threads)
    inputs = _native.Arena(64)  # zeroed: token 0, slot 0, position 0
    base = inputs.address
    empty = _native.Plan(b"", pool, {"inputs": inputs}, 1, 1, 1, 1, base, base + 4, base + 8, base + 12)
    call_ns = _per_call_ns(_native.noop)
    step_ns = _per_call_ns(empty.run, (1, 0))
    regions = 100 if quick else 400
    figures = {"noop_call_ns": call_ns, "empty_step_ns": step_ns, "threads": threads}
    runs = (("dispatch", 0, False, regions), ("dispatch_after_idle", 1000, False, regions // 4),
            ("fork_join", 0, True, regions // 4), ("fork_join_after_idle", 1000, True, regions // 8))
    for label, idle_us, all_threads, n in runs:
        ns, on_workers, timeouts = _native.pool_region_ns(threads, n, idle_us, all_threads)
        figures[label] = {"median_ns": statistics.median(ns), "p90_ns": float(np.percentile(ns, 90)), "regions": n,
                          "chunks_on_workers": on_workers, "timeouts": timeouts}
    us = {k: v["median_ns"] / 1e3 for k, v in figures.items() if isinstance(v, dict)}
    fj = figures["fork_join"]
    result = (f"empty call {call_ns:.0f} ns, empty step {step_ns / 1e3:.2f} us; parallel region: dispatch "
              f"{us['dispatch']:.2f} us, after 1 ms idle {us['dispatch_after_idle']:.1f} us; all {threads} threads "
              f"joined: {us['fork_join']:.1f} us median, p90 {fj['p90_ns'] / 1e3:.0f} us, after 1 ms idle "
              f"{us['fork_join_after_idle']:.0f} us")
    if fj["timeouts"]:
        result += (f" ({fj['timeouts']} of {fj['regions']} joins waited out the 10 ms limit: another process held "
                   "a core)")
    method = ("empty call: a C function doing nothing, called from Python; empty step: a plan of zero ops through "
              "the engine's step entry (argument checks, GIL release, the executor's loop); both median ns per call "
              "over 15 batches of 2000 minus the bare Python loop. Region, timed in C around one pool run of a pool "
              "of its "
              f"own with {threads} threads: dispatch = {4 * threads} empty chunks split as the executor splits ops "
              "(the caller may finish them alone); fork-join = one chunk per thread, each waiting until every thread "
              "holds one (waking workers, handing out work, the closing barrier). Back to back (workers spinning, as "
              "within a step) and after 1 ms idle (workers asleep after 200 us of spinning)")
    return Check("dispatch latency", INFO, result, method, figures)


# ---- the whole run ---------------------------------------------------------------------------------

def validate(model: str | None = None, n_ctx: int | None = None, n_slots: int = 1, threads: int | None = None,
             quick: bool = False, kv_cache: str | None = None) -> dict:
    from kiln import __version__
    from kiln.machine import facts as machine_facts

    facts = machine_facts()
    threads = threads or facts["physical_cores"] or 1
    reps = 3 if quick else 5
    ext, info = check_extension()
    checks = [ext, check_load(facts), check_cpu(facts)]
    kernels_ok = False
    if info is not None:
        checks += [check_isa(), check_threads(), check_huge_pages()]
    checks.append(check_memlock(facts))
    mem, fit = check_memory(facts, model, n_ctx, n_slots, kv_cache)
    checks.append(mem)
    if info is not None:
        kern = check_kernels()
        kernels_ok = kern.status == PASSED
        gemm, gemv = check_gemm(threads, reps), check_gemv(threads, reps, quick)
        checks += [kern, gemm, gemv, check_peaks(threads, gemm, gemv), check_dispatch(threads, quick)]
    ready = info is not None and kernels_ok and (fit is None or fit["fits"])
    return {"object": "kiln_validation", "kiln_version": __version__, "ready": ready, "threads": threads,
            "quick": quick, "machine": facts, "model_fit": fit, "checks": [asdict(c) for c in checks]}
