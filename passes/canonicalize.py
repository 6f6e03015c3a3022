"""canonicalize: constant folding, algebraic simplification, CSE and DCE, to a fixpoint.

Precondition: `g` verifies. Postcondition: the result verifies, computes the same outputs,
has no two nodes with equal (op, operands, attrs), no node unreachable from an output
(INPUTs are kept: they are the signature), no scan output nobody reads, and no rule of
`RULES` applies anywhere (scan bodies included).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar

from titanc.ir import Graph, Node, Op, OpGroup
from titanc.ir.elementwise import ELEMENTWISE
from titanc.ir.structural import STRUCTURAL
from titanc.ir.types import TensorType

Rule = Callable[[Node, "Rewriter"], "int | None"]


class Rewriter:
    """Copies a graph node by node into a new one, applying rules and CSE on the way."""

    def __init__(self, name: str):
        self.g = Graph(name)
        self.memo: dict[tuple, int] = {}

    def node(self, nid: int) -> Node:
        return self.g.node(nid)

    def emit(self, op: Op, inputs: tuple[int, ...], attrs: dict[str, Any],
             type: Any = None) -> int:
        key = (op, inputs, tuple(sorted(attrs.items(), key=lambda kv: kv[0])))
        if op is not Op.INPUT:
            try:
                hit = self.memo.get(key)
            except TypeError:
                hit = None
            if hit is not None:
                return hit
        nid = self.g.add(op, inputs, attrs, type)
        proto = self.g.node(nid)
        for rule in RULES.get(op, (fold_constants,) if op in ELEMENTWISE else ()):
            out = rule(proto, self)
            if out is not None and out != nid:
                return out
        if op is not Op.INPUT:
            try:
                self.memo[key] = nid
            except TypeError:
                pass
        return nid

    # helpers for rules ------------------------------------------------------------------------
    def scalar(self, nid: int) -> float | None:
        """The value of a constant that is the same everywhere (FULL, maybe broadcast/moved)."""
        n = self.g.node(nid)
        while n.op in OpGroup.VIEW or n.op is Op.CAST:
            n = self.g.node(n.inputs[0])
        return n.attr("value") if n.op is Op.FULL else None

    def full(self, value: float, t: TensorType) -> int:
        c = self.emit(Op.FULL, (), {"value": float(value), "shape": (), "dtype": t.dtype})
        if t.shape == ():
            return c
        return self.emit(Op.EXPAND, (c,), {"shape": t.shape})


# -- rules: each returns the id that replaces the node, or None ---------------------------------

def _is(r: Rewriter, nid: int, v: float) -> bool:
    return r.scalar(nid) == v


def _same(r: Rewriter, n: Node, k: int) -> int | None:
    """Operand k if it already has the node's type (no broadcasting hidden in the op)."""
    return n.inputs[k] if r.node(n.inputs[k]).type == n.type else None


def fold_constants(n: Node, r: Rewriter) -> int | None:
    # op(c1, c2) -> c   when every operand is a uniform constant (the op's registry `fold`;
    # outside its domain, nothing folds)
    vals = [r.scalar(i) for i in n.inputs]
    if not vals or any(v is None for v in vals) or n.op not in ELEMENTWISE:
        return None
    try:
        v = ELEMENTWISE[n.op].fold(*vals)
    except (OverflowError, ZeroDivisionError, ValueError):
        return None
    return r.full(v, n.type)


def add_zero(n: Node, r: Rewriter) -> int | None:
    # x + 0 -> x ; 0 + x -> x ; x - 0 -> x
    if _is(r, n.inputs[1], 0.0):
        return _same(r, n, 0)
    if n.op is Op.ADD and _is(r, n.inputs[0], 0.0):
        return _same(r, n, 1)
    return None


def mul_identity(n: Node, r: Rewriter) -> int | None:
    # x * 1 -> x ; 1 * x -> x ; x * 0 -> 0 ; x / 1 -> x
    if _is(r, n.inputs[1], 1.0):
        return _same(r, n, 0)
    if n.op is Op.MUL and _is(r, n.inputs[0], 1.0):
        return _same(r, n, 1)
    if n.op is Op.MUL and (_is(r, n.inputs[0], 0.0) or _is(r, n.inputs[1], 0.0)):
        return r.full(0.0, n.type)
    return None


def zero_through(n: Node, r: Rewriter) -> int | None:
    # einsum(.., 0, ..) -> 0 ; sum(0) -> 0 ; -0 -> 0 ; pad/concat/cumsum(0) -> 0 ; the op's
    # structural entry says which operands must be zero (`zero`); NEG: its only one
    how = STRUCTURAL[n.op].zero if n.op in STRUCTURAL else "all"
    if how == "any":
        zero = any(_is(r, i, 0.0) for i in n.inputs)
    elif how == "first":                              # data operand first, index second
        zero = _is(r, n.inputs[0], 0.0)
    else:
        zero = all(_is(r, i, 0.0) for i in n.inputs)
    # a view of the FULL itself is already the canonical zero (FULL + EXPAND)
    if zero and not (n.op in OpGroup.VIEW and r.node(n.inputs[0]).op is Op.FULL):
        return r.full(0.0, n.type)
    return None


