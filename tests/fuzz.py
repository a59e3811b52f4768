"""A mutation fuzzer over GGUF headers: small kiln.synth models with their metadata, tensor table, counts
and lengths changed the way a hostile file would, each loaded by kiln in a worker process.

A mutation is a list of JSON-able ops on the parsed header (keys and tensors by name, not byte offsets),
so a recorded crash still means the same thing after kiln.synth changes. `python -m tests.fuzz worker`
is the worker: it reads one case per line (a file path), loads the model with the native engine, runs a
short forward pass and answers one JSON line per case. A case that kills it (a signal, an ASan report)
or never answers is the parent's to record.
"""

from __future__ import annotations

import json
import os
import select
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGUFValueType as VT

ROOT = Path(__file__).resolve().parent.parent

# the seeds: every family, several tensor types, tied and untied heads, small enough to load in milliseconds
SEEDS = {
    "llama": dict(shape="tiny-llama", qtype="Q8_0", vocab_size=320),
    "qwen2": dict(shape="tiny-qwen2", qtype="F16", vocab_size=320),
    "qwen3": dict(shape="tiny-qwen3", qtype="Q4_0", vocab_size=320, head_dim=32),
    "gemma3": dict(shape="tiny-gemma3", qtype="Q8_0", vocab_size=320, head_dim=32),
    "lfm2": dict(shape="tiny-lfm2", qtype="Q8_0", vocab_size=320),
    "granite": dict(shape="tiny-granite", qtype="Q4_0", vocab_size=320),
    "olmo2": dict(shape="tiny-olmo2", qtype="Q8_0", vocab_size=320),
    "smollm3": dict(shape="tiny-smollm3", qtype="F16", vocab_size=320),
    "gemma2": dict(shape="tiny-gemma2", qtype="Q8_0", vocab_size=320, head_dim=32),
    "qwen2-yarn": dict(shape="tiny-qwen2-yarn", qtype="F16", vocab_size=320),
    "qwen3moe": dict(shape="tiny-qwen3moe", qtype="Q8_0", vocab_size=320),
    "qwen2moe": dict(shape="tiny-qwen2moe", qtype="Q4_0", vocab_size=320),
    "olmoe": dict(shape="tiny-olmoe", qtype="Q8_0", vocab_size=320),
    "granitemoe": dict(shape="tiny-granitemoe", qtype="Q4_0", vocab_size=320),
    "gpt-oss": dict(shape="tiny-gpt-oss", qtype="Q8_0", vocab_size=320),
}


def write_seed(name: str, path: Path) -> Path:
    from gguf import GGMLQuantizationType as QT

    from kiln.synth import write_random_gguf

    spec = dict(SEEDS[name])
    return write_random_gguf(path, spec.pop("shape"), qtype=QT[spec.pop("qtype")], seed=1, **spec)


# ---- the header as data ---------------------------------------------------------------------------------
_SCALARS = {VT.UINT8: "<B", VT.INT8: "<b", VT.UINT16: "<H", VT.INT16: "<h", VT.UINT32: "<I", VT.INT32: "<i",
            VT.FLOAT32: "<f", VT.BOOL: "<B", VT.UINT64: "<Q", VT.INT64: "<q", VT.FLOAT64: "<d"}


@dataclass
class KV:
    key: str
    vtype: int
    value: object  # scalar, str, or list (an array of `item`)
    item: int | None = None
    key_len: int | None = None  # a length field written instead of the true one
    value_len: int | None = None  # a string value's length, or an array's count


@dataclass
class Tensor:
    name: str
    dims: list[int]
    type: int
    offset: int
    name_len: int | None = None


@dataclass
class Header:
    version: int
    kvs: list[KV]
    tensors: list[Tensor]
    data: bytes  # the data section, from the first tensor's offset
    n_kv: int | None = None
    n_tensors: int | None = None
    truncate: float | None = None  # keep this fraction of the file's bytes
    flips: list[tuple[float, int]] = field(default_factory=list)  # (where in the header, xor mask)

    def kv(self, key: str) -> KV | None:
        return next((kv for kv in self.kvs if kv.key == key), None)

    @property
    def alignment(self) -> int:
        kv = self.kv("general.alignment")
        return kv.value if kv is not None and isinstance(kv.value, int) and 0 < kv.value <= 1 << 16 else 32


