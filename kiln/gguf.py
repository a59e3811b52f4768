"""GGUF in: metadata and tensor views over one memory map of the file.

The header is parsed here rather than with `gguf.GGUFReader` because that reader builds several numpy
objects per vocabulary string (24 s to open a 262k-token vocabulary); this parser reads the same
format in well under a second. Constants, block sizes and the reference dequantization all come from
the `gguf` package, which stays the oracle for tensor contents.
"""

from __future__ import annotations

import math
import mmap
import os
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf import quants as gguf_quants

from kiln.errors import ModelFileError, UnsupportedModelError

QT = GGMLQuantizationType

# Tensor types kiln runs. These have a repacked kernel format in the native core:
KERNEL_TYPES = (QT.F32, QT.F16, QT.BF16, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q8_0, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.MXFP4)
# Types the `gguf` package dequantizes but kiln has no kernel for: the native engine runs their values
# requantized to Q8_0 at load (twice or more the memory of the original, and as much slower to decode),
# except those a kernel type holds exactly (EXACT_REWRITES), whose blocks are rewritten into it.
REQUANTIZED_TYPES = (QT.Q5_1, QT.Q2_K, QT.Q3_K, QT.IQ2_XXS, QT.IQ2_XS, QT.IQ2_S, QT.IQ3_XXS, QT.IQ3_S, QT.IQ1_S,
                     QT.IQ1_M, QT.IQ4_NL, QT.IQ4_XS, QT.TQ1_0, QT.TQ2_0)
SUPPORTED_TYPES = KERNEL_TYPES + REQUANTIZED_TYPES

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

_SCALAR_FORMATS = {
    GGUFValueType.UINT8: ("<B", 1),
    GGUFValueType.INT8: ("<b", 1),
    GGUFValueType.UINT16: ("<H", 2),
    GGUFValueType.INT16: ("<h", 2),
    GGUFValueType.UINT32: ("<I", 4),
    GGUFValueType.INT32: ("<i", 4),
    GGUFValueType.FLOAT32: ("<f", 4),
    GGUFValueType.BOOL: ("<?", 1),
    GGUFValueType.UINT64: ("<Q", 8),
    GGUFValueType.INT64: ("<q", 8),
    GGUFValueType.FLOAT64: ("<d", 8),
}
_NUMPY_DTYPES = {
    GGUFValueType.UINT8: "<u1",
    GGUFValueType.INT8: "<i1",
    GGUFValueType.UINT16: "<u2",
    GGUFValueType.INT16: "<i2",
    GGUFValueType.UINT32: "<u4",
    GGUFValueType.INT32: "<i4",
    GGUFValueType.FLOAT32: "<f4",
    GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "<u8",
    GGUFValueType.INT64: "<i8",
    GGUFValueType.FLOAT64: "<f8",
}
_MAX_DIMS = 4


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type: GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order: (rows, cols) for a matrix; cols is GGUF's ne0
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)


def tensor_nbytes(ggml_type: GGMLQuantizationType, shape: tuple[int, ...]) -> int:
    block, size = GGML_QUANT_SIZES[ggml_type]
    return math.prod(shape) // block * size  # Python ints: a crafted shape cannot wrap around to a small size


