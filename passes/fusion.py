"""fusion: group the nodes of a graph into kernels, producing a `Schedule`.

Precondition: `g` verifies (canonicalized graphs give the best result). Postcondition: every
non-INPUT node is in exactly one kernel (a SCAN's ITEMs in the SCAN's), no kernel mixes the
nodes of a scan body with the outside (each body gets its own schedule, fused recursively),
the kernels form a DAG listed in a topological order, and the schedule's peak of live bytes
(`schedule.peak_live_bytes`: live intermediate values, graph inputs excluded, a scan kernel
adding its body's peak) is no higher than that of one kernel per node.

Kernel families, with what a kernel may contain:
- pointwise: elementwise ops, CAST, gathers (TAKE, TAKE_ALONG), views (RESHAPE, PERMUTE,
  EXPAND, SLICE, PAD, CONCAT) and generators (FULL, MASK); every computing node has the
  kernel's element count (its domain) and is evaluated once per element. A ROPE table is a
  kernel of its own, which the buffer plan binds once as a constant (`BufferPlan.views`):
  its readers load cos/sin values instead of evaluating them per element.
- reduction: SUM/AMAX sharing one input shape and axes, or CUMSUMs sharing shape, axis and
  direction, with a pointwise prologue on the reduction's input domain, a pointwise epilogue
  on its output domain, and a row epilogue: input-domain elementwise nodes (and EXPANDs of a
  reduced value) after the reduction, each reading only its own row's reduced value (the node
  has the input's shape, the reduced value the keep-dims shape; `_row_epilogue`), so
  `x * rsqrt(mean(x²))` is one kernel that holds the row (or loops over it again). No
  reduction depends on another (that would be a second pass).
- matmul: up to MAX_CONTRACTIONS EINSUMs over one output tile (`matmul_tile`: the same output
  shape, each axis a batch, M or N letter alike), each its own K loop and accumulator, with a
  pointwise epilogue on that domain (siblings reading one operand, a sum of products); their
  operands are views of kernel inputs (read with remapped indices, never materialized) or
  the kernel's prologue (`fusion_rules.matmul_prologue`): pointwise work before any
  contraction that only the einsums read (no other kernel, not the epilogue), evaluated as
  each operand tile is loaded (`silu(a) * b` feeding the FFN's down projection).
- template: a SCAN with its ITEMs and its prologue (`schedule.prologue_of`: gathers, and float
  casts of them, that only its carries read, as their initial values; the embedding gather
  feeding the layer scan is no kernel of its own), a pattern op (`OpGroup.PATTERN`, e.g. ATTENTION) with its ITEMs, an
  INDEX_ADD or a SCATTER_ALONG, alone.

"Free" nodes (generators, and views and float casts whose operands are free or read from
memory) cost no work and may be used at any index (`passes/split_casts.py` gives each reader
of a cast of an input its own copy, so the cast fuses into every reader's loads); `passes/views_per_reader.py`
copies a view that one kernel would write for another into its readers). A view of a value computed in the same kernel must be a
RESHAPE (the linear index is unchanged); anything else (a broadcast, slice, pad, permute or
gather of a computed value) would evaluate it more or less than once per element, duplicating
or scattering work, so such a value is materialized instead.

Greedy: start from one kernel per node; candidate merges are producer/consumer pairs,
siblings reading a common value, cousins (two elementwise-only groups reading outputs of
one kernel), and neighbours (groups of one kind, within HORIZONTAL kernels of each other in
the order: pointwise with pointwise, reductions over one shape and axes, contractions over
one output tile; the three gate gradients of a memory layer become one kernel), scored by
bytes saved (`bytes(a) + bytes(b) - bytes(a∪b)`: a value read only inside the group never
goes to memory, a shared input is read once); the best is taken first (ties:
producer/consumer before siblings before cousins before neighbours, then program order). A
merge that saves no bytes is taken only for cousins and neighbours: it saves a launch (a
GPU step of ~1,000 small kernels is bound by their count, docs/gpu.md); a neighbour merge
leaves the kernel at most NEIGHBOUR_TENSORS tensors. A merge is
refused if the union breaks the rules above, if it closes a cycle in the kernel graph, or if it
raises the schedule's peak of live bytes. The kernel order starts as a topological sort keyed
on program order; a merge only reorders the kernels between the two it joins, placing the
merged kernel early (after what the later one needs) or late (before what depends on the
earlier one), whichever keeps fewer bytes live; the peak is updated over that window only.
Scalar constants (`schedule.is_immediate`) are inlined by every kernel that reads them.
Before the greedy loop, each prologue node joins its scan's kernel (under the same cycle
and peak checks; it saves the gathered value's round trip through memory).
The result depends only on the graph.

Modules: this one (the pass, its entry points and the kernels' names),
`passes.fusion_rules` (what one kernel may contain, per-node facts such as `node_flops`) and
`passes.fusion_greedy` (the greedy merger, the kernel order and its live bytes).
"""
from __future__ import annotations