def neg_neg(n: Node, r: Rewriter) -> int | None:
    # -(-x) -> x
    x = r.node(n.inputs[0])
    return x.inputs[0] if x.op is Op.NEG else None


def identity_move(n: Node, r: Rewriter) -> int | None:
    # reshape/expand to the same shape, identity permute, full slice, same-dtype cast -> x
    if n.op is Op.PERMUTE and tuple(n.attr("perm")) != tuple(range(len(n.attr("perm")))):
        return None                               # a transpose of equal axes keeps the type
    return _same(r, n, 0)


def collapse_moves(n: Node, r: Rewriter) -> int | None:
    # reshape(reshape(x)) -> reshape(x) ; permute(permute(x, p), q) -> permute(x, p∘q)
    x = r.node(n.inputs[0])
    if n.op is Op.RESHAPE and x.op is Op.RESHAPE:
        return r.emit(Op.RESHAPE, x.inputs, {"shape": n.attr("shape")})
    if n.op is Op.PERMUTE and x.op is Op.PERMUTE:
        p, q = x.attr("perm"), n.attr("perm")
        return r.emit(Op.PERMUTE, x.inputs, {"perm": tuple(p[i] for i in q)})
    if n.op is Op.EXPAND and x.op is Op.EXPAND:
        return r.emit(Op.EXPAND, x.inputs, {"shape": n.attr("shape")})
    return None


def cumsum_total(n: Node, r: Rewriter) -> int | None:
    # slice(cumsum(x, a), the last position along a) -> sum(x, a, keepdim): the running sum's
    # end is the total (a reverse cumsum's: its first position), which no longer waits for
    # the cumsum (the memory's chunk decay: its cumulative log-keep and the chunk's total)
    x = r.node(n.inputs[0])
    if x.op is not Op.CUMSUM or n.attr("axis") != x.attr("axis"):
        return None
    a = n.attr("axis")
    size = x.type.shape[a]
    end = (0, 1) if x.attr("reverse") else (size - 1, size)
    if (n.attr("start"), n.attr("stop")) != end:
        return None
    return r.emit(Op.SUM, x.inputs, {"axes": (a,), "keepdim": True})


WIDER = {"bf16": 0, "f32": 1, "f64": 2}


def sum_narrow(n: Node, r: Rewriter) -> int | None:
    # index_add(cast(x, wide)) -> index_add[dtype=wide](x): the narrow gradient (a bf16
    # embedding cotangent) is read as it is and summed in the wide dtype (widening is exact)
    x = r.node(n.inputs[0])
    if x.op is not Op.CAST or not isinstance(x.type, TensorType):
        return None
    src = r.node(x.inputs[0]).type
    if WIDER.get(src.dtype, 9) >= WIDER.get(x.type.dtype, -1):
        return None
    return r.emit(Op.INDEX_ADD, (x.inputs[0], n.inputs[1]), {**n.attr_dict,
                                                             "dtype": x.type.dtype})


def widen_narrow(n: Node, r: Rewriter) -> int | None:
    # cast(cast(x, wide), narrow) -> x where x is narrow: widening is exact (a bf16 cotangent
    # through the VJPs of a float32 residual add and of the cast back to bf16)
    x = r.node(n.inputs[0])
    if x.op is not Op.CAST:
        return None
    src = r.node(x.inputs[0])
    if (src.type.dtype == n.type.dtype
            and WIDER.get(src.type.dtype, 9) < WIDER.get(x.type.dtype, -1)):
        return src.id
    return None


def constant_ys(n: Node, r: Rewriter) -> int | None:
    """An ITEM of a scan's y that its body computes as one constant everywhere (a FULL,
    maybe broadcast: a cotangent that is zero at every iteration) is that constant at the
    stacked shape; the y is then unread and `_prune_scan_outputs` drops it from the body."""
    scan = r.node(n.inputs[0])
    k = n.attr("index")
    if scan.op is not Op.SCAN or k < scan.attr("n_carry"):
        return None
    body: Graph = scan.attr("body")
    v = body.node(body.outputs[k][1])
    while v.op in OpGroup.VIEW or v.op is Op.CAST:
        v = body.node(v.inputs[0])
    return None if v.op is not Op.FULL else r.full(v.attr("value"), n.type)


