"""`kiln trace TAG`: where the time of a request goes, measured inside the engine.

A request runs in-process through the same calls `kiln run` makes (chat template, tokenize,
`engine.forward`, `Sequence.sample`, `Sequence.append`), with a clock read between them, while the C
executor times every op of every native call (`Plan.set_trace`: two CLOCK_MONOTONIC reads per op, plus
the caller's barrier wait inside each parallel op). From those:

- TTFT, cold start and warm: model load, chat template, tokenize, queue wait (none in-process), prefill
  (host part and native time per op class), first sample, detokenize;
- each decode token: host time around the native call, native time per op class and per layer, barrier
  waits, sampling, detokenizing; ops and parallel regions per token; weight and KV bytes read
  per token and the bandwidth that achieves against a plain read measured in the same run;
- controls: the parts must cover the wall time within 5%, and decode tokens traced and untraced in
  turn give the tracer's own cost (the hook-based tracer of seed 000 had no such control).

Clocks: Python's time.monotonic_ns and the executor's kiln_now_ns are both CLOCK_MONOTONIC, so host
marks and op timestamps share one timeline (the Chrome trace relies on it).
"""

from __future__ import annotations

import gc
import re
import statistics
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from kiln.errors import KilnError

CLASSES = ("matmul", "attention", "norm/rope/act/quant", "lm head", "embedding")
DEFAULT_PROMPT = "Explain in a few sentences why the sky is blue."
CHROME_DECODE_STEPS = 4
SUM_TOLERANCE = 0.05
OVERHEAD_LIMIT = 0.03
now = time.monotonic_ns


# ---- what each op of a plan does ---------------------------------------------------------------------

@dataclass
class OpInfo:
    index: int
    kind: str  # OP_* name without the prefix
    op_class: int
    layer: int | None  # None: outside the transformer blocks (embedding, final norm, lm head)
    weight_bytes: int  # packed matrix bytes the op streams per call (a split head: its first pass)
    chunks: int  # chunks the op is split into for one sequence's decode row (1: calling thread only)


def kind_names() -> dict[int, str]:
    from kiln import _native

    return {getattr(_native, n): n[3:] for n in dir(_native) if n.startswith("OP_")}


def packed_bytes(layout: dict) -> int:
    """Bytes of a packed matrix the kernels read: rows_padded / 4 tiles of tile_bytes."""
    return layout["tile_bytes"] * layout["rows_padded"] // 4


