"""Reverse-mode autodiff on the IR: a VJP rule per op, scans included.

`grad_graph(g, wrt, loss)` returns a new graph computing `loss` and `grad.<name>` for every
input named in `wrt`. Precondition: `g` verifies and `loss` is a scalar float output.
Postcondition: the result verifies; its forward part computes exactly what `g` computes.

Scans are differentiated by recomputation: the forward scan also stacks the carry at the
start of every iteration (for the layer scan that is the per-layer activation checkpoint,
for the memory scan the per-chunk memory state; stored in the scan's `checkpoint_dtype`
where the mixed-precision policy set one, widened again where the backward reads it); the
backward is a reverse scan whose body recomputes one iteration from its saved carry and pulls
cotangents back through it, adding the cotangents of loop-invariant operands into accumulator
carries.
"""
from __future__ import annotations


from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Iterator

from titanc.ir import Builder, Graph, Op, Value
from titanc.ir.elementwise import ELEMENTWISE
from titanc.ir.structural import STRUCTURAL, unbroadcast
from titanc.ir.types import TensorType

if TYPE_CHECKING:
    from titanc.passes.remat import Policy

Ct = dict[int, "Value | list[Value | None]"]   # scan nodes: one entry per tuple element


def vjp(b: Builder, op: Op, attrs: dict, xs: list[Value], y: Value, ct: Value) -> list[Value | None]:
    """Cotangents of a node's operands given the cotangent of its (tensor) output: the op's
    registry entry's VJP (`ir/elementwise.py`, `ir/structural.py`); an elementwise op's are
    summed back over the axes broadcasting added."""
    if op in ELEMENTWISE:
        cts = ELEMENTWISE[op].vjp(ct, xs, y)
        return [None if c is None else unbroadcast(c, x.shape) for c, x in zip(cts, xs)]
    rule = STRUCTURAL[op].vjp if op in STRUCTURAL else None
    if rule is None:
        raise NotImplementedError(f"no VJP rule for {op.name}")
    return rule(b, attrs, xs, y, ct)


def _zeros(b: Builder, t: TensorType) -> Value:
    return b.full(0.0, (), t.dtype).expand(*t.shape) if t.shape else b.full(0.0, (), t.dtype)


def _add_ct(acc: Value | None, ct: Value | None) -> Value | None:
    if ct is None:
        return acc
    return ct if acc is None else acc + ct


def _checkpoint(b: Builder, carry: Value, dtype: str | None) -> Value:
    """A carry as its scan saves it for the backward: in the scan's `checkpoint_dtype` where
    that is narrower (mixed precision stores the float32 memory state's checkpoints bf16; the
    carry itself stays float32), else as it is."""
    if dtype is None or carry.dtype == dtype or carry.dtype != "f32":
        return carry
    return b.op(Op.CAST, carry, dtype=dtype)


@dataclass(frozen=True)
class _Unsaved:
    """Stands in for an operand the remat policy neither saved nor recomputes: VJP rules that
    only need its type (ADD, RESHAPE, ...) work; one that reads its value fails loudly."""
    type: TensorType

    @property
    def shape(self) -> tuple[int, ...]:
        return self.type.shape

    @property
    def dtype(self) -> str:
        return self.type.dtype

    @property
    def rank(self) -> int:
        return self.type.rank


@dataclass
class ScanSave:
    """What a forward scan keeps for its backward, each stacked over iterations: the carry at
    the start of every iteration, the body values the remat policy saves (by body node id),
    and, for nested scans that will not be re-run, their own ScanSave."""
    carries: list[Value]
    values: dict[int, Value] = field(default_factory=dict)
    nested: dict[int, "ScanSave"] = field(default_factory=dict)

    def flatten(self) -> list[Value]:
        out = list(self.carries) + [self.values[k] for k in sorted(self.values)]
        for k in sorted(self.nested):
            out += self.nested[k].flatten()
        return out

    def rebuild(self, it: Iterator[Value]) -> "ScanSave":
        """The same structure over new values (e.g. per-iteration slices inside a body)."""
        carries = [next(it) for _ in self.carries]
        values = {k: next(it) for k in sorted(self.values)}
        nested = {k: self.nested[k].rebuild(it) for k in sorted(self.nested)}
        return ScanSave(carries, values, nested)


