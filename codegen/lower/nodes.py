"""Lowering a kernel's IR nodes to Triton statements: the part of the hooks that reads the IR.

`KernelLowering` knows one kernel of one schedule: which of its nodes are computed (once per
element of their domain) and which are free (generators, and views of values read from
memory), the tensors it reads and writes, and the compute dtype. Given a `Section` and
coordinates it produces values:

- `read(sec, v, coords)`: value `v` at `coords` when `v` is not computed here: a kernel input
  (a masked `tl.load` through the tensor's own strides), an immediate (a literal), or a free
  node, composed down to its operands by its rule in the triton target's index table
  (`lowerings.TRITON_INDEX`, the built-in rules at the end of this module):
  PERMUTE/EXPAND/SLICE/RESHAPE remap coordinates, PAD
  and CONCAT add validity conditions (and a `tl.where` chain for CONCAT), TAKE/TAKE_ALONG load
  the index first, a float CAST converts the value it loads (bf16: rounded to nearest even),
  and FULL, ROPE and MASK are computed from the coordinates (ROPE in float64, as the reference
  does, then rounded to the node's dtype: only a lone ROPE kernel the plan could not bind as a
  constant table, since fusion never puts a ROPE into another kernel);
- `compute(sec, node, coords)`: an elementwise node (or CAST, or a gather) from its operands;
  operands computed in the same section are reused, anything else is `read` at the operand's
  broadcast coordinates.

Everything becomes statements checked by `expr.check_statement`; tensors are named `in<k>`
(read) and `out<k>` (written) in first-use order, so rendering is deterministic. Loads are
not cast: hooks render for the dtype the storage holds (`graph_dtype`, or the executor's
float dtype), and index arithmetic is int64.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Collection, Sequence

import torch

from titanc.ir import Graph, Node, Op, OpGroup
from titanc.ir.elementwise import ELEMENTWISE
from titanc.ir.lowering import register_lowering
from titanc.ir.types import TensorType
from titanc.ir.schedule import Kernel, is_immediate

from titanc.codegen.lower.expr import format_number
from titanc.codegen.lower.lowerings import TRITON_INDEX
from titanc.codegen.lower.indexing import (Ix, Section, broadcast_coords, const, delinearize, reshape_coords,
                       shift)

__all__ = ["KernelLowering", "Val", "GATHERS"]

GATHERS = frozenset({Op.TAKE, Op.TAKE_ALONG})

@dataclass(frozen=True)
class Val:
    """A value in a section: a variable (or literal) varying along `dims`."""

    expr: str
    dims: frozenset[str] = frozenset()
    literal: float | None = None
    is_int: bool = False


def _float_cast(g: Graph, n: Node) -> bool:
    return n.type.is_float and g.node(n.inputs[0]).type.is_float


def literal(x: float) -> Val:
    return Val(format_number(x), frozenset(), float(x))


def _cmp(a: Ix, op: str, b: Ix) -> str | bool:
    """`a op b`, folded to a bool when both are constants."""
    if a.value is not None and b.value is not None:
        return {">=": a.value >= b.value, "<": a.value < b.value, "<=": a.value <= b.value}[op]
    return f"{a.expr} {op} {b.expr}"


class KernelLowering:
    """The IR facts and tensor table of one kernel (see the module docstring)."""

    def __init__(self, g: Graph, kernel: Kernel, cd: str, strided: Collection[int] = ()):
        self.g, self.kernel, self.cd = g, kernel, cd
        self.strided = frozenset(strided)          # inputs that may be bound non-dense
        self.inside = set(kernel.nodes)
        self.free: set[int] = set()
        for nid in kernel.nodes:
            n = g.node(nid)
            local = [i for i in n.inputs if i in self.inside]
            if n.op in OpGroup.GENERATOR or (n.op in OpGroup.INDEXING and all(i in self.free for i in local)):
                self.free.add(nid)
            elif n.op is Op.CAST and _float_cast(g, n) and all(i in self.free for i in local):
                self.free.add(nid)                      # converted as it is loaded
        self.tensors: dict[int, tuple[str, int]] = {}       # value -> (name, rank), first use
        self.direct: dict[int, str] = {}                    # value -> template-loaded input

    # -- tensors -------------------------------------------------------------------------------
    def tensor(self, vid: int, prefix: str = "in") -> str:
        """The kernel argument naming value `vid` (registered on first use)."""
        if vid not in self.tensors:
            k = sum(1 for name, _ in self.tensors.values() if name.startswith(prefix))
            self.tensors[vid] = (f"{prefix}{k}", self.node(vid).type.rank)
        return self.tensors[vid][0]

    def indexed(self) -> list[tuple[str, int]]:
        return list(self.tensors.values())

    def node(self, vid: int) -> Node:
        return self.g.node(vid)

    def shape(self, vid: int) -> tuple[int, ...]:
        return self.g.node(vid).type.shape

    def computed(self, vid: int) -> bool:
        return vid in self.inside and vid not in self.free

    def where(self, what: str) -> str:
        return f"kernel {self.kernel.name} of graph {self.g.name}: {what}"

    # -- reading values that are not computed here ---------------------------------------------
    def read(self, sec: Section, vid: int, coords: Sequence[Ix],
             valid: tuple[str, ...] = ()) -> Val:
        if vid in sec.values:
            return sec.values[vid]
        if is_immediate(self.g, vid):
            return self.guard(sec, literal(self.node(vid).attr("value")), valid)
        if vid not in self.inside:
            return self.load(sec, vid, coords, valid)
        n = self.node(vid)
        if vid not in self.free and n.op not in GATHERS:
            raise NotImplementedError(self.where(
                f"%{vid} ({n.op.name}) is computed here but read at other coordinates"))
        key = ("read", vid, tuple(c.expr for c in coords), valid, sec.mask)
        if key not in sec.cache:
            sec.cache[key] = self._read_node(sec, n, list(coords), valid)
        return sec.cache[key]

    def _read_node(self, sec: Section, n: Node, c: list[Ix], valid: tuple[str, ...]) -> Val:
        """A free node at `c`: its rule in the triton target's index table."""
        return TRITON_INDEX[n.op](self, sec, n, c, valid)

    def load(self, sec: Section, vid: int, coords: Sequence[Ix], valid: tuple[str, ...],
             stored: bool = False) -> Val:
        """`tl.load` of kernel input `vid` at `coords`, 0 where `valid` fails; in the compute
        dtype, or as stored (`stored`: a 16-bit MMA operand takes its tile as it is)."""
        t = self.node(vid).type
        is_int = not t.is_float
        if (sec.flat is not None and not is_int and not valid and t.numel == sec.numel
                and vid not in self.strided
                and list(coords) == delinearize(sec, sec.flat, t.shape)):
            if vid not in self.direct:                # the template loads it at the flat index
                self.direct[vid] = f"src{len(self.direct)}"
            return Val(self.direct[vid], sec.dims)
        name = self.tensor(vid)
        terms = [f"{c.expr} * stride_{name}_{d}" if c.value != 1 else f"stride_{name}_{d}"
                 for d, c in enumerate(coords) if c.value != 0]
        dims = frozenset().union(*(c.dims for c in coords))
        ptr = f"{name}_ptr" + "".join(f" + {term}" for term in terms)
        # storage holds the compute dtype (hooks render for it), except bf16 tensors of a
        # mixed-precision graph: computed in float32, rounded where they are stored
        cast = f".to({self.cd})" if t.dtype == "bf16" and not stored else ""
        if not dims:                                  # one address for the whole tile
            v = self.let(sec, f"tl.load({ptr}){cast}", [], is_int=is_int)
            return self.guard(sec, v, valid)
        mask = " & ".join([sec.mask, *(f"({v})" for v in valid)])
        return self.let(sec, f"tl.load({ptr}, mask={mask}, other=0){cast}",
                         [Val("", sec.dims)], is_int=is_int, prefix="x")

    def offset(self, sec: Section, vid: int, coords: Sequence[Ix]) -> str:
        """A variable holding, for the whole tile, where output `vid`'s element at `coords`
        goes (in elements, through the output's own strides)."""
        name = self.tensor(vid, "out")
        terms = [f"{c.expr} * stride_{name}_{d}" if c.value != 1 else f"stride_{name}_{d}"
                 for d, c in enumerate(coords) if c.value != 0]
        dims = frozenset().union(*(c.dims for c in coords))
        expr = " + ".join(terms) or "0"
        if dims != sec.dims:                          # a full tile, so the mask applies per lane
            expr = f"{expr} + tl.full({sec.block}, 0, dtype=tl.int32)"
        return sec.let(expr, "o")

    def guard(self, sec: Section, v: Val, valid: tuple[str, ...]) -> Val:
        """`v` where every condition of `valid` holds, else 0."""
        if not valid:
            return v
        if v.literal == 0.0:
            return v
        cond = " & ".join(f"({c})" for c in valid)
        return self.let(sec, f"tl.where({cond}, {v.expr}, 0)", [v, Val("", sec.dims)],
                         is_int=v.is_int)

    def let(self, sec: Section, expr: str, args: Sequence[Val], is_int: bool = False,
             prefix: str = "t") -> Val:
        dims = frozenset().union(*(a.dims for a in args)) if args else frozenset()
        return Val(sec.let(expr, prefix), dims, None, is_int)

    # -- computed nodes ------------------------------------------------------------------------
    def compute(self, sec: Section, n: Node, coords: Sequence[Ix]) -> Val:
        """Value of computed node `n` at its coordinates `coords` (its own shape)."""
        if n.op is Op.RESHAPE:                        # of a value computed here: same element
            if n.inputs[0] not in sec.values:
                raise NotImplementedError(self.where(
                    f"%{n.id} reshapes %{n.inputs[0]}, computed in another domain"))
            return sec.values[n.inputs[0]]
        if n.op in GATHERS:
            return self.read(sec, n.id, coords)
        if n.op is Op.CAST:
            x = self.operand(sec, n, n.inputs[0], coords)
            to = "tl.int64" if n.attr("dtype") == "i64" else self.cd
            if x.literal is not None and n.attr("dtype") != "bf16":
                return literal(x.literal) if to != "tl.int64" else Val(str(int(x.literal)))
            if n.attr("dtype") == "bf16":             # round, keep computing in float32
                return self.round_bf16(sec, self.block(sec, x))
            return self.let(sec, f"{x.expr}.to({to})", [x], is_int=to == "tl.int64")
        if n.op not in ELEMENTWISE:
            raise NotImplementedError(self.where(
                f"%{n.id} ({n.op.name}) has no pointwise lowering"))
        rule = ELEMENTWISE[n.op]
        args = [self.operand(sec, n, i, coords) for i in n.inputs]
        if all(a.literal is not None for a in args):
            return literal(rule.fold(*(a.literal for a in args)))
        fmt = rule.triton
        names = [f"({a.expr})" if a.expr.startswith("-") else a.expr for a in args]
        if n.type.dtype == "bf16":                     # a bf16 result: rounded as stored
            return self.round_bf16(sec, self.block(sec, self.let(sec, fmt.format(*names), args)))
        return self.let(sec, fmt.format(*names), args)

    def round_bf16(self, sec: Section, v: Val) -> Val:
        """`v` (a float32 tile) rounded to the nearest bfloat16, ties to even, kept in float32:
        the value a bf16 tensor stores (`_bf16`, codegen/templates/_bf16.py.jinja)."""
        return self.let(sec, f"_bf16({v.expr})", [v], prefix="r")

    def operand(self, sec: Section, n: Node, vid: int, coords: Sequence[Ix]) -> Val:
        """Operand `vid` of `n` at the element of `n` at `coords`."""
        if vid in sec.values:
            return sec.values[vid]
        if self.computed(vid):
            raise NotImplementedError(self.where(
                f"%{n.id} reads %{vid}, computed in another domain of the kernel"))
        t = self.node(vid).type
        assert isinstance(t, TensorType)
        return self.read(sec, vid, broadcast_coords(coords, n.type.shape, t.shape))

    def block(self, sec: Section, v: Val, dtype: str | None = None) -> Val:
        """`v` as a full tile of the section (constants and scalars broadcast)."""
        if v.dims >= sec.dims and v.literal is None:
            return v
        cd = dtype or ("tl.int64" if v.is_int else self.cd)
        if v.literal is not None:
            return self.let(sec, f"tl.full({sec.block}, {v.expr}, {cd})", [Val("", sec.dims)])
        return self.let(sec, f"{v.expr} + tl.full({sec.block}, 0, dtype={cd})",
                         [Val("", sec.dims)], is_int=v.is_int)


