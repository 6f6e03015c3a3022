"""Carries held on chip: a scan loop's carry as a loop-carried register tile.

A carry whose local shape has rank <= 2 is held as one tile of that shape, each axis padded
to a power of two >= 16 (zero outside), when its loop nests no scan and the carries held so
far stay within the register budget (`reg_why` says why not). `whole_tile` is a stage tile
with exactly a carry's axes (the only tiles that read one: `values.value`), `reg_value`
computes a carry's value into such a tile, `reg_store` stores one. `em` is the kernel's
`emitter.ScanEmitter`.
"""
from __future__ import annotations

from math import prod
from typing import Any

from titanc.codegen.meta import pow2
from titanc.codegen.scan.index import BodyRefs, Ref, StageTile, local_shape
from titanc.codegen.scan.values import value

__all__ = ["is_reg", "reg_store", "reg_value", "reg_why", "whole_tile"]


def whole_tile(em: Any, shape: tuple[int, ...], pax: tuple[int, ...] | None,
               dims: tuple[int, ...], guard: bool = False) -> tuple[StageTile, list[str], str]:
    """One tile over the local shape of `shape`, padded to `dims` (a carry's tile): the
    StageTile, the full coordinates of its elements and its shape literal (rank 0: one element
    of a 16-wide tile)."""
    L = local_shape(shape, pax)
    if not L:
        ix = em.let(f"{em.arange(16)}", "i")
        z = em.let(em.zero_tile("[16]"), "z")
        m = em.let(f"({ix} < 1)" + (f" & ((pid + {z}) == 0)" if guard else ""), "m")
        return StageTile(m, z, vars=(ix,)), em.full_coords([], shape, pax), "[16]"
    axes = []
    for j, P in enumerate(dims):
        sfx = "" if len(dims) == 1 else "[:, None]" if j == 0 else "[None, :]"
        axes.append(em.let(f"{em.arange(P)}{sfx}", "r"))
    tshape = f"[{', '.join(map(str, dims))}]"
    z = em.let(em.zero_tile(tshape), "z")
    m = em.mask(*(em.in_bounds(a, d, P) for a, d, P in zip(axes, L, dims)),
                f"((pid + {z}) == 0)" if guard else None)
    return (StageTile(m, z, vars=tuple(axes), axes=tuple(zip(axes, dims))),
            em.full_coords(axes, shape, pax), tshape)


def reg_value(em: Any, sc: BodyRefs, vid: int, shape: tuple[int, ...],
              pax: tuple[int, ...] | None, dims: tuple[int, ...]) -> str:
    """A register tile (a carry's) holding value `vid` of `sc`, zero off its shape."""
    sec, c, tshape = whole_tile(em, shape, pax, dims)
    v = value(em, sec, sc, vid, c)
    full = em.full(v, tshape) if sec.mask is None else \
        f"tl.where({sec.mask}, {em.full(v, tshape)}, 0.0)"
    if not dims:
        return em.let(f"tl.sum({full}, axis=0).to({em.cd})", "cn")
    return em.let(f"({full}).to({em.cd})", "cn", tile=True)


def reg_store(em: Any, var: str, dims: tuple[int, ...], shape: tuple[int, ...],
              pax: tuple[int, ...] | None, dest: Ref, guard: bool = False) -> None:
    """dest = the register tile `var` (a carry's final value)."""
    sec, c, tshape = whole_tile(em, shape, pax, dims, guard)
    x = var if dims else f"({var}) + tl.full([16], 0, dtype={em.cd})"
    em.store(em.ptr(sec, dest, c), x, sec.mask)


def reg_why(em: Any, scan: int, k: int, local: tuple[int, ...], nests: bool) -> str | None:
    """Why carry `k` of `scan` stays in the workspace (None: it is held on chip).
    `nests`: the scan's body holds a scan (whose loop gets the registers: a carry held
    across it would stay live through every inner stage)."""
    if (scan, k) in em.reg_demoted:
        return em.reg_demoted[(scan, k)]
    if em.split > 1:
        return (f"a split kernel ({em.split} programs a slice) keeps its carries in the "
                "workspace its slice's programs share")
    if nests:
        return "its loop holds a nested scan, whose carries and stages get the registers"
    if len(local) > 2:
        return (f"its local tile {list(local)} has rank {len(local)} (carries on chip are "
                "tiles of rank <= 2)")
    b = prod(pow2(d, 16) for d in local) * em.itemsize
    if em.reg_bytes + b > em.reg_budget:
        return (f"{b} B would pass the budget of {em.reg_budget} B of registers per "
                f"program for carries ({em.reg_bytes} B taken)")
    return None


def is_reg(sc: BodyRefs, v: int) -> bool:
    """Is value `v` of `sc` a carry held on chip (directly or as an enclosing scope's)?"""
    ref = sc.refs[v]
    while ref.kind == "at" and not ref.lead and ref.scope is not None:
        ref = ref.scope.refs[ref.node.id]
    return ref.kind == "reg"
