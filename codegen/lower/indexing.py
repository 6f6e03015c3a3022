"""Index arithmetic for IR-driven kernels: coordinates as Triton expressions.

A generated kernel evaluates its IR nodes at one point of its domain (a block of flat
elements, a [rows, cols] tile, a matmul tile). Where a node's element lives in another
value's shape is integer arithmetic on the domain's index variables (`idx_0`, `rows`,
`cols`, `offs_m`, ...): `delinearize` splits a linear index into coordinates, `linearize`
joins them, `reshape_coords` maps coordinates through a RESHAPE (pairing axis groups of
equal size, so a split or a merge costs one `//` or `%`, not a full round trip).

`Ix` is one coordinate: a Triton expression, the domain axes it varies along, and its value
when it is a constant (size-1 axes, slice starts), so constants fold at codegen time. A
`Section` owns one straight-line region of a kernel (a prologue, a K-loop body, an
epilogue): it names every non-trivial expression once (`let`), through `check_statement`,
and caches coordinates so each is computed once per region.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod
from typing import Sequence

from titanc.codegen.lower.expr import check_statement

__all__ = ["Ix", "Names", "Section", "broadcast_coords", "const", "delinearize", "linearize",
           "reshape_coords", "shift"]


@dataclass(frozen=True)
class Ix:
    """An integer coordinate: `expr` varies along the domain axes `dims`; `value` if constant."""

    expr: str
    dims: frozenset[str] = frozenset()
    value: int | None = None
    base: "Ix | None" = None     # when `expr` is `base + delta`: shifts fold into one
    delta: int = 0


def const(v: int) -> Ix:
    return Ix(str(v), frozenset(), v)


class Names:
    """Fresh statement variables of one kernel (`t0`, `i1`, ...): never a template's name."""

    def __init__(self) -> None:
        self.n = 0

    def fresh(self, prefix: str) -> str:
        self.n += 1
        return f"{prefix}{self.n}"


@dataclass
class Section:
    """One straight-line region of a kernel: its statements, base mask and caches.

    `mask` is the boolean tile every load of the region is masked with (the domain bound);
    `block` is the shape list of the region's tile (`[BLOCK]`, `[BLOCK_R, BLOCK_C]`) used to
    materialise constants; `dims` are the axes that tile varies along.
    """

    names: Names
    mask: str
    block: str
    dims: frozenset[str]
    stmts: list[str] = field(default_factory=list)
    cache: dict[object, object] = field(default_factory=dict)
    values: dict[int, object] = field(default_factory=dict)     # computed node -> its Val
    flat: Ix | None = None       # the flat element index, where inputs may be read directly
    numel: int = 0               # ... over this many elements

    def let(self, expr: str, prefix: str = "t") -> str:
        """Assign `expr` to a fresh variable (once per distinct expression) and return it."""
        key = ("let", expr)
        if key not in self.cache:
            var = self.names.fresh(prefix)
            self.stmts.append(check_statement(f"{var} = {expr}"))
            self.cache[key] = var
        return self.cache[key]

    def ix(self, expr: str, dims: frozenset[str]) -> Ix:
        """A coordinate computed by `expr`, named once."""
        return Ix(self.let(expr, "i"), dims)


def _p(e: str) -> str:
    """Parenthesise a compound expression before it becomes an operand."""
    return e if e.isidentifier() or e.lstrip("-").isdigit() else f"({e})"


def delinearize(sec: Section, lin: Ix, shape: Sequence[int]) -> list[Ix]:
    """Row-major coordinates of linear index `lin` in `shape` (size-1 axes are constant 0).

    The outermost non-trivial axis takes no modulo: lanes past the end are masked anyway."""
    key = ("delin", lin.expr, tuple(shape))
    if key in sec.cache:
        return list(sec.cache[key])
    real = [d for d, s in enumerate(shape) if s != 1]
    out: list[Ix] = []
    for d, size in enumerate(shape):
        if size == 1:
            out.append(const(0))
            continue
        inner = prod(shape[d + 1:])
        if lin.value is not None:
            out.append(const(lin.value // inner % size))
        elif d == real[0]:
            out.append(lin if inner == 1 else sec.ix(f"{_p(lin.expr)} // {inner}", lin.dims))
        elif inner == 1:
            out.append(sec.ix(f"{_p(lin.expr)} % {size}", lin.dims))
        else:
            out.append(sec.ix(f"{_p(lin.expr)} // {inner} % {size}", lin.dims))
    sec.cache[key] = tuple(out)
    return out


def linearize(sec: Section, coords: Sequence[Ix], shape: Sequence[int]) -> Ix:
    """The row-major linear index of `coords` in `shape`."""
    terms: list[str] = []
    total, dims = 0, frozenset()
    for d, (c, size) in enumerate(zip(coords, shape)):
        if size == 1:
            continue
        inner = prod(shape[d + 1:])
        if c.value is not None:
            total += c.value * inner
            continue
        dims |= c.dims
        terms.append(c.expr if inner == 1 else f"{_p(c.expr)} * {inner}")
    if not terms:
        return const(total)
    if total:
        terms.append(str(total))
    if len(terms) == 1 and terms[0].isidentifier():
        return Ix(terms[0], dims)
    return sec.ix(" + ".join(terms), dims)


def _groups(out_shape: Sequence[int], in_shape: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Pair runs of non-trivial axes of equal size: ([out axes], [in axes]) per group."""
    outs = [d for d, s in enumerate(out_shape) if s != 1]
    ins = [d for d, s in enumerate(in_shape) if s != 1]
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(outs) or j < len(ins):
        go, gi = [outs[i]], [ins[j]]
        po, pi = out_shape[outs[i]], in_shape[ins[j]]
        i, j = i + 1, j + 1
        while po != pi:
            if po < pi:
                go.append(outs[i])
                po *= out_shape[outs[i]]
                i += 1
            else:
                gi.append(ins[j])
                pi *= in_shape[ins[j]]
                j += 1
        groups.append((go, gi))
    return groups


def reshape_coords(sec: Section, coords: Sequence[Ix], out_shape: Sequence[int],
                   in_shape: Sequence[int]) -> list[Ix]:
    """Coordinates in `in_shape` of the element at `coords` of its reshape to `out_shape`."""
    if tuple(out_shape) == tuple(in_shape):
        return list(coords)
    res = [const(0) for _ in in_shape]
    for go, gi in _groups(out_shape, in_shape):
        if len(go) == 1 and len(gi) == 1:
            res[gi[0]] = coords[go[0]]
            continue
        lin = linearize(sec, [coords[d] for d in go], [out_shape[d] for d in go])
        for d, c in zip(gi, delinearize(sec, lin, [in_shape[d] for d in gi])):
            res[d] = c
    return res


def broadcast_coords(coords: Sequence[Ix], out_shape: Sequence[int],
                     in_shape: Sequence[int]) -> list[Ix]:
    """Coordinates of a numpy-broadcast operand of shape `in_shape` (size-1 axes read 0)."""
    pad = len(out_shape) - len(in_shape)
    return [const(0) if s == 1 else coords[pad + d] for d, s in enumerate(in_shape)]


def shift(sec: Section, c: Ix, delta: int) -> Ix:
    """`c + delta` (a shift of a shift is one addition to the first base)."""
    if delta == 0:
        return c
    if c.value is not None:
        return const(c.value + delta)
    if c.base is not None:
        c, delta = c.base, c.delta + delta
        if delta == 0:
            return c
    sign = "+" if delta > 0 else "-"
    var = sec.let(f"{_p(c.expr)} {sign} {abs(delta)}", "i")
    return Ix(var, c.dims, None, c, delta)