class _Differentiator:
    """Copies a graph into a builder (scans save what the remat policy asks) and pulls
    cotangents back through it."""

    def __init__(self, b: Builder, g: Graph, policy: "Policy"):
        self.b, self.g, self.policy = b, g, policy
        self.env: dict[int, Value] = {}
        self.saved: dict[int, ScanSave] = {}

    def forward(self, args: list[Value], provided: dict[int, Value] | None = None,
                provided_scans: dict[int, ScanSave] | None = None) -> None:
        """Emit the graph's nodes; `provided` values (and scans' saves) are used, not recomputed."""
        b, g = self.b, self.g
        provided, provided_scans = provided or {}, provided_scans or {}
        self.env.update(zip(g.inputs, args))
        self.saved.update(provided_scans)
        for node in g:
            if node.op is Op.INPUT:
                continue
            if node.id in provided:
                self.env[node.id] = provided[node.id]
            elif node.op is Op.SCAN and node.id in provided_scans:
                continue                      # not re-run: its used ITEMs are provided
            elif any(i not in self.env for i in node.inputs):
                continue                      # reads a scan that is not re-run: not needed
            elif node.op is Op.SCAN:
                self.env[node.id] = self._scan_forward(node, [self.env[i] for i in node.inputs])
            else:
                self.env[node.id] = b.op(node.op, *[self.env[i] for i in node.inputs],
                                         **node.attr_dict)

    def _scan_forward(self, node, ins: list[Value]) -> Value:
        """The scan, its body also emitting what the backward needs per iteration."""
        a = node.attr_dict
        body: Graph = a["body"]
        nc = a["n_carry"]
        keep = self.policy.select(body)
        ab = Builder(body.name)
        args = [ab.op(Op.INPUT, name=body.node(i).attr("name"), type=body.node(i).type)
                for i in body.inputs]
        inner = _Differentiator(ab, body, self.policy.nested())
        inner.forward(args)
        nested = {k: v for k, v in inner.saved.items() if self.policy.keeps_nested}
        low = a.get("checkpoint_dtype")
        proto = ScanSave([_checkpoint(ab, inner.env[body.inputs[k]], low) for k in range(nc)],
                         {k: inner.env[k] for k in sorted(keep)}, nested)
        extra = proto.flatten()
        ab.graph.set_outputs([(name, inner.env[i].id) for name, i in body.outputs]
                             + [(f"saved{k}", v.id) for k, v in enumerate(extra)])
        tup = self.b.op(Op.SCAN, *ins, **{**a, "body": ab.graph})
        n_out = len(body.outputs)
        items = iter([self.b.item(tup, n_out + k) for k in range(len(extra))])
        self.saved[node.id] = proto.rebuild(items)
        return tup       # ITEM k < n_out still names the same element

    def backward(self, seeds: Ct) -> Ct:
        """seeds: cotangents of some nodes of g (tensor nodes: Value; scan nodes: list)."""
        ct: Ct = dict(seeds)
        for nid in reversed(self.g.order()):
            node = self.g.node(nid)
            if nid not in ct or node.op in (Op.INPUT, Op.FULL, Op.ROPE, Op.MASK):
                continue
            c = ct.pop(nid)
            if node.op is Op.ITEM:
                src = node.inputs[0]
                lst = ct.setdefault(src, [None] * len(self.g.node(src).type))
                lst[node.attr("index")] = _add_ct(lst[node.attr("index")], c)
                continue
            ins = [self._val(i) for i in node.inputs]
            if node.op is Op.SCAN:
                grads = self._scan_vjp(node, ins, c)
            else:
                grads = vjp(self.b, node.op, node.attr_dict, ins, self._val(nid), c)
            for i, gi in zip(node.inputs, grads):
                if gi is not None and self.g.node(i).type.is_float:
                    ct[i] = _add_ct(ct.get(i), gi)
        return ct

    def _val(self, nid: int) -> "Value | _Unsaved":
        return self.env[nid] if nid in self.env else _Unsaved(self.g.node(nid).type)

    def _scan_vjp(self, node, ins: list[Value], cts: list[Value | None]) -> list[Value | None]:
        b = self.b
        a = node.attr_dict
        body: Graph = a["body"]
        nc, nx_, length = a["n_carry"], a["n_xs"], a["length"]
        carries, xs, consts = ins[:nc], ins[nc:nc + nx_], ins[nc + nx_:]
        body_types = [body.node(i).type for i in body.inputs]
        ny = len(body.outputs) - nc
        ct_c = [c if c is not None else _zeros(b, v.type) for c, v in zip(cts[:nc], carries)]
        y_live = [k for k in range(ny) if cts[nc + k] is not None]
        diff_k = [j for j, v in enumerate(consts) if v.type.is_float]
        diff_x = [j for j, v in enumerate(xs) if v.type.is_float]

        save = self.saved[node.id]
        flat = save.flatten()
        n_ct_y = len(y_live)

        def bwd(bb: Builder, carry: list[Value], xsl: list[Value], ks: list[Value]):
            ct_carry, acc = carry[:nc], carry[nc:]
            here = save.rebuild(iter(xsl[:len(flat)]))              # this iteration's saves
            x_t = xsl[len(flat):len(flat) + nx_]
            ct_y = xsl[len(flat) + nx_:len(flat) + nx_ + n_ct_y]
            inner = _Differentiator(bb, body, self.policy.replayed())
            start = [c if c.dtype == t.dtype else bb.op(Op.CAST, c, dtype=t.dtype)
                     for c, t in zip(here.carries, body_types)]   # a narrowed checkpoint, widened
            inner.forward(start + list(x_t) + list(ks), here.values, here.nested)
            seeds: Ct = {}
            for k, (_, oid) in enumerate(body.outputs[:nc]):
                seeds[oid] = _add_ct(seeds.get(oid), ct_carry[k])
            for k, cy in zip(y_live, ct_y):
                oid = body.outputs[nc + k][1]
                seeds[oid] = _add_ct(seeds.get(oid), cy)
            got = inner.backward(seeds)
            def ct_of(k: int) -> Value:
                v = got.get(body.inputs[k])
                return v if v is not None else _zeros(bb, body_types[k])
            new_c = [ct_of(k) for k in range(nc)]
            new_acc = [acc[m] + ct_of(nc + nx_ + j) for m, j in enumerate(diff_k)]
            ys = [ct_of(nc + j) for j in diff_x]
            return new_c + new_acc, ys

        acc0 = [_zeros(b, consts[j].type) for j in diff_k]
        ct_ys = [cts[nc + k] for k in y_live]
        (out_c, ys) = b.scan(bwd, ct_c + acc0, flat + list(xs) + ct_ys, consts,
                             length=length, reverse=not a["reverse"], name=f"{body.name}_bwd",
                             role=a.get("role", "loop"))
        grads: list[Value | None] = list(out_c[:nc]) + [None] * (nx_ + len(consts))
        for m, j in enumerate(diff_x):
            grads[nc + j] = ys[m]
        for m, j in enumerate(diff_k):
            grads[nc + nx_ + j] = out_c[nc + m]
        return grads


