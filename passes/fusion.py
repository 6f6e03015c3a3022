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
  operands may be views of kernel inputs (read with remapped indices, never materialized),
  not computed ones.
- template: a SCAN with its ITEMs and its prologue (`schedule.prologue_of`: gathers, and float
  casts of them, that only its carries read, as their initial values; the embedding gather
  feeding the layer scan is no kernel of its own), a pattern op (`OpGroup.PATTERN`, e.g. ATTENTION) with its ITEMs, an
  INDEX_ADD or a SCATTER_ALONG, alone.

"Free" nodes (generators, and views and float casts whose operands are free or read from
memory) cost no work and may be used at any index (`passes/split_casts.py` gives each reader
of a cast of an input its own copy, so the cast fuses into every reader's loads). A view of a value computed in the same kernel must be a
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
"""
from __future__ import annotations

import heapq
import re
import sys
from dataclasses import dataclass
from itertools import accumulate, count
from math import prod
from typing import Iterator

from titanc.ir import Graph, Node, Op, OpGroup
from titanc.ir.shapes import parse_einsum
from titanc.ir.structural import STRUCTURAL
from titanc.ir.types import TensorType

from titanc.config import debug_level
from titanc.ir.kernel_family import FAMILIES, prefix
from titanc.ir.schedule import (Kernel, Schedule, is_immediate, peak_live_bytes, prologue_of,
                       value_bytes)
from titanc.passes.split_casts import splittable

GATHERS = frozenset({Op.TAKE, Op.TAKE_ALONG})
REDUCTIONS = frozenset({Op.SUM, Op.AMAX, Op.CUMSUM})
MAX_NAME_OPS = 4
MAX_CONTRACTIONS = 4         # einsums one matmul kernel may hold (one K loop each)
SIBLING_READERS = 8          # siblings of a value are paired only when it has this few readers
HORIZONTAL = 8               # kernels either side in the order a launch-saving merge looks at
NEIGHBOUR_TENSORS = 12       # tensors a neighbour merge may leave a kernel reading and writing
                             # (more held a tiny.yaml reduction at 255 registers, 1.6 KB spilled)


class _Templates:
    """Ops alone in a template kernel: those whose record names a kernel family of category
    "template" (`Structural.family`, `ir.kernel_family`): SCAN, the scatter-adds and every
    pattern op (read at each test, so an op or family registered later counts)."""

    def __contains__(self, op: Op) -> bool:
        entry = STRUCTURAL.get(op)
        fam = FAMILIES.get(entry.family) if entry is not None and entry.family else None
        return fam is not None and fam.category == "template"


TEMPLATES = _Templates()


def fuse(g: Graph) -> Schedule:
    """Fuse `g` and its scan bodies into kernels; names are numbered in pre-order."""
    return _name(_fuse_graph(g, check_peak=True), count())


def unfused(g: Graph) -> Schedule:
    """One kernel per node (a SCAN with its ITEMs): the baseline fusion is measured against."""
    return _name(_fuse_graph(g, check_peak=True, merge=False), count())


# -- per-node facts ------------------------------------------------------------------------------

def _numel(n: Node) -> int:
    return n.type.numel if isinstance(n.type, TensorType) else 0


def node_flops(n: Node, g: Graph, body_flops: int = 0) -> int:
    """Work of one node: elementwise 1/element, einsum 2*prod(letter sizes), reductions and
    scatter-adds 1/input element, scans length * body, a pattern op its entry's `flops`
    (attention: the visible pairs only); views, gathers, generators 0."""
    if n.op in OpGroup.ELEMENTWISE:
        return _numel(n)
    if n.op is Op.EINSUM:
        terms, _ = parse_einsum(n.attr("spec"), len(n.inputs))
        sizes: dict[str, int] = {}
        for term, i in zip(terms, n.inputs):
            sizes.update(zip(term, g.node(i).type.shape))
        return 2 * prod(sizes.values())
    if n.op in REDUCTIONS or n.op in (Op.INDEX_ADD, Op.SCATTER_ALONG):
        return _numel(g.node(n.inputs[0]))
    if n.op is Op.SCAN:
        return n.attr("length") * body_flops
    e = STRUCTURAL.get(n.op)
    if e is not None and e.flops is not None:
        return e.flops(n, g)
    return 0


def graph_flops(g: Graph) -> int:
    """Work of a whole graph as `node_flops` counts it, a scan's body once per iteration
    (before fusion: what the graph computes, whichever kernels will run it)."""
    return sum(node_flops(n, g, graph_flops(n.attr("body")) if n.op is Op.SCAN else 0)
               for n in g)


def matmul_tile(g: Graph, e: Node) -> tuple | None:
    """The output tile of a two-operand einsum as the matmul family iterates it: its output
    shape and, per output axis, whether its letter is a batch letter (in both operands), an M
    letter (the first operand's) or an N letter (the second's); None when the matmul family
    cannot run it (not two operands, or a diagonal). Einsums with equal tiles share one
    kernel's (batch, M, N) grid, each with its own K loop and accumulator."""
    if len(e.inputs) != 2:
        return None
    (ta, tb), tc = parse_einsum(e.attr("spec"), 2)
    if len(set(ta)) != len(ta) or len(set(tb)) != len(tb):
        return None
    roles = tuple("b" if ch in ta and ch in tb else "m" if ch in ta else "n" for ch in tc)
    return e.type.shape, roles




def _float_cast(n: Node, node: dict[int, Node]) -> bool:
    """A float-to-float CAST: free where its operand is read from memory (a conversion as the
    value is loaded, like a view's index arithmetic)."""
    return n.op is Op.CAST and n.type.is_float and node[n.inputs[0]].type.is_float


@dataclass(frozen=True)
class _Summary:
    """What a set of nodes would be as one kernel."""
    category: str | None         # None: not a legal kernel
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    bytes: int


# -- the greedy fuser ----------------------------------------------------------------------------

class _Fuser:
    """Greedy merging over groups of nodes. A group's id is the program position of its first
    node when it was created; a merge keeps the smaller id.

    State kept incrementally (each merge only reorders the window between the two groups):
    `order`/`rank` (current kernel order), `prof` (live bytes during each kernel) with prefix
    and suffix maxima, `preds`/`succs` (the kernel graph), `prod`/`readers` per value."""

    def __init__(self, g: Graph, bodies: dict[int, Schedule], check_peak: bool):
        self.g, self.bodies, self.check_peak = g, bodies, check_peak
        self.debug = debug_level()
        self.why = ""                       # why the last `category` call refused
        order = g.order()
        self.pos = {nid: k for k, nid in enumerate(order)}
        self.node = {nid: g.node(nid) for nid in order}
        self.users = {nid: g.users(nid) for nid in order}
        self.graph_out = {v for _, v in g.outputs}
        self.size = {nid: value_bytes(g, nid) for nid in order}
        self.imm = {nid for nid in order if is_immediate(g, nid)}
        self.group: dict[int, int] = {}
        self.members: dict[int, list[int]] = {}
        for nid in order:
            n = self.node[nid]
            if n.op is Op.INPUT or nid in self.imm:
                continue
            gid = self.group[n.inputs[0]] if n.op is Op.ITEM else self.pos[nid]
            self.group[nid] = gid
            self.members.setdefault(gid, []).append(nid)
        for nid in sorted(self.imm, key=self.pos.__getitem__):
            # a scalar constant lives in its first plain reader's kernel (others inline it),
            # or alone when it must be stored (a template reads it or it is a graph output)
            readers = sorted((u for u in self.users[nid] if self.node[u].op not in TEMPLATES),
                             key=self.pos.__getitem__)
            stored = nid in self.graph_out or len(readers) < len(self.users[nid])
            gid = self.group[readers[0]] if readers and not stored else self.pos[nid]
            self.group[nid] = gid
            self.members[gid] = sorted(self.members.get(gid, []) + [nid],
                                       key=self.pos.__getitem__)
        self.info = {gid: self.summary(ms, legal=False) for gid, ms in self.members.items()}
        self.tag = {gid: self._tag(ms) for gid, ms in self.members.items()}
        self.version = {gid: 0 for gid in self.members}
        self._families: dict[tuple[int, int], tuple | None] = {}
        self.ws = {gid: sum(peak_live_bytes(bodies[n]) for n in ms if n in bodies)
                   for gid, ms in self.members.items()}
        self.prod = {v: gid for gid, s in self.info.items() for v in s.outputs}
        self.readers: dict[int, set[int]] = {}
        self.preds: dict[int, set[int]] = {gid: set() for gid in self.members}
        self.succs: dict[int, set[int]] = {gid: set() for gid in self.members}
        for gid, s in self.info.items():
            for v in s.inputs:
                self.readers.setdefault(v, set()).add(gid)
                if v in self.prod:
                    self.preds[gid].add(self.prod[v])
                    self.succs[self.prod[v]].add(gid)
        self.order = self._initial_order()
        self._reindex(self._profile())

    # -- group facts ------------------------------------------------------------------------------
    def summary(self, members: list[int], legal: bool = True) -> _Summary:
        """Inputs, outputs and bytes of `members` as one kernel; its category if `legal`."""
        inside = set(members)
        ins: dict[int, None] = {}
        outs: list[int] = []
        for nid in members:
            n = self.node[nid]
            for i in n.inputs:
                if i not in inside and (i not in self.imm or n.op in TEMPLATES):
                    ins.setdefault(i)
        outs = self._outputs(members, inside)
        nbytes = sum(self.size[v] for v in ins) + sum(self.size[v] for v in outs)
        kind = self.category(members, inside) if legal else None
        return _Summary(kind, tuple(ins), tuple(outs), nbytes)

    def _outputs(self, members: list[int], inside: set[int]) -> list[int]:
        """Members some other kernel or the graph's outputs read (immediates: templates only)."""
        return [nid for nid in members if not isinstance(self.node[nid].type, tuple) and (
            nid in self.graph_out or any(u not in inside and (
                nid not in self.imm or self.node[u].op in TEMPLATES) for u in self.users[nid]))]

    def _refuse(self, why: str) -> None:
        self.why = why
        return None

    def category(self, members: list[int], inside: set[int]) -> str | None:
        """The kernel category of `members` fused, or None (the reason in `self.why`)."""
        nodes = [self.node[n] for n in members]
        if len(nodes) > 1 and any(n.op is Op.ROPE for n in nodes):
            return self._refuse("a rotary table stays alone: bound once as a constant table "
                                "that readers load, never computed per element")
        tmpl = [n for n in nodes if n.op in TEMPLATES]
        if tmpl:
            t = tmpl[0]
            ok = len(tmpl) == 1 and all(n is t or (n.op is Op.ITEM and n.inputs[0] == t.id)
                                         or prologue_of(self.g, n.id) == t.id for n in nodes)
            return "template" if ok else self._refuse("a template kernel holds one template "
                                                      "node (a scan: and its prologue gathers)")
        einsums = [n for n in nodes if n.op is Op.EINSUM]
        reds = [n for n in nodes if n.op in REDUCTIONS]
        if einsums and reds:
            return self._refuse("a contraction and a reduction")
        if len(einsums) > 1:
            if len(einsums) > MAX_CONTRACTIONS:
                return self._refuse(f"more than {MAX_CONTRACTIONS} contractions")
            tile = matmul_tile(self.g, einsums[0])
            if tile is None or any(matmul_tile(self.g, e) != tile for e in einsums[1:]):
                return self._refuse("contractions over different output tiles")
        free: set[int] = set()
        post: set[int] = set()           # depends on a reduction / einsum of this kernel
        computed: list[Node] = []
        for n in nodes:
            local = [i for i in n.inputs if i in inside]
            bound = [i for i in local if i not in free]       # computed operands
            if n.op in OpGroup.GENERATOR or (n.op in OpGroup.INDEXING and not bound) or (
                    _float_cast(n, self.node) and not bound):
                free.add(n.id)
                continue
            if n.op is Op.EXPAND and reds and all(i in post for i in bound):
                pass                     # a reduced value over its row (`_row_epilogue`)
            elif n.op in OpGroup.INDEXING and n.op is not Op.RESHAPE:
                return self._refuse(f"%{n.id} ({n.op.name.lower()}) views a computed value")
            if n.op in GATHERS or n.op is Op.EINSUM:
                if bound:
                    return self._refuse(f"%{n.id} ({n.op.name.lower()}) reads a computed "
                                        f"operand (gathers and matmuls read memory)")
            elif n.op in OpGroup.ELEMENTWISE:
                wide = [i for i in bound if _numel(self.node[i]) != _numel(n)]
                if wide and not (reds and all(i in post for i in wide)):   # a row epilogue
                    return self._refuse(f"%{n.id} broadcasts a computed value")
            elif n.op in REDUCTIONS:
                if any(i in post or self.node[i].op in REDUCTIONS for i in bound):
                    return self._refuse(f"%{n.id} reduces a reduction (a second pass)")
            elif n.op not in (Op.RESHAPE, Op.EXPAND):
                return self._refuse(f"%{n.id} ({n.op.name.lower()}) fuses with nothing")
            if n.op in REDUCTIONS or n.op is Op.EINSUM or any(i in post for i in bound):
                post.add(n.id)
            computed.append(n)
        outs = [self.node[v] for v in self._outputs(members, inside)]
        if einsums:
            dom = {_numel(einsums[0])}
            kind = "matmul"
        elif reds:
            r0 = reds[0]
            key = self._reduction_key(r0)
            if any(self._reduction_key(r) != key for r in reds[1:]):
                return self._refuse("reductions over different axes")
            n_in, n_out = _numel(self.node[r0.inputs[0]]), _numel(r0)
            late = [n for n in computed if _numel(n) == n_in != n_out and n.id in post]
            if late:
                why = self._row_epilogue(r0, late, inside - free)
                if why:
                    return self._refuse(why)
            dom = {n_in, n_out}
            kind = "reduction"
        else:
            dom = {_numel(computed[0])} if computed else {_numel(n) for n in outs}
            kind = "pointwise"
        if len(dom) == 0 or any(_numel(n) not in dom for n in computed + outs):
            return self._refuse("values of more than one iteration domain")
        if kind == "pointwise" and len(dom) != 1:
            return self._refuse("a pointwise kernel over two domains")
        return kind

    def _row_epilogue(self, r0: Node, late: list[Node], computed: set[int]) -> str | None:
        """Why input-domain nodes after the reduction cannot be its row epilogue, or None.

        The reduction kernel holds each row while it reduces it (or loops over its column
        blocks again), so `x * rsqrt(mean(x²))` is one kernel: an input-domain node reads the
        reduced value of its own row. That is the element at its broadcast coordinates only
        when the node has the reduction's input shape and the reduced value the keep-dims
        shape (the reduced axes of size 1); other reads would cross rows."""
        x = self.node[r0.inputs[0]].type.shape
        axes = {a % len(x) for a in r0.attr("axes")}
        keep = tuple(1 if d in axes else s for d, s in enumerate(x))
        n_out = _numel(r0)
        for n in late:
            if n.op not in OpGroup.ELEMENTWISE and n.op not in (Op.RESHAPE, Op.EXPAND):
                return f"%{n.id} ({n.op.name.lower()}) after the reduction is no elementwise op"
            if n.op is Op.EXPAND and _numel(self.node[n.inputs[0]]) != n_out:
                return f"%{n.id} expands no reduced value"
            for i in n.inputs:
                if i not in computed or _numel(self.node[i]) != n_out:
                    continue                 # read from memory (or free) at its coordinates
                if n.type.shape != x or self.node[i].type.shape != keep:
                    return (f"%{n.id} reads the reduced %{i} {self.node[i].type.shape} at "
                            f"other than its row of {x} (a second pass)")
        return None

    def _tag(self, members: list[int]) -> tuple[int, int, frozenset]:
        """(templates, einsums, reduction keys): enough to reject most unions cheaply."""
        ops = [self.node[n] for n in members]
        return (sum(n.op in TEMPLATES for n in ops), sum(n.op is Op.EINSUM for n in ops),
                frozenset(self._reduction_key(n) for n in ops if n.op in REDUCTIONS))

    def compatible(self, a: int, b: int) -> bool:
        """A necessary condition for `category(a ∪ b)` to be legal."""
        (ta, ea, ra), (tb, eb, rb) = self.tag[a], self.tag[b]
        return not (ta or tb or ea + eb > MAX_CONTRACTIONS or ((ea or eb) and (ra or rb))
                    or len(ra | rb) > 1)

    def _reduction_key(self, r: Node) -> tuple:
        shape = self.node[r.inputs[0]].type.shape
        if r.op is Op.CUMSUM:
            return ("cumsum", shape, r.attr("axis"), r.attr("reverse"))
        return ("reduce", shape, tuple(r.attr("axes")))

    # -- order and liveness -----------------------------------------------------------------------
    def _initial_order(self) -> list[int]:
        """Topological order of the groups, ties by program position (a heap-based Kahn)."""
        indeg = {gid: len(ps) for gid, ps in self.preds.items()}
        ready = [gid for gid, d in indeg.items() if d == 0]
        heapq.heapify(ready)
        order = []
        while ready:
            gid = heapq.heappop(ready)
            order.append(gid)
            for s in self.succs[gid]:
                indeg[s] -= 1
                if indeg[s] == 0:
                    heapq.heappush(ready, s)
        assert len(order) == len(self.members), "the node graph has a cycle"
        return order

    def _profile(self) -> list[int]:
        """Live bytes during each kernel of the current order, from scratch."""
        rank = {gid: k for k, gid in enumerate(self.order)}
        end = len(self.order) - 1
        diff = [0] * (len(self.order) + 1)
        for v, p in self.prod.items():
            a = rank[p]
            b = end if v in self.graph_out else max(rank[r] for r in self.readers[v])
            diff[a] += self.size[v]
            diff[b + 1] -= self.size[v]
        prof, run = [], 0
        for k, gid in enumerate(self.order):
            run += diff[k]
            prof.append(run + self.ws[gid])
        return prof

    def _reindex(self, prof: list[int]) -> None:
        self.rank = {gid: k for k, gid in enumerate(self.order)}
        self.prof = prof
        self.pre = list(accumulate(prof, max))
        self.suf = list(accumulate(reversed(prof), max))[::-1]
        self.peak = self.pre[-1] if prof else 0

    def _last(self, v: int) -> int:
        if v in self.graph_out:
            return len(self.order) - 1
        return max(self.rank[r] for r in self.readers[v])

    def union(self, a: int, b: int) -> _Summary:
        """The summary of a and b as one kernel (without its category)."""
        sa, sb = self.info[a], self.info[b]
        pair = (a, b)
        ins = tuple(dict.fromkeys(v for v in sa.inputs + sb.inputs if self.prod.get(v) not in pair))
        outs = tuple(sorted((v for v in sa.outputs + sb.outputs
                             if v in self.graph_out or self.readers.get(v, set()) - {a, b}),
                            key=self.pos.__getitem__))
        return _Summary(None, ins, outs, sum(self.size[v] for v in ins + outs))

    def window(self, x: int, y: int, u: _Summary) -> tuple[list[int], list[int]] | None:
        """Merge x (earlier) and y (later) in the order. Two placements of the merged kernel
        (labelled x) are tried: early (the groups between them that y depends on move before
        it) and late (the groups that depend on x move after it); the one with the lower
        (peak, total) live bytes wins, early on ties. Returns the new window [rank x .. rank y]
        and its live-bytes profile, or None if the merge closes a cycle."""
        i, j = self.rank[x], self.rank[y]
        inside = lambda g: i < self.rank[g] < j                   # noqa: E731
        anc = self._closure(self.preds, y, inside)
        desc = self._closure(self.succs, x, inside)
        if anc & desc or x in anc:
            return None                           # x -> ... -> y through another kernel
        old = self.order[i:j + 1]
        mid = [g for g in old if g != x and g != y]
        early = [g for g in mid if g in anc] + [x] + [g for g in mid if g not in anc]
        late = [g for g in mid if g not in desc] + [x] + [g for g in mid if g in desc]
        best = None
        for new in (early, late) if early != late else (early,):
            prof = self._window_profile(old, new, u, x, y)
            if best is None or (max(prof), sum(prof)) < (max(best[1]), sum(best[1])):
                best = (new, prof)
        return best

    @staticmethod
    def _closure(edges: dict[int, set[int]], start: int, keep) -> set[int]:
        out: set[int] = set()
        stack = [g for g in edges[start] if keep(g)]
        while stack:
            g = stack.pop()
            if g not in out:
                out.add(g)
                stack.extend(h for h in edges[g] if keep(h) and h not in out)
        return out

    def _window_profile(self, old: list[int], new: list[int], u: _Summary, x: int,
                        y: int) -> list[int]:
        """Live bytes during each kernel of `new`, which replaces `old` (x and y merged)."""
        i, j = self.rank[x], self.rank[y]
        npos = {g: i + k for k, g in enumerate(new)}
        hi = i + len(new) - 1
        # bytes live across the whole window, untouched by it: prof[i] minus what the old
        # window touches that is live at i
        touched_old = {v for g in old for v in self.info[g].inputs + self.info[g].outputs
                       if v in self.prod}
        at_i = sum(self.size[v] for v in touched_old
                   if self.rank[self.prod[v]] <= i <= self._last(v))
        base = self.prof[i] - self.ws[old[0]] - at_i
        diff = [0] * (len(new) + 1)
        seen: set[int] = set()
        for g in new:
            s = u if g == x else self.info[g]
            for v in s.inputs + s.outputs:
                if v in seen or v not in self.prod:
                    continue
                seen.add(v)
                p = self.prod[v]
                first = npos.get(x if p == y else p, i)
                if v in self.graph_out:
                    last = hi
                else:
                    last = i
                    for r in self.readers[v]:
                        r = x if r == y else r
                        last = max(last, npos[r] if r in npos else
                                   (hi if self.rank[r] > j else i))
                diff[first - i] += self.size[v]
                diff[last - i + 1] -= self.size[v]
        prof, run = [], base
        for k, g in enumerate(new):
            run += diff[k]
            prof.append(run + self.ws[g])
        return prof

    # -- merging ----------------------------------------------------------------------------------
    def candidates(self, gid: int) -> Iterator[tuple[int, int, int]]:
        """(other group, kind, score) for producer/consumer (kind 0) and sibling (1) pairs."""
        info = self.info[gid]
        near = [(o, 0) for o in sorted(self.preds[gid] | self.succs[gid])]
        for v in info.inputs:
            if _numel(self.node[v]) > 1:
                readers = sorted(self.readers[v] - {gid})
                if len(readers) <= SIBLING_READERS:
                    near += [(o, 1) for o in readers]
        if self._elementwise_only(gid):
            for p in sorted(self.preds[gid]):          # cousins: read one kernel's outputs
                others = sorted(self.succs[p] - {gid})
                if len(others) <= SIBLING_READERS:
                    near += [(o, 2) for o in others if self._elementwise_only(o)]
        seen: set[int] = set()
        for other, kind in near:
            # a lone cast of an input (one per reader: `split_casts`) goes into its reader
            if (self._cast_only(gid) and other not in self.succs[gid]) or (
                    self._cast_only(other) and other not in self.preds[gid]):
                continue
            if other not in seen and self.compatible(gid, other):
                seen.add(other)
                score = info.bytes + self.info[other].bytes - self.union(gid, other).bytes
                if score > 0 or (kind == 2 and score == 0):     # cousins: a launch saved
                    yield other, kind, score
        # neighbours: independent work of one kind nearby in the order, a launch saved (no
        # shared value, so no bytes: a pair that shares one was a candidate above)
        family = self._family(gid)
        if family is None:
            return
        r = self.rank[gid]
        tensors = len(info.inputs) + len(info.outputs)
        for other in self.order[max(0, r - HORIZONTAL):r + HORIZONTAL + 1]:
            o = self.info[other]
            if other != gid and other not in seen and self._family(other) == family and \
                    tensors + len(o.inputs) + len(o.outputs) <= NEIGHBOUR_TENSORS:
                yield other, 3, 0

    def _elementwise_only(self, gid: int) -> bool:
        """No contraction, reduction or template: a group that can only be pointwise."""
        t, e, r = self.tag[gid]
        return not (t or e or r)

    def _family(self, gid: int) -> tuple | None:
        """What a neighbour must match to share a kernel with this group (cached per group
        version): pointwise over one element count, contractions over one output tile,
        reductions of the same keys; None for a template (alone) and for a cast of an input
        that a reader other than a template can take in (`split_casts`: it goes there)."""
        key = (gid, self.version[gid])
        if key not in self._families:
            t, e, r = self.tag[gid]
            ms = [self.node[n] for n in self.members[gid]]
            if t or (self._cast_only(gid) and any(
                    self.node[u].op not in TEMPLATES for v in self.info[gid].outputs
                    for u in self.users[v])):
                fam = None
            elif e:
                fam = ("matmul", matmul_tile(self.g, next(n for n in ms if n.op is Op.EINSUM)))
            elif r:
                fam = ("reduction", r)
            else:
                outs = self.info[gid].outputs
                fam = ("pointwise", _numel(self.node[outs[0]]) if outs else None)
            self._families[key] = fam
        return self._families[key]

    def _cast_only(self, gid: int) -> bool:
        """Is the group a cast of an input (with views of it), which only its reader takes?"""
        ms = [self.node[n] for n in self.members[gid]]
        return any(n.op is Op.CAST for n in ms) and all(
            n.op in OpGroup.VIEW or splittable(self.g, n.id) for n in ms)

    def run(self) -> None:
        heap: list[tuple] = []

        def push(gid: int) -> None:
            for other, kind, score in self.candidates(gid):
                a, b = min(gid, other), max(gid, other)
                heapq.heappush(heap, (-score, kind, a, b, self.version[a], self.version[b]))

        self.prologues()
        for gid in sorted(self.members):
            push(gid)
        while heap:
            _, _, a, b, va, vb = heapq.heappop(heap)
            if self.version.get(a) != va or self.version.get(b) != vb:
                continue
            if self.join(a, b):
                push(min(a, b))

    def prologues(self) -> None:
        """Fold each prologue node (`schedule.prologue_of`: a gather, casts of it) into its
        scan's kernel, the scan's operand first (so no merge closes a cycle)."""
        for nid in sorted(self.group, key=self.pos.__getitem__, reverse=True):
            sid = prologue_of(self.g, nid) if self.node[nid].op in (Op.TAKE, Op.CAST) else None
            a = self.group[nid]
            if sid is not None and self.members[a] == [nid]:
                self.join(a, self.group[sid])

    def join(self, a: int, b: int) -> bool:
        """Merge groups a and b into one kernel if legal, acyclic and not raising the peak
        (else say why, `_refused`); the merged group keeps the label min(a, b)."""
        members = sorted(self.members[a] + self.members[b], key=self.pos.__getitem__)
        if self.category(members, set(members)) is None:
            self._refused(a, b, self.why)
            return False
        x, y = (a, b) if self.rank[a] < self.rank[b] else (b, a)
        u = self.union(a, b)
        got = self.window(x, y, u)
        if got is None:
            self._refused(a, b, "a path between them runs through another kernel")
            return False
        new, prof = got
        i, j = self.rank[x], self.rank[y]
        peak = max(self.pre[i - 1] if i else 0, max(prof),
                   self.suf[j + 1] if j + 1 < len(self.order) else 0)
        if self.check_peak and peak > self.peak:
            self._refused(a, b, f"peak memory would rise to {peak} B (> {self.peak} B)")
            return False
        self.merge(x, y, u)
        keep = min(a, b)
        self.order = self.order[:i] + [keep if g == x else g for g in new] + self.order[j + 1:]
        self._reindex(self.prof[:i] + prof + self.prof[j + 1:])
        return True

    def _refused(self, a: int, b: int, why: str) -> None:
        """`TITANC_DEBUG=2`: print each refused merge and its reason."""
        if self.debug >= 2:
            name = lambda gid: "+".join(f"%{n}" for n in self.members[gid][:3]) + (
                "+..." if len(self.members[gid]) > 3 else "")
            print(f"[titanc] fusion {self.g.name}: [{name(a)}] with [{name(b)}] refused: {why}",
                  file=sys.stderr)

    def merge(self, x: int, y: int, u: _Summary) -> None:
        """Fold groups x and y into one labelled min(x, y); update every map but the order."""
        keep = min(x, y)
        pair = {x, y}
        old_in = self.info[x].inputs + self.info[y].inputs
        old_out = self.info[x].outputs + self.info[y].outputs
        members = sorted(self.members.pop(x) + self.members.pop(y), key=self.pos.__getitem__)
        for nid in members:
            self.group[nid] = keep
        self.members[keep] = members
        for v in old_out:
            del self.prod[v]
        for v in u.outputs:
            self.prod[v] = keep
        for v in old_in:
            self.readers[v] -= pair
        for v in u.inputs:
            self.readers[v].add(keep)
        preds = (self.preds.pop(x) | self.preds.pop(y)) - pair
        succs = (self.succs.pop(x) | self.succs.pop(y)) - pair
        for p in preds:
            self.succs[p] -= pair
            self.succs[p].add(keep)
        for q in succs:
            self.preds[q] -= pair
            self.preds[q].add(keep)
        self.preds[keep], self.succs[keep] = preds, succs
        self.ws[keep] = self.ws.pop(x) + self.ws.pop(y)
        version = max(self.version.pop(x), self.version.pop(y)) + 1
        del self.info[x], self.info[y]
        self.info[keep], self.version[keep] = u, version
        ta, tb = self.tag.pop(x), self.tag.pop(y)
        self.tag[keep] = (ta[0] + tb[0], ta[1] + tb[1], ta[2] | tb[2])

    def kernels(self) -> list[Kernel]:
        out = []
        for gid in self.order:
            members = self.members[gid]
            s = self.summary(members)
            flops = sum(node_flops(self.node[n], self.g, self._body_flops(n)) for n in members)
            out.append(Kernel("", s.category, tuple(members), s.inputs, s.outputs, flops,
                              s.bytes))
        return out

    def _body_flops(self, nid: int) -> int:
        b = self.bodies.get(nid)
        return sum(k.flops for k in b.kernels) if b is not None else 0


def _fuse_graph(g: Graph, check_peak: bool, merge: bool = True) -> Schedule:
    """Fuse the scan bodies first (a scan kernel's workspace is its body's peak), then `g`."""
    bodies = {n.id: _fuse_graph(n.attr("body"), check_peak, merge)
              for n in g if n.op is Op.SCAN}
    f = _Fuser(g, bodies, check_peak)
    if merge:
        f.run()
    return Schedule(g, f.kernels(), bodies)


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