def parse(data: bytes) -> Header:
    pos = 4

    def take(fmt):
        nonlocal pos
        (v,) = struct.unpack_from(fmt, data, pos)
        pos += struct.calcsize(fmt)
        return v

    def string():
        nonlocal pos
        n = take("<Q")
        pos += n
        return data[pos - n : pos].decode("utf-8")

    def value(vtype):
        if vtype == VT.STRING:
            return string(), None
        if vtype == VT.ARRAY:
            item, n = take("<I"), take("<Q")
            return [value(item)[0] for _ in range(n)], item
        return take(_SCALARS[VT(vtype)]), None

    version, n_tensors, n_kv = take("<I"), take("<Q"), take("<Q")
    kvs = []
    for _ in range(n_kv):
        key = string()
        vtype = take("<I")
        v, item = value(vtype)
        kvs.append(KV(key, vtype, v, item))
    tensors = []
    for _ in range(n_tensors):
        name = string()
        dims = [take("<Q") for _ in range(take("<I"))]
        tensors.append(Tensor(name, dims, take("<I"), take("<Q")))
    header = Header(version, kvs, tensors, b"")
    start = -(-pos // header.alignment) * header.alignment
    header.data = data[start:]
    return header


def serialize(h: Header) -> bytes:
    out = bytearray(b"GGUF")

    def put(fmt, v):
        out.extend(struct.pack(fmt, v))

    def string(s: str, length: int | None = None):
        raw = s.encode("utf-8", "surrogatepass")
        put("<Q", len(raw) if length is None else length)
        out.extend(raw)

    def value(vtype, v, item, length=None):
        if vtype == VT.STRING:
            string(v, length)
        elif vtype == VT.ARRAY:
            put("<I", item)
            put("<Q", len(v) if length is None else length)
            for x in v:
                value(item, x, None)
        elif vtype in _SCALARS:
            fmt = _SCALARS[VT(vtype)]
            if fmt == "<f":
                with np.errstate(over="ignore"):
                    put(fmt, float(np.float32(v)))  # past float32's range: infinity, as a writer would round
            elif fmt == "<d":
                put(fmt, float(v))
            else:
                bits = 8 * struct.calcsize(fmt)
                v = int(v) % (1 << bits)  # any integer, as the field's bits
                put(fmt.upper() if fmt[-1] in "bhiq" else fmt, v)
        # an unknown value type: nothing follows it, as a file written by a broken writer

    put("<I", h.version)
    put("<Q", len(h.tensors) if h.n_tensors is None else h.n_tensors % (1 << 64))
    put("<Q", len(h.kvs) if h.n_kv is None else h.n_kv % (1 << 64))
    for kv in h.kvs:
        string(kv.key, kv.key_len)
        put("<I", kv.vtype % (1 << 32))
        value(kv.vtype, kv.value, kv.item, kv.value_len)
    for t in h.tensors:
        string(t.name, t.name_len)
        put("<I", len(t.dims))
        for d in t.dims:
            put("<Q", d % (1 << 64))
        put("<I", t.type % (1 << 32))
        put("<Q", t.offset % (1 << 64))
    header_end = len(out)
    for where, mask in h.flips:
        at = min(int(where * header_end), header_end - 1)
        out[at] ^= mask
    out.extend(b"\0" * (-len(out) % h.alignment))
    out.extend(h.data)
    if h.truncate is not None:
        del out[int(len(out) * h.truncate):]
    return bytes(out)


# ---- mutations ---------------------------------------------------------------------------------------------
INTS = [0, 1, 2, 3, 7, 8, 63, 64, 65, 127, 255, 256, 4095, 4096, 65535, 65536, 1 << 31, (1 << 31) - 1, 1 << 32,
        (1 << 32) - 1, 1 << 63, (1 << 64) - 1, -1]
FLOATS = [0.0, -0.0, 1.0, -1.0, 0.5, 1e-30, 1e30, 3.4e38, float("nan"), float("inf"), float("-inf")]
STRINGS = ["", "none", "linear", "yarn", "longrope", "llama", "qwen2", "qwen3", "gemma3", "mamba", "x" * 300, "\u00e9"]
SWITCHES = ["rope.scaling.type", "rope.scaling.factor", "rope.scaling.original_context_length",
            "rope.scaling.attn_factor", "rope.freq_base_swa", "attention.sliding_window_pattern",
            "final_logit_softcapping", "attn_logit_softcapping", "attention.sliding_window", "vocab_size",
            "expert_count", "rope.dimension_count", "attention.key_length", "attention.value_length",
            "attention.head_count_kv", "pooling_type", "rope.scale_linear", "rope.scaling.yarn_beta_fast",
            "rope.scaling.yarn_beta_slow", "rope.scaling.yarn_attn_factor", "rope.scaling.yarn_ext_factor"]
TENSOR_NAMES = ["blk.0.attn_qkv.weight", "blk.0.attn_q.bias", "blk.0.attn_output.bias", "blk.0.ffn_up.bias",
                "rope_freqs.weight", "output.weight", "blk.99.attn_q.weight", "blk.0.attn_q_norm.weight", ""]
SCALAR_TYPES = [VT.UINT8, VT.INT8, VT.UINT16, VT.INT16, VT.UINT32, VT.INT32, VT.FLOAT32, VT.BOOL, VT.UINT64,
                VT.INT64, VT.FLOAT64]


def _pick(rng, seq):
    return seq[int(rng.integers(len(seq)))]


def _int_near(rng, v: int) -> int:
    return int(_pick(rng, [v + 1, v - 1, v * 2, v // 2, v * 4096, -v, _pick(rng, INTS), int(rng.integers(0, 1 << 16))]))


def _random_value(rng, vtype=None, n_layers=2):
    vtype = vtype if vtype is not None else _pick(rng, SCALAR_TYPES + [VT.STRING, VT.ARRAY])
    if vtype == VT.STRING:
        return int(vtype), _pick(rng, STRINGS), None
    if vtype == VT.ARRAY:
        item = _pick(rng, [VT.UINT32, VT.INT32, VT.BOOL, VT.FLOAT32, VT.STRING, VT.ARRAY, 99])
        n = _pick(rng, [0, 1, n_layers, n_layers + 1, 7])
        if item == VT.STRING:
            return int(vtype), [_pick(rng, STRINGS) for _ in range(n)], int(item)
        if item in (VT.ARRAY, 99):
            return int(vtype), [], int(item)
        return int(vtype), [_random_value(rng, item)[1] for _ in range(n)], int(item)
    if vtype in (VT.FLOAT32, VT.FLOAT64):
        return int(vtype), _pick(rng, FLOATS), None
    if vtype == VT.BOOL:
        return int(vtype), int(rng.integers(0, 3)), None
    return int(vtype), _pick(rng, INTS), None


_KINDS = {"value": 6, "same": 1, "item": 3, "retype": 2, "drop_key": 1, "add_key": 3, "dims": 3, "type": 1,
          "offset": 1, "drop_tensor": 1, "dup_tensor": 0.5, "rename": 1, "counts": 0.5, "lengths": 1,
          "truncate": 0.5, "flip": 1, "version": 0.3}
_WEIGHTS = np.array(list(_KINDS.values())) / sum(_KINDS.values())


def mutations(rng, h: Header) -> list[dict]:
    """One to three ops drawn at random for this header."""
    arch = next((kv.value for kv in h.kvs if kv.key == "general.architecture"), "llama")
    n_layers = next((kv.value for kv in h.kvs if kv.key.endswith(".block_count")), 2)
    scalars = [kv for kv in h.kvs if kv.vtype in SCALAR_TYPES or kv.vtype == VT.STRING]
    arch_keys = [kv for kv in h.kvs if kv.key.startswith(arch + ".")]
    arrays = [kv for kv in h.kvs if kv.vtype == VT.ARRAY and kv.value]
    ops = []
    for _ in range(int(rng.integers(1, 4))):
        kind = rng.choice(list(_KINDS), p=_WEIGHTS)
        if kind == "item":  # one element of an array (a token, its type or score, a merge), or its length
            kv = _pick(rng, arrays)
            i = int(rng.integers(len(kv.value)))
            if rng.random() < 0.2:
                ops.append({"op": "resize", "key": kv.key, "length": _pick(rng, [0, 1, i, len(kv.value) + 1])})
                continue
            old = kv.value[i]
            if isinstance(old, str):
                value = _pick(rng, STRINGS + [kv.value[(i + 1) % len(kv.value)], old + " " + old, old[:1]])
            elif isinstance(old, float):
                value = _pick(rng, FLOATS)
            else:
                value = _int_near(rng, old) if kv.item != VT.BOOL else int(rng.integers(0, 3))
            ops.append({"op": "item", "key": kv.key, "index": i, "value": value})
        elif kind == "same":  # the same number as another integer type: a file that must still load
            kv = _pick(rng, [kv for kv in h.kvs if isinstance(kv.value, int) and kv.vtype != VT.BOOL])
            vtype = _pick(rng, [VT.UINT32, VT.INT32, VT.UINT64, VT.INT64, VT.UINT16])
            ops.append({"op": "set", "key": kv.key, "vtype": int(vtype), "value": kv.value})
        elif kind == "value":
            kv = _pick(rng, arch_keys if rng.random() < 0.7 else scalars)
            if isinstance(kv.value, int) and kv.vtype != VT.BOOL:
                value = _int_near(rng, kv.value)
            elif isinstance(kv.value, float):
                value = _pick(rng, FLOATS + [kv.value * 2, kv.value / 2])
            elif isinstance(kv.value, str):
                value = _pick(rng, STRINGS + [kv.value[::-1], kv.value[: len(kv.value) // 2]])
            elif isinstance(kv.value, list):  # a per-layer array (lfm2's KV head counts): one count moved
                value = list(kv.value)
                i = int(rng.integers(len(value)))
                value[i] = _int_near(rng, value[i]) if isinstance(value[i], int) else value[i]
            else:
                value = int(rng.integers(0, 3))
            ops.append({"op": "set", "key": kv.key, "vtype": kv.vtype, "value": value, "item": kv.item})
        elif kind == "retype":
            kv = _pick(rng, arch_keys)
            vtype, value, item = _random_value(rng, n_layers=n_layers)
            ops.append({"op": "set", "key": kv.key, "vtype": vtype, "value": value, "item": item})
        elif kind == "drop_key":
            ops.append({"op": "drop_key", "key": _pick(rng, h.kvs).key})
        elif kind == "add_key":
            vtype, value, item = _random_value(rng, n_layers=n_layers)
            key = f"{arch}.{_pick(rng, SWITCHES)}" if rng.random() < 0.8 else "general.alignment"
            ops.append({"op": "set", "key": key, "vtype": vtype, "value": value, "item": item})
        elif kind == "dims":
            t = _pick(rng, h.tensors)
            dims = list(t.dims)
            how = _pick(rng, ["one", "one", "swap", "add", "remove", "zero"])
            if how == "one":
                i = int(rng.integers(len(dims)))
                dims[i] = _int_near(rng, dims[i]) if rng.random() < 0.7 else _pick(rng, [32, 64, 256, 320, 1 << 32])
            elif how == "swap":
                dims.reverse()
            elif how == "add":
                dims.append(_pick(rng, [1, 2, 3]))
            elif how == "remove" and len(dims) > 1:
                dims.pop()
            else:
                dims[-1] = 0
            ops.append({"op": "dims", "tensor": t.name, "dims": dims})
        elif kind == "type":
            ops.append({"op": "type", "tensor": _pick(rng, h.tensors).name,
                        "type": _pick(rng, [0, 1, 2, 3, 6, 7, 8, 10, 12, 13, 14, 15, 16, 20, 23, 30, 39, 41, 1 << 31])})
        elif kind == "offset":
            t = _pick(rng, h.tensors)
            other = _pick(rng, h.tensors)
            ops.append({"op": "offset", "tensor": t.name,
                        "offset": _pick(rng, [0, other.offset, t.offset + 1, t.offset + 32, t.offset - 32,
                                              len(h.data), 1 << 40, (1 << 64) - 1])})
        elif kind == "drop_tensor":
            ops.append({"op": "drop_tensor", "tensor": _pick(rng, h.tensors).name})
        elif kind == "dup_tensor":
            ops.append({"op": "dup_tensor", "tensor": _pick(rng, h.tensors).name})
        elif kind == "rename":
            ops.append({"op": "rename", "tensor": _pick(rng, h.tensors).name, "to": _pick(rng, TENSOR_NAMES)})
        elif kind == "counts":
            which = _pick(rng, ["n_kv", "n_tensors"])
            actual = len(h.kvs) if which == "n_kv" else len(h.tensors)
            ops.append({"op": "count", "which": which, "value": _pick(rng, [0, actual - 1, actual + 1, 1 << 32, (1 << 64) - 1])})
        elif kind == "lengths":
            if rng.random() < 0.5:
                kv = _pick(rng, h.kvs)
                field_ = _pick(rng, ["key_len", "value_len"])
            else:
                kv, field_ = _pick(rng, h.tensors), "name_len"
            name = kv.key if isinstance(kv, KV) else kv.name
            ops.append({"op": "length", "of": name, "field": field_,
                        "value": _pick(rng, [0, 1, 7, 1 << 20, 1 << 31, 1 << 40, (1 << 64) - 1, (1 << 63) + 5])})
        elif kind == "truncate":
            ops.append({"op": "truncate", "keep": float(_pick(rng, [0.01, 0.1, 0.3, 0.5, 0.9, 0.99, 0.999]))})
        elif kind == "flip":
            ops.append({"op": "flip", "at": float(rng.random()), "mask": int(_pick(rng, [1, 0x80, 0xFF, 0x40]))})
        else:
            ops.append({"op": "version", "value": _pick(rng, [0, 1, 2, 4, 1 << 31])})
    return ops


def apply(h: Header, ops: list[dict]) -> Header:
    """`h` with the ops applied in order (an op on a key or tensor the header lacks does nothing)."""
    import copy

    h = copy.deepcopy(h)
    tensors = {t.name: t for t in h.tensors}
    for op in ops:
        kind = op["op"]
        if kind == "set":
            kv = h.kv(op["key"])
            if kv is None:
                kv = KV(op["key"], 0, None)
                h.kvs.append(kv)
            kv.vtype, kv.value, kv.item = op["vtype"], op["value"], op.get("item")
        elif kind == "drop_key":
            h.kvs = [kv for kv in h.kvs if kv.key != op["key"]]
        elif kind in ("dims", "type", "offset") and op["tensor"] in tensors:
            setattr(tensors[op["tensor"]], {"dims": "dims", "type": "type", "offset": "offset"}[kind], op[kind])
        elif kind == "drop_tensor":
            h.tensors = [t for t in h.tensors if t.name != op["tensor"]]
        elif kind == "dup_tensor" and op["tensor"] in tensors:
            h.tensors.append(copy.deepcopy(tensors[op["tensor"]]))
        elif kind == "rename" and op["tensor"] in tensors:
            tensors[op["tensor"]].name = op["to"]
        elif kind == "count":
            setattr(h, op["which"], op["value"])
        elif kind == "length":
            for item in h.kvs + h.tensors:
                if (item.key if isinstance(item, KV) else item.name) == op["of"]:
                    setattr(item, op["field"], op["value"])
        elif kind == "item":
            kv = h.kv(op["key"])
            if kv is not None and isinstance(kv.value, list) and op["index"] < len(kv.value):
                kv.value[op["index"]] = op["value"]
        elif kind == "resize":
            kv = h.kv(op["key"])
            if kv is not None and isinstance(kv.value, list):
                kv.value = (kv.value + kv.value[-1:] * op["length"])[: op["length"]]
        elif kind == "truncate":
            h.truncate = op["keep"]
        elif kind == "flip":
            h.flips.append((op["at"], op["mask"]))
        elif kind == "version":
            h.version = op["value"]
    return h


def generate(seeds: dict[str, Header], n: int, base_seed: int) -> list[tuple[str, list[dict]]]:
    """`n` cases: (seed name, ops), the same for the same base seed."""
    names = sorted(seeds)
    cases = []
    for i in range(n):
        rng = np.random.default_rng([base_seed, i])
        name = names[i % len(names)]
        cases.append((name, mutations(rng, seeds[name])))
    return cases


# ---- running cases -------------------------------------------------------------------------------------------
@dataclass
class Outcome:
    case: int
    status: str  # refused | loaded | traceback | crash | hang
    detail: str = ""
    seconds: float = 0.0
    native: str = ""  # the kiln._native the worker ran


def worker_env(native: str | None = None) -> dict:
    """The environment of a worker process; `native`: the path of another build of kiln._native (the
    AddressSanitizer one), which the worker imports instead of the package's own."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    if native:
        env["KILN_FUZZ_NATIVE"] = native
    return env


def run_cases(paths: list[Path], env: dict | None = None, timeout_s: float = 60.0) -> list[Outcome]:
    """Each file through a worker process, restarted after a case that kills it or hangs."""
    import tempfile

    outcomes: list[Outcome] = []
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as listing:
        listing.write("".join(f"{p}\n" for p in paths))
    i = 0
    while i < len(paths):
        proc = subprocess.Popen([sys.executable, "-m", "tests.fuzz", "worker", listing.name, str(i)], cwd=ROOT,
                                env=env or worker_env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
        stderr_chunks: list[bytes] = []
        buf = b""
        deadline = time.monotonic() + timeout_s * 4  # the first case also imports kiln
        dead = None
        while i < len(paths):
            ready, _, _ = select.select([proc.stdout, proc.stderr], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                proc.kill()
                dead = ("hang", f"no answer within {timeout_s:.0f} s")
                break
            if proc.stderr in ready:
                chunk = os.read(proc.stderr.fileno(), 1 << 16)
                stderr_chunks.append(chunk)
            if proc.stdout in ready:
                chunk = os.read(proc.stdout.fileno(), 1 << 16)
                if not chunk:
                    proc.wait()
                    dead = ("crash", f"worker exited with {proc.returncode}")
                    break
                buf += chunk
                while b"\n" in buf and i < len(paths):
                    line, buf = buf.split(b"\n", 1)
                    reply = json.loads(line)
                    outcomes.append(Outcome(i, reply["status"], reply["detail"], reply["seconds"], reply["native"]))
                    i += 1
                    deadline = time.monotonic() + timeout_s
        if dead is not None:
            rest = b"".join(stderr_chunks) + (proc.stderr.read() or b"")
            outcomes.append(Outcome(i, dead[0], dead[1] + "\n" + rest.decode("utf-8", "replace")[-3000:]))
            i += 1
        proc.stdout.close()
        proc.stderr.close()
        proc.wait()
    os.unlink(listing.name)
    return outcomes


def _import_native(path: str) -> None:
    import importlib.machinery
    import importlib.util

    import kiln

    loader = importlib.machinery.ExtensionFileLoader("kiln._native", path)
    spec = importlib.util.spec_from_file_location("kiln._native", path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    sys.modules["kiln._native"] = kiln._native = module


def worker(listing: str, start: int) -> None:
    import shutil
    import tempfile
    import traceback

    if os.environ.get("KILN_FUZZ_NATIVE"):
        _import_native(os.environ["KILN_FUZZ_NATIVE"])
    from kiln.engine import native
    from kiln.engine.model import load
    from kiln.errors import KilnError
    from kiln.store import Store

    if not native.available():
        raise SystemExit("the native core is not built")
    # a store in memory where there is one: every load writes (and fsyncs) a repack cache
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    home = Path(tempfile.mkdtemp(prefix="kiln-fuzz-", dir=shm))
    store = Store(home=home)
    try:
        paths = Path(listing).read_text().splitlines()[start:]
        for n, path in enumerate(paths, start):
            t0 = time.perf_counter()
            try:
                model = load(path, backend="native", n_ctx=64, threads=1 + n % 2, store=store, progress=False)
            except KilnError as e:
                status, detail = "refused", f"{type(e).__name__}: {e}"
            except Exception:  # a traceback: a kiln bug
                status, detail = "traceback", traceback.format_exc(limit=-4)
            else:
                try:
                    ids = model.tokenizer.encode("Hello world, hello")[:12] or [0]
                    logits = model.engine.forward(ids)
                    model.engine.decode([int(np.argmax(logits))], [0], [len(ids)])
                    status, detail = "loaded", ""
                except Exception:
                    status, detail = "traceback", traceback.format_exc(limit=-4)
                finally:
                    model.close()
            shutil.rmtree(home / "cache", ignore_errors=True)
            print(json.dumps({"status": status, "detail": detail[-2000:], "seconds": time.perf_counter() - t0,
                              "native": native._native.__file__}), flush=True)
    finally:
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    worker(sys.argv[2], int(sys.argv[3]))
