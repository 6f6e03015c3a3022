"""precision: the bfloat16 mixed-precision policy, decided by the compiler (`train.dtype:
bfloat16`).

The graph arrives in float32 (parameters, graph inputs and outputs are float32 master copies)
and leaves with a dtype on every tensor and explicit CASTs where dtypes change:

    EINSUM          operands cast to bf16, result bf16 (the executors accumulate in float32:
                    torch's bf16 matmul on CPU, `tl.dot` into a float32 accumulator on GPU)
    SUM CUMSUM LOG  float32 operands and result: norm statistics, softmax denominators and
                    the loss (bf16 terms, float32 accumulator), gate log-cumsums (log-space
                    weights), log-sigmoid gates, the log-sum-exp
    AMAX            in its operand's dtype (a max is exact), the result cast to float32
    ATTENTION       (the flash-attention pattern op) q, k, v and o bf16, the log-sum-exp
                    float32: scores, softmax and accumulators are float32 inside the op (the
                    cpu loop upcasts per block, the Triton templates accumulate in float32);
                    its VJP, ATTENTION_BWD, reads bf16 q, k, v, o, do and writes bf16 dq, dk, dv
    LINEAR_CROSS_ENTROPY  (the fused LM head + loss) and its VJP: float32 operands (h, the
                    head, lse, dloss) and results, like the loss itself
    matmul-bound    an elementwise node of float32 operands whose value reaches only matmul
                    (or attention) operands, maybe through views and other such nodes (a
                    norm's output x̂·w, its x̂): computed in float32 and stored bf16 (a CAST
                    right after it, fused into its kernel), so the float32 value is never
                    written and the backward saves the bf16 one the matmul reads anyway
    elementwise     float32 when every user demands it: a chain feeding a CUMSUM, a LOG, a
                    sum to a scalar (the per-token losses) or a float32 scan carry (the
                    memory state W, S); otherwise an activation: bf16 as soon as one operand
                    is a bf16 activation (float32 weights, biases and scalar constants are cast
                    down to meet it), float32 when all operands are float32. EXP, DIV, RSQRT
                    of bf16 activations run in float32 inside the executors and are stored in
                    bf16 (the CPU's bf16 ops and the Triton kernels both compute in float32)
    SCAN            carries keep their float32 type (the memory state W, S, loss
                    accumulators) except a layer scan's: the residual stream between layers is
                    a bf16 activation (and so its per-layer checkpoint and its cotangent); the
                    carries a scan saves per iteration for the backward (the memory state at
                    every segment / chunk boundary) are stored bf16 (`checkpoint_dtype`,
                    widened where the backward recomputes from them); xs and consts pass in the
                    dtype they have; ys the graph returns as float32 outputs (a decode step's
                    states, a decode write's memory state) are computed in float32; the body
                    is rewritten under the same rules
    views, gathers  the dtype of their data operand; a chain read only by the fused LM head
                    + loss (the final norm's output) is float32 like the loss
    ROPE            a rotary table read by bf16 activations is made in bf16 at bind time
    graph outputs   their original dtype (the loss, logits and decode states stay float32)

So activations written between kernels (matmul results and the elementwise chains on them,
the operands saved for the backward) are half the bytes, and the buffer plan sizes them so.
Autodiff differentiates the CASTs like any op (a cast's VJP casts the cotangent back), so the
gradients of float32 parameters arrive in float32.

Pre: `g` verifies, every float tensor is float32. Post: same computation up to bfloat16
rounding of the values above; graph inputs and outputs keep their types; every elementwise
node's operands share one dtype.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from titanc.ir import Graph, Op, OpGroup
from titanc.ir.elementwise import ELEMENTWISE
from titanc.ir.structural import STRUCTURAL

LOW = "bf16"
HIGH = "f32"

# ops computed in float32 whatever their operands: sums (norm statistics, softmax
# denominators, the loss), cumulative sums (gate log-space weights) and logarithms
# (log-sigmoid gates, the loss's log-sum-exp)
F32_OPS = frozenset({Op.SUM, Op.CUMSUM, Op.LOG})


def precision_class(op: Op) -> str:
    """The precision class of `op`'s registry entry (`ir/structural.py` lists them)."""
    e = ELEMENTWISE.get(op) or STRUCTURAL.get(op)
    return e.precision if e is not None else ""


