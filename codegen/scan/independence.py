"""The independence analysis of a scan kernel: which axes each program owns.

The grid is the product of the scan's *independent leading axes* (e.g. [B, Nm] of a
memory-chunk body): the longest prefix `P` of the carries' shape such that no body op mixes
those axes. Every body value gets a `pax`: where the axes of `P` sit in its shape, or None
when it does not vary along them ("shared": computed whole by every program). `prefixes`
lists the candidates, longest first; `pax_of` gives a node's pax from its operands' by its
op's TRITON_SCAN rule (`rules.py`), or raises `PaxError` naming how the op mixes them (the
kernel then tries a shorter prefix). `em` is the kernel's `emitter.ScanEmitter`.
"""
from __future__ import annotations

from typing import Any

from titanc.ir import Graph, Node

from titanc.codegen.scan.index import BodyRefs, PaxError, ScanFallback
from titanc.codegen.scan.rules import scan_rule

__all__ = ["pax_of", "prefixes"]


def prefixes(g: Graph, n: Node) -> list[tuple[int, ...]]:
    """Candidate independent axes of scan `n`, longest first: leading shapes of the carries."""
    nc = n.attr("n_carry")
    seen: dict[tuple[int, ...], None] = {}
    shapes = [g.node(i).type.shape for i in n.inputs[:nc]]
    for p in range(max((len(s) for s in shapes), default=0), 0, -1):
        for s in shapes:
            if len(s) >= p:
                seen[tuple(s[:p])] = None
    return sorted(seen, key=len, reverse=True)


def pax_of(em: Any, sc: BodyRefs, n: Node) -> tuple[int, ...] | None:
    """Where the independent axes sit in `n`'s value, from its operands' (or raise)."""
    rule = scan_rule(n)
    if rule.pax is None:
        raise ScanFallback(f"%{n.id}: no scan-kernel rule for {n.op.name}")

    def bad(why: str) -> PaxError:
        return PaxError(f"%{n.id} ({n.op.name.lower()}) {why} the independent axes "
                        f"{list(em.prefix)}")
    return rule.pax(n, [sc.pax.get(i) for i in n.inputs], sc, bad)
