"""fusion: group the nodes of a graph into kernels, producing a `Schedule`.

Precondition: `g` verifies (canonicalized graphs give the best result). Postcondition: every
non-INPUT node is in exactly one kernel (a SCAN's ITEMs in the SCAN's), no kernel mixes the
nodes of a scan body with the outside (each body gets its own schedule, fused recursively),
the kernels form a DAG listed in a topological order, and the schedule's peak of live bytes
(`schedule.peak_live_bytes`) is no higher than that of one kernel per node.

Kernel families, with what a kernel may contain:
- pointwise: elementwise ops, CAST, gathers (TAKE, TAKE_ALONG), views (RESHAPE, PERMUTE,
  EXPAND, SLICE, PAD, CONCAT) and generators (FULL, ROPE, MASK); every computing node has the
  kernel's element count (its domain) and is evaluated once per element.
- reduction: SUM/AMAX sharing one input shape and axes, or CUMSUMs sharing shape, axis and
  direction, with a pointwise prologue on the reduction's input domain and a pointwise
  epilogue on its output domain; nothing on the input domain may depend on a reduction of the
  same kernel (that would be a second pass) and no reduction depends on another.
- matmul: one EINSUM with a pointwise epilogue on its output domain; its operands may be
  views of kernel inputs (read with remapped indices, never materialized), not computed ones.
- template: a SCAN with its ITEMs, an INDEX_ADD or a SCATTER_ALONG, alone.

"Free" nodes (generators, and views whose operands are free or read from memory) cost no
work and may be used at any index. A view of a value computed in the same kernel must be a
RESHAPE (the linear index is unchanged); anything else (a broadcast, slice, pad, permute or
gather of a computed value) would evaluate it more or less than once per element, duplicating
or scattering work, so such a value is materialized instead.

Greedy: start from one kernel per node; candidate merges are producer/consumer pairs and
siblings reading a common value, scored by bytes saved (`bytes(a) + bytes(b) - bytes(a∪b)`: a
value read only inside the group never goes to memory, a shared input is read once); the best
is taken first (ties by program order). A merge is refused if the union breaks the rules above,
if it closes a cycle in the kernel graph, or if it raises the schedule's peak of live bytes
(kernels ordered by a topological sort keyed on program order; a scan kernel counts its body's
peak). The result depends only on the graph.
"""
from __future__ import annotations

import heapq
import re
from dataclasses import dataclass
from itertools import count
from math import prod
from typing import Iterator

from titanc.ir import Graph, Node, Op, OpGroup
from titanc.ir.shapes import parse_einsum
from titanc.ir.types import TensorType

from .schedule import PREFIX, Kernel, Schedule, peak_live_bytes, value_bytes

