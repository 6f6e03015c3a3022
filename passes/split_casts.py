"""split_casts: one copy of a cast of a stored input per reader, so fusion loads it cast.

Under mixed precision a float32 master parameter (a graph input, or a layer scan's slice of the
stacked parameters) is cast to bf16 where a matmul, a norm or a gate reads it. One CAST node
read by several kernels must be a kernel of its own (fusion puts every node in one kernel), a
launch that only converts: per layer, inside the layer backward's host loop. Split into one
CAST per reader, each is "free" in its reader's kernel (`passes.fusion`: a float cast of a
value read from memory costs no work, like a view): the kernel loads the float32 value and
rounds it as it loads it (`codegen.lower.nodes`; a scan kernel inlines it), so the bf16 copy is
never written and bf16 steps launch what float32 steps do.

Each copy casts the input itself and applies the views after it (cast(slice(x)) becomes
slice(cast(x)): a cast commutes with views), so the reader's kernel reads only the input (no
view of it stays live for fusion's peak) and converts just the elements it loads.

Pre: `g` verifies. Post: the same computation; every float-to-float CAST whose operand is an
input or a view chain of one reads the input directly and has exactly one reader (a graph
output counts as a reader), scan bodies included. Run last, right before fusion:
canonicalize's CSE would merge the copies.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from titanc.ir import Graph, Op, OpGroup


def _stored(g: Graph, nid: int) -> bool:
    """Is `nid` an input, or views of one (read from memory by any kernel)?"""
    n = g.node(nid)
    while n.op in OpGroup.VIEW:
        n = g.node(n.inputs[0])
    return n.op is Op.INPUT


def splittable(g: Graph, nid: int) -> bool:
    """A float-to-float CAST of a stored input (the casts fusion treats as free)."""
    n = g.node(nid)
    return (n.op is Op.CAST and n.type.is_float and g.node(n.inputs[0]).type.is_float
            and _stored(g, n.inputs[0]))


@dataclass(frozen=True)
class SplitCasts:
    """One copy of each splittable cast per reader (module docstring).

    Pre: `g` verifies. Post: the same values; every float cast of an input reads the input
    itself and has one reader."""
    name: ClassVar[str] = "split_casts"

    def __call__(self, g: Graph) -> Graph:
        return split_casts(g)


def split_casts(g: Graph) -> Graph:
    out = Graph(g.name)
    env: dict[int, int] = {}
    for nid in g.inputs:                                  # positional, as a scan binds them
        env[nid] = out.add_like(g.node(nid))
    derived: set[int] = set()       # the casts and the views of them: copied per reader
    for n in g:
        if splittable(g, n.id) or (n.op in OpGroup.VIEW and n.inputs[0] in derived):
            derived.add(n.id)
    outs = {v for _, v in g.outputs}
    dead: set[int] = set()          # views read only by the casts, which now read the input
    for nid in reversed(g.order()):
        users = g.users(nid)
        if g.node(nid).op in OpGroup.VIEW and nid not in outs and users and all(
                u in derived or u in dead for u in users):
            dead.add(nid)

    def copy(i: int) -> int:
        """Value `i` (a cast of an input, with views before and after it) made anew: the cast
        of the input, then every view of the chain in order (a cast commutes with views)."""
        views, x, cast = [], i, None
        while g.node(x).op is not Op.INPUT:
            if g.node(x).op is Op.CAST:
                cast = g.node(x)
            else:
                views.append(g.node(x))
            x = g.node(x).inputs[0]
        assert cast is not None
        v = out.add_like(cast, (env[x],))
        for view in reversed(views):
            v = out.add_like(view, (v,))
        return v

    def operand(i: int, mine: dict[int, int]) -> int:
        if i not in derived:
            return env[i]
        if i not in mine:                                 # this reader's own copy
            mine[i] = copy(i)
        return mine[i]

    for n in g:
        if n.op is Op.INPUT or n.id in derived or n.id in dead:
            continue
        mine: dict[int, int] = {}
        ins = [operand(i, mine) for i in n.inputs]
        extra = {"body": split_casts(n.attr("body"))} if n.op is Op.SCAN else {}
        env[n.id] = out.add_like(n, ins, **extra)
    out.set_outputs([(name, operand(v, {})) for name, v in g.outputs])
    return out
