"""constants_per_reader: a copy of a composed constant for each elementwise node reading it.

A constant is a generator (FULL, ROPE, MASK), or an INDEXING op (view, PAD, CONCAT) or a
CAST of constants only, e.g. RoPE's full-width table [cos ‖ cos] or its sign [−1 ‖ 1] (and
under mixed precision their casts). A kernel
computes one from its coordinates at no cost (`codegen/lower/nodes.py`), but fusion puts each
node in one kernel: a constant read by two kernels (the recomputed forward and the backward of
a scan body) would be stored by a kernel of its own that only makes values. A generator or a
view chain over one already costs nothing (the buffer plan binds it as a view of a constant
made at bind time); a constant holding a CONCAT or PAD is what this pass copies, once per
elementwise reader, so each copy joins its reader's kernel.

Runs last, right before fusion (it undoes CSE on those constants on purpose).
Pre: `g` verifies. Post: the result verifies and computes the same values; no CONCAT or PAD
constant is read by two elementwise nodes. Scan bodies are rewritten recursively.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from titanc.ir import Graph, Op, OpGroup


def _composed_constants(g: Graph) -> tuple[set[int], set[int]]:
    """(every constant of `g`, those holding a CONCAT or PAD)."""
    const: set[int] = set()
    composed: set[int] = set()
    for n in g:
        if n.op in OpGroup.GENERATOR:
            const.add(n.id)
        elif ((n.op in OpGroup.INDEXING or n.op is Op.CAST) and n.inputs
              and all(i in const for i in n.inputs)):
            const.add(n.id)
            if n.op in (Op.CONCAT, Op.PAD) or any(i in composed for i in n.inputs):
                composed.add(n.id)
    return const, composed


def constants_per_reader(g: Graph) -> Graph:
    """`g` with a copy of each composed constant per elementwise reader (module docstring)."""
    has_scan = any(n.op is Op.SCAN for n in g)
    const, composed = _composed_constants(g)
    shared_use = {i for n in g if n.op not in OpGroup.ELEMENTWISE and n.id not in const
                  for i in n.inputs} | {i for _, i in g.outputs}
    if not composed and not has_scan:
        return g
    out = Graph(g.name)
    env: dict[int, int] = {}

    def copy(vid: int) -> int:
        """A fresh copy of constant `vid` (its composed operands copied too)."""
        n = g.node(vid)
        ins = tuple(copy(i) if i in composed else env_of(i) for i in n.inputs)
        return out.add_like(n, ins)

    def env_of(vid: int) -> int:
        if vid not in env:                              # a shared constant, made on first use
            n = g.node(vid)
            env[vid] = out.add_like(n, (env_of(i) for i in n.inputs))
        return env[vid]

    for n in g:
        if n.id in const and n.id not in shared_use and n.op is not Op.INPUT:
            continue                                    # made where it is read
        if n.op in OpGroup.ELEMENTWISE:
            ins = tuple(copy(i) if i in composed else env_of(i) for i in n.inputs)
            env[n.id] = out.add_like(n, ins)
            continue
        extra = {"body": constants_per_reader(n.attr("body"))} if n.op is Op.SCAN else {}
        env[n.id] = out.add_like(n, (env_of(i) for i in n.inputs), **extra)
    out.set_outputs([(name, env_of(i)) for name, i in g.outputs])
    return out


@dataclass(frozen=True)
class ConstantsPerReader:
    """A copy of each CONCAT/PAD constant per elementwise reader: `constants_per_reader(g)`.

    Pre: `g` verifies. Post: same values; no CONCAT or PAD constant has two elementwise
    readers (module docstring)."""
    name: ClassVar[str] = "constants_per_reader"

    def __call__(self, g: Graph) -> Graph:
        return constants_per_reader(g)