# -- index rules: a free node at coordinates of its own shape (`lowerings.TRITON_INDEX`) ----------

def _as_ix(v: Val) -> Ix:
    if v.literal is not None:
        return const(int(v.literal))
    return Ix(v.expr, v.dims)


def _range(c: Ix, lo: int, hi: int) -> tuple[str, ...] | None:
    """Conditions for lo <= c < hi (None: never true; (): always true)."""
    if c.value is not None:
        return () if lo <= c.value < hi else None
    return (f"{c.expr} >= {lo}", f"{c.expr} < {hi}")


@register_lowering(Op.FULL, TRITON_INDEX)
def _full(low: KernelLowering, sec: Section, n: Node, c: list[Ix], valid: tuple[str, ...]) -> Val:
    return low.guard(sec, literal(n.attr("value")), valid)


@register_lowering(Op.ROPE, TRITON_INDEX)
def _rope(low: KernelLowering, sec: Section, n: Node, c: list[Ix], valid: tuple[str, ...]) -> Val:
    """cos/sin((start + p) * base^(-2j / (2 half))) in float64, rounded to the node dtype."""
    a = n.attr_dict
    p, j = c
    coef = -2.0 / (2 * a["half"]) * math.log(a["base"])
    fn = "cos" if a["kind"] == "cos" else "sin"
    if p.value is not None and j.value is not None:
        ang = (a["start"] + p.value) * math.exp(j.value * coef)
        return low.guard(sec, literal(math.cos(ang) if fn == "cos" else math.sin(ang)), valid)
    pos = (format_number(a["start"] + p.value) if p.value is not None
           else f"({p.expr} + {a['start']}).to(tl.float64)")
    inv = (format_number(math.exp(j.value * coef)) if j.value is not None
           else f"tl.exp({j.expr}.to(tl.float64) * {format_number(coef)})")
    return low.guard(sec, low.let(sec, f"tl.{fn}({pos} * {inv}).to({low.cd})",
                                  [Val("", p.dims | j.dims)]), valid)