def _typed(data: np.ndarray, t: TensorInfo) -> np.ndarray:
    if t.type == QT.F32:
        return data.view(np.float32).reshape(t.shape)
    if t.type == QT.F16:
        return data.view(np.float16).reshape(t.shape)
    if t.type == QT.BF16:
        return data.view(np.uint16).reshape(t.shape)
    return data.reshape(*t.shape[:-1], t.nbytes // int(np.prod(t.shape[:-1])))


class _Cursor:
    """Reads GGUF's little-endian fields, naming the offset of anything out of bounds."""

    def __init__(self, buf: memoryview, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def fail(self, what: str, offset: int | None = None) -> ModelFileError:
        at = self.pos if offset is None else offset
        return ModelFileError(f"{self.path}: {what} (at byte offset {at}, file size {len(self.buf)})")

    def take(self, n: int, what: str) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise self.fail(f"truncated while reading {what}: need {n} bytes")
        view = self.buf[self.pos : self.pos + n]
        self.pos += n
        return view

    def scalar(self, vtype: GGUFValueType, what: str):
        fmt, size = _SCALAR_FORMATS[vtype]
        return struct.unpack(fmt, self.take(size, what))[0]

    def u32(self, what: str) -> int:
        return self.scalar(GGUFValueType.UINT32, what)

    def u64(self, what: str) -> int:
        return self.scalar(GGUFValueType.UINT64, what)

    def string(self, what: str) -> str:
        start = self.pos
        n = self.u64(f"length of {what}")
        raw = self.take(n, what)
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"{what} is not valid UTF-8 ({e.reason})", start) from None

    def value(self, vtype: int, key: str) -> Any:
        try:
            vtype = GGUFValueType(vtype)
        except ValueError:
            raise self.fail(f"metadata key {key!r} has unknown value type {vtype}", self.pos - 4) from None
        if vtype == GGUFValueType.STRING:
            return self.string(f"value of {key!r}")
        if vtype != GGUFValueType.ARRAY:
            return self.scalar(vtype, f"value of {key!r}")
        item_type = self.u32(f"array type of {key!r}")
        count = self.u64(f"array length of {key!r}")
        if item_type == GGUFValueType.STRING:
            item_size = 8  # a string is at least its length field
        elif item_type in _NUMPY_DTYPES:
            item_size = np.dtype(_NUMPY_DTYPES[GGUFValueType(item_type)]).itemsize
        else:  # ggml reads no arrays of arrays either
            raise self.fail(f"metadata key {key!r} is an array of value type {item_type}; "
                            "arrays hold numbers, booleans or strings", self.pos - 12)
        if count > (len(self.buf) - self.pos) // item_size:
            raise self.fail(f"truncated or corrupt: metadata key {key!r} claims {count} array items, more than "
                            f"the {len(self.buf) - self.pos} bytes left can hold")
        if item_type == GGUFValueType.STRING:
            return self._string_array(count, key)
        raw = self.take(count * item_size, f"array {key!r}")
        return np.frombuffer(raw, dtype=_NUMPY_DTYPES[GGUFValueType(item_type)]).copy()

    def _string_array(self, count: int, key: str) -> "StringArray":
        """Find the strings' extents now (a bad length is reported at load), decode them on first use:
        a vocabulary is 10^5 strings a cached tokenizer never needs."""
        buf, pos, end = self.buf, self.pos, len(self.buf)
        starts = np.empty(count + 1, dtype=np.int64)
        for i in range(count):
            if pos + 8 > end:
                self.pos = pos
                raise self.fail(f"truncated in string {i} of array {key!r}")
            n = int.from_bytes(buf[pos : pos + 8], "little")
            starts[i] = pos + 8
            pos += 8 + n
            if pos > end:
                self.pos = pos - n
                raise self.fail(f"string {i} of array {key!r} runs past the end of the file")
        starts[count] = pos + 8  # so string i always ends at starts[i + 1] - 8
        self.pos = pos
        return StringArray(buf, starts)


def is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def as_int(value, default: int = 0) -> int:
    """A metadata value as an integer where it is one, else `default`: for what is only shown."""
    return int(value) if is_int(value) else default


def describe(value) -> str:
    """A metadata value as an error message shows it: small ones as they are, large ones by kind."""
    if isinstance(value, (np.ndarray, StringArray, list)):
        return f"an array of {len(value)}"
    if isinstance(value, str):
        return repr(value) if len(value) <= 40 else f"a string of {len(value)} characters"
    return repr(value)


class StringArray(Sequence):
    """A GGUF array of strings, decoded (all at once) the first time one is read."""

    def __init__(self, buf: memoryview, starts: np.ndarray):
        self._buf, self._starts, self._items = buf, starts, None

    def _decoded(self) -> list[str]:
        if self._items is None:
            b, s = self._buf, self._starts.tolist()
            self._items = [str(b[s[i] : s[i + 1] - 8], "utf-8", "replace") for i in range(len(s) - 1)]
        return self._items

    def __len__(self) -> int:
        return len(self._starts) - 1

    def __getitem__(self, i):
        return self._decoded()[i]

    def __iter__(self):
        return iter(self._decoded())

    def __eq__(self, other) -> bool:
        return list(self) == list(other)


class GGUFFile:
    """A parsed GGUF file: `metadata`, `tensors` (by name), and zero-copy views of tensor data."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
        except OSError as e:
            raise ModelFileError(f"{self.path}: cannot open model file ({e.strerror})") from None
        if size < 24:
            raise ModelFileError(f"{self.path}: not a GGUF file (only {size} bytes)")
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        self._fd = -1
        cur = _Cursor(memoryview(self._map), self.path)
        magic = bytes(cur.take(4, "magic"))
        if magic != GGUF_MAGIC:
            raise cur.fail(f"not a GGUF file: magic is {magic!r}, expected {GGUF_MAGIC!r}", 0)
        self.version = cur.u32("version")
        if self.version not in (2, 3):
            raise cur.fail(f"unsupported GGUF version {self.version} (kiln reads versions 2 and 3)", 4)
        n_tensors = cur.u64("tensor count")
        n_kv = cur.u64("metadata count")
        if n_tensors > size // 24 or n_kv > size // 13:
            raise cur.fail(
                f"header claims {n_tensors} tensors and {n_kv} metadata keys, impossible for this size: "
                "the file is truncated or corrupt", 8)

        self.metadata: dict[str, Any] = {}
        for i in range(n_kv):
            start = cur.pos
            key = cur.string(f"name of metadata key {i}")
            if key in self.metadata:
                raise cur.fail(f"metadata key {key!r} appears twice", start)
            self.metadata[key] = cur.value(cur.u32(f"value type of {key!r}"), key)

        infos = []
        for i in range(n_tensors):
            start = cur.pos
            name = cur.string(f"name of tensor {i}")
            n_dims = cur.u32(f"dimension count of tensor {name!r}")
            if not 1 <= n_dims <= _MAX_DIMS:
                raise cur.fail(f"tensor {name!r} has {n_dims} dimensions (expected 1..{_MAX_DIMS})", start)
            dims = [cur.u64(f"dimensions of tensor {name!r}") for _ in range(n_dims)]
            type_id = cur.u32(f"type of tensor {name!r}")
            rel_offset = cur.u64(f"data offset of tensor {name!r}")
            infos.append((name, dims, type_id, rel_offset, start))

        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not is_int(alignment) or alignment <= 0 or alignment & (alignment - 1):
            raise ModelFileError(f"{self.path}: general.alignment is {describe(alignment)}, "
                                 "expected a power of two")
        data_start = -(-cur.pos // alignment) * alignment
        self.data_offset = data_start
        self.tensors: dict[str, TensorInfo] = {}
        # As ggml lays the data section out (and checks it): each tensor starts where the one before it in
        # the header ends, padded to the alignment, so no two overlap and none starts unaligned.
        expected = 0
        for name, dims, type_id, rel_offset, header_at in infos:
            if name in self.tensors:
                raise cur.fail(f"tensor {name!r} appears twice in the header", header_at)
            info = self._tensor_info(name, dims, type_id, data_start + rel_offset, header_at, size)
            if rel_offset != expected:
                raise ModelFileError(
                    f"{self.path}: tensor {name!r} has data offset {rel_offset}, expected {expected} (tensors are "
                    f"stored in header order, each padded to general.alignment = {alignment})")
            expected += -(-info.nbytes // alignment) * alignment
            self.tensors[name] = info
        self._fd = os.open(self.path, os.O_RDONLY)

    def _tensor_info(self, name, dims, type_id, offset, header_at, size) -> TensorInfo:
        try:
            ggml_type = GGMLQuantizationType(type_id)
        except ValueError:
            raise UnsupportedModelError(
                f"{self.path}: tensor {name!r} (header at byte {header_at}) has unknown type id {type_id}; "
                f"supported: {', '.join(t.name for t in SUPPORTED_TYPES)}"
            ) from None
        if ggml_type not in SUPPORTED_TYPES:
            raise UnsupportedModelError(
                f"{self.path}: tensor {name!r} has type {ggml_type.name}, which kiln does not run; "
                f"supported: {', '.join(t.name for t in SUPPORTED_TYPES)}"
            )
        block = GGML_QUANT_SIZES[ggml_type][0]
        if any(d <= 0 for d in dims) or dims[0] % block:
            raise ModelFileError(
                f"{self.path}: tensor {name!r} has shape {dims}, invalid for {ggml_type.name} (block of {block})"
            )
        shape = tuple(int(d) for d in reversed(dims))
        nbytes = tensor_nbytes(ggml_type, shape)
        if nbytes > size:
            raise ModelFileError(f"{self.path}: tensor {name!r} has shape {dims}: {nbytes} bytes of "
                                 f"{ggml_type.name}, more than the whole file ({size} bytes)")
        if offset + nbytes > size:
            raise ModelFileError(
                f"{self.path}: tensor {name!r} needs bytes {offset}..{offset + nbytes} but the file ends at "
                f"{size}: the file is truncated"
            )
        return TensorInfo(name, ggml_type, shape, offset, nbytes)

    # --- metadata -------------------------------------------------------------------------------
    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ModelFileError(f"{self.path}: metadata key 'general.architecture' is missing")
        return arch

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise ModelFileError(f"{self.path}: required metadata key {key!r} is missing")
        return self.metadata[key]

    # --- tensor data ------------------------------------------------------------------------------
    def info(self, name: str) -> TensorInfo:
        """A tensor, or rows of one (`row_view`): a run of whole rows is contiguous in the file."""
        view, heads = parse_row_view(name), parse_head_view(name)
        base = view[0] if view else heads[0] if heads else name
        if base not in self.tensors:
            raise ModelFileError(f"{self.path}: required tensor {base!r} is missing")
        t = self.tensors[base]
        if heads is not None:
            return self._head_view_info(name, t, *heads[1:])
        if view is None:
            return t
        _, start, stop = view
        rows = t.shape[0]
        if not 0 <= start < stop <= rows:
            raise ModelFileError(f"{self.path}: tensor {base!r} has {rows} rows; rows {start}..{stop} do not exist")
        block = GGML_QUANT_SIZES[t.type][0]
        if len(t.shape) == 1 and (start % block or stop % block):  # a vector's rows are its elements
            raise ModelFileError(f"{self.path}: tensor {base!r} cannot be split at elements {start}..{stop} "
                                 f"(blocks of {block})")
        at = lambda row: tensor_nbytes(t.type, (row, *t.shape[1:]))  # noqa: E731
        return TensorInfo(name, t.type, (stop - start, *t.shape[1:]), t.offset + at(start), at(stop) - at(start))

    def _head_view_info(self, name: str, t: TensorInfo, part: int, parts: int, rows: int) -> TensorInfo:
        """Rows of one part of every head (`head_view`): not contiguous, so `raw` and `read` gather them;
        the offset is the whole tensor's."""
        if len(t.shape) != 2 or not 0 <= part < parts or t.shape[0] % (parts * rows):
            raise ModelFileError(f"{self.path}: tensor {t.name!r} has {t.shape[0]} rows, not heads of {parts} "
                                 f"parts of {rows} rows each")
        n = t.shape[0] // parts
        return TensorInfo(name, t.type, (n, t.shape[1]), t.offset, t.nbytes // parts)

    def _gather_heads(self, name: str, whole: np.ndarray) -> np.ndarray:
        _, part, parts, rows = parse_head_view(name)
        heads = whole.reshape(-1, parts, rows, *whole.shape[1:])
        return np.ascontiguousarray(heads[:, part]).reshape(-1, *whole.shape[1:])

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as stored: (rows, bytes per row) uint8 for quantized types, typed for floats."""
        heads = parse_head_view(name)
        if heads is not None:
            return self._gather_heads(name, self.raw(heads[0]))
        t = self.info(name)
        return _typed(self._map[t.offset : t.offset + t.nbytes], t)

    def read(self, name: str) -> np.ndarray:
        """A copy of the tensor's bytes, read without touching the memory map: small tensors (norms,
        biases) sit between large ones, and a page fault may map a large folio of the file around them."""
        heads = parse_head_view(name)
        if heads is not None:
            return self._gather_heads(name, self.read(heads[0]))
        t = self.info(name)
        data = np.frombuffer(os.pread(self._fd, t.nbytes, t.offset), dtype=np.uint8)
        return _typed(data, t)

    def dequantize(self, name: str) -> np.ndarray:
        """Float32 values of a tensor, computed by the `gguf` package's reference dequantization."""
        t = self.info(name)
        raw = self.read(name)
        if t.type == QT.F32:
            return np.array(raw, dtype=np.float32)
        if t.type == QT.F16:
            return raw.astype(np.float32)
        if t.type == QT.BF16:  # the upper half of a float32
            return (raw.astype(np.uint32) << 16).view(np.float32)
        return gguf_quants.dequantize(raw, t.type).astype(np.float32, copy=False).reshape(t.shape)

    def release_pages(self) -> None:
        """Unmap the file's pages from this process (they stay in the page cache): after repacking,
        the packed copy is the one that stays resident."""
        self._map._mmap.madvise(mmap.MADV_DONTNEED)

    def fileno(self) -> int:
        return self._fd

    def file_size(self) -> int:
        return int(self._map.shape[0])

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        mm = getattr(self._map, "_mmap", None)
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass  # a view is still alive; the map closes when the last view dies


# ---- exact rewrites ---------------------------------------------------------------------------------
# Q3_K: per 256 weights d (fp16) and 16 six-bit scales (sc - 32); w = d * (sc - 32) * q with q = 2 low bits
# - 4 * (1 - high bit), in [-4, 3], per 16-weight sub-block. Q6_K holds the same values: its int8 scale per
# 16 weights is sc - 32 and its 6-bit value q + 32 (28..35). IQ4_NL: w = d * table[i] with a 16-entry int8
# table, which is a Q8_0 block with the same d.

_IQ4_NL_TABLE = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)