def _demanding(n: Any) -> bool:
    """Is `n` a consumer whose float32 demand reaches back through the elementwise chain that
    feeds it? Entries of class "demanding" (cumulative sums and logarithms, the fused LM head
    + loss: its h, the final norm's output, is computed in float32, not rounded to bf16 and
    widened again), and a sum to a scalar (a loss or a total: the per-token losses are float32
    too); a norm's or a softmax's row sum reads bf16 terms into a float32 accumulator instead."""
    return precision_class(n.op) == "demanding" or (n.op is Op.SUM and n.type.shape == ())


# ops whose dtype is their data operand's (operand 0)
FOLLOW = OpGroup.MOVEMENT - {Op.CONCAT}


def _f32_demanded(g: Graph, n_carry: int | None, f32_ys: frozenset[int] = frozenset()
                  ) -> set[int]:
    """Elementwise nodes every user of which computes in float32, so they do too: the
    prologue of a norm or a softmax, a log-sigmoid gate on its way to a cumsum, the update of
    a float32 carry (the memory state W, S). A carry output (every output of a top-level
    graph, `n_carry` None) counts as a float32 user, and so do the ys at positions `f32_ys`
    (those the enclosing graph returns as float32 outputs: a decode step's new states, the
    memory state a decode write computes); other ys count as no user."""
    sinks = {i for k, (_, i) in enumerate(g.outputs)
             if n_carry is None or k < n_carry or k in f32_ys}
    demanded: set[int] = set()
    for nid in reversed(g.order()):
        n = g.node(nid)
        if not (n.op in OpGroup.ELEMENTWISE or n.op in OpGroup.VIEW) or n.op is Op.CAST:
            continue                # (a view passes its users' demand on to its operand)
        users = g.users(nid)
        if not users and nid not in sinks:
            continue
        if all(_demanding(g.node(u)) or u in demanded for u in users):
            demanded.add(nid)
    return demanded




class _MatmulBound:
    """Elementwise nodes (and the views on the way) whose every user is a matmul or attention
    operand, a scan input of the same kind in its body, or another such node: their float32
    results would only be cast down there. `stored` are those stored bf16 right away: the ones
    whose storing low turns no full-size float32 operand low on the way down (x̂ = x·rsqrt(...)
    is stored low; the rsqrt is not, as it would turn x·rsqrt, and so x, bf16)."""

    def __init__(self, g: Graph, f32: set[int]):
        self.g = g
        self.scans: dict[int, set[int]] = {}
        sinks = {i for _, i in g.outputs}
        self.bound: set[int] = set()
        for nid in reversed(g.order()):
            n = g.node(nid)
            if not (n.op in OpGroup.ELEMENTWISE or n.op in FOLLOW) or n.op is Op.CAST \
                    or nid in f32 or nid in sinks:
                continue
            if self._read_low(nid):
                self.bound.add(nid)
        self.stored = {nid for nid in self.bound
                       if g.node(nid).op in OpGroup.ELEMENTWISE and self._harmless(nid)}

    def _read_low(self, nid: int) -> bool:
        users = self.g.users(nid)
        return bool(users) and all(self._reads_low(u, nid) for u in users)

    def _reads_low(self, uid: int, nid: int) -> bool:
        u = self.g.node(uid)
        if u.op is Op.EINSUM or precision_class(u.op) == "low":    # read in bf16 whatever given
            return True
        if u.op is Op.SCAN:
            return all(k in self._scan_inputs(u) for k, i in enumerate(u.inputs) if i == nid)
        return uid in self.bound

    def _scan_inputs(self, u: Any) -> set[int]:
        """Positions of scan `u`'s xs and consts that its body reads only as matmul operands."""
        if u.id not in self.scans:
            body, nc = u.attr("body"), u.attr("n_carry")
            inner = _MatmulBound(body, _f32_demanded(body, nc))
            self.scans[u.id] = {k for k, i in enumerate(body.inputs)
                                if k >= nc and inner._read_low(i) and inner._harmless(i)}
        return self.scans[u.id]

    def _harmless(self, nid: int) -> bool:
        low, todo = {nid}, [nid]
        while todo:
            for u in self.g.users(todo.pop()):
                if u in self.bound and u not in low:
                    low.add(u)
                    todo.append(u)
        g = self.g
        return all(o in low or g.node(o).type.numel < g.node(u).type.numel
                   for u in low if u != nid and g.node(u).op in OpGroup.ELEMENTWISE
                   for o in g.node(u).inputs)


