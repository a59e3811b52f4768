"""The native engine: weights repacked once (and cached next to the model), a preallocated fp16 KV
cache, and plans compiled from the family's graph that C runs in one call per step.

Two plans share the weights and the cache: a decode plan for up to `max_batch` rows and a prefill
plan for chunks of up to `prefill_rows` rows. They also share one arena of activations, since only one
step runs at a time.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT
from gguf import quants as gguf_quants

from kiln import __version__
from kiln.engine.compile import Buf, Lowering, Recorder, assign_offsets, encode_ops
from kiln.engine.interface import Limits
from kiln.engine.kv import (KV_CACHE_TYPES, StateWindow, check_kv_cache_type, check_span, kv_head_bytes,
                            recurrent_state_bytes, state_window)
from kiln.engine.oracle import rope_angles
from kiln.engine.repack_cache import RepackCache
from kiln.errors import KilnError, RequestError
from kiln.gguf import EXACT_REWRITES, KERNEL_TYPES, GGUFFile, rewrite_exactly
from kiln.models import Family
from kiln.models.base import DeltaNet, Rope, attention_layers, recurrent_layers

try:
    from kiln import _native
except ImportError:  # the extension did not build: the oracle engine still runs
    _native = None

GUARD_BYTES = 64  # a guarded plan's guard past each activation buffer
CACHE_VERSION = 6  # bumped whenever a packed layout (or the cache's index) changes


def cache_version() -> str:
    """What a repack cache's packed layouts must have been written by."""
    return f"{CACHE_VERSION}/{__version__}"


def available() -> bool:
    return _native is not None


def physical_cores() -> int:
    """Cores, not hardware threads: a second hyperthread adds no memory bandwidth."""
    try:
        cpus = os.sched_getaffinity(0)
    except AttributeError:
        cpus = range(os.cpu_count() or 1)
    cores = set()
    for cpu in cpus:
        try:
            siblings = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text().strip()
        except OSError:
            siblings = str(cpu)
        cores.add(siblings)
    return max(1, len(cores))


@dataclass
class Table:
    """An embedding table read in place from the GGUF file (pread of one row per token). A table the output
    head shares is not one: its rows come from the packed head, already in memory (kiln_unpack_row)."""

    fd: int
    offset: int
    ggml_type: int
    row_bytes: int
    rows: int


def warm_page_cache(fd: int, offset: int, nbytes: int) -> None:
    """Read a file range once in a background thread, so that it sits in the page cache (which is not
    this process's memory). An embedding row is read from the file when its token first occurs; from a
    cold cache that read waits on the disk, and POSIX_FADV_WILLNEED did no better (docs/PERF.md,
    "Sampling, the QKV op's end, the embedding table")."""
    own = os.dup(fd)  # the model may be closed while this runs

    def read_range():
        try:
            end, buf = offset + nbytes, bytearray(1 << 20)  # one buffer: no fresh pages to fault in per read
            for at in range(offset, end, len(buf)):
                os.preadv(own, [memoryview(buf)[: min(len(buf), end - at)]], at)
        except OSError:
            pass  # only a warm-up: rows are read again when needed, and errors reported then
        finally:
            os.close(own)

    threading.Thread(target=read_range, name="kiln-table-warm", daemon=True).start()