@dataclass(frozen=True)
class Autodiff:
    """The training graph of a forward graph: `grad_graph(g, wrt, policy=policy)`.

    Pre: `g` verifies and has a scalar output `loss`. Post: `loss` unchanged, plus
    `grad.<name>` = d loss / d input `<name>` for each name in `wrt`; each scan's backward is a
    reverse scan that recomputes what `policy` does not save."""
    wrt: tuple[str, ...]
    policy: "Policy | None" = None
    name: ClassVar[str] = "autodiff"

    def __call__(self, g: Graph) -> Graph:
        return grad_graph(g, list(self.wrt), policy=self.policy)


def grad_graph(g: Graph, wrt: list[str], loss: str = "loss", name: str = "grad",
               policy: "Policy | None" = None) -> Graph:
    """Forward + backward: outputs `loss` and `grad.<name>` for each input named in `wrt`.
    `policy` says what scans save for their backward (default: carries only)."""
    from titanc.passes.remat import Policy
    b = Builder(name)
    args = [b.op(Op.INPUT, name=g.node(i).attr("name"), type=g.node(i).type) for i in g.inputs]
    d = _Differentiator(b, g, policy or Policy("recompute"))
    d.forward(args)
    loss_id = g.output(loss)
    lv = d.env[loss_id]
    ct = d.backward({loss_id: b.full(1.0, (), lv.dtype)})
    outs = [(loss, lv.id)]
    for nm in wrt:
        i = g.input_by_name(nm)
        gv = ct.get(i)
        gv = gv if gv is not None else _zeros(b, g.node(i).type)
        outs.append((f"grad.{nm}", gv.id))
    b.graph.set_outputs(outs)
    return b.graph


def derivative(g: Graph, wrt: str, loss: str = "loss") -> Graph:
    """d `loss` / d input `wrt` as a graph of its own, over all of `g`'s inputs: its one
    output `grad.<wrt>`, canonicalised (the forward nodes the derivative does not read are
    gone). A frontend inlines it (`Builder.inline`) where it needs a derivative it does not
    write by hand: the memory's inner objective (titanc/model/objective.py). Pre: as
    `grad_graph`; `g` has no scan (nothing here saves a scan's residuals)."""
    from titanc.passes.canonicalize import Canonicalize
    full = grad_graph(g, [wrt], loss=loss, name=f"d_{g.name}")
    keep = full.output(f"grad.{wrt}")
    full.set_outputs([(f"grad.{wrt}", keep)])
    return Canonicalize()(full)