@dataclass(frozen=True)
class MixedPrecision:
    """Assign bf16 / float32 to every float tensor and insert the casts (module docstring)."""
    name: ClassVar[str] = "mixed_precision"

    def __call__(self, g: Graph) -> Graph:
        return _Rewrite(g).graph


def _wide_items(g: Graph, n_carry: int | None, f32_ys: frozenset[int]) -> set[tuple[int, int]]:
    """(scan id, output index) of the scan results that `g` returns as float32 outputs (maybe
    through views): computed in float32 in the scan's body, never rounded to bf16 first."""
    out: set[tuple[int, int]] = set()
    for k, (_, v) in enumerate(g.outputs):
        if not (n_carry is None or k < n_carry or k in f32_ys):
            continue
        n = g.node(v)
        while n.op in OpGroup.VIEW:
            n = g.node(n.inputs[0])
        if n.op is Op.ITEM and g.node(n.inputs[0]).op is Op.SCAN and n.type.dtype == HIGH:
            out.add((n.inputs[0], n.attr("index")))
    return out


def _carry_dtype(role: str | None, t: Any) -> str:
    """A scan carry's dtype: the residual stream a layer scan carries is an activation
    (bf16: stored between layers, saved per layer for the backward, and so its cotangent);
    the outer scan of layer groups (`layer_group`) carries the same stream; every other carry
    keeps its type (the memory state W, S, loss accumulators)."""
    return LOW if role in ("layer", "layer_group") and t.dtype == HIGH else t.dtype


