"""views_per_reader: a view that one kernel writes for another, copied into its readers.

A view (RESHAPE, PERMUTE, EXPAND, SLICE, or a PAD) of a value that a kernel reads from memory
costs nothing: the kernel maps its coordinates (`codegen/lower/nodes.py`). But fusion puts
each node in one kernel, so a view read by nodes of two kernels is computed in one of them,
written, and read back by the other: the depthwise conv's shifted slices of its padded input
in a MAC segment's backward, each read by the conv weight's gradient and by the input's, or a
head layout read by two matmuls (large_125m bf16: 33.4 GB of view outputs written a step).

This pass fuses the graph once to find them (`passes.fusion.fuse`, a trial: its schedule is
dropped): every view output of a kernel whose chain of views over a stored value lies in
that kernel, read by nodes of other kernels. Each such reader gets its own copy of the chain,
so the graph fused again puts the copy into the reader's kernel, which loads the stored value
through it; the writing kernel keeps the original for its own nodes and no longer writes it,
and a kernel reading several views of one value (the conv's slices) reads that value once.
Only those views are copied, so the greedy fusion's other choices stand. Not copied: a graph
output, and a view a template node reads (a scan or a pattern op holds no other node).

Pre: `g` verifies. Post: the same values; no kernel of `fuse(result)` writes a view over a
stored value for a non-template node of another kernel, where the trial's readers took their
copies. Scan bodies are rewritten recursively, but for the memory's chunk recurrences (a scan
kernel renders its body by its own rules and writes no view). Run right before fusion:
canonicalize's CSE would merge the copies.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from titanc.ir import Graph, Op, OpGroup
from titanc.ir.schedule import Schedule
from titanc.passes.fusion import fuse
from titanc.passes.fusion_rules import TEMPLATES

VIEWS = OpGroup.VIEW | {Op.PAD}
KEPT_BODIES = ("memory", "memory_group")     # scan roles whose bodies are left as they are


def written_views(s: Schedule) -> dict[int, set[int]]:
    """View -> the readers that get a copy: the view outputs of `s`'s kernels whose chain over
    a stored value lies in the kernel, and their non-template readers in other kernels."""
    g = s.graph
    where = s.kernel_index()
    outputs = {v for _, v in g.outputs}
    found: dict[int, set[int]] = {}
    for k in s.kernels:
        inside = set(k.nodes)
        for v in k.outputs:
            if g.node(v).op not in VIEWS or v in outputs:
                continue
            root = v
            while root in inside and g.node(root).op in VIEWS:
                root = g.node(root).inputs[0]
            if root in inside:                       # a view of a value computed here
                continue
            readers = {u for u in g.users(v)
                       if where.get(u) != where[v] and g.node(u).op not in TEMPLATES}
            if readers:
                found[v] = readers
    return found


def views_per_reader(g: Graph, trial: Schedule | None = None) -> Graph:
    """`g` with each view a kernel of `trial` (default: `fuse(g)`) writes for another copied
    into its readers, scan bodies included (module docstring)."""
    if trial is None:
        if not any(n.op in VIEWS or n.op is Op.SCAN for n in g):
            return g
        trial = fuse(g)
    copies = written_views(trial)
    bodies = {n.id: views_per_reader(n.attr("body"), trial.bodies[n.id]) for n in g
              if n.op is Op.SCAN and n.attr("role", "loop") not in KEPT_BODIES}
    if not copies and all(b is g.node(i).attr("body") for i, b in bodies.items()):
        return g
    out = Graph(g.name)
    env: dict[int, int] = {}
    for nid in g.inputs:                                  # positional, as a scan binds them
        env[nid] = out.add_like(g.node(nid))

    def copy(vid: int, mine: dict[int, int]) -> int:
        """A reader's own copy of the view chain `vid`, down to its stored value."""
        n = g.node(vid)
        if n.op not in VIEWS:
            return env[vid]
        if vid not in mine:
            mine[vid] = out.add_like(n, [copy(n.inputs[0], mine)])
        return mine[vid]

    for n in g:
        if n.op is Op.INPUT:
            continue
        mine: dict[int, int] = {}
        ins = [copy(i, mine) if n.id in copies.get(i, ()) else env[i] for i in n.inputs]
        extra = {"body": bodies[n.id]} if n.id in bodies else {}
        env[n.id] = out.add_like(n, ins, **extra)
    out.set_outputs([(name, env[v]) for name, v in g.outputs])
    live = out.reachable_from_outputs()               # a view all of whose readers copied it
    if all(n.id in live or n.op is Op.INPUT for n in out):
        return out
    kept = Graph(g.name)
    kenv: dict[int, int] = {}
    for n in out:
        if n.id in live or n.op is Op.INPUT:
            kenv[n.id] = kept.add_like(n, [kenv[i] for i in n.inputs])
    kept.set_outputs([(name, kenv[i]) for name, i in out.outputs])
    return kept


@dataclass(frozen=True)
class ViewsPerReader:
    """Each view a kernel would write for another copied into its readers (module docstring).

    Pre: `g` verifies. Post: the same values; the views a trial fusion writes for readers in
    other kernels are copied into those readers."""
    name: ClassVar[str] = "views_per_reader"

    def __call__(self, g: Graph) -> Graph:
        return views_per_reader(g)