def _q3k_to_q6k(raw: np.ndarray) -> np.ndarray:
    b = raw.reshape(-1, 110)
    n = len(b)
    hmask, qs, scales, d = b[:, :32], b[:, 32:96], b[:, 96:108], b[:, 108:110]
    # value v = 128 h + 32 j + i: low bits from qs[32 h + i] at bits 2j, high bit from hmask[i] at bit v // 32
    low = (qs.reshape(n, 2, 1, 32) >> (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1)) & 3
    high = (hmask.reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    q6 = low.reshape(n, 256).astype(np.int16) - 4 * (1 - high.reshape(n, 256).astype(np.int16)) + 32
    # scale s: low 4 bits from scales[s % 8] at bits 4 (s // 8), high 2 from scales[8 + s % 4] at bits 2 (s // 4)
    s = np.arange(16)
    sc = ((scales[:, s % 8] >> (4 * (s // 8)).astype(np.uint8)) & 15) | (((scales[:, 8 + s % 4] >> (2 * (s // 4)).astype(np.uint8)) & 3) << 4)
    out = np.zeros((n, 210), np.uint8)
    # Q6_K: value v = 128 h + r keeps its low 4 bits in ql[64 h + r % 64] at bits 4 (r // 64), its high 2 in
    # qh[32 h + r % 32] at bits 2 (r // 32)
    v = np.arange(256)
    h, r = v // 128, v % 128
    q6 = q6.astype(np.uint8)
    for nibble in (0, 1):
        sel = r // 64 == nibble
        out[:, (64 * h + r % 64)[sel]] |= (q6[:, sel] & 15) << (4 * nibble)
    for pair in range(4):
        sel = r // 32 == pair
        out[:, 128 + (32 * h + r % 32)[sel]] |= (q6[:, sel] >> 4) << (2 * pair)
    out[:, 192:208] = (sc.astype(np.int16) - 32).astype(np.int8).view(np.uint8)
    out[:, 208:210] = d
    return out


def _iq4nl_to_q8_0(raw: np.ndarray) -> np.ndarray:
    b = raw.reshape(-1, 18)
    n = len(b)
    idx = (b[:, 2:].reshape(n, 1, 16) >> np.array([0, 4], np.uint8).reshape(1, 2, 1)) & 15  # weights 0-15, 16-31
    out = np.empty((n, 34), np.uint8)
    out[:, :2] = b[:, :2]
    out[:, 2:] = _IQ4_NL_TABLE[idx.reshape(n, 32)].view(np.uint8)
    return out


EXACT_REWRITES = {QT.Q3_K: (QT.Q6_K, _q3k_to_q6k), QT.IQ4_NL: (QT.Q8_0, _iq4nl_to_q8_0)}


def rewrite_exactly(raw: np.ndarray, ggml_type: QT, rows: int) -> np.ndarray:
    """A tensor's GGUF bytes of a type in EXACT_REWRITES as the same values in its kernel type, (rows, bytes)."""
    return EXACT_REWRITES[QT(ggml_type)][1](np.ascontiguousarray(raw).view(np.uint8)).reshape(rows, -1)


_ROW_VIEW = re.compile(r"(.+)\[(\d+):(\d+)\]")


def row_view(name: str, start: int, stop: int) -> str:
    """The name of rows [start, stop) of tensor `name` (elements, for a vector): how a family reads one part
    of a fused tensor (q, k and v of `attn_qkv`, gate and up of Phi-3's `ffn_up`) as a tensor of its own."""
    return f"{name}[{start}:{stop}]"


def parse_row_view(name: str) -> tuple[str, int, int] | None:
    m = _ROW_VIEW.fullmatch(name)
    return (m.group(1), int(m.group(2)), int(m.group(3))) if m else None


_HEAD_VIEW = re.compile(r"(.+)\[(\d+)/(\d+)x(\d+)\]")


def head_view(name: str, part: int, parts: int, rows: int) -> str:
    """The name of part `part` of every head of a matrix whose heads are `parts` runs of `rows` rows each
    (Qwen3.5's attn_q: each head's queries, then its output gate), as a matrix of its own."""
    return f"{name}[{part}/{parts}x{rows}]"


def parse_head_view(name: str) -> tuple[str, int, int, int] | None:
    m = _HEAD_VIEW.fullmatch(name)
    return (m.group(1), int(m.group(2)), int(m.group(3)), int(m.group(4))) if m else None
