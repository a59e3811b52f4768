"""A model file checked against its family before anything runs it: the family's forward pass walked once
with the widths of values instead of values, so that every tensor it reads is checked where it is read.

A tensor's shape must be the one the metadata implies (llama.cpp's "wrong shape; expected …, got …"); a
tensor the family needs and the file lacks, and one the file carries that no layer reads, are errors.
Shapes are printed as GGUF writes them, innermost (column) dimension first.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kiln.errors import ModelFileError, UnsupportedModelError
from kiln.gguf import GGUFFile, StringArray, describe, is_int, parse_head_view, parse_row_view
from kiln.models.base import Attention, DeltaNet, DeltaNetWeights, Experts, ModelConfig, Rope, ShortConv

# what the tokenizer's keys hold (llama.cpp's types); per-token arrays have one entry per token
_TOKENIZER_KINDS = {"tokenizer.ggml.model": "a string", "tokenizer.ggml.pre": "a string",
                    "tokenizer.chat_template": "a string", "tokenizer.ggml.tokens": "an array of strings",
                    "tokenizer.ggml.merges": "an array of strings", "tokenizer.ggml.token_type": "per-token integers",
                    "tokenizer.ggml.scores": "per-token numbers"}


@dataclass(frozen=True)
class Width:
    """A value's row width; `source` is the matrix (name, input width) whose rows set it, blamed when a
    reader needs another width. None: it comes from a missing tensor, reported after the walk."""

    n: int | None
    source: tuple[str, int] | None = None


class ShapeCheck:
    """`Ops` that check each tensor against the widths the config and the graph imply."""

    def __init__(self, gguf: GGUFFile, cfg: ModelConfig):
        self.gguf, self.cfg = gguf, cfg
        self.used: set[str] = set()
        self.missing: list[str] = []
        self.view_ends: dict[str, int] = {}  # a fused tensor read in parts: the last row any part reads

    # ---- tensors ---------------------------------------------------------------------------------
    def _shape(self, name: str) -> tuple[int, ...] | None:
        view = parse_row_view(name)
        if view is not None:
            return self._view_shape(*view)
        heads = parse_head_view(name)
        if heads is not None:
            return self._head_view_shape(*heads)
        self.used.add(name)
        if name not in self.gguf.tensors:
            if name not in self.missing:
                self.missing.append(name)
            return None
        return self.gguf.tensors[name].shape

    def _view_shape(self, base: str, start: int, stop: int) -> tuple[int, ...] | None:
        """Rows [start, stop) of a fused tensor; the parts must end where the tensor does (`check_views`)."""
        got = self._shape(base)
        if got is None:
            return None
        self.view_ends[base] = max(self.view_ends.get(base, 0), stop)
        if stop > got[0]:
            raise self._wrong(base, (stop, *got[1:]), got)
        return (stop - start, *got[1:])

    def _head_view_shape(self, base: str, part: int, parts: int, rows: int) -> tuple[int, ...] | None:
        """One part of every head of a matrix: its rows are whole heads of `parts` runs of `rows`."""
        got = self._shape(base)
        if got is None:
            return None
        if len(got) != 2 or got[0] % (parts * rows):
            raise self._wrong(base, (-(-got[0] // (parts * rows)) * parts * rows, *got[1:]), got)
        return (got[0] // parts, got[1])

    def check_views(self) -> None:
        for base, end in self.view_ends.items():
            got = self.gguf.tensors[base].shape
            if got[0] != end:
                raise self._wrong(base, (end, *got[1:]), got)

    def _wrong(self, name: str, expected: tuple[int, ...], got: tuple[int, ...]) -> ModelFileError:
        ggml = lambda shape: "[" + ", ".join(map(str, reversed(shape))) + "]"  # noqa: E731
        return ModelFileError(f"{self.gguf.path}: tensor {name!r} has wrong shape; expected {ggml(expected)}, "
                              f"got {ggml(got)}")

    def _expect(self, name: str, *shape: int) -> bool:
        """Whether the tensor exists; raises if its shape is not `shape`."""
        got = self._shape(name)
        if got is not None and got != shape:
            raise self._wrong(name, shape, got)
        return got is not None

    def _vector(self, name: str, n: int | None) -> None:
        """A vector as long as its input is wide (when that is known: else only noted as read)."""
        if n is None:
            self._shape(name)
        else:
            self._expect(name, n)

    def _matrix(self, name: str, cols: int | None, rows: int | None = None) -> Width:
        """A matrix read by a value of width `cols`; `rows` when the config fixes them."""
        got = self._shape(name)
        if got is None:
            return Width(None)
        want = (got[0] if rows is None else rows, got[-1] if cols is None else cols)
        if got != want:
            raise self._wrong(name, want, got)
        return Width(got[0], (name, cols) if cols is not None else None)

    def _need(self, x: Width, n: int, what: str) -> None:
        if x.n is None or x.n == n:
            return
        if x.source is not None:
            name, cols = x.source
            raise self._wrong(name, (n, cols), (x.n, cols))
        raise ModelFileError(f"{self.gguf.path}: {what} is {x.n} wide, expected {n}")  # no tensor to blame

    # ---- Ops ---------------------------------------------------------------------------------------
    def embed(self, table, scale=1.0):
        self._expect(table, self.cfg.vocab_size, self.cfg.dim)
        return Width(self.cfg.dim)

    def rmsnorm(self, x, weight, eps, heads=1):
        if heads == 1:
            self._vector(weight, x.n)
        else:  # per head: a head is head_dim wide
            self._need(x, heads * self.cfg.head_dim, f"the input of {weight}")
            self._expect(weight, self.cfg.head_dim)
        return x

    def linear(self, x, weight, bias=None):
        out = self._matrix(weight, x.n)
        if bias is not None:
            self._vector(bias, out.n)
        return out

    def rope(self, x, rope: Rope, heads):
        for factors in (rope.freq_factors, rope.long_factors):
            if factors is not None:
                self._expect(factors, rope.dim // 2)
        return x

    def attention(self, layer, q, k, v, attn: Attention):
        if not 0 <= layer < self.cfg.n_layers or attn is not self.cfg.layers[layer]:
            raise ModelFileError(f"{self.gguf.path}: layer {layer} is not one of the config's {self.cfg.n_layers}")
        self._need(q, attn.n_heads * attn.head_dim, f"layer {layer}'s queries")
        self._need(k, attn.n_kv_heads * attn.head_dim, f"layer {layer}'s keys")
        self._need(v, attn.n_kv_heads * attn.head_dim, f"layer {layer}'s values")
        if attn.sinks is not None:
            self._expect(attn.sinks, attn.n_heads)
        return Width(attn.n_heads * attn.head_dim)

    def glu(self, x, gate, up, act, gate_bias=None, up_bias=None):
        for name, bias in ((gate, gate_bias), (up, up_bias)):
            self._matrix(name, x.n, self.cfg.ffn_dim)
            if bias is not None:
                self._expect(bias, self.cfg.ffn_dim)
        return Width(self.cfg.ffn_dim)

    def layernorm(self, x, weight, bias, eps):
        self._vector(weight, x.n)
        self._vector(bias, x.n)
        return x

    def activation(self, x, act):
        return x

    def add(self, a, b, scale=1.0):
        self._need(b, self.cfg.dim, "a residual branch")
        return Width(self.cfg.dim)

    def logits(self, x, weight, bias=None, scale=1.0, softcap=0.0):
        self._need(x, self.cfg.dim, "the output head's input")
        self._matrix(weight, self.cfg.dim, self.cfg.vocab_size)
        if bias is not None:
            self._expect(bias, self.cfg.vocab_size)
        return Width(self.cfg.vocab_size)

    def shortconv(self, layer, bcx, weight, conv: ShortConv):
        if not 0 <= layer < self.cfg.n_layers or conv is not self.cfg.layers[layer]:
            raise ModelFileError(f"{self.gguf.path}: layer {layer} is not one of the config's {self.cfg.n_layers}")
        self._need(bcx, 3 * conv.width, f"layer {layer}'s convolution input")
        self._expect(weight, conv.width, conv.length)
        return Width(conv.width)

    def delta_net(self, layer, qkv, z, alpha, beta, weights: DeltaNetWeights, net: DeltaNet):
        if not 0 <= layer < self.cfg.n_layers or net is not self.cfg.layers[layer]:
            raise ModelFileError(f"{self.gguf.path}: layer {layer} is not one of the config's {self.cfg.n_layers}")
        self._need(qkv, net.width, f"layer {layer}'s q, k and v")
        self._need(z, net.n_v_heads * net.v_dim, f"layer {layer}'s output gate")
        self._need(alpha, net.n_v_heads, f"layer {layer}'s time steps")
        self._need(beta, net.n_v_heads, f"layer {layer}'s update rates")
        self._expect(weights.conv, net.width, net.length)
        for name in (weights.decay, weights.dt_bias):
            self._expect(name, net.n_v_heads)
        self._expect(weights.norm, net.v_dim)
        return Width(net.n_v_heads * net.v_dim)

    def gate(self, x, gate):
        if x.n is not None:
            self._need(gate, x.n, "an output gate")
        return x

    def moe(self, x, e: Experts):
        dim, n = self.cfg.dim, e.n_experts
        self._need(x, dim, f"the input of {e.router}")
        self._matrix(e.router, dim, n)
        self._expect(e.gate, n, e.ff_dim, dim)
        self._expect(e.up, n, e.ff_dim, dim)
        self._expect(e.down, n, dim, e.ff_dim)
        if e.router_bias is not None:
            self._expect(e.router_bias, n)
        for bias, width in ((e.gate_bias, e.ff_dim), (e.up_bias, e.ff_dim), (e.down_bias, dim)):
            if bias is not None:
                self._expect(bias, n, width)
        if e.shared_gate is not None:
            for name in (e.shared_gate, e.shared_up):
                self._matrix(name, dim, e.shared_ff_dim)
            self._matrix(e.shared_down, e.shared_ff_dim, dim)
        if e.shared_scale is not None:
            self._expect(e.shared_scale, dim)
        return Width(dim)


def check_tensors(gguf: GGUFFile, cfg: ModelConfig, forward) -> None:
    """Raise a one-line error unless the file's tensors are exactly those `forward` reads, each of the shape
    the config implies."""
    check = ShapeCheck(gguf, cfg)
    forward(check, cfg)
    check.check_views()
    unused = [name for name in gguf.tensors if name not in check.used]
    if unused:
        more = f" (and {len(unused) - 1} more)" if len(unused) > 1 else ""
        raise UnsupportedModelError(f"{gguf.path}: tensor {unused[0]!r}{more} is not one kiln's {cfg.architecture} "
                                    "family reads; refusing the file rather than ignoring it")
    if check.missing:
        more = f" (and {len(check.missing) - 1} more)" if len(check.missing) > 1 else ""
        raise ModelFileError(f"{gguf.path}: required tensor {check.missing[0]!r}{more} is missing")


def _kind_ok(kind: str, value, n_tokens: int | None) -> bool:
    if kind == "a string":
        return isinstance(value, str)
    if kind == "an array of strings":
        return isinstance(value, StringArray)
    if kind == "a boolean":
        return isinstance(value, (bool, np.bool_))
    if kind == "an integer":
        return is_int(value)
    numeric = isinstance(value, np.ndarray) and value.dtype.kind in ("iu" if kind == "per-token integers" else "iuf")
    return numeric and (n_tokens is None or len(value) == n_tokens)


def check_tokenizer_metadata(gguf: GGUFFile) -> None:
    """The tokenizer's keys have the types llama.cpp writes, so that building it cannot fail on one."""
    tokens = gguf.metadata.get("tokenizer.ggml.tokens")
    n_tokens = len(tokens) if isinstance(tokens, StringArray) else None
    for key, value in gguf.metadata.items():
        if key.startswith("tokenizer.chat_template"):  # named templates too (tokenizer.chat_template.<name>)
            kind = "a string"
        elif key.startswith("tokenizer.ggml.add_"):
            kind = "a boolean"
        elif key.startswith("tokenizer.ggml.") and key.endswith("_token_id"):
            kind = "an integer"
        else:
            kind = _TOKENIZER_KINDS.get(key)
        if kind is not None and not _kind_ok(kind, value, n_tokens):
            raise ModelFileError(f"{gguf.path}: metadata key {key!r} is {describe(value)}, expected {kind}"
                                 + (f" ({n_tokens} of them)" if kind.startswith("per-token") else ""))