def describe(engine, nplan, position: int = 0) -> list[OpInfo]:
    """OpInfo for each op of a NativePlan, for a decode row at `position`. An op's layer is that of the
    weights it multiplies (QKV and attention carry it); a quantize op belongs to the op that consumes its
    output, a norm-add to the op whose output it finishes."""
    from kiln import _native

    names = kind_names()
    mats = {m.address: (name, packed_bytes(m.layout), m.layout) for name, m in engine.weights.mats.items()}
    experts = {id(table): name for name, table in engine.weights.expert_tables.items()}
    threads = engine.pool.threads
    infos = []
    for i, op in enumerate(nplan.ops):
        kind = names[op["kind"]]
        layer = op.get("layer")
        weight_bytes, tiles = 0, 0
        for key in ("w", "w2", "wq", "wk", "wv"):
            if op.get(key) in mats:
                name, nbytes, layout = mats[op[key]]
                weight_bytes += nbytes
                tiles = layout["rows_padded"] // 4
                m = re.match(r"blk\.(\d+)\.", name)
                if layer is None and m and op["op_class"] not in (_native.OPC_HEAD, _native.OPC_EMBED):
                    layer = int(m[1])
        if kind == "MOE":
            # a decode row reads the router, its n_used experts and the shared expert (w: the router)
            for key in ("exp_gate", "exp_up", "exp_down"):
                weight_bytes += op["n_used"] * packed_bytes(engine.weights.matrix(experts[id(op[key])]).layout)
            for key in ("sh_gate", "sh_up", "sh_down", "sh_scale"):
                if op.get(key) in mats:
                    weight_bytes += mats[op[key]][1]
            parts = -(-op["ff"] // (4 * op["chunk_tiles"]))
            chunks = op["n_used"] * parts + (-(-op.get("shared_ff", 0) // (4 * op["chunk_tiles"])))
        elif kind in ("MATMUL", "GLU", "LOGITS"):
            chunks = -(-tiles // op["chunk_tiles"])
        elif kind == "QKV":
            chunks = _native.qkv_chunks(op["n_heads"] + 2 * op["n_kv_heads"], op["chunk_heads"])
        elif kind == "ATTN":
            first = max(0, position - op["window"] + 1) if op["window"] > 0 else 0
            chunks = op["n_kv_heads"] * (position // _native.ATTN_SPAN - first // _native.ATTN_SPAN + 1)  # heads x parts
        else:
            chunks = 1
        if threads == 1 or chunks > _native.POOL_MAX_CHUNKS:
            chunks = 1
        infos.append(OpInfo(i, kind, op["op_class"], layer, weight_bytes, chunks))
    for i in reversed(range(len(infos) - 1)):
        if infos[i].layer is None and infos[i].kind in ("QUANT", "NORM_QUANT") and infos[i].op_class == _native.OPC_NORM:
            infos[i].layer = infos[i + 1].layer
    for i in range(1, len(infos)):
        if infos[i].layer is None and infos[i].kind == "NORM_ADD":
            infos[i].layer = infos[i - 1].layer
    return infos


def _attention_ops(nplan) -> list[dict]:
    from kiln import _native

    return [op for op in nplan.ops if op["kind"] == _native.OP_ATTN]


def kv_read_bytes(nplan, position: int) -> int:
    """Keys and values (in the cache's type) one decode row at `position` attends to: from the window's
    start (or 0) to its own position, for every attention op — the logical amount; the kernel may load a
    few keys more to fill its vectors."""
    total = 0
    for op in _attention_ops(nplan):
        first = max(0, position - op["window"] + 1) if op["window"] > 0 else 0
        total += 2 * op["n_kv_heads"] * _kv_bytes(op, position + 1 - first)
    return total


def _kv_bytes(op: dict, positions: int) -> int:
    from kiln.engine.kv import KV_CACHE_TYPES, kv_head_bytes

    return kv_head_bytes(KV_CACHE_TYPES[op.get("kv_type", 0)], positions, op["head_dim"])


def kv_write_bytes(nplan) -> int:
    """The key and value of one row (in the cache's type), stored by every layer's QKV op."""
    return sum(2 * op["n_kv_heads"] * _kv_bytes(op, 1) for op in _attention_ops(nplan))


def state_bytes(nplan) -> tuple[int, int]:
    """fp32 recurrent state one decode row reads (the inputs before its own that each convolution's taps
    reach, and a DeltaNet's matrices) and writes (its own input, and the matrices), summed over the
    recurrent ops: the same at any position."""
    from kiln import _native

    ops = [op for op in nplan.ops if op["kind"] in (_native.OP_SHORTCONV, _native.OP_DELTANET)]
    matrices = sum(4 * op["dn_v_heads"] * op["dn_k_dim"] * op["dn_v_dim"] for op in ops
                   if op["kind"] == _native.OP_DELTANET)
    return (sum(4 * (op["conv_len"] - 1) * op["cols"] for op in ops) + matrices,
            sum(4 * op["cols"] for op in ops) + matrices)


def dispatch_figures(engine, position: int = 0) -> dict:
    """Per decode token of one sequence at `position`: ops, parallel regions and bytes, from the decode plan."""
    nplan = engine.decode_plan
    infos = describe(engine, nplan, position)
    embed = sum(op["table_row_bytes"] for op in nplan.ops if "table_row_bytes" in op)
    return {"ops_per_call": nplan.plan.n_ops, "parallel_regions_per_call": sum(i.chunks > 1 for i in infos),
            "weight_bytes": sum(i.weight_bytes for i in infos), "embedding_row_bytes": embed,
            "kv_write_bytes": kv_write_bytes(nplan), "state_read_bytes": state_bytes(nplan)[0],
            "state_write_bytes": state_bytes(nplan)[1]}


# ---- per-op timers ------------------------------------------------------------------------------------

def plans(engine) -> list:
    return [engine.decode_plan, engine.prefill_plan]


def set_tracing(engine, on: bool) -> None:
    """Switch the executor's per-op timers on or off; either way their totals restart from zero."""
    for p in plans(engine):
        p.plan.set_trace(on)


def snapshot(engine) -> list[tuple[np.ndarray, np.ndarray, int]]:
    out = []
    for p in plans(engine):
        ns, wait, runs = p.plan.trace()
        out.append((np.frombuffer(ns, np.int64).copy(), np.frombuffer(wait, np.int64).copy(), runs))
    return out


class Profile:
    """The executor's per-op totals, summed over requests, for every plan of one engine."""

    def __init__(self, engine):
        self.infos = [describe(engine, p) for p in plans(engine)]
        self.op_ns = [np.zeros(len(i), np.int64) for i in self.infos]
        self.wait_ns = [np.zeros(len(i), np.int64) for i in self.infos]
        self.runs = [0] * len(self.infos)

    def add(self, snap) -> None:
        for k, (ns, wait, runs) in enumerate(snap):
            self.op_ns[k] += ns
            self.wait_ns[k] += wait
            self.runs[k] += runs

    def group(self, key) -> dict:
        """{key(info): [op ns, wait ns]} over every op of every plan."""
        out: dict = {}
        for infos, ns, wait in zip(self.infos, self.op_ns, self.wait_ns):
            for info, a, b in zip(infos, ns, wait):
                acc = out.setdefault(key(info), [0, 0])
                acc[0] += int(a)
                acc[1] += int(b)
        return out

    @property
    def total_ns(self) -> int:
        return int(sum(ns.sum() for ns in self.op_ns))

    @property
    def wait_total_ns(self) -> int:
        return int(sum(w.sum() for w in self.wait_ns))

    @property
    def ops_run(self) -> int:
        """Ops the executor ran, from its count of runs of each plan while timed."""
        return sum(r * len(i) for r, i in zip(self.runs, self.infos))

    @property
    def matrix_ns(self) -> int:
        """Time in the ops that stream weight matrices (projections, FFN, lm head)."""
        g = self.group(lambda i: i.weight_bytes > 0)
        return g.get(True, [0, 0])[0]


# ---- requests -----------------------------------------------------------------------------------------

@dataclass
class Request:
    """One request's clock marks (monotonic ns) and the engine's counters around its native calls.
    Decode tokens alternate between traced ones (clock reads between the calls, per-op timers on) and
    plain ones (one clock read, per-op timers off); per-token lists hold None for plain tokens."""

    prompt_tokens: int = 0
    marks: dict = field(default_factory=dict)  # template, tokenize, setup, prefill, sample, detok: (start, end)
    prefill_native_ns: int = 0
    prefill_calls: int = 0
    token_start: list = field(default_factory=list)  # after the bookkeeping that follows the previous token
    token_end: list = field(default_factory=list)
    traced: list = field(default_factory=list)
    forward: list = field(default_factory=list)  # (start, end) of engine.forward
    sample_end: list = field(default_factory=list)
    native_ns: list = field(default_factory=list)
    calls: list = field(default_factory=list)
    readout_ns: int = 0  # switching the op timers and reading them between tokens, outside every token's time
    prefill_ops: list | None = None
    decode_ops: list | None = None

    @property
    def ttft_ns(self) -> int:
        return self.marks["detok"][1] - self.marks["template"][0]

    @property
    def token_wall(self) -> np.ndarray:
        return np.subtract(self.token_end, self.token_start)

    def traced_tokens(self) -> list[int]:
        return [i for i, t in enumerate(self.traced) if t]


def _sequence(model, ids, params, n_decode):
    from kiln.engine.request import GenerationRequest, prepare

    # no stops: every request decodes exactly n_decode tokens, so all do the same work
    request = GenerationRequest(prompt=ids, sampling=asdict(params), max_tokens=n_decode + 1, ignore_eos=True)
    return prepare(model, request)[0]


def traced_request(model, messages, params, n_decode: int, trace_first: bool | None = True) -> Request:
    """A request through the calls `kiln run` makes, with clock reads between them and the executor's
    per-op timers on for the whole prefill. Decode tokens are traced in turn — the first, third, ...
    (`trace_first`) or the second, fourth, ...; None: all — so that each traced token has untraced
    neighbours run under the same conditions: the tracer's overhead control. The op timers are
    switched and read between tokens; that readout is timed but lies outside every token's time."""
    engine, tok, stats = model.engine, model.tokenizer, model.engine.stats
    dplan = engine.decode_plan.plan
    r = Request()
    set_tracing(engine, True)
    t0 = now()
    text = tok.apply_chat_template(messages)
    t1 = now()
    ids = tok.encode(text)
    t2 = now()
    seq = _sequence(model, ids, params, n_decode)
    n0, c0 = stats.native_ns, stats.steps
    t3 = now()
    logits = engine.forward(ids, 0, 0)
    t4 = now()
    r.prefill_native_ns, r.prefill_calls = stats.native_ns - n0, stats.steps - c0
    token = seq.sample(logits)
    t5 = now()
    seq.append(token)
    t6 = now()
    r.prompt_tokens = len(ids)
    r.marks = {"template": (t0, t1), "tokenize": (t1, t2), "setup": (t2, t3), "prefill": (t3, t4),
               "sample": (t4, t5), "detok": (t5, t6)}
    r.prefill_ops = snapshot(engine)
    set_tracing(engine, False)
    decode_ops = [(np.zeros_like(ns), np.zeros_like(wait), 0) for ns, wait, _ in r.prefill_ops]
    position = len(ids)
    for i in range(n_decode):
        traced = trace_first is None or (i % 2 == 0) == trace_first
        b0 = now()
        dplan.set_trace(traced)
        prev = now()
        r.readout_ns += prev - b0
        if traced:
            n0, c0 = stats.native_ns, stats.steps
            a = now()
            logits = engine.forward([token], 0, position)
            b = now()
            token = seq.sample(logits)
            c = now()
            seq.append(token)
            d = now()
            r.forward.append((a, b))
            r.sample_end.append(c)
            r.native_ns.append(stats.native_ns - n0)
            r.calls.append(stats.steps - c0)
            ns, wait, runs = dplan.trace()
            ns0, wait0, runs0 = decode_ops[0]
            decode_ops[0] = (ns0 + np.frombuffer(ns, np.int64), wait0 + np.frombuffer(wait, np.int64), runs0 + runs)
            r.readout_ns += now() - d
        else:
            token = seq.sample(engine.forward([token], 0, position))
            seq.append(token)
            d = now()
            for lst in (r.forward, r.sample_end, r.native_ns, r.calls):
                lst.append(None)
        r.token_start.append(prev)
        r.token_end.append(d)
        r.traced.append(traced)
        position += 1
    dplan.set_trace(False)
    r.decode_ops = decode_ops
    if decode_ops[0][2] != sum(r.traced):
        raise KilnError(f"the trace expected one decode-plan run per traced token ({sum(r.traced)}) and the "
                        f"executor timed {decode_ops[0][2]}: the engine no longer decodes a token in one step")
    return r


def overhead_ratios(r: Request) -> list[float]:
    """For each traced token between two untraced ones: its wall time over the mean of theirs (the
    neighbours' positions straddle its own, so the growing KV cache cancels out)."""
    wall, t = r.token_wall, r.traced
    return [float(wall[i] / ((wall[i - 1] + wall[i + 1]) / 2)) for i in range(1, len(wall) - 1)
            if t[i] and not t[i - 1] and not t[i + 1]]


# ---- the Chrome / Perfetto trace ------------------------------------------------------------------------

class StepRecorder:
    """Wraps one engine's `step` for a request, keeping every native call's op timeline (start and end
    of each op from the executor, and each op's barrier wait from the difference of its totals)."""

    def __init__(self, engine):
        self.engine = engine
        self.calls: list[dict] = []
        self.infos = {id(p): describe(engine, p) for p in plans(engine)}

    def __enter__(self):
        inner = self.engine.step

        def step(tokens, slots, positions, out_rows):
            before = [(p, p.plan.trace()) for p in plans(self.engine)]
            t0 = now()
            out = inner(tokens, slots, positions, out_rows)
            t1 = now()
            for p, (_, wait0, runs0) in before:
                _, wait1, runs1 = p.plan.trace()
                if runs1 > runs0:
                    starts, ends = p.plan.timeline()
                    self.calls.append({"start": t0, "end": t1, "rows": len(tokens), "infos": self.infos[id(p)],
                                       "op_start": np.frombuffer(starts, np.int64).copy(),
                                       "op_end": np.frombuffer(ends, np.int64).copy(),
                                       "op_wait": np.frombuffer(wait1, np.int64) - np.frombuffer(wait0, np.int64)})
            return out

        self.engine.step = step
        return self

    def __exit__(self, *exc):
        del self.engine.step  # the class's method again


def chrome_trace(model, messages, params, n_decode: int) -> dict:
    """A traced request with per-op slices of the prefill and the first decode steps, in the Trace Event
    Format (chrome://tracing, ui.perfetto.dev). Everything runs on the calling thread; the op slices
    nest inside the engine.step slice of their native call, a barrier wait at the end of its op."""
    with StepRecorder(model.engine) as rec:
        r = traced_request(model, messages, params, n_decode, trace_first=None)
    origin = r.marks["template"][0]
    events = [{"ph": "M", "pid": 1, "tid": 1, "name": "process_name", "args": {"name": f"kiln trace {model.tag}"}},
              {"ph": "M", "pid": 1, "tid": 1, "name": "thread_name",
               "args": {"name": "calling thread: python and the executor's op loop"}}]

    def slice_(name, start, end, cat, **args):
        # whole ns in µs, so a viewer's conversion back to ns keeps adjacent slices adjacent
        events.append({"ph": "X", "pid": 1, "tid": 1, "name": name, "cat": cat, "ts": round((start - origin) / 1e3, 3),
                       "dur": round((end - start) / 1e3, 3), **({"args": args} if args else {})})

    slice_("request", origin, r.token_end[-1] if r.token_end else r.marks["detok"][1], "host",
           prompt_tokens=r.prompt_tokens, decode_tokens=n_decode)
    labels = {"template": "chat template", "tokenize": "tokenize", "setup": "sequence setup",
              "prefill": "prefill: engine.forward", "sample": "first sample", "detok": "detokenize"}
    for key, (a, b) in r.marks.items():
        slice_(labels[key], a, b, "host")
    for i, (fwd, c, d) in enumerate(zip(r.forward, r.sample_end, r.token_end)):
        a, b = fwd
        slice_(f"decode token {i + 1}: engine.forward", a, b, "host")
        slice_("sample", b, c, "host")
        slice_("detokenize", c, d, "host")
    for call in rec.calls:
        slice_("engine.step", call["start"], call["end"], "host", rows=call["rows"])
        for info, a, b, wait in zip(call["infos"], call["op_start"], call["op_end"], call["op_wait"]):
            name = info.kind + (f" L{info.layer}" if info.layer is not None else "")
            slice_(name, int(a), int(b), CLASSES[info.op_class], op=info.index, layer=info.layer,
                   weight_bytes=info.weight_bytes, barrier_wait_us=int(wait) / 1e3)
            if wait > 0:
                slice_("barrier wait", int(b) - int(wait), int(b), "wait")
    return {"traceEvents": events, "displayTimeUnit": "ns",
            "otherData": {"model": model.tag, "clock": "CLOCK_MONOTONIC", "decode_steps": n_decode}}


# ---- the whole measurement ---------------------------------------------------------------------------------

def _ms(ns) -> float:
    return float(ns) / 1e6


def _load(ref, n_ctx, threads):
    from kiln.engine.model import load

    t0 = now()
    model = load(ref, backend="native", n_ctx=n_ctx, threads=threads, progress=False)
    wall = now() - t0
    engine = model.engine
    return model, {"wall_ms": _ms(wall), "engine_ms": engine.load_ms,
                   "gguf_tokenizer_store_ms": _ms(wall) - engine.load_ms,
                   "weights": "read from the repack cache" if engine.weights.from_cache else "repacked from the GGUF",
                   "packed_bytes": engine.weights.nbytes}


def _native_parts(profile: Profile, native_ns: int) -> dict:
    """Native time split: compute per op class (op time less its barrier wait), the barrier waits, and
    the executor's own time outside ops (what the call timer has beyond the op timers)."""
    by_class = profile.group(lambda i: i.op_class)
    parts = {f"native {CLASSES[c]}": by_class.get(c, [0, 0])[0] - by_class.get(c, [0, 0])[1]
             for c in range(len(CLASSES))}
    parts["native barrier wait"] = profile.wait_total_ns
    parts["native executor outside ops"] = native_ns - profile.total_ns
    return parts


def ttft_parts(r: Request, profile: Profile, load_ms: float | None) -> dict:
    """ms per part; `profile` holds this request's prefill only."""
    m = {k: b - a for k, (a, b) in r.marks.items()}
    parts = {}
    if load_ms is not None:
        parts["model load"] = load_ms * 1e6
    parts.update({"chat template": m["template"], "tokenize": m["tokenize"], "queue wait": 0,
                  "sequence setup": m["setup"],
                  "prefill host (python around native calls)": m["prefill"] - r.prefill_native_ns})
    parts.update(_native_parts(profile, r.prefill_native_ns))
    parts.update({"first sample": m["sample"], "detokenize": m["detok"]})
    wall = r.ttft_ns + (load_ms * 1e6 if load_ms is not None else 0)
    covered = sum(parts.values())
    return {"parts_ms": {k: _ms(v) for k, v in parts.items()}, "wall_ms": _ms(wall), "sum_ms": _ms(covered),
            "unaccounted_ms": _ms(wall - covered), "prompt_tokens": r.prompt_tokens,
            "ops_cover_native_pct": 100.0 * profile.total_ns / r.prefill_native_ns,
            "prefill_native_calls": r.prefill_calls}


def _profile_of(engine, reqs, phase: str) -> Profile:
    p = Profile(engine)
    for r in reqs:
        p.add(getattr(r, phase))
    return p


def expert_load(rows: dict[int, np.ndarray] | None) -> dict | None:
    """How the measured requests' rows (prefill and decode) spread over each MOE layer's experts: the rows
    each expert got, and the busiest expert's share over an even spread's."""
    if not rows:
        return None
    layers = {layer: counts.tolist() for layer, counts in sorted(rows.items())}
    imbalance = {layer: float(c.max() / c.mean()) if c.sum() else 0.0 for layer, c in sorted(rows.items())}
    return {"rows_per_expert": layers, "busiest_over_mean": imbalance,
            "busiest_over_mean_max": max(imbalance.values())}


def decode_report(engine, reqs: list[Request], profile: Profile, read_gb_s: float) -> dict:
    """Per traced decode token: the parts of its wall time, where the native time went, what it read."""
    idx = [(r, i) for r in reqs for i in r.traced_tokens()]
    tokens = len(idx)
    wall = np.array([r.token_end[i] - r.token_start[i] for r, i in idx])
    fwd = sum(r.forward[i][1] - r.forward[i][0] for r, i in idx)
    native = sum(r.native_ns[i] for r, i in idx)
    sample = sum(r.sample_end[i] - r.forward[i][1] for r, i in idx)
    detok = sum(r.token_end[i] - r.sample_end[i] for r, i in idx)
    parts = {"host (python around the native call)": fwd - native}
    parts.update(_native_parts(profile, native))
    parts.update({"sampling": sample, "detokenize + bookkeeping (Sequence.append)": detok})
    covered = sum(parts.values())
    total = int(wall.sum())
    per_token = {k: _ms(v) / tokens for k, v in parts.items()}
    per_token["unaccounted (loop, clock reads)"] = _ms(total - covered) / tokens
    calls = sum(r.calls[i] for r, i in idx) / tokens
    untraced = sum(len(r.token_end) for r in reqs) - tokens
    nplan = engine.decode_plan
    positions = [r.prompt_tokens + i for r, i in idx]
    d = dispatch_figures(engine, max(positions))
    kv_read = statistics.fmean(kv_read_bytes(nplan, p) for p in positions)
    bytes_token = d["weight_bytes"] + d["embedding_row_bytes"] + kv_read + d["state_read_bytes"]
    mean_wall_s = total / tokens / 1e9
    layers = profile.group(lambda i: (i.layer, i.op_class))
    n_layers = engine.config.n_layers
    by_layer = []
    for layer in range(n_layers):  # as the parts above: each class less its barrier wait, then the waits
        ns = [layers.get((layer, c), [0, 0]) for c in range(3)]
        row = {"layer": layer, **{CLASSES[c]: _ms(ns[c][0] - ns[c][1]) / tokens for c in range(3)},
               "barrier wait": _ms(sum(w for _, w in ns)) / tokens, "total": _ms(sum(t for t, _ in ns)) / tokens}
        by_layer.append(row)
    matrix_ms = _ms(profile.matrix_ns) / tokens
    return {
        "tokens": tokens,
        "requests": len(reqs),
        "untraced_tokens": untraced,
        "start_position": reqs[0].prompt_tokens,
        "wall_ms_per_token": {"median": _ms(np.median(wall)), "mean": _ms(total) / tokens,
                              "p90": _ms(np.percentile(wall, 90))},
        "tokens_per_s_median": 1e9 / float(np.median(wall)),
        "parts_ms_per_token": per_token,
        "parts_cover_pct": 100.0 * covered / total,
        "ops_cover_native_pct": 100.0 * profile.total_ns / native if native else 0.0,
        "native_ms_by_layer": by_layer,
        "readout_ms_per_token": _ms(sum(r.readout_ns for r in reqs)) / tokens,
        "native_calls_per_token": calls,
        "ops_per_token": calls * d["ops_per_call"],
        "ops_per_call": d["ops_per_call"],
        "ops_run_per_token": profile.ops_run / tokens,
        "parallel_regions_per_token": calls * d["parallel_regions_per_call"],
        "bytes_per_token": {"weights": d["weight_bytes"], "embedding_row": d["embedding_row_bytes"],
                            "kv_read_mean": kv_read, "kv_mean_position": statistics.fmean(positions),
                            "kv_write": d["kv_write_bytes"], "state_read": d["state_read_bytes"],
                            "state_write": d["state_write_bytes"], "total": bytes_token},
        "gb_per_s": {"effective": bytes_token / mean_wall_s / 1e9,
                     "matrix_ops": d["weight_bytes"] / (matrix_ms / 1e3) / 1e9 if matrix_ms else 0.0},
        "pct_of_read_bandwidth": {"effective": 100 * bytes_token / mean_wall_s / 1e9 / read_gb_s,
                                  "matrix_ops": 100 * d["weight_bytes"] / (matrix_ms / 1e3) / 1e9 / read_gb_s
                                  if matrix_ms else 0.0},
    }


def phase_profile(profile: Profile, units: int) -> dict:
    """Native ms per op class (per `units`: prefill requests or decode tokens) and shares of op time."""
    g = profile.group(lambda i: i.op_class)
    total = profile.total_ns or 1
    return {"by_class_ms": {CLASSES[c]: _ms(v[0]) / units for c, v in sorted(g.items())},
            "by_class_pct": {CLASSES[c]: 100.0 * v[0] / total for c, v in sorted(g.items())},
            "wait_pct": 100.0 * profile.wait_total_ns / total,
            "matrix_share_pct": 100.0 * profile.matrix_ns / total}


METHOD = {
    "load": "wall time of kiln.engine.model.load (store lookup, GGUF parse, tokenizer, engine); engine = "
            "NativeEngine's own timer (weights from the repack cache or repacked, KV cache, plan compile). Cold: "
            "the first load in this process; warm: a second load of the same model in the same process. The OS "
            "page cache is not dropped",
    "ttft": "clock reads (CLOCK_MONOTONIC) between the calls `kiln run` makes; native time from the engine's "
            "C-side timer around each native call; per-class native time from the executor's per-op timers; "
            "queue wait is 0 in-process (no scheduler; `kiln serve` reports queue_ms per request)",
    "decode": "per token from the end of the previous one: engine.forward, Sequence.sample, Sequence.append "
              "timed from Python; native time and barrier waits from the C executor (per-op timers: op time "
              "less the caller's wait at the op's closing barrier; executor outside ops: the call's time less "
              "the op timers). "
              "Means over all traced tokens, so the parts add up to the mean wall time",
    "bytes": "weights: packed bytes of every matrix a decode step multiplies (tile_bytes x rows_padded / 4 from "
             "each matrix's layout); embedding: one GGUF table row; KV: fp16 keys and values from position 0 "
             "(or the sliding window) to the token's own, for each attention op (the logical amount), averaged "
             "over the traced positions; recurrent state: fp32, what each convolution's taps read before the token's "
             "own input, and that input written. GB/s: those bytes over the mean wall time per token (effective) or over "
             "the time in matrix ops (matrix_ops)",
    "dispatch": "ops per token: native calls per token (engine.stats.steps) x ops in the decode plan; parallel "
                "regions: ops the executor hands to the pool with more than one chunk (one thread: none)",
    "overhead": "decode tokens alternate between traced (per-op timers on, clock reads between the calls) and "
                "plain (timers off, one clock read per token); for every traced token between two plain ones, its "
                "wall time over the mean of theirs. The overhead is the median of those ratios minus one. Requests "
                "alternate whether the first token is traced. Switching and reading the op timers between tokens "
                "(readout) exists only because of this interleaving; it is timed and reported, not counted",
}


def run(ref: str, prompt: str = DEFAULT_PROMPT, n_decode: int = 64, reps: int = 6, threads: int | None = None,
        n_ctx: int | None = None, chrome: bool = False, read_bytes: int | None = None,
        progress=None) -> tuple[dict, dict | None]:
    """Measure `ref`; return the report and, with `chrome`, a Trace Event Format document."""
    from kiln.engine import native
    from kiln.sampling import SamplingParams
    from kiln.machine import facts
    from kiln.store import Store
    from kiln.validate import ReadLoop

    if not native.available():
        raise KilnError("kiln trace measures the native engine, and kiln._native is not built; "
                        "build it with `python setup.py build_ext --inplace`")
    if n_decode < 3 or reps < 1:
        raise KilnError(f"need at least 3 decode tokens (traced ones between plain ones) and 1 request, "
                        f"got {n_decode} and {reps}")
    say = progress or (lambda msg: None)
    Store().ensure(ref)  # a pull (with its progress bar) is not part of any load time
    messages = [{"role": "user", "content": prompt}]

    say("cold load and the first request")
    model, cold = _load(ref, n_ctx, threads)
    params = SamplingParams().replace(**model.defaults).replace(seed=0)
    prompt_tokens = len(model.tokenizer.encode(model.tokenizer.apply_chat_template(messages)))
    if prompt_tokens + n_decode + 1 > model.n_ctx:
        raise KilnError(f"the prompt ({prompt_tokens} tokens) + {n_decode} decode tokens do not fit the context of "
                        f"{model.n_ctx}; pass a larger --ctx or fewer --tokens")
    first = traced_request(model, messages, params, n_decode)
    cold_start = ttft_parts(first, _profile_of(model.engine, [first], "prefill_ops"), cold["wall_ms"])
    model.close()
    del model, first
    gc.collect()

    say("warm load")
    model, warm = _load(ref, n_ctx, threads)
    engine = model.engine
    say("plain read bandwidth")
    read = ReadLoop(engine.threads, read_bytes)
    passes = [read.pass_gb_s() for _ in range(3)]
    traced_request(model, messages, params, n_decode)  # first touch of this engine's buffers, not measured
    reqs = []
    if engine.decode_plan.expert_counts:
        engine.expert_rows = {}
    for i in range(reps):
        say(f"request {i + 1} of {reps}")
        reqs.append(traced_request(model, messages, params, n_decode, trace_first=i % 2 == 0))
        passes.append(read.pass_gb_s())  # spread over the run, so it sees the machine the requests saw
    bw = read.figures(passes, "spread over the run: 3 before the requests, one after each")
    del read
    ratios = [x for r in reqs for x in overhead_ratios(r)]
    overhead = statistics.median(ratios) - 1

    by_ttft = sorted(reqs, key=lambda r: r.ttft_ns)
    median_req = by_ttft[(len(by_ttft) - 1) // 2]
    warm_ttft = ttft_parts(median_req, _profile_of(engine, [median_req], "prefill_ops"), None)
    prefill = _profile_of(engine, reqs, "prefill_ops")
    decode_prof = _profile_of(engine, reqs, "decode_ops")
    decode = decode_report(engine, reqs, decode_prof, bw["gb_s"])
    prefill_ms = [_ms(r.marks["prefill"][1] - r.marks["prefill"][0]) for r in reqs]
    plain = [r.token_wall[i] for r in reqs for i in range(len(r.traced)) if not r.traced[i]]
    covers = {"decode": decode["parts_cover_pct"],
              "ttft_warm": 100 * warm_ttft["sum_ms"] / warm_ttft["wall_ms"],
              "ttft_cold_start": 100 * cold_start["sum_ms"] / cold_start["wall_ms"]}
    ttfts = [_ms(r.ttft_ns) for r in reqs]
    experts, engine.expert_rows = expert_load(engine.expert_rows), None
    report = {
        "object": "kiln_trace",
        "model": model.tag, "model_sha256": model.sha256, "architecture": model.config.architecture,
        "threads": engine.threads, "n_ctx": model.n_ctx, "prompt": prompt, "prompt_tokens": prompt_tokens,
        "decode_tokens_per_request": n_decode, "requests": reps, "sampling": asdict(params),
        "machine": facts(),
        "load": {"cold": cold, "warm": warm},
        "ttft": {"cold_start": cold_start, "warm_median": warm_ttft,
                 "warm_ttft_ms": {"median": statistics.median(ttfts), "min": min(ttfts), "max": max(ttfts)}},
        "prefill": {"tokens": prompt_tokens, "wall_ms_median": statistics.median(prefill_ms),
                    "tokens_per_s_median": prompt_tokens / statistics.median(prefill_ms) * 1e3,
                    **phase_profile(prefill, len(reqs))},
        "decode": decode,
        "decode_profile": phase_profile(decode_prof, decode["tokens"]),
        **({"experts": experts} if experts else {}),
        "read_bandwidth": bw,
        "overhead": {"pct": 100 * overhead, "ratios": len(ratios),
                     "ratio_p10_p90": [float(np.percentile(ratios, 10)), float(np.percentile(ratios, 90))],
                     "plain_ms_per_token_median": _ms(np.median(plain)),
                     "traced_ms_per_token_median": decode["wall_ms_per_token"]["median"]},
        "checks": {"parts_cover_pct": covers,
                   "parts_within_5pct": all(abs(v - 100) <= 100 * SUM_TOLERANCE for v in covers.values()),
                   "tracer_overhead_pct": 100 * overhead, "tracer_overhead_below_3pct": overhead < OVERHEAD_LIMIT},
        "method": METHOD,
    }
    events = None
    if chrome:
        say("a request for the Chrome trace")
        events = chrome_trace(model, messages, params, min(CHROME_DECODE_STEPS, n_decode))
    model.close()
    return report, events