class _Rewrite:
    """`g` rebuilt under the policy. A top-level graph keeps its outputs' types; a scan body
    (`in_types`: its inputs' new types, by position) keeps its `n_carry` carries' types and
    leaves its ys in the dtype computed."""

    def __init__(self, g: Graph, in_types: list[Any] | None = None, n_carry: int = 0,
                 f32_ys: frozenset[int] = frozenset()):
        self.graph = Graph(g.name)
        self.env: dict[int, int] = {}
        self.casts: dict[tuple[int, str], int] = {}
        self.f32 = _f32_demanded(g, None if in_types is None else n_carry, f32_ys)
        self.wide = _wide_items(g, None if in_types is None else n_carry, f32_ys)
        self.bound = _MatmulBound(g, self.f32).stored
        for k, nid in enumerate(g.inputs):               # positional, as a scan binds them
            node = g.node(nid)
            t = in_types[k] if in_types is not None else node.type
            self.env[nid] = self.graph.add(Op.INPUT, (), node.attr_dict, t)
        for node in g:
            if node.op is not Op.INPUT:
                self.env[node.id] = self._node(node)
        outs = []
        for k, (name, i) in enumerate(g.outputs):
            if in_types is None:
                want = g.node(i).type.dtype
            elif k < n_carry:
                want = self.graph.node(self.graph.inputs[k]).type.dtype
            elif k in f32_ys:
                want = g.node(i).type.dtype
            else:
                want = self._dtype(self.env[i])
            outs.append((name, self._to(self.env[i], want)))
        self.graph.set_outputs(outs)

    # -- helpers -------------------------------------------------------------------------------
    def _dtype(self, nid: int) -> str:
        return self.graph.node(nid).type.dtype

    def _to(self, nid: int, dtype: str) -> int:
        """`nid` (a node of the new graph) as `dtype`: itself, a retyped constant, the input of
        an exact widening cast, or one (memoised) CAST."""
        n = self.graph.node(nid)
        if isinstance(n.type, tuple) or n.type.dtype == dtype or not n.type.is_float:
            return nid
        if n.op in (Op.FULL, Op.ROPE):            # a rotary table is made in bf16 at bind
            return self.graph.add(n.op, (), {**n.attr_dict, "dtype": dtype})
        if n.op is Op.EXPAND and self.graph.node(n.inputs[0]).op is Op.FULL:
            return self.graph.add(Op.EXPAND, (self._to(n.inputs[0], dtype),), n.attr_dict)
        if n.op is Op.CAST and self._dtype(n.inputs[0]) == dtype and dtype == LOW:
            return n.inputs[0]                       # bf16 -> f32 -> bf16 is exact
        key = (nid, dtype)
        if key not in self.casts:
            self.casts[key] = self.graph.add(Op.CAST, (nid,), {"dtype": dtype})
        return self.casts[key]

    def _weak(self, nid: int) -> bool:
        """A constant scalar (FULL, maybe expanded): it takes its partner's dtype."""
        n = self.graph.node(nid)
        while n.op is Op.EXPAND:
            n = self.graph.node(n.inputs[0])
        return n.op is Op.FULL and n.attr("shape") == ()

    def _activation(self, ins: list[int]) -> str:
        """The dtype of an elementwise result that no float32 consumer demands: an activation,
        bf16 as soon as one operand is a bf16 activation (float32 weights, biases and
        constants are cast down to meet it), float32 when every operand is float32."""
        dts = {self._dtype(i) for i in ins if not self._weak(i)} or \
              {self._dtype(i) for i in ins}
        if "f64" in dts or not dts & {LOW, HIGH}:
            return max(dts)                           # not a float32 graph: left alone
        return LOW if LOW in dts else HIGH

    # -- one node ------------------------------------------------------------------------------
    def _node(self, node: Any) -> int:
        ins = [self.env[i] for i in node.inputs]
        op, add = node.op, self.graph.add_like
        if op is Op.SCAN:
            return self._scan(node, ins)
        if op is Op.CAST or op in OpGroup.SOURCE or op is Op.ITEM or op in FOLLOW:
            return add(node, ins)
        if op is Op.AMAX:          # exact in its operand's dtype; the statistic is float32
            return self._to(add(node, ins), HIGH)
        if op is Op.EINSUM:
            return add(node, [self._to(i, LOW) for i in ins])
        if op in OpGroup.PATTERN:  # its entry's class: flash attention's bf16 operands (float32
            low = precision_class(op) == "low"                  # inside), else float32 ones
            return add(node, [self._to(i, LOW if low else HIGH) for i in ins])
        if op in F32_OPS or node.id in self.f32:
            return add(node, [self._to(i, HIGH) for i in ins])
        if op in OpGroup.ELEMENTWISE or op is Op.CONCAT:
            dt = self._activation(ins)
            out = add(node, [self._to(i, dt) for i in ins])
            # matmul-bound: stored bf16 (computed in float32)
            return self._to(out, LOW) if node.id in self.bound and dt == HIGH else out
        raise NotImplementedError(f"mixed precision has no rule for {op.name} (node %{node.id})")

    def _scan(self, node: Any, ins: list[int]) -> int:
        a = node.attr_dict
        body: Graph = a["body"]
        nc, nx_ = a["n_carry"], a["n_xs"]
        carry_dtypes = [_carry_dtype(a.get("role"), body.node(i).type)
                        for i in body.inputs[:nc]]
        ins = [self._to(v, carry_dtypes[k]) if k < nc else v for k, v in enumerate(ins)]
        in_types = []
        for k, v in enumerate(ins):
            t = self.graph.node(v).type
            in_types.append(t if k < nc or k >= nc + nx_
                            else type(t)(t.shape[1:], t.dtype))
        f32_ys = frozenset(k for k in range(nc, len(body.outputs))
                           if (node.id, k) in self.wide)
        new_body = _Rewrite(body, in_types, nc, f32_ys).graph
        # the carries saved per iteration for the backward (the memory state at every chunk
        # or segment boundary) are stored bf16; the carries themselves stay as they are
        return self.graph.add_like(node, ins, body=new_body, checkpoint_dtype=LOW)


mixed_precision = MixedPrecision()
