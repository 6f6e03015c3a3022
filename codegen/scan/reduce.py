"""Reduction stages of a scan kernel: sums, maxima and cumulative sums on [rows, cols] tiles.

A reduction (its TRITON_SCAN rule's `combine`: "sum", "max" or "cumsum") runs over a
[rows, cols] tile per step, rows the kept local axes and cols the reduced ones; where that
reads a carry held on chip, a sum or max runs over one tile of the local shape instead. A
run of reductions alike (`reduce_key`) that read none of each other's results is one stage.
`em` is the kernel's `emitter.ScanEmitter`.
"""
from __future__ import annotations

from math import prod
from typing import Any, Callable

from titanc.ir import Node

from titanc.codegen.meta import pow2
from titanc.codegen.render import sanitize_comment
from titanc.codegen.scan.carries import whole_tile
from titanc.codegen.scan.index import (MAX_CUMSUM, MAX_TILE, BodyRefs, Ref, RegMiss,
                                       ScanFallback, StageTile, delin, local_shape)
from titanc.codegen.scan.rules import scan_rule
from titanc.codegen.scan.values import value

__all__ = ["reduce_key", "reduce_stage"]


def _combine(n: Node) -> str:
    return scan_rule(n).combine


def reduce_stage(em: Any, sc: BodyRefs, run: list[tuple[Node, Ref]]) -> None:
    """Sums or maxima over axes, or cumulative sums along one: a [rows, cols] tile per step;
    where that reads a carry held on chip, a sum or max over one tile of the local shape. A
    run of reductions alike (`reduce_key`) that read none of each other's results is one
    stage: one loop over their common tile, every member's loads in the same round, one
    barrier; where a member reads a carry on chip, each is a stage of its own."""
    mark = (len(em.lines), em.depth)
    try:
        with em.stage():
            finish = _reduce_rows(em, sc, run)
        em.barrier()
        if finish is not None:        # a split kernel's partial sums, combined
            with em.stage():
                finish()
            em.barrier()
        return
    except RegMiss:
        if len(run) == 1:
            n, dest = run[0]
            x = n.inputs[0]
            L = local_shape(sc.g.node(x).type.shape, sc.pax.get(x))
            dims = tuple(pow2(d, 16) for d in L)
            if _combine(n) == "cumsum" or not L or len(L) > 2 or \
                    prod(dims) * em.itemsize > max(em.reg_budget, 1):
                raise
        del em.lines[mark[0]:]
        em.depth = mark[1]
    if len(run) > 1:
        for member in run:
            reduce_stage(em, sc, [member])
        return
    n, dest = run[0]
    x = n.inputs[0]
    L = local_shape(sc.g.node(x).type.shape, sc.pax.get(x))
    with em.stage():
        _reduce_whole(em, sc, n, dest, tuple(pow2(d, 16) for d in L))
    em.barrier()


def reduce_key(sc: BodyRefs, n: Node) -> tuple:
    """Reductions with equal keys share a stage's loops: the op, its input's shape and
    independent axes, and what it reduces along."""
    x = sc.g.node(n.inputs[0])
    a = n.attr_dict
    along = (a["axis"] % x.type.rank, a["reverse"]) if _combine(n) == "cumsum" else \
        (tuple(sorted(v % x.type.rank for v in a["axes"])), a["keepdim"])
    return (n.op, x.type.shape, sc.pax.get(n.inputs[0]), along)


def _reduce_whole(em: Any, sc: BodyRefs, n: Node, dest: Ref, dims: tuple[int, ...]) -> None:
    """A sum or max of one tile of the local shape (an input read from a carry on chip)."""
    x = n.inputs[0]
    xs, qx = sc.g.node(x).type.shape, sc.pax.get(x)
    axes = sorted(a % len(xs) for a in n.attr("axes"))
    lx = [i for i in range(len(xs)) if qx is None or i not in qx]
    em.line(f"# %{n.id} = {n.op.name.lower()}: over {[xs[a] for a in axes]} of one tile")
    sec, c, tshape = whole_tile(em, xs, qx, dims)
    is_max = _combine(n) == "max"
    fill = 'float("-inf")' if is_max else "0.0"
    y = em.masked(value(em, sec, sc, x, c), sec.mask, tshape, fill)
    for pos in sorted((lx.index(a) for a in axes), reverse=True):
        y = em.let(f"tl.{'max' if is_max else 'sum'}({y}, axis={pos}, keep_dims=True)",
                   "y", True)
    var = dict(zip(lx, (v for v, _ in sec.axes)))
    yshape = [1 if i in axes else dims[j] for j, i in enumerate(lx)]
    zo = em.let(em.zero_tile(str(yshape)), "z")
    mo = em.let(" & ".join([f"({var[i]} < {xs[i]})" for i in lx if i not in axes]
                           + [f"({zo} == 0)"]), "m")
    oc = [em.pc[qx.index(i)] if qx is not None and i in qx else "0" if i in axes
          else var[i] for i in range(len(xs))]
    out_c = oc if n.attr("keepdim") else [oc[i] for i in range(len(xs)) if i not in axes]
    em.line(f"tl.store({em.ptr(StageTile(mo, zo, vars=()), dest, out_c)}, {y}, mask={mo})")


