"""Pointwise stages of a scan kernel: stored values computed over flat tiles of a local shape.

`pointwise_stage` writes `dest[lead + c] = expr(c)` for every coordinate `c` of the program's
local slice, in flat tiles, or, where that reads a carry held on chip, as one tile of the
local shape. `pointwise_run` puts consecutive stored elementwise nodes of one local shape in
as few stages as they allow: a member reads an earlier member's result from the register
tile that holds it (no store, barrier and load between them). `em` is the kernel's
`emitter.ScanEmitter`.
"""
from __future__ import annotations

from math import prod
from typing import Any, Callable

from titanc.ir import Node

from titanc.codegen.meta import pow2
from titanc.codegen.render import sanitize_comment
from titanc.codegen.scan.carries import whole_tile
from titanc.codegen.scan.index import (MAX_TILE, BodyRefs, GroupMiss, Ref, RegMiss, StageTile,
                                       delin, local_shape)
from titanc.codegen.scan.values import node_value, value

__all__ = ["copy", "pointwise_run", "pointwise_stage", "ref_value"]

Expr = Callable[[StageTile, list[str]], str]


def pointwise_stage(em: Any, label: str, shape: tuple[int, ...], pax: tuple[int, ...] | None,
                    dest: Ref, lead: tuple[str, ...], expr: Expr, guard: bool = False) -> None:
    """dest[lead + c] = expr(c) for every c of `shape` local to the program: flat tiles,
    or, where that reads a carry held on chip, one tile of the local shape (its axes the
    carry's)."""
    em.line(f"# {sanitize_comment(label)}")
    L = local_shape(shape, pax)
    mark = (len(em.lines), em.depth)
    try:
        _flat_stage(em, shape, pax, dest, lead, expr, guard)
    except RegMiss:
        dims = tuple(pow2(d, 16) for d in L)
        if not L or len(L) > 2 or prod(dims) * em.itemsize > max(em.reg_budget, 1):
            raise
        del em.lines[mark[0]:]
        em.depth = mark[1]
        with em.stage():
            sec, c, tshape = whole_tile(em, shape, pax, dims, guard)
            r = expr(sec, c)
            em.store(em.ptr(sec, dest, list(lead) + c), em.full(r, tshape), sec.mask)
    em.barrier()


def _flat_tile(em: Any, shape: tuple[int, ...], pax: tuple[int, ...] | None,
               guard: bool = False) -> tuple[StageTile, list[str], str, int]:
    """Open a flat tile over the local slice of `shape` (a loop over blocks where it needs
    several): the tile, the full coordinates of its elements, the loop's variable ("0":
    none) and the block."""
    L = local_shape(shape, pax)
    N = prod(L)
    B = min(pow2(N, 16), MAX_TILE)
    o = em.open_loop(em.fresh("o"), N, B, independent=True)
    ix = em.let(f"{o} + {em.arange(B)}" if o != "0" else f"{em.arange(B)}", "i")
    z = em.let(em.zero_tile(f"[{B}]"), "z")
    m = em.mask(em.in_bounds(ix, N, B), f"((pid + {z}) == 0)" if guard else None)
    local = delin(ix, L)
    sec = StageTile(m, z, vars=(ix,), flat=(ix, L, tuple(local)),
                    axes=((ix, B),) if len(L) == 1 and o == "0" else ())
    return sec, em.full_coords(local, shape, pax), o, B


def _flat_stage(em: Any, shape: tuple[int, ...], pax: tuple[int, ...] | None, dest: Ref,
                lead: tuple[str, ...], expr: Expr, guard: bool) -> None:
    with em.stage():
        sec, c, o, B = _flat_tile(em, shape, pax, guard)
        r = expr(sec, c)
        em.store(em.ptr(sec, dest, list(lead) + c), em.full(r, f'[{B}]'), sec.mask)
        em.close(o)


def pointwise_run(em: Any, sc: BodyRefs, run: list[tuple[Node, Ref]]) -> None:
    """Stored elementwise nodes of one local shape, in order: as few stages as they allow.
    A stage holds a prefix of the run whose members read the earlier members' results
    at the tile's own coordinates (from registers: no store, barrier and load between
    them); the first member that reads one otherwise, or reads a carry held on chip,
    starts over in a stage of its own (`pointwise_stage`)."""
    i = 0
    while i < len(run):
        took = _flat_run(em, sc, run[i:]) if len(run) - i > 1 else 0
        if took < 2:
            n, dest = run[i]
            pointwise_stage(em, f"%{n.id} = {n.op.name.lower()}", n.type.shape, sc.pax[n.id],
                            dest, (), lambda sec, c, n=n: node_value(em, sec, sc, n, c, ()))
            took = 1
        i += took


def _members(run: list[tuple[Node, Ref]]) -> str:
    return "# " + sanitize_comment(", ".join(f"%{n.id} = {n.op.name.lower()}" for n, _ in run))


def _flat_run(em: Any, sc: BodyRefs, run: list[tuple[Node, Ref]]) -> int:
    """Emit the longest prefix of `run` that one flat stage holds (`pointwise_run`), if
    it has at least two members; return its length (0: nothing emitted)."""
    first = run[0][0]
    mark = (len(em.lines), em.depth)
    em.line(_members(run))
    took = len(run)
    with em.stage():
        sec, c, o, B = _flat_tile(em, first.type.shape, sc.pax[first.id])
        for j, (n, dest) in enumerate(run):
            at = len(em.lines)
            try:
                r = node_value(em, sec, sc, n, c, ())
            except (GroupMiss, RegMiss):
                del em.lines[at:]
                took = j
                break
            r = r if r in em.tiles else em.let(em.full(r, f"[{B}]"), tile=True)
            em.store(em.ptr(sec, dest, c), r, sec.mask)
            sec.cache[("ws", "", dest.base, (), tuple(c), ())] = r
            sec.written.add(dest.base)
        em.close(o)
    if took < 2:
        del em.lines[mark[0]:]
        em.depth = mark[1]
        return 0
    if took < len(run):                          # the comment names the stage's members
        em.lines[mark[0]] = "    " * mark[1] + _members(run[:took])
    em.barrier()
    return took


def copy(em: Any, label: str, sc: BodyRefs, vid: int, shape: tuple[int, ...],
         pax: tuple[int, ...] | None, dest: Ref, lead: tuple[str, ...] = (),
         guard: bool = False) -> None:
    """dest[lead + c] = value `vid` of `sc` at c (a carry's or a y's copy)."""
    pointwise_stage(em, label, shape, pax, dest, lead,
                    lambda sec, c: value(em, sec, sc, vid, c), guard)


def ref_value(em: Any, sec: StageTile, ref: Ref, c: list[str]) -> str:
    """A masked load of workspace `ref` at `c`, once per stage tile."""
    key = ("ref", ref.base, tuple(c))
    if key not in sec.cache:
        masking = f", mask={sec.mask}, other=0.0" if sec.mask else ""
        sec.cache[key] = em.let(f"tl.load({em.ptr(sec, ref, c)}{masking})", "x", True)
    return sec.cache[key]