class PackedWeights:
    """Every matrix the graph multiplies by, repacked into kernel layouts in one huge-page arena.
    The arena is written to `cache_dir` once (kiln/engine/repack_cache.py), so later loads are one
    sequential read; `gguf_sha256` is the file's when the store knows it."""

    def __init__(self, gguf: GGUFFile, names: list[str], cache_dir: Path | None, split: set[str] = frozenset(),
                 gguf_sha256: str | None = None):
        """`split`: matrices to pack as a split int8 head where they are Q8_0 (csrc/op_logits.c)."""
        self.gguf = gguf
        self.vectors: dict[str, np.ndarray] = {}
        self.tables: dict[str, Table] = {}
        cache = RepackCache(cache_dir, gguf, cache_version(), sorted(split), gguf_sha256) if cache_dir else None
        loaded = cache.load(names) if cache else None
        self.from_cache = loaded is not None
        if loaded:
            self.arena, layouts = loaded
        else:
            layouts = self._pack(names, split)
            gguf.release_pages()
            if cache:
                cache.save(self.arena, layouts)
        self.layouts = layouts
        self.mats = {name: self._wmat(lay) for name, lay in layouts.items()}
        # a 3-D tensor's experts, each a matrix of its own (the first is also `mats[name]`), and the table
        # of their addresses an OP_MOE reads
        self.experts = {name: [self._wmat(lay, e) for e in range(lay["experts"])]
                        for name, lay in layouts.items() if "experts" in lay}
        self.expert_tables = {name: np.array([m.address for m in ms], np.uint64) for name, ms in self.experts.items()}
        # a split head's low bits (its high bits are the matrix above)
        self.remainders = {name: self._wmat(lay["remainder"]) for name, lay in layouts.items() if "remainder" in lay}

    def _wmat(self, lay: dict, expert: int = 0):
        return _native.wmat(self.arena, lay["offset"] + expert * lay.get("expert_stride", 0), lay["fmt"], lay["rows"],
                            lay["cols"], lay["rows_padded"], lay["tile_bytes"])

    def _source(self, name: str, ggml: int, rows: int, cols: int, expert: int | None = None) -> np.ndarray:
        """GGUF bytes of a matrix (or of one expert of a 3-D tensor) as packed: its own, its blocks
        rewritten exactly, or the gguf package's values requantized."""
        own = self.gguf.info(name).type
        pick = (lambda a: a) if expert is None else (lambda a: a[expert])
        if ggml == int(own):
            return np.ascontiguousarray(pick(self.gguf.raw(name)))
        if own in EXACT_REWRITES:
            return rewrite_exactly(np.ascontiguousarray(pick(self.gguf.raw(name))), own, rows)
        values = self.gguf.dequantize(name).reshape(-1, rows, cols)
        return gguf_quants.quantize(values[0 if expert is None else expert], QT.Q8_0)

    def _pack(self, names, split):
        shapes, halves, experts = {}, {}, {}
        for name in names:
            t = self.gguf.info(name)
            n_experts, rows, cols = matrix_shape(t.shape)
            if n_experts:
                experts[name] = n_experts
            ggml = packed_type(int(t.type), rows, cols)
            shapes[name] = (ggml, rows, cols)
            if name in split and ggml == int(QT.Q8_0):
                # None (packed whole) only if some block's 8 x scale overflows fp16
                halves[name] = _native.split_q8_0(np.ascontiguousarray(self._source(name, ggml, rows, cols)))
        parts = {name: [(int(QT.Q5_0), halves[name][0]), (int(QT.Q4_0), halves[name][1])] if halves.get(name)
                 else [(ggml, None)] for name, (ggml, _, _) in shapes.items()}
        total, offsets = 0, {}
        for name, ps in parts.items():
            for i, (ggml, _) in enumerate(ps):
                offsets[name, i] = total
                total += arena_bytes(ggml, *shapes[name][1:]) * experts.get(name, 1)
        self.arena = _native.Arena(max(total, 1))
        layouts = {}
        for name, ps in parts.items():
            _, rows, cols = shapes[name]
            packed = []
            for i, (ggml, raw) in enumerate(ps):
                if name in experts:  # each expert packed on its own pages, one stride apart
                    stride = arena_bytes(ggml, rows, cols)
                    for e in range(experts[name]):
                        m = _native.pack_into(self.arena, offsets[name, i] + e * stride, ggml,
                                              self._source(name, ggml, rows, cols, e), rows, cols)
                    packed.append(dict(m.layout, offset=offsets[name, i], experts=experts[name], expert_stride=stride))
                    continue
                raw = self._source(name, ggml, rows, cols) if raw is None else raw
                m = _native.pack_into(self.arena, offsets[name, i], ggml, raw, rows, cols)
                packed.append(dict(m.layout, offset=offsets[name, i]))
            # ggml_type: what a row unpacks to (a split pair's rows unpack to Q8_0 together)
            layouts[name] = dict(packed[0], ggml_type=shapes[name][0])
            if len(packed) == 2:
                layouts[name]["remainder"] = packed[1]
        return layouts

    def matrix(self, name: str):
        """The packed matrix; of a 3-D tensor, its first expert (all of them share its layout)."""
        return self.mats[name]

    def expert_table(self, name: str) -> np.ndarray:
        """The addresses of a 3-D tensor's experts, as OP_MOE reads them."""
        return self.expert_tables[name]

    def remainder(self, name: str):
        """A split head's low bits (csrc/op_logits.c), or None for a matrix packed whole."""
        return self.remainders.get(name)

    def has_matrix(self, name: str) -> bool:
        return name in self.mats

    def row_format(self, name: str) -> tuple[int, int]:
        """A tensor's GGUF type and the bytes of one of its rows; for a packed matrix, what its rows unpack
        to (its own type, the type it was rewritten into, or Q8_0 when it was requantized)."""
        if name not in self.layouts:
            t = self.gguf.info(name)
            return int(t.type), t.nbytes // t.shape[0]
        ggml, cols = self.layouts[name]["ggml_type"], self.layouts[name]["cols"]
        block, block_bytes = GGML_QUANT_SIZES[QT(ggml)]
        return ggml, cols // block * block_bytes

    def vector(self, name: str) -> np.ndarray:
        if name not in self.vectors:
            self.vectors[name] = np.ascontiguousarray(self.gguf.dequantize(name), dtype=np.float32).ravel()
        return self.vectors[name]

    def table(self, name: str) -> Table:
        if name not in self.tables:
            t = self.gguf.info(name)
            ggml_type, row_bytes = self.row_format(name)
            self.tables[name] = Table(self.gguf.fileno(), t.offset, ggml_type, row_bytes, t.shape[0])
            warm_page_cache(self.gguf.fileno(), t.offset, t.nbytes)
        return self.tables[name]

    @property
    def nbytes(self) -> int:
        return self.arena.nbytes


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int, int]:
    """(experts, rows, cols) a tensor is packed as: a 3-D tensor is its experts' matrices (experts > 0), a
    vector one row (a shared expert's scale), else a matrix of its first dimension's rows."""
    if len(shape) == 3:
        return shape[0], shape[1], shape[2]
    if len(shape) == 1:
        return 0, 1, shape[0]
    return 0, shape[0], int(np.prod(shape[1:]))