def _reduce_rows(em: Any, sc: BodyRefs, run: list[tuple[Node, Ref]]
                 ) -> Callable[[], None] | None:
    """Every member of `run` over [rows, cols] tiles of their common input shape. In a split
    kernel whose rows are one block, the column blocks are handed out instead: each
    sub-program stores its partial results, and the stage returned (run after a barrier, on
    sub-program 0) combines them in order (`_combine_partials`)."""
    n = run[0][0]
    xs = sc.g.node(n.inputs[0]).type.shape
    qx = sc.pax.get(n.inputs[0])
    cumsum = _combine(n) == "cumsum"
    axes = [n.attr("axis") % len(xs)] if cumsum else sorted(a % len(xs) for a in n.attr("axes"))
    kept = [i for i in range(len(xs)) if i not in axes]
    rloc = [i for i in kept if qx is None or i not in qx]        # row axes (local)
    O = prod(xs[i] for i in rloc)
    Rn = prod(xs[i] for i in axes)
    if cumsum and Rn > MAX_CUMSUM:
        raise ScanFallback(f"%{n.id}: cumsum over {Rn} > {MAX_CUMSUM} elements")
    BR = pow2(Rn, 2) if cumsum else min(pow2(Rn, 2), MAX_TILE)
    BO = max(2, min(pow2(O, 2), MAX_TILE // BR))
    em.line("# " + sanitize_comment(", ".join(f"%{m.id} = {m.op.name.lower()}" for m, _ in run)
                                    + f": {O} rows of {Rn}"))
    o = em.open_loop(em.fresh("o"), O, BO, independent=True)
    ix = em.let(f"({o} + {em.arange(BO)})[:, None]", "r")
    jx_ = em.fresh("j")
    row_c = dict(zip(rloc, delin(ix, tuple(xs[i] for i in rloc))))

    def in_coords(jx: str, m: Node, rows: dict[int, str] = row_c) -> list[str]:
        col_c = dict(zip(axes, delin(jx, tuple(xs[i] for i in axes))))
        if _combine(m) == "cumsum" and m.attr("reverse"):
            col_c = {a: f"({Rn - 1} - {jx})" for a in axes}
        return [em.pc[qx.index(i)] if qx is not None and i in qx else
                rows[i] if i in rows else col_c[i] for i in range(len(xs))]

    rmask = em.in_bounds(ix, O, BO)
    tile = f"[{BO}, {BR}]"
    partials = None
    if cumsum:
        _cumsum_rows(em, sc, run, rmask, ix, BR, Rn, tile, in_coords)
    else:
        partials = _reduce_cols(em, sc, run, rmask, ix, jx_, (BO, BR), Rn, kept, len(xs),
                                in_coords)
    em.close(o)
    if partials is None:
        return None

    def finish() -> None:
        ixf = em.let(f"{em.arange(BO)}[:, None]", "r")
        rows = dict(zip(rloc, delin(ixf, tuple(xs[i] for i in rloc))))
        _combine_partials(em, run, partials, ixf, O, BO, kept, len(xs),
                          lambda m: in_coords("0", m, rows))
    return finish


def _combine_partials(em: Any, run: list[tuple[Node, Ref]], partials: list[str], ix: str,
                      O: int, BO: int, kept: list[int], rank: int, out_coords: Any) -> None:
    """Each member's result from the split's partial results (`partials`: workspace offsets
    of [split, BO] buffers), combined in sub-program order."""
    P = em.split
    PP = pow2(P, 2)
    em.line(f"# {', '.join(f'%{m.id}' for m, _ in run)}: the {P} sub-programs' partial "
            "results combined")
    jx = em.let(f"{em.arange(PP)}[None, :]", "j")
    is_max = _combine(run[0][0]) == "max"
    fill = 'float("-inf")' if is_max else "0.0"
    cmask = em.in_bounds(jx, P, PP)
    masking = f", mask={cmask}, other={fill}" if cmask else ""
    rmask = em.in_bounds(ix, O, BO)
    sec = StageTile(rmask, em.let(em.zero_tile(f"[{BO}, 1]"), "z"), vars=(ix,))
    for (m, dest), off in zip(run, partials):
        x = em.let(f"tl.load(ws_ptr + pbase + {off} + {jx} * {BO} + {ix}{masking})", "x")
        red = em.let(f"tl.{'max' if is_max else 'sum'}({x}, axis=1, keep_dims=True)", "y")
        oc = out_coords(m)
        out_c = [oc[i] for i in range(rank)] if m.attr("keepdim") else [oc[i] for i in kept]
        em.store(em.ptr(sec, dest, out_c), red, rmask)


def _cumsum_rows(em: Any, sc: BodyRefs, run: list[tuple[Node, Ref]], rmask: str | None,
                 ix: str, BR: int, Rn: int, tile: str, in_coords: Any) -> None:
    """Cumulative sums along the columns: one [BO, BR] tile holds a whole row."""
    jx = em.let(f"{em.arange(BR)}[None, :]", "j")
    mask = em.mask(rmask, em.in_bounds(jx, Rn, BR))
    sec = StageTile(mask, em.let(em.zero_tile(tile), "z"), vars=(ix, jx))
    vals = [value(em, sec, sc, m.inputs[0], in_coords(jx, m)) for m, _ in run]
    for (m, dest), v in zip(run, vals):
        y = em.let(f"tl.cumsum({em.masked(v, mask, tile)}, axis=1)", "y")
        em.store(em.ptr(sec, dest, in_coords(jx, m)), y, mask)


def _reduce_cols(em: Any, sc: BodyRefs, run: list[tuple[Node, Ref]], rmask: str | None,
                 ix: str, jx_: str, blocks: tuple[int, int], Rn: int, kept: list[int],
                 rank: int, in_coords: Any) -> list[str] | None:
    """Sums or maxima: accumulate [BO, BR] blocks over the columns, then reduce each row.
    In a split kernel whose stage has handed out no blocks yet, the column blocks are
    handed out and each member's partial result stored at [sub, row] of a workspace buffer
    of its own: their offsets (`_reduce_rows` combines them)."""
    BO, BR = blocks
    tile = f"[{BO}, {BR}]"
    is_max = _combine(run[0][0]) == "max"
    fill = 'float("-inf")' if is_max else "0.0"
    split = em.split > 1 and em.undistributed and Rn > BR
    accs = [em.let(f"tl.full({tile}, {fill}, dtype={em.cd})", "acc") for _ in run]
    r0 = em.open_loop(em.fresh("c"), Rn, BR, independent=split)
    jx = em.let(f"({r0} + {em.arange(BR)})[None, :]", jx_)
    mask = em.mask(rmask, em.in_bounds(jx, Rn, BR))
    sec = StageTile(mask, em.let(em.zero_tile(tile), "z"), vars=(ix, jx))
    vals = [value(em, sec, sc, m.inputs[0], in_coords(jx, m)) for m, _ in run]
    for acc, v in zip(accs, vals):
        v = em.masked(v, mask, tile, fill)
        em.line(f"{acc} = tl.maximum({acc}, {v})" if is_max else f"{acc} += {v}")
    em.close(r0)
    if split:
        partials = [em.alloc(em.split * BO) for _ in run]
        for off, acc in zip(partials, accs):
            red = em.let(f"tl.{'max' if is_max else 'sum'}({acc}, axis=1, keep_dims=True)", "y")
            em.line(f"tl.store(ws_ptr + pbase + {off} + sub * {BO} + {ix}, {red})")
        return partials
    sec = StageTile(rmask, em.let(em.zero_tile(f"[{BO}, 1]"), "z"), vars=(ix,))
    for (m, dest), acc in zip(run, accs):
        red = em.let(f"tl.{'max' if is_max else 'sum'}({acc}, axis=1, keep_dims=True)", "y")
        oc = in_coords("0", m)
        out_c = [oc[i] for i in range(rank)] if m.attr("keepdim") else [oc[i] for i in kept]
        em.store(em.ptr(sec, dest, out_c), red, rmask)