import re
from itertools import count
from typing import Iterator
from weakref import WeakKeyDictionary

from titanc.ir import Graph, Op, OpGroup
from titanc.ir.kernel_family import prefix
from titanc.ir.schedule import Kernel, Schedule
from titanc.passes.fusion_greedy import Fuser
from titanc.passes.fusion_rules import (MAX_CONTRACTIONS, TEMPLATES, graph_flops,  # noqa: F401
                                        matmul_tile, node_flops)

MAX_NAME_OPS = 4


def fuse(g: Graph) -> Schedule:
    """Fuse `g` and its scan bodies into kernels; names are numbered in pre-order."""
    return _name(_fuse_graph(g, check_peak=True), count())


def unfused(g: Graph) -> Schedule:
    """One kernel per node (a SCAN with its ITEMs): the baseline fusion is measured against."""
    return _name(_fuse_graph(g, check_peak=True, merge=False), count())


# graph -> (its node count and outputs then, check_peak, merge, its unnamed schedule): a
# scan body fused again when a pass kept it (`views_per_reader` fuses a trial first)
_FUSED: "WeakKeyDictionary[Graph, tuple]" = WeakKeyDictionary()


def _fuse_graph(g: Graph, check_peak: bool, merge: bool = True) -> Schedule:
    """Fuse the scan bodies first (a scan kernel's workspace is its body's peak), then `g`."""
    key = (len(g), tuple(g.outputs), check_peak, merge)
    hit = _FUSED.get(g)
    if hit is not None and hit[0] == key:
        return hit[1]
    bodies = {n.id: _fuse_graph(n.attr("body"), check_peak, merge)
              for n in g if n.op is Op.SCAN}
    f = Fuser(g, bodies, check_peak)
    if merge:
        f.run()
    out = Schedule(g, f.kernels(), bodies)
    _FUSED[g] = (key, out)
    return out


# -- names ---------------------------------------------------------------------------------------

def _ident(text: str) -> str:
    return re.sub(r"[^0-9a-zA-Z_]", "_", text).lower()


def kernel_ops(g: Graph, k: Kernel) -> list[str]:
    """The op names a kernel is named after: computing ops first, in order, deduplicated."""
    nodes = [g.node(n) for n in k.nodes]
    if k.category == "template":
        t = next(n for n in nodes if n.op in TEMPLATES)
        return ["scan", _ident(t.attr("body").name)] if t.op is Op.SCAN else [t.op.name.lower()]
    work = [n.op for n in nodes if n.op not in OpGroup.INDEXING and n.op not in OpGroup.GENERATOR]
    ops = list(dict.fromkeys(work or [n.op for n in nodes]))
    return [o.name.lower() for o in ops[:MAX_NAME_OPS]]


def _name(s: Schedule, counter: Iterator[int]) -> Schedule:
    kernels = []
    bodies: dict[int, Schedule] = {}
    for k in s.kernels:
        ops = "_".join(kernel_ops(s.graph, k))
        name = f"titanc_{prefix(k.category)}_fused_{ops}_{next(counter)}"
        kernels.append(Kernel(name, k.category, k.nodes, k.inputs, k.outputs, k.flops, k.bytes))
        for nid in k.nodes:
            if nid in s.bodies:
                bodies[nid] = _name(s.bodies[nid], counter)
    return Schedule(s.graph, kernels, bodies)
