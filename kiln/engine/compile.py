"""From a family's graph to a native plan.

The family's forward pass runs once against `Recorder`, which returns symbolic nodes instead of
arrays. `Lowering` then walks that small graph and emits the fused ops the C executor knows:

    rmsnorm → linear            NORM_QUANT (normalize and quantize the activations once)
    linear q/k/v → [qk-norm] → [rope] → attention
                                QKV (projections, per-head or whole-projection norm and rope, KV cache
                                store) + ATTN
    add(x, linear(h), scale)    MATMUL with the bias, the (scaled) product and the residual added as it is stored
    activation(linear(h))       MATMUL with the bias and the activation applied as it is stored (GELU MLPs)
    layernorm → linear          NORM_QUANT with the mean subtracted and the norm's bias added
    add(x, rmsnorm(linear(h)))  MATMUL + NORM_ADD (Gemma's post-norms)
    glu(h, gate, up)            GLU (both projections and the activation in one pass)
    delta_net(qkv, z, a, b)     MATMULs (no residual) + DELTANET over the slot's rings and matrices
    gate(attention, linear(h))  GATE (the attention's sigmoid output gate), then the output projection
    add(x, moe(h))              MOE (routing, the chosen experts' GLUs and down projections with their
                                biases, a shared expert, the weighted sum and the residual: csrc/op_moe.c)
    logits(rmsnorm(x))          NORM_QUANT of the rows that need logits + LOGITS (soft-capped last)

Buffers are symbolic until every op is emitted; then they get arena offsets, reused once dead. Each op's
scratch is C's to size (csrc/ops.h: every op family says what it needs).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from kiln.models.base import Rope


@dataclass(eq=False)
class Node:
    kind: str
    inputs: tuple = ()
    params: dict = field(default_factory=dict)


class Recorder:
    """`Ops` that records the graph instead of computing it."""

    def embed(self, table, scale=1.0):
        return Node("embed", (), {"table": table, "scale": scale})

    def rmsnorm(self, x, weight, eps, heads=1):
        return Node("rmsnorm", (x,), {"weight": weight, "eps": eps, "heads": heads})

    def linear(self, x, weight, bias=None):
        return Node("linear", (x,), {"weight": weight, "bias": bias})

    def rope(self, x, rope, heads):
        return Node("rope", (x,), {"rope": rope, "heads": heads})

    def attention(self, layer, q, k, v, attn):
        return Node("attention", (q, k, v), {"layer": layer, "attn": attn})

    def glu(self, x, gate, up, act, gate_bias=None, up_bias=None):
        return Node("glu", (x,), {"gate": gate, "up": up, "act": act, "gate_bias": gate_bias, "up_bias": up_bias})

    def layernorm(self, x, weight, bias, eps):
        return Node("layernorm", (x,), {"weight": weight, "bias": bias, "eps": eps})

    def activation(self, x, act):
        return Node("activation", (x,), {"act": act})

    def add(self, a, b, scale=1.0):
        return Node("add", (a, b), {"scale": scale})

    def logits(self, x, weight, bias=None, scale=1.0, softcap=0.0):
        return Node("logits", (x,), {"weight": weight, "bias": bias, "scale": scale, "softcap": softcap})

    def shortconv(self, layer, bcx, weight, conv):
        return Node("shortconv", (bcx,), {"layer": layer, "weight": weight, "conv": conv})

    def moe(self, x, experts):
        return Node("moe", (x,), {"experts": experts})

    def delta_net(self, layer, qkv, z, alpha, beta, weights, net):
        return Node("delta_net", (qkv, z, alpha, beta), {"layer": layer, "weights": weights, "net": net})

    def gate(self, x, gate):
        return Node("gate", (x, gate))


@dataclass(eq=False)
class Buf:
    """A symbolic buffer; `offset` is assigned after all ops are emitted."""

    nbytes: int
    offset: int = -1


class CompileError(Exception):
    """The graph uses a pattern the native executor has no op for (a kiln bug, not a user error)."""


class Lowering:
    """Emits op dicts (field name → value) for a recorded graph. `weights` resolves tensor names:
    `matrix(name)` → packed matrix (has .address, .layout), `vector(name)` → float32 array."""

    def __init__(self, native, weights, config, rows: int, out_rows: int, n_ctx: int, threads: int, kv, ropes,
                 negate_layer: int | None = None, state=None, kv_type: int = 0):
        """`state(layer)`: a recurrent layer's rings (float32, [slots][ring][width]), ring length and, for a
        DeltaNet, its matrices (float32, [slots][v heads * k_dim * v_dim]; else None).
        `kv_type`: the KV cache's layout, an index into kiln.engine.kv.KV_CACHE_TYPES."""
        self.kv_type = kv_type
        self.n, self.weights, self.cfg, self.rows, self.out_rows = native, weights, config, rows, out_rows
        self.state = state
        self.n_ctx, self.threads, self.kv, self.ropes = n_ctx, threads, kv, ropes
        self.negate_layer = negate_layer
        self.residuals: list[Buf] = []  # the residual stream after every add, for per-layer diagnosis
        self.ops: list[dict] = []
        self.values: dict[Node, Buf] = {}
        self.acts: dict[Node, dict[int, Buf]] = {}
        self.consumers: dict[Node, set[int]] = {}  # node → weight formats that read it
        self.logits: Buf | None = None
        self.hidden: Buf | None = None  # the final norm's output for the rows with logits (embeddings)
        # Inputs whose int8 quantization costs the most accuracy (those of the q/k/v projections, of the
        # down projection after the GLU, and of the output head) get precise two-row activations:
        # see csrc/ops.h.
        self.precise: set[Node] = set()

    # ---- public ----------------------------------------------------------------------------------
    def lower(self, root: Node) -> None:
        self._note_consumers(root, set())
        if root.kind != "logits":
            raise CompileError(f"a graph must end in logits, not {root.kind}")
        self._logits(root)

    # ---- analysis --------------------------------------------------------------------------------
    def _fmt(self, name: str) -> int:
        return self.weights.matrix(name).layout["fmt"]

    def _note_consumers(self, node: Node, seen: set) -> None:
        if id(node) in seen:
            return
        seen.add(id(node))
        reads = {"linear": ["weight"], "glu": ["gate", "up"], "logits": ["weight"]}.get(node.kind, [])
        for key in reads:
            self.consumers.setdefault(node.inputs[0], set()).add(self._fmt(node.params[key]))
        if node.kind == "moe":
            e = node.params["experts"]
            for name in (e.router, e.gate, e.up, e.shared_gate, e.shared_up, e.shared_scale):
                if name is not None:
                    self.consumers.setdefault(node.inputs[0], set()).add(self._fmt(name))
        if node.kind == "logits" or (node.kind == "linear" and node.inputs[0].kind in ("glu", "activation")):
            self.precise.add(node.inputs[0])
        if node.kind == "attention":  # the input of the q, k and v projections
            self.precise.add(self._projection(node.inputs[2])[0].inputs[0])
        for child in node.inputs:
            self._note_consumers(child, seen)

    def _layouts(self, fmts) -> dict[int, int]:
        """Activation layouts (kind → a format that reads it): formats of one kind share a buffer."""
        kinds: dict[int, int] = {}
        for fmt in sorted(fmts):
            kinds.setdefault(self.n.act_kind(fmt), fmt)
        return kinds

    # ---- buffers ---------------------------------------------------------------------------------
    def _floats(self, width: int, rows: int | None = None) -> Buf:
        return Buf(4 * width * (rows or self.rows))

    def _emit(self, **op) -> dict:
        self.ops.append(op)
        return op

    def _chunk_tiles(self, wmat) -> int:
        # a quarter of a thread's share, however many bytes: each chunk a worker claims starts a new stream
        # of weights for the prefetcher (docs/PERF.md, "Chunks of a quarter of a thread's share")
        tiles = max(1, -(-(wmat.layout["rows_padded"] // 4) // (4 * self.threads)))
        # the AMX prefill multiplies 32 rows (8 tiles) at a time: a chunk of whole such pairs wastes none
        return tiles // 8 * 8 if tiles >= 8 else tiles

    # ---- values and activations --------------------------------------------------------------------
    def value(self, node: Node) -> Buf:
        if node not in self.values:
            lower = getattr(self, f"_value_{node.kind}", None)
            if lower is None:
                raise CompileError(f"no native op computes a standalone {node.kind}")
            self.values[node] = lower(node)
        return self.values[node]

    def act(self, node: Node) -> dict[int, tuple[int, Buf]]:
        """Quantized copies of `node`'s value, one per activation layout its consumers read."""
        if node not in self.acts:
            width = self._width(node)
            rows = 2 * self.rows if node in self.precise else self.rows
            bufs = {kind: (fmt, Buf(self.n.act_size(fmt, width, rows)))
                    for kind, fmt in self._layouts(self.consumers.get(node, ())).items()}
            fields = self._act_fields(bufs, width)
            fields["precise"] = int(node in self.precise)
            if (node.kind == "rmsnorm" and node.params["heads"] == 1) or node.kind == "layernorm":
                self._emit(kind=self.n.OP_NORM_QUANT, op_class=self.n.OPC_NORM, **fields, in_=self.value(node.inputs[0]),
                           out=self._floats(width), **self._norm_fields(node))
            else:
                self._emit(kind=self.n.OP_QUANT, op_class=self.n.OPC_NORM, **fields, in_=self.value(node))
            self.acts[node] = bufs
        return self.acts[node]

    def _norm_fields(self, norm: Node) -> dict:
        """A NORM_QUANT's norm: RMSNorm, or LayerNorm (mean subtracted, bias added)."""
        fields = {"norm_w": self.weights.vector(norm.params["weight"]), "eps": norm.params["eps"]}
        if norm.kind == "layernorm":
            fields.update(layer_norm=1, norm_b=self.weights.vector(norm.params["bias"]))
        return fields

    def _bias(self, name: str | None):
        return None if name is None else self.weights.vector(name)

    def _act_fields(self, bufs: dict[int, tuple[int, Buf]], width: int) -> dict:
        fields: dict[str, Any] = {"n_act": len(bufs), "cols": width}
        for i, (fmt, buf) in enumerate(bufs.values()):
            fields[f"act_fmt[{i}]"] = fmt
            fields[f"act[{i}]"] = buf
        return fields

    def _act_index(self, node: Node, weight: str) -> tuple[dict, int]:
        bufs = self.act(node)
        return bufs, list(bufs).index(self.n.act_kind(self._fmt(weight)))

    def _width(self, node: Node) -> int:
        c = self.cfg
        if node.kind in ("embed", "add", "moe"):
            return c.dim
        if node.kind in ("rmsnorm", "layernorm", "activation", "gate"):
            return self._width(node.inputs[0])
        if node.kind == "glu":
            return self.weights.matrix(node.params["gate"]).layout["rows"]
        if node.kind == "attention":
            a = node.params["attn"]
            return a.n_heads * a.head_dim
        if node.kind == "linear":
            return self.weights.matrix(node.params["weight"]).layout["rows"]
        if node.kind == "shortconv":
            return node.params["conv"].width
        if node.kind == "delta_net":
            net = node.params["net"]
            return net.n_v_heads * net.v_dim
        raise CompileError(f"width of {node.kind} is unknown")

    # ---- lowering rules ------------------------------------------------------------------------------
    def _value_embed(self, node: Node) -> Buf:
        out = self._floats(self.cfg.dim)
        name = node.params["table"]
        if self.weights.has_matrix(name):  # tied to the output head: its packed rows, already in memory
            ggml_type, row_bytes = self.weights.row_format(name)
            lo = self.weights.remainder(name)
            source = {"table_w": self.weights.matrix(name).address, "table_w2": lo.address if lo else None,
                      "table_fd": -1, "table_type": ggml_type, "table_row_bytes": row_bytes,
                      "table_rows": self.weights.matrix(name).layout["rows"]}
        else:
            table = self.weights.table(name)
            source = {"table_fd": table.fd, "table_offset": table.offset, "table_type": table.ggml_type,
                      "table_row_bytes": table.row_bytes, "table_rows": table.rows}
        self._emit(kind=self.n.OP_EMBED, op_class=self.n.OPC_EMBED, cols=self.cfg.dim, out=out, scale=node.params["scale"], **source)
        return out

    def _value_add(self, node: Node) -> Buf:
        residual, branch = node.inputs
        res = self.value(residual)
        out = self._floats(self.cfg.dim)
        scale = node.params["scale"]
        if branch.kind == "linear":
            self._matmul(branch, out, res, scale)
        elif branch.kind == "moe":
            self._moe(branch, out, res, scale)
        elif branch.kind == "rmsnorm" and branch.inputs[0].kind == "linear" and scale == 1.0:
            tmp = self._floats(self.cfg.dim)
            self._matmul(branch.inputs[0], tmp, None)
            self._emit(kind=self.n.OP_NORM_ADD, op_class=self.n.OPC_NORM, cols=self.cfg.dim, in_=tmp, res=res, out=out,
                       norm_w=self.weights.vector(branch.params["weight"]), eps=branch.params["eps"])
        else:
            raise CompileError(f"no native op adds a {branch.kind} (scaled by {scale}) to the residual stream")
        self.residuals.append(out)
        return out

    def _value_activation(self, node: Node) -> Buf:
        linear = node.inputs[0]
        if linear.kind != "linear":
            raise CompileError(f"no native op applies an activation to a {linear.kind}")
        out = self._floats(self._width(linear))
        self._matmul(linear, out, None, activate=self._act_kind(node.params["act"]))
        return out

    def _act_kind(self, act: str) -> int:
        return {"silu": self.n.ACT_SILU, "gelu_tanh": self.n.ACT_GELU_TANH}[act]

    def _matmul(self, linear: Node, out: Buf, res: Buf | None, scale: float = 1.0,
                activate: int | None = None) -> None:
        w = self.weights.matrix(linear.params["weight"])
        acts, idx = self._act_index(linear.inputs[0], linear.params["weight"])
        fields = self._act_fields(acts, self._width(linear.inputs[0]))
        precise = linear.inputs[0] in self.precise
        chunk = self._chunk_tiles(w)
        self._emit(kind=self.n.OP_MATMUL, op_class=self.n.OPC_MATMUL, **fields, rows=w.layout["rows"], w=w.address, w_act=idx,
                   out=out, res=res, chunk_tiles=chunk, precise=int(precise), scale=scale,
                   bias=self._bias(linear.params["bias"]),
                   **({} if activate is None else {"activate": 1, "glu_act": activate}))

    def _moe(self, node: Node, out: Buf, res: Buf | None, scale: float = 1.0) -> None:
        e, x, w = node.params["experts"], node.inputs[0], self.weights
        gatings = {"softmax": self.n.MOE_SOFTMAX, "softmax_selected": self.n.MOE_SOFTMAX_SELECTED}
        acts_of = {"silu": self.n.ACT_SILU, "swiglu_oai": self.n.ACT_SWIGLU_OAI}
        if e.gating not in gatings or e.act not in acts_of:
            raise CompileError(f"no native op routes by {e.gating!r} into {e.act!r} experts")
        width, dim = self._width(x), self.cfg.dim
        acts, router_act = self._act_index(x, e.router)
        _, expert_act = self._act_index(x, e.gate)
        gate, down = w.matrix(e.gate), w.matrix(e.down)
        shared = {}
        if e.shared_gate is not None:
            shared.update(sh_gate=w.matrix(e.shared_gate).address, sh_up=w.matrix(e.shared_up).address,
                          sh_down=w.matrix(e.shared_down).address, shared_ff=e.shared_ff_dim,
                          sh_act=self._act_index(x, e.shared_gate)[1],
                          moe_hs=Buf(2 * self.rows * self.n.act_size(self._fmt(e.shared_down), e.shared_ff_dim, 1)))
        if e.shared_scale is not None:
            shared.update(sh_scale=w.matrix(e.shared_scale).address, sh_scale_act=self._act_index(x, e.shared_scale)[1])
        # gate and up chunks are whole activation groups (256 rows): each quantizes its own columns of
        # the GLU output for the down projection (csrc/op_moe.c)
        widest = max(e.ff_dim, e.shared_ff_dim)
        chunk_tiles = -(-widest // 4) if widest <= 256 else 64
        down_tiles = self._chunk_tiles(down)
        rows, pairs = self.rows, self.rows * e.n_used
        parts = max(-(-e.ff_dim // (4 * chunk_tiles)), -(-e.shared_ff_dim // (4 * chunk_tiles)),
                    -(-dim // (4 * down_tiles)))
        route_ints = 3 * pairs + 2 * e.n_experts + 4 * (e.n_experts + 1) * parts  # kiln_moe_route_ints
        layer = re.match(r"blk\.(\d+)\.", e.router)
        self._emit(kind=self.n.OP_MOE, op_class=self.n.OPC_MATMUL, layer=int(layer[1]) if layer else 0,
                   **self._act_fields(acts, width), rows=dim,
                   w=w.matrix(e.router).address, w_act=router_act, n_experts=e.n_experts, n_used=e.n_used,
                   moe_gating=gatings[e.gating], moe_normalize=int(e.normalize), ff=e.ff_dim, glu_act=acts_of[e.act],
                   bias=self._bias(e.router_bias), exp_gate_b=self._bias(e.gate_bias), exp_up_b=self._bias(e.up_bias),
                   exp_down_b=self._bias(e.down_bias),
                   exp_gate=w.expert_table(e.gate), exp_up=w.expert_table(e.up), exp_down=w.expert_table(e.down),
                   exp_act=expert_act, chunk_tiles=chunk_tiles, down_tiles=down_tiles, precise=1,
                   moe_route=Buf(4 * route_ints), moe_gates=Buf(4 * (rows * e.n_experts + pairs + rows)),
                   moe_x=Buf(pairs * self.n.act_size(gate.layout["fmt"], width, 1)),
                   moe_h=Buf(2 * pairs * self.n.act_size(down.layout["fmt"], e.ff_dim, 1)),
                   moe_y=Buf(4 * (pairs + rows) * dim), out=out, res=res, scale=scale, **shared)

    def _value_glu(self, node: Node) -> Buf:
        gate, up = (self.weights.matrix(node.params[k]) for k in ("gate", "up"))
        acts, gi = self._act_index(node.inputs[0], node.params["gate"])
        _, ui = self._act_index(node.inputs[0], node.params["up"])
        rows = gate.layout["rows"]
        out = self._floats(rows)
        chunk = min(self._chunk_tiles(gate), self._chunk_tiles(up))
        act = self._act_kind(node.params["act"])
        self._emit(kind=self.n.OP_GLU, op_class=self.n.OPC_MATMUL, **self._act_fields(acts, self._width(node.inputs[0])), rows=rows,
                   w=gate.address, w2=up.address, w_act=gi, w2_act=ui, glu_act=act, out=out, chunk_tiles=chunk,
                   bias=self._bias(node.params["gate_bias"]), bias2=self._bias(node.params["up_bias"]))
        return out

    def _value_attention(self, node: Node) -> Buf:
        layer, attn = node.params["layer"], node.params["attn"]
        (q_lin, q_norm, rope), (k_lin, k_norm, k_rope), (v_lin, v_norm, v_rope) = (
            self._projection(x) for x in node.inputs)
        if v_norm is not None or v_rope is not None or rope != k_rope:
            raise CompileError("attention expects the same rope (or none) on q and k, and a plain v projection")
        h = q_lin.inputs[0]
        if k_lin.inputs[0] is not h or v_lin.inputs[0] is not h:
            raise CompileError("q, k and v must project the same input")
        acts = self.act(h)
        fields = self._act_fields(acts, self._width(h))
        hd = attn.head_dim
        q = self._floats(attn.n_heads * hd)
        norms, whole = {}, self._whole_projection_norms(q_norm, k_norm, attn)
        for prefix, norm in (("qnorm", q_norm), ("knorm", k_norm)):
            if norm is not None:
                norms[f"{prefix}.weight"] = self.weights.vector(norm.params["weight"])
                norms[f"{prefix}.eps"] = norm.params["eps"]
        if whole:  # the raw projections of every row, normalized and roped once all heads are in
            norms.update(qk_norm_whole=1, qk_raw=self._floats((attn.n_heads + attn.n_kv_heads) * hd))
        cos, sin = self.ropes(rope) if rope is not None else (None, None)
        k_cache, v_cache = self.kv(layer)
        index = {}
        for name, lin in (("q", q_lin), ("k", k_lin), ("v", v_lin)):
            index[f"w{name}"] = self.weights.matrix(lin.params["weight"]).address
            index[f"{name}_act"] = list(acts).index(self.n.act_kind(self._fmt(lin.params["weight"])))
            if lin.params["bias"] is not None:
                index[f"b{name}"] = self.weights.vector(lin.params["bias"])
        # Chunks of several heads, two per thread: each is one longer streaming pass over a matrix (one
        # 64-wide head of a 576-wide Q4_1 matrix is only 23 KB); docs/PERF.md, "QKV chunks of several heads".
        heads = attn.n_heads + 2 * attn.n_kv_heads
        chunk_heads = -(-heads // (2 * self.threads))
        common = dict(layer=layer, n_heads=attn.n_heads, n_kv_heads=attn.n_kv_heads, head_dim=hd, q=q,
                      k_cache=k_cache, v_cache=v_cache, kv_type=self.kv_type)
        self._emit(kind=self.n.OP_QKV, op_class=self.n.OPC_MATMUL, **fields, **index, **norms, **common, precise=int(h in self.precise),
                   chunk_heads=chunk_heads,
                   **{"rope.cos": cos, "rope.sin": sin, "rope.dim": rope.dim if rope else 0,
                      "rope.neox": int(rope.neox) if rope else 0})
        out = self._floats(attn.n_heads * hd)
        self._emit(kind=self.n.OP_ATTN, op_class=self.n.OPC_ATTENTION, **common, out=out, scale=attn.scale, window=attn.window or 0,
                   negate=int(layer == self.negate_layer), softcap=attn.softcap,
                   sinks=None if attn.sinks is None else self.weights.vector(attn.sinks))
        return out

    def _value_linear(self, node: Node) -> Buf:
        if node.params["bias"] is not None:
            raise CompileError("no native op adds a bias to a standalone projection")
        out = self._floats(self._width(node))
        self._matmul(node, out, None)
        return out

    def _value_shortconv(self, node: Node) -> Buf:
        conv, layer = node.params["conv"], node.params["layer"]
        rings, ring, _ = self.state(layer)
        out = self._floats(conv.width)
        self._emit(kind=self.n.OP_SHORTCONV, op_class=self.n.OPC_ATTENTION, layer=layer, cols=conv.width,
                   in_=self.value(node.inputs[0]), out=out, conv_w=self.weights.vector(node.params["weight"]),
                   state=rings, conv_len=conv.length, state_len=ring)
        return out

    def _value_delta_net(self, node: Node) -> Buf:
        net, weights, layer = node.params["net"], node.params["weights"], node.params["layer"]
        qkv, z, alpha, beta = (self.value(x) for x in node.inputs)
        rings, ring, matrices = self.state(layer)
        out = self._floats(net.n_v_heads * net.v_dim)
        self._emit(kind=self.n.OP_DELTANET, op_class=self.n.OPC_ATTENTION, layer=layer, cols=net.width, in_=qkv,
                   dn_z=z, dn_alpha=alpha, dn_beta=beta, out=out, dn_mixed=self._floats(net.width),
                   conv_w=self.weights.vector(weights.conv), state=rings, conv_len=net.length, state_len=ring,
                   dn_decay=self.weights.vector(weights.decay), dn_dt_bias=self.weights.vector(weights.dt_bias),
                   norm_w=self.weights.vector(weights.norm), eps=net.eps, dn_matrices=matrices,
                   dn_k_heads=net.n_k_heads, dn_v_heads=net.n_v_heads, dn_k_dim=net.k_dim, dn_v_dim=net.v_dim,
                   chunk_heads=-(-net.n_v_heads // (2 * self.threads)))
        return out

    def _value_gate(self, node: Node) -> Buf:
        width = self._width(node)
        out = self._floats(width)
        self._emit(kind=self.n.OP_GATE, op_class=self.n.OPC_NORM, cols=width, in_=self.value(node.inputs[0]),
                   dn_z=self.value(node.inputs[1]), out=out)
        return out

    @staticmethod
    def _whole_projection_norms(q_norm: Node | None, k_norm: Node | None, attn) -> bool:
        """Whether q and k are normalized over the whole projection (OLMo2) rather than per head; for a
        projection of one head the two are the same."""
        if (q_norm is None) != (k_norm is None):
            raise CompileError("q and k must both be normalized, or neither")
        whole = set()
        for norm, heads in ((q_norm, attn.n_heads), (k_norm, attn.n_kv_heads)):
            if norm is None:
                continue
            if norm.params["heads"] not in (1, heads):
                raise CompileError(f"a q/k norm over {norm.params['heads']} groups of {heads} heads")
            if heads > 1:
                whole.add(norm.params["heads"] == 1)
        if len(whole) > 1:
            raise CompileError("q is normalized per head and k over its whole projection, or the other way")
        return whole == {True}

    @staticmethod
    def _projection(node: Node) -> tuple[Node, Node | None, Rope | None]:
        """Unwrap [rope ←] [per-head rmsnorm ←] linear."""
        rope = norm = None
        if node.kind == "rope":
            rope, node = node.params["rope"], node.inputs[0]
        if node.kind == "rmsnorm":
            norm, node = node, node.inputs[0]
        if node.kind != "linear":
            raise CompileError(f"attention input must be a projection, found {node.kind}")
        return node, norm, rope

    def _logits(self, node: Node) -> None:
        x = node.inputs[0]
        if x.kind not in ("rmsnorm", "layernorm"):
            raise CompileError("logits expect a normalized input")
        w = self.weights.matrix(node.params["weight"])
        fmt = w.layout["fmt"]
        width = self._width(x)
        act = Buf(self.n.act_size(fmt, width, 2 * self.out_rows))
        fields = {"n_act": 1, "cols": width, "act_fmt[0]": fmt, "act[0]": act, "precise": 1}
        self.hidden = self._floats(width, self.out_rows)
        self._emit(kind=self.n.OP_NORM_QUANT, op_class=self.n.OPC_HEAD, **fields, select_rows=1, in_=self.value(x.inputs[0]),
                   out=self.hidden, **self._norm_fields(x))
        vocab = w.layout["rows"]
        self.logits = self._floats(vocab, self.out_rows)
        lo = self.weights.remainder(node.params["weight"])
        split = {"w2": lo.address, "act[1]": Buf(self.n.act_size(fmt, width, 2 * self.out_rows))} if lo else {}
        self._emit(kind=self.n.OP_LOGITS, op_class=self.n.OPC_HEAD, **fields, **split, rows=vocab, w=w.address, w_act=0,
                   out=self.logits, chunk_tiles=self._chunk_tiles(w), bias=self._bias(node.params["bias"]),
                   scale=node.params["scale"], softcap=node.params["softcap"])


def assign_offsets(ops: list[dict], extra: list[Buf], reuse: bool, align: int = 64,
                   guard: int = 0) -> tuple[int, list[tuple[int, int]]]:
    """Give every Buf an arena offset; return the arena size and the (offset, bytes) past each buffer that
    no op may write: its alignment padding and `guard` bytes more (a guarded plan's). With `reuse`, a
    buffer's bytes go back to a free list (by exact size) after the last op that touches it."""
    first, last, order = {}, {}, []
    for i, op in enumerate(ops):
        for v in op.values():
            if isinstance(v, Buf):
                if id(v) not in first:
                    first[id(v)] = i
                    order.append(v)
                last[id(v)] = i
    for b in extra:
        if id(b) not in first:
            order.append(b)
        first[id(b)], last[id(b)] = first.get(id(b), 0), len(ops)  # read by the caller after the run
    size, free, gaps = 0, {}, set()
    releases: dict[int, list[Buf]] = {}
    for b in order:
        start = first[id(b)]
        if reuse:
            for i in sorted(k for k in releases if k < start):
                for dead in releases.pop(i):
                    free.setdefault(dead.nbytes, []).append(dead.offset)
        slot = free.get(b.nbytes)
        if reuse and slot:
            b.offset = slot.pop()
        else:
            b.offset = size
            size += -(-(b.nbytes + guard) // align) * align
        releases.setdefault(last[id(b)], []).append(b)
        gaps.add((b.offset + b.nbytes, -(-(b.nbytes + guard) // align) * align - b.nbytes))
    return size, sorted(g for g in gaps if g[1])


def encode_ops(native, ops: list[dict], base: int) -> bytes:
    """Lay ops out as the C struct, with Buf fields resolved against the arena at `base`."""
    import struct

    layout, size = native.op_layout()
    codes = {"i": "<i", "f": "<f", "p": "<Q", "z": "<Q"}
    out = bytearray(size * len(ops))
    for n, op in enumerate(ops):
        for key, value in op.items():
            name = "in" if key == "in_" else key
            if name not in layout:
                raise CompileError(f"op field {name!r} is not in kiln_op")
            offset, code = layout[name]
            if isinstance(value, Buf):
                value = base + value.offset
            elif value is None:
                value = 0
            elif hasattr(value, "ctypes"):
                value = value.ctypes.data
            struct.pack_into(codes[code], out, n * size + offset, value)
    return bytes(out)


