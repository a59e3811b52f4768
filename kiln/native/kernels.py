"""Weight repacking and quantized matmul kernels (csrc/kernels.h), wrapped for numpy arrays.

Packed weights and activation buffers are plain uint8 arrays; their byte layouts are documented in
csrc/kernels.h. Every call checks buffer sizes in C, so a wrong shape raises instead of corrupting memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kiln import _native

ISAS = ("generic", "avx2", "avx512", "amx")


_FORMATS, _ACT_KINDS = _native.kernel_formats()
# Kernel weight formats (kiln_wfmt), named as csrc/kernels.h names them.
Format = IntEnum("Format", _FORMATS)
# Activation layouts (act.h): F32, fp32 rows for the float formats; Q8, int8 per 32-block with scales and
# sums for the integer ones.
ActKind = IntEnum("ActKind", _ACT_KINDS)


def _isa_index(name: str) -> int:
    if name not in ISAS:
        raise ValueError(f"unknown ISA {name!r}; expected one of {', '.join(ISAS)}")
    return ISAS.index(name)


def detect_isa() -> str:
    """The best instruction set this CPU supports."""
    return ISAS[_native.isa_detect()]


def active_isa() -> str:
    """The instruction set the kernels use. Raises if KILN_ISA names one that cannot be used."""
    err = _native.isa_error()
    if err:
        raise RuntimeError(err)
    return ISAS[_native.isa_active()]


def amx_min_tokens() -> int | None:
    """Rows from which a step's integer matmuls run on AMX tiles where the CPU has them (None off x86)."""
    return _native.amx_min_tokens()


def isa_missing(name: str) -> str | None:
    """The first CPU feature `name` needs that this CPU lacks, or None if it is usable."""
    return _native.isa_missing(_isa_index(name))


def force_isa(name: str) -> None:
    """Use `name` from now on (RuntimeError if the CPU lacks it)."""
    _native.isa_force(_isa_index(name))


def format_for(ggml_type: int) -> Format:
    f = _native.wfmt_for_ggml(int(ggml_type))
    if f < 0:
        raise ValueError(f"GGML type {int(ggml_type)} has no kernel format")
    return Format(f)


@dataclass(frozen=True)
class PackedMatrix:
    fmt: Format
    rows: int
    cols: int
    rows_padded: int
    tile_bytes: int
    data: np.ndarray  # uint8, kiln_pack_size bytes (tiles + read slack)

    @property
    def tiles(self) -> int:
        return self.rows_padded // 4


def pack_size(ggml_type: int, rows: int, cols: int) -> int:
    return _native.pack_size(int(ggml_type), rows, cols)


def pack(ggml_type: int, raw: np.ndarray, rows: int, cols: int, out: np.ndarray | None = None) -> PackedMatrix:
    """Repack a tensor's GGUF bytes (e.g. GGUFFile.raw(name)) into its kernel format."""
    size = pack_size(ggml_type, rows, cols)
    if not size:
        raise ValueError(f"cannot pack GGML type {int(ggml_type)} with shape ({rows}, {cols})")
    dst = np.empty(size, np.uint8) if out is None else out
    fmt, rows_padded, tile_bytes = _native.pack(int(ggml_type), np.ascontiguousarray(raw), rows, cols, dst)
    return PackedMatrix(Format(fmt), rows, cols, rows_padded, tile_bytes, dst)


