"""A body value of a scan kernel at coordinates: a Triton expression for it.

`value(em, sec, sc, vid, coords, conds)` follows the value's `Ref` (`index.py`): a literal, a
carry held on chip (its register tile, plain or transposed), a masked load of a workspace
buffer or kernel tensor (cached per stage tile), a value of an enclosing scope, or a view /
inlined node, whose op's TRITON_SCAN rule (`rules.py`) composes it from its operands' values
down to loads. `em` is the kernel's `emitter.ScanEmitter`.
"""
from __future__ import annotations

from typing import Any

from titanc.ir import Node

from titanc.codegen.lower.expr import format_number
from titanc.codegen.scan.index import (BodyRefs, GroupMiss, Ref, RegMiss, ScanFallback,
                                       StageTile, bare)
from titanc.codegen.scan.rules import scan_rule

__all__ = ["node_value", "value"]


def _where(conds: tuple[str, ...], x: str) -> str:
    return f"tl.where({' & '.join(f'({c})' for c in conds)}, {x}, 0.0)"


def value(em: Any, sec: StageTile, sc: BodyRefs, vid: int, coords: list[str],
          conds: tuple[str, ...] = ()) -> str:
    """An expression for value `vid` of scope `sc` at `coords` (0 where `conds` fail)."""
    ref = sc.refs[vid]
    if ref.kind == "lit":
        v = format_number(ref.value)
        return v if not conds else _where(conds, v)
    if ref.kind == "reg":
        r = _reg_value(em, sec, ref, coords)
        return r if not conds else em.let(_where(conds, r), tile=True)
    if ref.kind in ("ws", "arg"):
        return _load(em, sec, ref, coords, conds)
    assert ref.node is not None and ref.scope is not None
    if ref.kind == "at":                          # an outer value at leading coordinates
        return value(em, sec, ref.scope, ref.node.id, list(ref.lead) + coords, conds)
    return node_value(em, sec, ref.scope, ref.node, coords, conds)


def _load(em: Any, sec: StageTile, ref: Ref, coords: list[str], conds: tuple[str, ...]) -> str:
    """A masked load of a workspace buffer or kernel tensor, once per stage tile; a buffer
    this stage writes is read from the registers that hold it, else `GroupMiss`."""
    key = (ref.kind, ref.name, ref.base, ref.lead, tuple(coords), conds)
    if key not in sec.cache and ref.kind == "ws" and ref.base in sec.written:
        raise GroupMiss(ref.base)
    if key not in sec.cache:
        mask = " & ".join(((sec.mask,) if sec.mask else ()) + tuple(f"({c})" for c in conds))
        # bf16 tensors are widened as they are loaded: the kernel computes in `cd`
        widen = f".to({em.cd})" if ref.kind == "arg" and ref.name in em.low_args else ""
        masking = f", mask={mask}, other=0" if mask else ""
        sec.cache[key] = em.let(f"tl.load({em.ptr(sec, ref, coords)}{masking}){widen}", "x",
                                True)
        em.loads.add(sec.cache[key])
    return sec.cache[key]


def _reg_value(em: Any, sec: StageTile, ref: Ref, coords: list[str]) -> str:
    """A carry held on chip at `coords`: its tile itself where the coordinates are the
    tile's whole axes in the carry's order (or, 2-D, transposed), else `RegMiss`."""
    local = [bare(c) for i, c in enumerate(coords) if ref.pax is None or i not in ref.pax]
    if not local:
        return ref.name
    axes = list(sec.axes)
    if [v for v, _ in axes] == local and tuple(e for _, e in axes) == ref.dims:
        return ref.name
    if len(local) == 2 and [v for v, _ in axes[::-1]] == local and \
            tuple(e for _, e in axes[::-1]) == ref.dims:
        key = ("trans", ref.name)
        if key not in sec.cache:
            sec.cache[key] = em.let(f"tl.trans({ref.name})", "xt", True)
            em.loads.add(sec.cache[key])
        return sec.cache[key]
    raise RegMiss(ref.scan, ref.carry, "read at coordinates other than its tile's "
                  f"({', '.join(coords)}) by a tile of axes {axes or 'none'}")


def node_value(em: Any, sec: StageTile, sc: BodyRefs, n: Node, c: list[str],
               conds: tuple[str, ...]) -> str:
    """Node `n` of `sc` at `c`, computed by its op's TRITON_SCAN value rule."""
    rule = scan_rule(n)
    if rule.value is None:
        raise ScanFallback(f"%{n.id}: no index rule for {n.op.name}")
    return rule.value(em, sec, sc, n, c, conds)