@register_lowering(Op.MASK, TRITON_INDEX)
def _mask(low: KernelLowering, sec: Section, n: Node, c: list[Ix], valid: tuple[str, ...]) -> Val:
    """0 where key kj is visible to query qi, -inf elsewhere (`ir.tables.mask_table`):
    a key group ('all', n) is always visible, ('causal', n, window) when its local key
    index j satisfies j <= q_start + qi and q_start + qi - j < window."""
    a = n.attr_dict
    qi, kj = c
    pos = shift(sec, qi, a["q_start"])
    alts: list[str] = []
    off = 0
    for kind, length, window in a["groups"]:
        j = shift(sec, kj, -off)
        conds = [_cmp(j, ">=", const(0)), _cmp(j, "<", const(length))]
        if kind != "all":
            conds.append(_cmp(j, "<=", pos))
            if window is not None:
                conds.append(_cmp(shift(sec, pos, -window), "<", j))
        off += length
        if False in conds:
            continue
        text = [f"({t})" for t in conds if isinstance(t, str)]
        if not text:
            return low.guard(sec, literal(0.0), valid)   # visible for every element of the tile
        alts.append(" & ".join(text))
    if not alts:
        return low.guard(sec, literal(-math.inf), valid)
    cond = " | ".join(f"({t})" if len(alts) > 1 else t for t in alts)
    cast = "" if low.cd == "tl.float32" else f".to({low.cd})"
    return low.guard(sec, low.let(sec, f'tl.where({cond}, 0.0, float("-inf")){cast}',
                                  [Val("", qi.dims | kj.dims)]), valid)