def unpack_row(w: PackedMatrix, ggml_type: int, row: int) -> np.ndarray:
    """Row `row` of a packed matrix back to its GGUF bytes (of type `ggml_type`, the type it was packed from)."""
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    out = np.empty(w.cols // block * size, np.uint8)
    _native.unpack_row(int(ggml_type), w.rows, w.cols, w.tile_bytes, w.data, row, out)
    return out


def kv_rotate(x: np.ndarray) -> np.ndarray:
    """x (..., width, width whole blocks of 32) rotated as a quantized KV cache stores its rows (csrc/attn_quant.h)."""
    x = np.ascontiguousarray(x, np.float32)
    out = np.empty_like(x)
    _native.kv_rotate(x, out)
    return out


def split_q8_0(raw: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray] | None:
    """A Q8_0 tensor's GGUF bytes split into its top 5 bits (Q5_0, scale 8d) and low 3 bits (Q4_0), each
    (rows, bytes per row); None if some block's 8d overflows fp16. The output head runs this way (csrc/op_logits.c)."""
    halves = _native.split_q8_0(np.ascontiguousarray(raw))
    return None if halves is None else tuple(np.frombuffer(h, np.uint8).reshape(rows, -1) for h in halves)


def unpack_split_row(hi: PackedMatrix, lo: PackedMatrix, row: int) -> np.ndarray:
    """Row `row` of a packed split pair back to its Q8_0 bytes."""
    out = np.empty(hi.cols // 32 * 34, np.uint8)
    _native.unpack_split_row(hi.rows, hi.cols, hi.tile_bytes, hi.data, lo.tile_bytes, lo.data, row, out)
    return out


def act_kind(fmt: Format) -> ActKind:
    return ActKind(_native.act_kind(int(fmt)))


def act_size(fmt: Format, cols: int, n_tok: int) -> int:
    return _native.act_size(int(fmt), cols, n_tok)


def quantize_act(fmt: Format, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Activations (n_tok, cols) float32 -> the buffer format `fmt` consumes."""
    x = np.ascontiguousarray(np.atleast_2d(x), dtype=np.float32)
    n_tok, cols = x.shape
    act = np.empty(act_size(fmt, cols, n_tok), np.uint8) if out is None else out
    _native.quantize_act(int(fmt), x, cols, cols, n_tok, act)
    return act


def quantize_act_pair(fmt: Format, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One token's precise pair (an integer format's layout): x quantized, and the residual it leaves
    quantized (csrc/kernels.h, kiln_quantize_act_pair)."""
    x = np.ascontiguousarray(x, dtype=np.float32).ravel()
    first, second = (np.empty(act_size(fmt, x.size, 1), np.uint8) for _ in range(2))
    _native.quantize_act_pair(int(fmt), x, x.size, first, second)
    return first, second


def matmul(w: PackedMatrix, act: np.ndarray, n_tok: int, out: np.ndarray | None = None, tile0: int = 0,
           tile1: int | None = None) -> np.ndarray:
    """y (n_tok, rows) = activations . weightsᵀ, for the rows of tiles [tile0, tile1) (others untouched)."""
    y = np.zeros((n_tok, w.rows), np.float32) if out is None else out
    if y.dtype != np.float32 or not y.flags.c_contiguous or y.ndim != 2 or y.shape != (n_tok, w.rows):
        raise ValueError(f"out must be a C-contiguous float32 array of shape ({n_tok}, {w.rows})")
    _native.matmul(int(w.fmt), w.rows, w.cols, w.tile_bytes, w.data, act, n_tok, y, w.rows, tile0,
                   w.tiles if tile1 is None else tile1)
    return y


def matmul_f32(w: PackedMatrix, x: np.ndarray) -> np.ndarray:
    """Quantize fp32 activations (n_tok, cols) as the format needs, then multiply."""
    x = np.atleast_2d(np.asarray(x, np.float32))
    return matmul(w, quantize_act(w.fmt, x), x.shape[0])


def huge_empty(nbytes: int) -> np.ndarray:
    """An uninitialised uint8 array on 2 MiB-aligned memory with transparent huge pages advised."""
    return np.frombuffer(_native.huge_buffer(nbytes), dtype=np.uint8)


def mem_read(buf: np.ndarray) -> int:
    """Read every byte of `buf` once in C (the plain memory-bandwidth reference); returns a checksum."""
    return _native.mem_read(buf)