RULES: dict[Op, tuple[Rule, ...]] = {}      # an elementwise op missing here: fold_constants
RULES[Op.ADD] = (fold_constants, add_zero)
RULES[Op.SUB] = (fold_constants, add_zero)
RULES[Op.MUL] = (fold_constants, mul_identity)
RULES[Op.DIV] = (fold_constants, mul_identity)
RULES[Op.NEG] = (fold_constants, neg_neg, zero_through)
for _op in (Op.RESHAPE, Op.PERMUTE, Op.EXPAND, Op.SLICE, Op.CAST):
    RULES[_op] = RULES.get(_op, ()) + (identity_move, collapse_moves)
for _op, _entry in STRUCTURAL.items():
    if _entry.zero:
        RULES[_op] = RULES.get(_op, ()) + (zero_through,)
RULES[Op.INDEX_ADD] += (sum_narrow,)
RULES[Op.CAST] += (widen_narrow,)
RULES[Op.SLICE] += (cumsum_total,)
RULES[Op.ITEM] = (constant_ys,)


# -- the driver ---------------------------------------------------------------------------------

def _copy(g: Graph, live: set[int] | None = None, bodies: bool = False) -> Graph:
    """Re-emit `g` through the rules and CSE; `bodies` also canonicalizes scan bodies."""
    r = Rewriter(g.name)
    env: dict[int, int] = {}
    for node in g:
        if live is not None and node.id not in live and node.op is not Op.INPUT:
            continue
        ins = tuple(env[i] for i in node.inputs)
        attrs = node.attr_dict
        if node.op is Op.SCAN and bodies:
            attrs["body"] = canonicalize(attrs["body"])
        # a copy keeps each node's type (its inputs are copies of the same types, or values
        # the rules proved equal), so it is not inferred again
        env[node.id] = r.emit(node.op, ins, attrs, node.type)
    r.g.set_outputs([(name, env[i]) for name, i in g.outputs])
    return r.g


def _prune_scan_outputs(g: Graph) -> Graph:
    """Drop scan ys nobody reads (ITEMs without users), renumbering the remaining ITEMs
    (`g` itself when every scan output is read)."""
    live = g.reachable_from_outputs()
    if not any(_unread_scan_outputs(g, n, live) for n in g if n.op is Op.SCAN):
        return g
    out = Graph(g.name)
    env: dict[int, int] = {}
    for node in g:
        if node.op is Op.ITEM and node.id not in live:
            continue
        attrs = node.attr_dict
        ins = tuple(env.get(i, -1) for i in node.inputs)
        if node.op is Op.SCAN:
            nc = attrs["n_carry"]
            used = sorted({g.node(u).attr("index") for u in g.users(node.id)
                           if u in live} | set(range(nc)))
            body: Graph = attrs["body"]
            if len(used) < len(body.outputs):
                nb = body.copy()
                nb.set_outputs([body.outputs[k] for k in used])
                attrs["body"] = _dce(nb)
            env[node.id] = out.add(node.op, ins, attrs)
            remap = {old: new for new, old in enumerate(used)}
            for u in g.users(node.id):
                if u in live:
                    env[u] = out.add(Op.ITEM, (env[node.id],), {"index": remap[g.node(u).attr("index")]})
            continue
        if node.id in env:
            continue
        env[node.id] = out.add_like(node, ins)
    out.set_outputs([(name, env[i]) for name, i in g.outputs])
    return out


def _unread_scan_outputs(g: Graph, scan: Node, live: set[int]) -> bool:
    """Does `scan` have a result (carry or y) that no live ITEM reads, or a dead ITEM?"""
    read = {g.node(u).attr("index") for u in g.users(scan.id) if u in live} | set(
        range(scan.attr("n_carry")))                     # carries are kept either way
    items = [u for u in g.users(scan.id) if g.node(u).op is Op.ITEM]
    return len(read) < len(scan.attr("body").outputs) or any(u not in live for u in items)


def _dce(g: Graph) -> Graph:
    """`g` without the nodes no output reads (`g` itself when there are none; INPUTs stay)."""
    live = g.reachable_from_outputs()
    if all(n.id in live or n.op is Op.INPUT for n in g):
        return g
    return _copy(g, live)


@dataclass(frozen=True)
class Canonicalize:
    """Fold constants, apply the rule table, CSE, DCE (scan bodies too), prune unread scan
    outputs, until nothing changes or `max_rounds` rounds.

    Pre: `g` verifies. Post: same outputs with the same values; no node whose value no output
    reads; no two nodes with the same op, operands and attrs."""
    max_rounds: int = 4
    name: ClassVar[str] = "canonicalize"

    def __call__(self, g: Graph) -> Graph:
        cur = _copy(g, bodies=True)
        for _ in range(self.max_rounds):
            nxt = _dce(_prune_scan_outputs(_dce(cur)))
            if len(nxt) == len(cur):
                return nxt
            cur = _copy(nxt)
        return cur


canonicalize = Canonicalize()