@register_lowering(Op.CAST, TRITON_INDEX)
def _cast(low: KernelLowering, sec: Section, n: Node, c: list[Ix], valid: tuple[str, ...]) -> Val:
    """Of a loaded value: converted as it is loaded."""
    x = low.read(sec, n.inputs[0], c, valid)
    if n.attr("dtype") != "bf16":
        return x                                  # loads are in the compute dtype already
    if x.literal is not None:
        return literal(float(torch.tensor(x.literal).to(torch.bfloat16)))
    return low.round_bf16(sec, x)


@register_lowering(Op.PERMUTE, TRITON_INDEX)
def _permute(low: KernelLowering, sec: Section, n: Node, c: list[Ix],
             valid: tuple[str, ...]) -> Val:
    perm = n.attr("perm")
    inner = [const(0)] * len(perm)
    for i, p in enumerate(perm):
        inner[p] = c[i]
    return low.read(sec, n.inputs[0], inner, valid)


@register_lowering(Op.EXPAND, TRITON_INDEX)
def _expand(low: KernelLowering, sec: Section, n: Node, c: list[Ix],
            valid: tuple[str, ...]) -> Val:
    src = n.inputs[0]
    return low.read(sec, src, broadcast_coords(c, n.type.shape, low.shape(src)), valid)