def packed_type(ggml: int, rows: int, cols: int) -> int:
    """The GGUF type a tensor is packed as: its own, the kernel type that holds its values exactly
    (kiln.gguf.EXACT_REWRITES), or Q8_0 for another one with no kernel format (kiln.gguf.REQUANTIZED_TYPES),
    whose values are requantized."""
    if _native.pack_size(ggml, rows, cols):
        return ggml
    return int(EXACT_REWRITES[ggml][0]) if ggml in EXACT_REWRITES else int(QT.Q8_0)


def arena_bytes(ggml: int, rows: int, cols: int) -> int:
    """What a matrix packed as GGUF type `ggml` takes in the weights arena: its parts start on 4 KiB pages."""
    return -(-_native.pack_size(ggml, rows, cols) // 4096) * 4096


def packed_parts(ggml: int, rows: int, cols: int, split: bool) -> list[int]:
    """The kernel formats (as GGUF types) a tensor is packed into: a Q8_0 output head is split in two."""
    ggml = packed_type(ggml, rows, cols)
    return [int(QT.Q5_0), int(QT.Q4_0)] if split and ggml == int(QT.Q8_0) else [ggml]


def heads_of(root) -> set[str]:
    """The output head's weight: the one matrix packed split when it is int8."""
    return {root.params["weight"]} if root.kind == "logits" else set()


def packed_names(gguf: GGUFFile, root) -> list[str]:
    """The matrices the graph multiplies by, then any embedding table of a type with no kernel: packed
    requantized, it is read as a tied table is (rows unpacked from the arena), since the executor's
    reads of the file cannot dequantize its type."""
    names = matrices_of(root)
    for name in tables_of(root):
        if name not in names and gguf.info(name).type not in KERNEL_TYPES:
            names.append(name)
    return names


def tables_of(root) -> list[str]:
    """Names of the embedding tables the graph reads rows of."""
    names, stack, seen = [], [root], set()
    while stack:
        node = stack.pop()
        if id(node) not in seen:
            seen.add(id(node))
            if node.kind == "embed" and node.params["table"] not in names:
                names.append(node.params["table"])
            stack.extend(node.inputs)
    return names


def matrices_of(root) -> list[str]:
    """Names of the weights the graph multiplies by, in first-use order."""
    names, stack, seen = [], [root], set()
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        for key in ("weight", "gate", "up"):
            if node.kind in ("linear", "glu", "logits") and key in node.params:
                if node.params[key] not in names:
                    names.append(node.params[key])
        if node.kind == "moe":
            e = node.params["experts"]
            for name in (e.router, e.gate, e.up, e.down, e.shared_gate, e.shared_up, e.shared_down, e.shared_scale):
                if name is not None and name not in names:
                    names.append(name)
        stack.extend(reversed(node.inputs))
    return names


@dataclass
class StepStats:
    """What the native calls cost, for `kiln bench` and `kiln trace` to set against wall time."""

    steps: int = 0
    rows: int = 0
    native_ns: int = 0
    wait_ns: int = 0

    def add(self, rows: int, native_ns: int, wait_ns: int) -> None:
        self.steps += 1
        self.rows += rows
        self.native_ns += native_ns
        self.wait_ns += wait_ns


class NativePlan:
    """One compiled plan with an arena of activations and per-row inputs: its own, or `arena` when that is
    large enough (plans that never run at once share one). Buffers are reused once dead, unless `keep_all`
    (for reading every layer's output afterwards). C sizes each op's scratch, and checks every address an
    op holds against the buffers named in `buffers` (csrc/plan_check.c); a guarded engine's plans put guard
    words around each op's scratch and after each activation buffer, and a step that writes past them fails."""

    def __init__(self, engine: "NativeEngine", root, rows: int, out_rows: int, keep_all: bool = False,
                 arena=None):
        e = engine
        low = Lowering(_native, e.weights, e.config, rows, out_rows, e.n_ctx, e.pool.threads, e.kv_layer, e.rope_table,
                       e.negate_layer, state=e.state_layer, kv_type=KV_CACHE_TYPES.index(e.kv_type))
        low.lower(root)
        inputs = {name: Buf(4 * rows) for name in ("tokens", "slots", "positions", "row_sel")}
        size, gaps = assign_offsets(low.ops, [low.logits, low.hidden, *inputs.values()], reuse=not keep_all,
                                    guard=GUARD_BYTES if e.guard else 0)
        self.arena = arena if arena is not None and arena.nbytes >= size else _native.Arena(size, huge=False)
        base = self.arena.address
        whole = np.frombuffer(self.arena, dtype=np.uint8)
        self.inputs = {k: whole[b.offset : b.offset + b.nbytes].view(np.int32) for k, b in inputs.items()}
        vocab = e.config.vocab_size
        self.logits = whole[low.logits.offset : low.logits.offset + low.logits.nbytes].view(np.float32).reshape(-1, vocab)
        self.ops = low.ops
        self.rows, self.out_rows = rows, out_rows
        dim = e.config.dim
        self.hidden = whole[low.hidden.offset : low.hidden.offset + low.hidden.nbytes].view(np.float32).reshape(-1, dim)
        self.residuals = [whole[b.offset : b.offset + b.nbytes].view(np.float32).reshape(rows, dim)
                          for b in low.residuals]
        # each MOE op's rows per expert in the last step (csrc/op_moe.c: `count`, after three runs of
        # rows x n_used routing ints), for kiln trace's expert load
        self.expert_counts = []
        for op in low.ops:
            if op["kind"] == _native.OP_MOE:
                at = op["moe_route"].offset + 4 * 3 * rows * op["n_used"]
                self.expert_counts.append((op["layer"], whole[at : at + 4 * op["n_experts"]].view(np.int32)))
        self.encoded = encode_ops(_native, low.ops, base)
        self.buffers = plan_buffers(e, self.arena)
        self.guard_gaps = np.array([(base + o, n) for o, n in gaps] if e.guard else [], np.uint64).tobytes()
        self.plan = _native.Plan(self.encoded, e.pool, self.buffers, rows, out_rows, e.kv_ctx, e.n_slots,
                                 *(base + inputs[k].offset for k in ("tokens", "slots", "positions", "row_sel")),
                                 guard=e.guard, guard_gaps=self.guard_gaps)


def plan_buffers(engine: "NativeEngine", activations) -> dict:
    """Every buffer and matrix a plan's ops point into, by name: what C holds each op's addresses against."""
    w = engine.weights
    buffers = {"activations": activations, "kv cache": engine.kv_arena, "weights": w.arena}
    if engine.state_arena is not None:
        buffers["recurrent state"] = engine.state_arena
    buffers.update(w.mats)
    for name, experts in w.experts.items():
        buffers.update({f"{name} expert {e}": m for e, m in enumerate(experts)})
        buffers[f"{name} experts"] = w.expert_tables[name]
    buffers.update({f"{name} (low bits)": m for name, m in w.remainders.items()})
    buffers.update(w.vectors)
    for i, (cos, sin) in enumerate(engine.ropes.values()):
        buffers[f"rope {i} cos"], buffers[f"rope {i} sin"] = cos, sin
    return buffers


class NativeEngine:
    name = "native"

    def __init__(self, gguf: GGUFFile, family: Family, n_ctx: int, n_slots: int = 1, threads: int | None = None,
                 cache_dir: Path | None = None, max_batch: int = 16, prefill_rows: int = 128, max_out: int = 16,
                 gguf_sha256: str | None = None, guard: bool = False, pool=None, kv_type: str = "f16"):
        """`guard` (or KILN_GUARD=1): plans with guard words around each op's scratch, for tests. `pool`: a
        thread pool shared with other engines (their steps overlap only with the pool's jobs kept on each
        stepping thread: scheduler.Turns); by default the engine makes its own of `threads`. `kv_type`: the
        KV cache's type (kiln.engine.kv.KV_CACHE_TYPES)."""
        if _native is None:
            raise KilnError("the native core (kiln._native) is not built; reinstall kiln or use --backend oracle")
        t0 = time.perf_counter()
        self.gguf, self.config, self.n_ctx, self.n_slots = gguf, family.config, n_ctx, n_slots
        self.pool = pool or _native.Pool(threads or physical_cores())
        self.threads = self.pool.threads
        from kiln.native.kernels import active_isa

        self.processor = f"CPU ({active_isa()}, {self.threads} thread{'s' if self.threads != 1 else ''})"
        root = family.forward(Recorder(), self.config)
        self.weights = PackedWeights(gguf, packed_names(gguf, root), cache_dir, split=heads_of(root),
                                     gguf_sha256=gguf_sha256)
        cfg = self.config
        # keys are stored in groups of 8 positions (csrc/attn.h), so the cache holds whole groups
        self.kv_ctx = -(-n_ctx // 8) * 8
        check_kv_cache_type(kv_type, cfg.head_dim)
        self.kv_type = kv_type
        kv_bytes = n_slots * cfg.n_kv_heads * kv_head_bytes(kv_type, self.kv_ctx, cfg.head_dim)
        # only attention layers have KV; a hybrid's others keep a recurrent state instead
        self.kv_index = {layer: i for i, layer in enumerate(attention_layers(cfg))}
        self.kv_arena = _native.Arena(max(2 * len(self.kv_index) * kv_bytes, 1))
        self._kv = np.frombuffer(self.kv_arena, dtype=np.uint8)[: 2 * len(self.kv_index) * kv_bytes].reshape(
            len(self.kv_index), 2, kv_bytes)
        self.ropes: dict[Rope, tuple[np.ndarray, np.ndarray]] = {}
        rows = max(prefill_rows, max_batch + 1)
        self.limits = Limits(rows=rows, batch=max_batch, out_rows=min(max_out, rows))
        self._allocate_state(n_slots, rows)
        self.negate_layer: int | None = None
        self.guard = guard or os.environ.get("KILN_GUARD") == "1"
        self._root = root
        self._compile()
        self.stats = StepStats()
        self.expert_rows: dict[int, np.ndarray] | None = None  # set to count rows per expert (kiln trace)
        self.load_ms = (time.perf_counter() - t0) * 1e3

    def _compile(self) -> None:
        # One step runs at a time and nothing in an arena outlives its step (step() copies the logits
        # out), so the decode plan lays its buffers over the prefill plan's arena.
        lim = self.limits
        self.prefill_plan = NativePlan(self, self._root, lim.rows, lim.out_rows)
        self.decode_plan = NativePlan(self, self._root, lim.batch, lim.batch, arena=self.prefill_plan.arena)
        self._last_plan = self.decode_plan

    def set_debug_negate(self, layer: int | None) -> None:
        """Break one layer on purpose (its attention output changes sign), to show accuracy checks fail."""
        self.negate_layer = layer
        self._compile()

    def hidden_states(self, tokens, slot: int = 0, start: int = 0) -> list[np.ndarray]:
        """The residual stream after every add (two per block), (len(tokens), dim) each, from a plan
        compiled for this call that keeps every intermediate buffer."""
        tokens = list(tokens)
        check_span(start, len(tokens), self.n_ctx)
        plan = NativePlan(self, self._root, len(tokens), 1, keep_all=True)
        n = len(tokens)
        plan.inputs["tokens"][:n] = tokens
        plan.inputs["slots"][:n] = slot
        plan.inputs["positions"][:n] = range(start, start + n)
        plan.inputs["row_sel"][:1] = n - 1
        if self.state_positions is not None:
            self.state_positions.advance([slot] * n, range(start, start + n), self._restore)
        plan.plan.run(n, 1)
        return [r[:n].copy() for r in plan.residuals]

    def _allocate_state(self, n_slots: int, rows: int) -> None:
        """Each recurrent layer's rings, float32 [slots][ring][width], and a DeltaNet's matrices, float32
        [slots][v heads * k_dim * v_dim], preallocated with the slots: a rewind of up to a step's rows stays
        within the rings, and none with matrices (kiln/engine/kv.py, StateWindow)."""
        layers = recurrent_layers(self.config)
        self.state_arena, self._state, self._snapshots, self.state_positions = None, {}, {}, None
        self._matrices, self._matrix_snapshots = {}, {}
        if not layers:
            return
        self.state_positions = StateWindow(n_slots, max(c.length for c in layers.values()),
                                           state_window(layers, rows))
        ring = self.state_positions.ring
        sizes = {i: n_slots * ring * c.width for i, c in layers.items()}
        matrices = {i: n_slots * c.matrix_floats for i, c in layers.items() if isinstance(c, DeltaNet)}
        self.state_arena = _native.Arena(recurrent_state_bytes(self.config, n_slots, rows))
        whole, at = np.frombuffer(self.state_arena, dtype=np.float32), 0
        for store, part in ((self._state, sizes), (self._matrices, matrices), (self._matrix_snapshots, matrices)):
            for i, size in part.items():
                store[i] = whole[at : at + size].reshape(n_slots, -1)
                at += size
        # each slot's snapshot of its rings: the inputs before one position (kiln/engine/kv.py, StateWindow)
        self._snapshots = {i: np.zeros((n_slots, c.length - 1, c.width), np.float32) for i, c in layers.items()}


    def _rings(self, layer: int) -> np.ndarray:
        return self._state[layer].reshape(self.n_slots, self.state_positions.ring, -1)

    def _restore(self, slot: int, position: int) -> None:
        rows = self.state_positions.positions_before(position)
        for i, snap in self._snapshots.items():
            self._rings(i)[slot, rows] = snap[slot, : len(rows)]
        for i, m in self._matrices.items():
            m[slot] = self._matrix_snapshots[i][slot] if position else 0.0

    def snapshot(self, slot: int, position: int) -> None:
        """Keep the state before `position` aside, so the slot can continue there however far it runs on."""
        if self.state_positions is not None and self.state_positions.take_snapshot(slot, position):
            rows = self.state_positions.positions_before(position)
            for i, snap in self._snapshots.items():
                snap[slot, : len(rows)] = self._rings(i)[slot, rows]
            for i, m in self._matrices.items():
                self._matrix_snapshots[i][slot] = m[slot]

    def checkpoint(self, slot: int, position: int) -> None:
        """Snapshot the state at `position` before a step that may be undone, where it cannot rewind."""
        if self.state_positions is not None and self.state_positions.needs_checkpoint():
            self.snapshot(slot, position)

    @property
    def state_bytes_per_slot(self) -> int:
        """The recurrent state one slot holds (a DeltaNet's snapshot of its matrices too), whatever its
        context: kiln validate's memory fit."""
        return sum(s[0].nbytes for s in (*self._state.values(), *self._matrices.values(),
                                         *self._matrix_snapshots.values()))

    # ---- resources the lowering asks for ---------------------------------------------------------
    def kv_layer(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        i = self.kv_index[layer]
        return self._kv[i, 0], self._kv[i, 1]

    def state_layer(self, layer: int) -> tuple[np.ndarray, int, np.ndarray | None]:
        return self._state[layer], self.state_positions.ring, self._matrices.get(layer)

    def rope_table(self, rope: Rope) -> tuple[np.ndarray, np.ndarray]:
        if rope not in self.ropes:
            inv = rope.inv_freq(self.weights.vector, self.n_ctx)
            cos, sin = rope_angles(rope, np.arange(self.kv_ctx), inv)
            self.ropes[rope] = (np.ascontiguousarray(cos, np.float32), np.ascontiguousarray(sin, np.float32))
        return self.ropes[rope]

    # ---- running -----------------------------------------------------------------------------------
    def step(self, tokens, slots, positions, out_rows) -> np.ndarray:
        """Run one batch of rows (any mix of sequences); return logits for `out_rows`, in order."""
        n, n_out = len(tokens), len(out_rows)
        # builtin min/max: a decode step's few ids are checked faster than numpy reductions start up
        vocab = self.config.vocab_size
        if n and (min(tokens) < 0 or max(tokens) >= vocab):
            bad = next(int(t) for t in tokens if not 0 <= t < vocab)
            raise RequestError(f"token id {bad} is outside the vocabulary of {vocab}", param="tokens")
        if n and (min(positions) < 0 or max(positions) >= self.n_ctx):
            bad = next(int(p) for p in positions if not 0 <= p < self.n_ctx)
            raise RequestError(f"position {bad} is outside the context of {self.n_ctx}", param="positions")
        plan = self.decode_plan if n <= self.limits.batch else self.prefill_plan
        if n > plan.rows or n_out > plan.out_rows:
            raise ValueError(f"a step of {n} rows ({n_out} with logits) exceeds the plan's {plan.rows} "
                             f"({plan.out_rows} with logits)")
        inp = plan.inputs
        inp["tokens"][:n] = tokens
        inp["slots"][:n] = slots
        inp["positions"][:n] = positions
        inp["row_sel"][:n_out] = out_rows
        if self.state_positions is not None:
            self.state_positions.advance(slots, positions, self._restore)
        native_ns, wait_ns = plan.plan.run(n, n_out)
        self.stats.add(n, native_ns, wait_ns)
        if self.expert_rows is not None:
            for layer, counts in plan.expert_counts:
                self.expert_rows.setdefault(layer, np.zeros(len(counts), np.int64))[:] += counts
        self._last_plan = plan
        return plan.logits[:n_out].copy()

    def hidden(self, n_out: int) -> np.ndarray:
        """The last step's final hidden states (the output head's normalized input) of its first `n_out`
        rows with logits: what an embedding is made of. Read them before the next step, which may reuse
        the arena."""
        return self._last_plan.hidden[:n_out].copy()

    def forward(self, tokens, slot: int = 0, start: int = 0, all_logits: bool = False) -> np.ndarray:
        tokens = list(tokens)
        check_span(start, len(tokens), self.n_ctx)
        chunk = self.prefill_plan.out_rows if all_logits else self.limits.rows
        results = []
        for i in range(0, len(tokens), chunk):
            part = tokens[i : i + chunk]
            rows = list(range(len(part))) if all_logits else ([len(part) - 1] if i + chunk >= len(tokens) else [])
            logits = self.step(part, [slot] * len(part), range(start + i, start + i + len(part)), rows)
            results.append(logits)
        return np.concatenate(results) if all_logits else results[-1][0]

    def decode(self, tokens, slots, positions) -> np.ndarray:
        out = []
        batch = self.limits.batch
        for i in range(0, len(tokens), batch):
            n = len(tokens[i : i + batch])
            out.append(self.step(tokens[i : i + n], slots[i : i + n], positions[i : i + n], list(range(n))))
        return np.concatenate(out)

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        """Copy KV positions [0, length) — in whole key groups of 8, which only adds positions the
        destination does not use yet."""
        cfg = self.config
        kv = self._kv.reshape(len(self.kv_index), 2, self.n_slots, cfg.n_kv_heads, -1)
        n = kv_head_bytes(self.kv_type, -(-length // 8) * 8, cfg.head_dim)
        kv[:, :, dst, :, :n] = kv[:, :, src, :, :n]
        for state in (*self._state.values(), *self._snapshots.values(), *self._matrices.values(),
                      *self._matrix_snapshots.values()):
            state[dst] = state[src]
        if self.state_positions is not None:
            self.state_positions.copy(src, dst)

    def resume_point(self, slot: int, position: int) -> int:
        """The furthest position at or before `position` the slot can continue from (itself, without a
        recurrent state)."""
        return position if self.state_positions is None else self.state_positions.resume_point(slot, position)

    def close(self) -> None:
        self.decode_plan = self.prefill_plan = self._last_plan = None