GATHERS = frozenset({Op.TAKE, Op.TAKE_ALONG})
VIEWS = frozenset({Op.RESHAPE, Op.PERMUTE, Op.EXPAND, Op.SLICE, Op.PAD, Op.CONCAT})
REDUCTIONS = frozenset({Op.SUM, Op.AMAX, Op.CUMSUM})
TEMPLATES = frozenset({Op.SCAN, Op.INDEX_ADD, Op.SCATTER_ALONG})
MAX_NAME_OPS = 4
SIBLING_READERS = 8          # siblings of a value are paired only when it has this few readers


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
    scatter-adds 1/input element, scans length * body; views, gathers, generators 0."""
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
    return 0


@dataclass(frozen=True)
class _Summary:
    """What a set of nodes would be as one kernel."""
    category: str | None         # None: not a legal kernel
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    bytes: int


# -- the greedy fuser ----------------------------------------------------------------------------

class _Fuser:
    def __init__(self, g: Graph, bodies: dict[int, Schedule], check_peak: bool):
        self.g, self.bodies, self.check_peak = g, bodies, check_peak
        order = g.order()
        self.pos = {nid: k for k, nid in enumerate(order)}
        self.node = {nid: g.node(nid) for nid in order}
        self.users = {nid: g.users(nid) for nid in order}
        self.graph_out = {v for _, v in g.outputs}
        self.size = {nid: value_bytes(g, nid) for nid in order}
        self.workspace = {sid: peak_live_bytes(b, exclude_inputs=True) for sid, b in bodies.items()}
        # groups: id = program position of its first node (stable, deterministic)
        self.group: dict[int, int] = {}
        self.members: dict[int, list[int]] = {}
        for nid in order:
            n = self.node[nid]
            if n.op is Op.INPUT:
                continue
            gid = self.group[n.inputs[0]] if n.op is Op.ITEM else self.pos[nid]
            self.group[nid] = gid
            self.members.setdefault(gid, []).append(nid)
        self.info = {gid: self.summary(ms) for gid, ms in self.members.items()}
        self.version = {gid: 0 for gid in self.members}
        self.order = self.schedule_order()
        self.rank = {gid: k for k, gid in enumerate(self.order)}
        self.peak = self.peak_of(self.order, self.info) if check_peak else 0

    # -- group facts ------------------------------------------------------------------------------
    def summary(self, members: list[int]) -> _Summary:
        inside = set(members)
        ins: dict[int, None] = {}
        outs: list[int] = []
        for nid in members:
            n = self.node[nid]
            for i in n.inputs:
                if i not in inside:
                    ins.setdefault(i)
            if n.op is Op.SCAN:
                continue
            if nid in self.graph_out or any(u not in inside for u in self.users[nid]):
                outs.append(nid)
        nbytes = sum(self.size[v] for v in ins) + sum(self.size[v] for v in outs)
        return _Summary(self.category(members, inside), tuple(ins), tuple(outs), nbytes)

    def category(self, members: list[int], inside: set[int]) -> str | None:
        nodes = [self.node[n] for n in members]
        tmpl = [n for n in nodes if n.op in TEMPLATES]
        if tmpl:
            t = tmpl[0]
            ok = len(tmpl) == 1 and all(n is t or (n.op is Op.ITEM and n.inputs[0] == t.id)
                                         for n in nodes)
            return "template" if ok else None
        einsums = [n for n in nodes if n.op is Op.EINSUM]
        reds = [n for n in nodes if n.op in REDUCTIONS]
        if len(einsums) > 1 or (einsums and reds):
            return None
        free: set[int] = set()
        post: set[int] = set()           # depends on a reduction / einsum of this kernel
        computed: list[Node] = []
        for n in nodes:
            local = [i for i in n.inputs if i in inside]
            bound = [i for i in local if i not in free]       # computed operands
            if n.op in OpGroup.GENERATOR or (n.op in VIEWS and not bound):
                free.add(n.id)
                continue
            if n.op in VIEWS and n.op is not Op.RESHAPE:
                return None              # broadcast/slice/pad/permute of a computed value
            if n.op in GATHERS or n.op is Op.EINSUM:
                if bound:
                    return None          # gathers and matmul operands read memory only
            elif n.op in OpGroup.ELEMENTWISE:
                if any(_numel(self.node[i]) != _numel(n) for i in bound):
                    return None          # implicit broadcast of a computed value
            elif n.op in REDUCTIONS:
                if any(i in post or self.node[i].op in REDUCTIONS for i in bound):
                    return None          # a reduction of a reduction: a second pass
            elif n.op is not Op.RESHAPE:
                return None
            if n.op in REDUCTIONS or n.op is Op.EINSUM or any(i in post for i in bound):
                post.add(n.id)
            computed.append(n)
        outs = [n for n in nodes if n.id in self.graph_out
                or any(u not in inside for u in self.users[n.id])]
        if einsums:
            dom = {_numel(einsums[0])}
            kind = "matmul"
        elif reds:
            r0 = reds[0]
            key = self._reduction_key(r0)
            if any(self._reduction_key(r) != key for r in reds[1:]):
                return None
            n_in, n_out = _numel(self.node[r0.inputs[0]]), _numel(r0)
            if any(_numel(n) == n_in != n_out and n.id in post for n in computed):
                return None              # input-domain work after the reduction: second pass
            dom = {n_in, n_out}
            kind = "reduction"
        else:
            dom = {_numel(computed[0])} if computed else {_numel(n) for n in outs}
            kind = "pointwise"
        if len(dom) == 0 or any(_numel(n) not in dom for n in computed + outs):
            return None
        if kind == "pointwise" and len(dom) != 1:
            return None
        return kind

    def _reduction_key(self, r: Node) -> tuple:
        shape = self.node[r.inputs[0]].type.shape
        if r.op is Op.CUMSUM:
            return ("cumsum", shape, r.attr("axis"), r.attr("reverse"))
        return ("reduce", shape, tuple(r.attr("axes")))

    def preds(self, gid: int, info: _Summary) -> set[int]:
        return {self.group[i] for i in info.inputs if i in self.group} - {gid}

    def succs(self, gid: int) -> set[int]:
        out = set()
        for nid in self.members[gid]:
            for u in self.users[nid]:
                out.add(self.group[u])
        out.discard(gid)
        return out

    # -- order and peak ---------------------------------------------------------------------------
    def schedule_order(self, merged: tuple[int, int] | None = None,
                       info: dict[int, _Summary] | None = None) -> list[int]:
        """Topological order of the groups (b folded into a when `merged`), by program order."""
        info = info if info is not None else self.info
        a, b = merged if merged else (None, None)
        remap = (lambda x: a if x == b else x)
        indeg: dict[int, int] = {}
        succ: dict[int, list[int]] = {}
        for gid, s in info.items():
            ps = {remap(self.group[i]) for i in s.inputs if i in self.group} - {gid}
            indeg[gid] = len(ps)
            for p in ps:
                succ.setdefault(p, []).append(gid)
        ready = [gid for gid, d in indeg.items() if d == 0]
        heapq.heapify(ready)
        order = []
        while ready:
            gid = heapq.heappop(ready)
            order.append(gid)
            for s in succ.get(gid, ()):
                indeg[s] -= 1
                if indeg[s] == 0:
                    heapq.heappush(ready, s)
        if len(order) != len(info):
            return []                    # a cycle
        return order

    def peak_of(self, order: list[int], info: dict[int, _Summary]) -> int:
        diff = [0] * (len(order) + 1)
        first: dict[int, int] = {}
        last: dict[int, int] = {}
        for k, gid in enumerate(order):
            s = info[gid]
            for v in s.outputs:
                first[v] = k
                last.setdefault(v, k)
            for v in s.inputs:
                first.setdefault(v, 0)
                last[v] = k
            for nid in self.members.get(gid, ()):
                if nid in self.workspace:
                    diff[k] += self.workspace[nid]
                    diff[k + 1] -= self.workspace[nid]
        end = len(order) - 1
        for v in self.graph_out:
            first.setdefault(v, 0)
            last[v] = end
        for v, a in first.items():
            diff[a] += self.size[v]
            diff[last[v] + 1] -= self.size[v]
        peak = run = 0
        for d in diff[:-1]:
            run += d
            peak = max(peak, run)
        return peak

    # -- merging ----------------------------------------------------------------------------------
    def candidates(self, gid: int) -> Iterator[tuple[int, int, int]]:
        """(other group, kind, score) for producer/consumer (kind 0) and sibling (1) pairs."""
        info = self.info[gid]
        seen: set[int] = set()
        near = [(o, 0) for o in sorted(self.preds(gid, info) | self.succs(gid))]
        for v in info.inputs:
            if _numel(self.node[v]) <= 1:
                continue
            readers = sorted({self.group[u] for u in self.users[v]} - {gid})
            if len(readers) <= SIBLING_READERS:
                near += [(o, 1) for o in readers]
        for other, kind in near:
            if other in seen:
                continue
            seen.add(other)
            union = sorted(self.members[gid] + self.members[other], key=self.pos.__getitem__)
            u = self.summary(union)
            score = info.bytes + self.info[other].bytes - u.bytes
            if u.category is not None and score > 0:
                yield other, kind, score

    def reaches(self, src: int, dst: int) -> bool:
        """Is there a path src -> x -> ... -> dst through some other group x?"""
        limit = self.rank[dst]
        stack = [s for s in self.succs(src) if s != dst and self.rank[s] < limit]
        seen = set(stack)
        while stack:
            x = stack.pop()
            for s in self.succs(x):
                if s == dst:
                    return True
                if s not in seen and self.rank[s] < limit:
                    seen.add(s)
                    stack.append(s)
        return False

    def run(self) -> None:
        heap: list[tuple] = []

        def push(gid: int) -> None:
            for other, kind, score in self.candidates(gid):
                a, b = min(gid, other), max(gid, other)
                heapq.heappush(heap, (-score, kind, a, b, self.version[a], self.version[b]))

        for gid in sorted(self.members):
            push(gid)
        while heap:
            _, _, a, b, va, vb = heapq.heappop(heap)
            if self.version.get(a) != va or self.version.get(b) != vb:
                continue
            x, y = (a, b) if self.rank[a] < self.rank[b] else (b, a)
            if self.reaches(x, y):
                continue
            members = sorted(self.members[a] + self.members[b], key=self.pos.__getitem__)
            summary = self.summary(members)
            info = {k: v for k, v in self.info.items() if k != b}
            info[a] = summary
            order = self.schedule_order((a, b), info)
            if not order:
                continue
            if self.check_peak:
                peak = self.peak_of(order, info)     # scans are never merged: workspaces hold
                if peak > self.peak:
                    continue
                self.peak = peak
            for nid in self.members.pop(b):
                self.group[nid] = a
            self.members[a] = members
            self.info = info
            del self.version[b]
            self.version[a] += 1
            self.order = order
            self.rank = {gid: k for k, gid in enumerate(order)}
            push(a)

    def kernels(self) -> list[Kernel]:
        out = []
        for gid in self.order:
            members, s = self.members[gid], self.info[gid]
            flops = sum(node_flops(self.node[n], self.g, self._body_flops(n)) for n in members)
            out.append(Kernel("", s.category, tuple(members), s.inputs, s.outputs, flops,
                              s.bytes))
        return out

    def _body_flops(self, nid: int) -> int:
        b = self.bodies.get(nid)
        return sum(k.flops for k in b.kernels) if b is not None else 0


def _fuse_graph(g: Graph, check_peak: bool, merge: bool = True) -> Schedule:
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
    work = [n.op for n in nodes if n.op not in VIEWS and n.op not in OpGroup.GENERATOR]
    ops = list(dict.fromkeys(work or [n.op for n in nodes]))
    return [o.name.lower() for o in ops[:MAX_NAME_OPS]]


def _name(s: Schedule, counter: Iterator[int]) -> Schedule:
    kernels = []
    bodies: dict[int, Schedule] = {}
    for k in s.kernels:
        name = f"titanc_{PREFIX[k.category]}_fused_{'_'.join(kernel_ops(s.graph, k))}_{next(counter)}"
        kernels.append(Kernel(name, k.category, k.nodes, k.inputs, k.outputs, k.flops, k.bytes))
        for nid in k.nodes:
            if nid in s.bodies:
                bodies[nid] = _name(s.bodies[nid], counter)
    return Schedule(s.graph, kernels, bodies)
