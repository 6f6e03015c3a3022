"""The scan kernel's per-op rules: the TRITON_SCAN lowering table (`ir/lowering.py`).

One `ScanRule` per op says whether a node of that op stays inside a scan kernel and how the
kernel holds it:

    stage    how `loops.body` emits the node:
               "input"     a body input, bound by its scan before the body
               "item"      an ITEM of a nested scan, bound by that scan's loop
               "literal"   a FULL: the literal inlined at every read
               "table"     a MASK / ROPE table: made on the host, a kernel tensor
               "view"      computed by index arithmetic on its consumers' loads (`value`)
               "pointwise" inlined into its single user, else stored by a flat stage
                           (`stages.pointwise_run`); its value at coordinates is `value`
               "einsum"    `tl.dot` on tiles (`einsum.py`)
               "reduce"    a [rows, cols] tile reduction (`reduce.py`), `combine` names it
               "scan"      a nested loop (`loops.scan_loop`)
               "expand"    a pattern op the kernel writes back as its primitive chain first
                           (`passes.flash_attention.expand_attention`)
               "none"      not in scan kernels: `why_not` is the reason the scan falls back
    pax      (n, operand paxes, scope, bad) -> where the independent axes sit in the node's
             value, or None ("shared"); `bad(why)` is the `PaxError` to raise where the op
             mixes them (the independence analysis, `independence.pax_of`)
    value    (emitter, tile, scope, n, coords, conds) -> a Triton expression for the node's
             value at `coords` (0 where a condition of `conds` fails), reading operands with
             `emitter.read(tile, scope, vid, coords, conds)`
    expr     (emitter, n, operand expressions) -> the pointwise op's expression
    combine  a reduction's combination: "sum", "max" or "cumsum"
    inline_stored  inlined into every user even when its operand is stored (a cast: one
             rounding per read is cheaper than a stage)
    check    n -> why this node is refused ("" where it fits), e.g. an integer cast

A body node whose op has no rule raises `ScanFallback` naming the op and this table
(`scan_rule`): the scan runs as its host loop and the executor and report.json say why.
Every arithmetic elementwise op of the registry (`ir/elementwise.py`) gets the pointwise rule
with its registry entry's Triton expression when this module is imported.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Any, Callable

from titanc.ir import Graph, Node, Op
from titanc.ir.elementwise import ELEMENTWISE
from titanc.ir.lowering import register_lowering

from titanc.codegen.lower.lowerings import TRITON_SCAN
from titanc.codegen.scan.index import PaxError, ScanFallback, bcast, reshape_coords

__all__ = ["LOW_CASTS", "ScanRule", "TRITON_SCAN", "expands", "scan_rule", "stage_of"]

Pax = tuple[int, ...] | None
STAGES = ("input", "item", "literal", "table", "view", "pointwise", "einsum", "reduce", "scan",
          "expand", "none")
# float casts a scan kernel renders (a bf16 one rounds and stays in the compute dtype)
LOW_CASTS = ("f32", "f64", "bf16")


@dataclass(frozen=True)
class ScanRule:
    """How a scan kernel holds one op (the fields: this module's docstring)."""

    stage: str
    pax: Callable[[Node, list[Pax], Any, Callable[[str], PaxError]], Pax] | None = None
    value: Callable[..., str] | None = None
    expr: Callable[[Any, Node, list[str]], str] | None = None
    combine: str = ""
    inline_stored: bool = False
    check: Callable[[Node], str] | None = None
    why_not: str = ""

    def __post_init__(self) -> None:
        if self.stage not in STAGES:
            raise ValueError(f"ScanRule stage {self.stage!r}: one of {STAGES}")


def scan_rule(n: Node) -> ScanRule:
    """Node `n`'s rule; `ScanFallback` naming its op where TRITON_SCAN has none."""
    rule = TRITON_SCAN.rules.get(n.op)
    if rule is None:
        raise ScanFallback(f"%{n.id}: no scan-kernel rule for {n.op.name} (TRITON_SCAN: "
                           f"register_lowering(Op.{n.op.name}, TRITON_SCAN, ScanRule(...)), "
                           "codegen/scan/rules.py)")
    return rule


def stage_of(n: Node) -> str:
    """Node `n`'s stage ("" where its op has no rule)."""
    rule = TRITON_SCAN.rules.get(n.op)
    return rule.stage if rule is not None else ""


def expands(body: Graph) -> bool:
    """Does `body` (or a nested body) hold a pattern op the kernel writes back as its chain?"""
    return any(stage_of(n) == "expand" or (stage_of(n) == "scan" and expands(n.attr("body")))
               for n in body)


def _rule(ops: Any, rule: ScanRule) -> None:
    for op in ops:
        register_lowering(op, TRITON_SCAN, rule)


def _where(conds: tuple[str, ...], x: str) -> str:
    return f"tl.where({' & '.join(f'({c})' for c in conds)}, {x}, 0.0)"


# -- independence: where the independent axes sit in a node's value -------------------------

def _pax_elementwise(n: Node, ins: list[Pax], sc: Any, bad: Callable[[str], PaxError]) -> Pax:
    """Operands' axes right-aligned (numpy broadcasting), all the same."""
    R = len(n.type.shape)
    got = {tuple(R - sc.g.node(i).type.rank + x for x in q)
           for i, q in zip(n.inputs, ins) if q is not None}
    if len(got) > 1:
        raise bad(f"misaligns (operand axes {sorted(got)} of)")
    return got.pop() if got else None


def _pax_concat(n: Node, ins: list[Pax], sc: Any, bad: Callable[[str], PaxError]) -> Pax:
    got = {q for q in ins if q is not None}
    if len(got) > 1:
        raise bad(f"misaligns (operand axes {sorted(got)} of)")
    q = got.pop() if got else None
    if q is not None and n.attr("axis") % len(n.type.shape) in q:
        raise bad("concatenates along")
    return q


def _pax_einsum(n: Node, ins: list[Pax], sc: Any, bad: Callable[[str], PaxError]) -> Pax:
    """The letters of the independent axes, the same in every operand, kept in the output."""
    terms, out = n.attr("spec").split("->")
    lets = {tuple(t[x] for x in q) for t, q in zip(terms.split(","), ins) if q is not None}
    if len(lets) > 1:
        raise bad(f"misaligns (letters {sorted(lets)} of)")
    if not lets:
        return None
    ls = lets.pop()
    if any(ch not in out for ch in ls):
        raise bad("contracts")
    return tuple(out.index(ch) for ch in ls)


def _pax_reduce(n: Node, ins: list[Pax], sc: Any, bad: Callable[[str], PaxError]) -> Pax:
    q = ins[0]
    if q is None:
        return None
    axes = [x % len(sc.g.node(n.inputs[0]).type.shape) for x in n.attr("axes")]
    if set(axes) & set(q):
        raise bad("reduces")
    return q if n.attr("keepdim") else tuple(x - sum(1 for y in axes if y < x) for x in q)


def _pax_along(n: Node, ins: list[Pax], sc: Any, bad: Callable[[str], PaxError]) -> Pax:
    """An op along one axis (cumsum, slice, pad): any but the independent ones."""
    q = ins[0]
    if q is not None and n.attr("axis") % len(n.type.shape) in q:
        raise bad("runs along")
    return q


def _pax_same(n: Node, ins: list[Pax], sc: Any, bad: Callable[[str], PaxError]) -> Pax:
    return ins[0]


def _pax_permute(n: Node, ins: list[Pax], sc: Any, bad: Callable[[str], PaxError]) -> Pax:
    q = ins[0]
    return None if q is None else tuple(list(n.attr("perm")).index(x) for x in q)


def _pax_expand(n: Node, ins: list[Pax], sc: Any, bad: Callable[[str], PaxError]) -> Pax:
    q = ins[0]
    if q is None:
        return None
    r = sc.g.node(n.inputs[0]).type.rank
    return tuple(x + len(n.type.shape) - r for x in q)


def _pax_reshape(n: Node, ins: list[Pax], sc: Any, bad: Callable[[str], PaxError]) -> Pax:
    """Each independent axis kept whole: an output axis of its size with the same product
    of sizes before it."""
    q = ins[0]
    if q is None:
        return None
    src, shape = sc.g.node(n.inputs[0]).type.shape, n.type.shape
    out = []
    for x in q:
        before = prod(src[:x])
        j = next((j for j in range(len(shape)) if prod(shape[:j]) == before
                  and shape[j] == src[x]), None)
        if j is None:
            raise bad("reshapes")
        out.append(j)
    return tuple(out)


def _pax_take_along(n: Node, ins: list[Pax], sc: Any, bad: Callable[[str], PaxError]) -> Pax:
    q = ins[0]
    if q is None:
        return None
    if len(n.type.shape) in q or (ins[1] is not None and ins[1] != q):
        raise bad("gathers along")
    return q


# -- values at coordinates ------------------------------------------------------------------

def _permute(em: Any, sec: Any, sc: Any, n: Node, c: list[str], conds: tuple[str, ...]) -> str:
    inner = ["0"] * len(n.attr("perm"))
    for i, p in enumerate(n.attr("perm")):
        inner[p] = c[i]
    return em.read(sec, sc, n.inputs[0], inner, conds)


def _expand(em: Any, sec: Any, sc: Any, n: Node, c: list[str], conds: tuple[str, ...]) -> str:
    src = n.inputs[0]
    return em.read(sec, sc, src, bcast(c, n.type.shape, sc.g.node(src).type.shape), conds)


def _slice(em: Any, sec: Any, sc: Any, n: Node, c: list[str], conds: tuple[str, ...]) -> str:
    ax, start = n.attr("axis") % n.type.rank, n.attr("start")
    c = list(c)
    c[ax] = f"({c[ax]} + {start})" if start else c[ax]
    return em.read(sec, sc, n.inputs[0], c, conds)


def _reshape(em: Any, sec: Any, sc: Any, n: Node, c: list[str], conds: tuple[str, ...]) -> str:
    src = n.inputs[0]
    return em.read(sec, sc, src, reshape_coords(c, n.type.shape, sc.g.node(src).type.shape),
                   conds)


def _pad(em: Any, sec: Any, sc: Any, n: Node, c: list[str], conds: tuple[str, ...]) -> str:
    """The operand where the coordinate falls inside it, else 0."""
    src, ax, before = n.inputs[0], n.attr("axis") % n.type.rank, n.attr("before")
    size = sc.g.node(src).type.shape[ax]
    c = list(c)
    c[ax] = f"({c[ax]} - {before})" if before else c[ax]
    return em.read(sec, sc, src, c, conds + (f"{c[ax]} >= 0", f"{c[ax]} < {size}"))


def _concat(em: Any, sec: Any, sc: Any, n: Node, c: list[str], conds: tuple[str, ...]) -> str:
    """Each piece read where the coordinate falls inside it, selected by nested wheres."""
    ax = n.attr("axis") % n.type.rank
    lo, parts = 0, []
    for s in n.inputs:
        size = sc.g.node(s).type.shape[ax]
        cc = list(c)
        cc[ax] = f"({c[ax]} - {lo})" if lo else c[ax]
        parts.append((lo + size, em.read(sec, sc, s, cc, conds + (
            f"{c[ax]} >= {lo}", f"{c[ax]} < {lo + size}"))))
        lo += size
    out = parts[-1][1]
    for hi, v in reversed(parts[:-1]):
        out = em.let(f"tl.where({c[ax]} < {hi}, {v}, {out})",
                     tile=v in em.tiles or out in em.tiles)
    return out


def _take(em: Any, sec: Any, sc: Any, n: Node, c: list[str], conds: tuple[str, ...]) -> str:
    """table[idx[i...], j...] (a prologue gather, read through)."""
    r = sc.g.node(n.inputs[1]).type.rank
    idx = em.read(sec, sc, n.inputs[1], list(c[:r]), conds)
    return em.read(sec, sc, n.inputs[0], [idx] + list(c[r:]), conds)


def _take_along(em: Any, sec: Any, sc: Any, n: Node, c: list[str],
                conds: tuple[str, ...]) -> str:
    """x[..., idx[...]]"""
    idx = em.read(sec, sc, n.inputs[1], c, conds)
    return em.read(sec, sc, n.inputs[0], list(c) + [idx], conds)


def _scatter_along(em: Any, sec: Any, sc: Any, n: Node, c: list[str],
                   conds: tuple[str, ...]) -> str:
    """grad[...] where idx[...] == j"""
    g = em.read(sec, sc, n.inputs[0], c[:-1], conds)
    idx = em.read(sec, sc, n.inputs[1], c[:-1], conds)
    return em.let(f"tl.where({idx} == {c[-1]}, {g}, 0.0)",
                  tile=g in em.tiles or idx in em.tiles)


def _pointwise(em: Any, sec: Any, sc: Any, n: Node, c: list[str],
               conds: tuple[str, ...]) -> str:
    """An inlined elementwise node: its expression (`expr`) of its operands, broadcast."""
    args = [em.read(sec, sc, i, bcast(c, n.type.shape, sc.g.node(i).type.shape), conds)
            for i in n.inputs]
    tile = any(x in em.tiles for x in args)
    r = em.let(scan_rule(n).expr(em, n, args), tile=tile)
    if conds:                                 # a pad / concat above: 0 outside
        r = em.let(_where(conds, r), tile=tile)
    return r


def _registry_expr(em: Any, n: Node, args: list[str]) -> str:
    """The registry entry's Triton expression, rounded as a bf16 value's storage would."""
    return em.rounded(n, ELEMENTWISE[n.op].triton.format(*[f"({x})" for x in args]))


def _formula(fmt: str) -> Callable[[Any, Node, list[str]], str]:
    def expr(em: Any, n: Node, args: list[str]) -> str:
        return em.rounded(n, fmt.format(*[f"({x})" for x in args]))
    return expr


def _cast_check(n: Node) -> str:
    return "" if n.attr("dtype") in LOW_CASTS else f"cast to {n.attr('dtype')}"


def _cast_expr(em: Any, n: Node, args: list[str]) -> str:
    """A float cast: a bf16 one rounds to bf16 and is held in the compute dtype."""
    if _cast_check(n):
        raise ScanFallback(f"%{n.id}: {_cast_check(n)}")
    if n.attr("dtype") == "bf16":
        return f"_bf16(({args[0]}).to(tl.float32)).to({em.cd})"
    return f"({args[0]}).to({em.cd})"


# -- the table ------------------------------------------------------------------------------

POINTWISE = ScanRule("pointwise", _pax_elementwise, _pointwise, _registry_expr)

_rule([Op.INPUT], ScanRule("input"))
_rule([Op.ITEM], ScanRule("item"))
_rule([Op.FULL], ScanRule("literal"))
_rule([Op.MASK, Op.ROPE], ScanRule("table"))
_rule([Op.SCAN], ScanRule("scan"))
_rule([Op.EINSUM], ScanRule("einsum", _pax_einsum))
_rule([Op.SUM], ScanRule("reduce", _pax_reduce, combine="sum"))
_rule([Op.AMAX], ScanRule("reduce", _pax_reduce, combine="max"))
_rule([Op.CUMSUM], ScanRule("reduce", _pax_along, combine="cumsum"))
_rule([Op.PERMUTE], ScanRule("view", _pax_permute, _permute))
_rule([Op.EXPAND], ScanRule("view", _pax_expand, _expand))
_rule([Op.SLICE], ScanRule("view", _pax_along, _slice))
_rule([Op.RESHAPE], ScanRule("view", _pax_reshape, _reshape))
_rule([Op.PAD], ScanRule("view", _pax_along, _pad))
_rule([Op.CONCAT], ScanRule("view", _pax_concat, _concat))
_rule([Op.TAKE_ALONG], ScanRule("pointwise", _pax_take_along, _take_along))
_rule([Op.SCATTER_ALONG], ScanRule("pointwise", _pax_same, _scatter_along))
_rule(ELEMENTWISE, POINTWISE)
# sigmoid spelled out: the same formula as tl.sigmoid, without a nested @jit call (which
# costs the interpreter a re-patch of triton.language per call)
_rule([Op.SIGMOID], ScanRule("pointwise", _pax_elementwise, _pointwise,
                             _formula("1.0 / (1.0 + tl.exp(-{0}))")))
_rule([Op.SILU], ScanRule("pointwise", _pax_elementwise, _pointwise,
                          _formula("{0} / (1.0 + tl.exp(-{0}))")))
_rule([Op.CAST], ScanRule("pointwise", _pax_elementwise, _pointwise, _cast_expr,
                          inline_stored=True, check=_cast_check))
_rule([Op.TAKE], ScanRule("none", value=_take, why_not=(
    "a gather (TAKE) in a scan body is not in scan kernels (one in the kernel's prologue, "
    "a carry's initial rows, is read through)")))
_rule([Op.INDEX_ADD], ScanRule("none", why_not=(
    "a scatter-add (INDEX_ADD) is not in scan kernels (its kernel is a template of its own, "
    "TRITON_KERNEL)")))
_rule([Op.ATTENTION, Op.ATTENTION_BWD], ScanRule("expand"))
_rule([Op.LINEAR_CROSS_ENTROPY, Op.LINEAR_CROSS_ENTROPY_BWD, Op.ADAMW], ScanRule(
    "none", why_not="a pattern op other than attention is a template kernel of its own, not "
                    "in scan kernels"))