@register_lowering(Op.SLICE, TRITON_INDEX)
def _slice(low: KernelLowering, sec: Section, n: Node, c: list[Ix], valid: tuple[str, ...]) -> Val:
    ax = n.attr("axis") % n.type.rank
    c[ax] = shift(sec, c[ax], n.attr("start"))
    return low.read(sec, n.inputs[0], c, valid)


@register_lowering(Op.RESHAPE, TRITON_INDEX)
def _reshape(low: KernelLowering, sec: Section, n: Node, c: list[Ix],
             valid: tuple[str, ...]) -> Val:
    src = n.inputs[0]
    return low.read(sec, src, reshape_coords(sec, c, n.type.shape, low.shape(src)), valid)


@register_lowering(Op.PAD, TRITON_INDEX)
def _pad(low: KernelLowering, sec: Section, n: Node, c: list[Ix], valid: tuple[str, ...]) -> Val:
    src, ax = n.inputs[0], n.attr("axis") % n.type.rank
    c[ax] = shift(sec, c[ax], -n.attr("before"))
    conds = _range(c[ax], 0, low.shape(src)[ax])
    if conds is None:
        return literal(0.0)
    return low.read(sec, src, c, valid + conds)


@register_lowering(Op.CONCAT, TRITON_INDEX)
def _concat(low: KernelLowering, sec: Section, n: Node, c: list[Ix],
            valid: tuple[str, ...]) -> Val:
    ax = n.attr("axis") % n.type.rank
    parts: list[tuple[int, Val]] = []
    lo = 0
    for src in n.inputs:
        size = low.shape(src)[ax]
        cc = list(c)
        cc[ax] = shift(sec, c[ax], -lo)
        conds = _range(c[ax], lo, lo + size)
        if conds is not None:
            parts.append((lo + size, low.read(sec, src, cc, valid + conds)))
        lo += size
    if len(parts) == 1:
        return parts[0][1]
    out = parts[-1][1]
    for hi, v in reversed(parts[:-1]):
        out = low.let(sec, f"tl.where({c[ax].expr} < {hi}, {v.expr}, {out.expr})",
                      [v, out, Val("", c[ax].dims)])
    return out


@register_lowering(Op.TAKE, TRITON_INDEX)
def _take(low: KernelLowering, sec: Section, n: Node, c: list[Ix], valid: tuple[str, ...]) -> Val:
    src, idx = n.inputs
    r = low.node(idx).type.rank
    row = low.read(sec, idx, c[:r], valid)
    return low.read(sec, src, [_as_ix(row)] + c[r:], valid)


@register_lowering(Op.TAKE_ALONG, TRITON_INDEX)
def _take_along(low: KernelLowering, sec: Section, n: Node, c: list[Ix],
                valid: tuple[str, ...]) -> Val:
    row = low.read(sec, n.inputs[1], c, valid)
    return low.read(sec, n.inputs[0], c + [_as_ix(row)], valid)
