"""fusion, the greedy merger: groups of nodes joined into kernels, best bytes saved first.

The algorithm and its scores are described in `passes/fusion.py`'s docstring (the pass's
contract); what a kernel may hold is `passes.fusion_rules`. `Fuser(g, bodies, check_peak)`
starts from one kernel per node; `run()` merges; `kernels()` lists the result in order.
"""
from __future__ import annotations

import heapq
import sys
from dataclasses import dataclass
from itertools import accumulate
from typing import Iterator

from titanc.config import debug_level
from titanc.ir import Graph, Op, OpGroup
from titanc.ir.schedule import (Kernel, Schedule, is_immediate, peak_live_bytes, prologue_of,
                                value_bytes)
from titanc.passes.fusion_rules import (TEMPLATES, KernelRules, matmul_tile, node_flops,
                                        numel)
from titanc.passes.split_casts import splittable

SIBLING_READERS = 8          # siblings of a value are paired only when it has this few readers
HORIZONTAL = 8               # kernels either side in the order a launch-saving merge looks at
NEIGHBOUR_TENSORS = 12       # tensors a neighbour merge may leave a kernel reading and writing
                             # (more held a tiny.yaml reduction at 255 registers, 1.6 KB spilled)


@dataclass(frozen=True)
class _Summary:
    """What a set of nodes would be as one kernel."""
    category: str | None         # None: not a legal kernel
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    bytes: int


class Fuser:
    """Greedy merging over groups of nodes. A group's id is the program position of its first
    node when it was created; a merge keeps the smaller id.

    State kept incrementally (each merge only reorders the window between the two groups):
    `order`/`rank` (current kernel order), `prof` (live bytes during each kernel) with prefix
    and suffix maxima, `preds`/`succs` (the kernel graph), `prod`/`readers` per value."""

    def __init__(self, g: Graph, bodies: dict[int, Schedule], check_peak: bool):
        self.g, self.bodies, self.check_peak = g, bodies, check_peak
        self.debug = debug_level()
        order = g.order()
        self.pos = {nid: k for k, nid in enumerate(order)}
        self.node = {nid: g.node(nid) for nid in order}
        self.rules = KernelRules(g, self.node)
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
        self.tag = {gid: self.rules.tag(ms) for gid, ms in self.members.items()}
        self.version = {gid: 0 for gid in self.members}
        self._memo: dict[tuple, object] = {}  # per group version: category, family, tile, union
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
                if i not in inside and (i not in self.imm or nid in self.rules.template):
                    ins.setdefault(i)
        outs = self._outputs(members, inside)
        nbytes = sum(self.size[v] for v in ins) + sum(self.size[v] for v in outs)
        kind = self.category(members, inside) if legal else None
        return _Summary(kind, tuple(ins), tuple(outs), nbytes)

    def _outputs(self, members: list[int], inside: set[int]) -> list[int]:
        """Members some other kernel or the graph's outputs read (immediates: templates only)."""
        return [nid for nid in members if not isinstance(self.node[nid].type, tuple) and (
            nid in self.graph_out or any(u not in inside and (
                nid not in self.imm or u in self.rules.template) for u in self.users[nid]))]

    def category(self, members: list[int], inside: set[int]) -> str | None:
        """`KernelRules.category` of `members` as one kernel (the reason in `rules.why`)."""
        return self.rules.category(members, inside, self._outputs(members, inside))

    def compatible(self, a: int, b: int) -> bool:
        """A necessary condition for `category(a ∪ b)` to be legal: the groups' tags allow it,
        and contractions in both share one output tile (`KernelRules._contractions`)."""
        if not self.rules.compatible(*self.tag[a], *self.tag[b]):
            return False
        if self.tag[a][1] and self.tag[b][1]:
            tile = self._tile(a)
            return tile is not None and tile == self._tile(b)
        return True

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
        """The summary of a and b as one kernel (without its category). A function of the two
        groups' versions: another merge leaves a value's producer outside the pair and a read
        value read elsewhere, so it is kept per version pair (`_memo`)."""
        a, b = min(a, b), max(a, b)
        key = ("union", a, self.version[a], b, self.version[b])
        if key not in self._memo:
            self._memo[key] = self._union(a, b)
        return self._memo[key]

    def _union(self, a: int, b: int) -> _Summary:
        sa, sb = self.info[a], self.info[b]
        prod, readers = self.prod, self.readers
        ins = tuple(dict.fromkeys(v for v in sa.inputs + sb.inputs
                                  if prod.get(v) != a and prod.get(v) != b))
        outs = tuple(sorted((v for v in sa.outputs + sb.outputs if v in self.graph_out or (
            v in readers and len(readers[v]) > (a in readers[v]) + (b in readers[v]))),
                            key=self.pos.__getitem__))
        size = self.size
        return _Summary(None, ins, outs, sum(size[v] for v in ins) + sum(size[v] for v in outs))

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
            if self.rules.size[v] > 1:
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
        key = ("family", gid, self.version[gid])
        if key not in self._memo:
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
                fam = ("pointwise", numel(self.node[outs[0]]) if outs else None)
            self._memo[key] = fam
        return self._memo[key]

    def _tile(self, gid: int) -> tuple | None:
        """The output tile of the group's contractions (one tile: the group is legal)."""
        key = ("tile", gid, self.version[gid])
        if key not in self._memo:
            first = next(n for n in self.members[gid] if self.node[n].op is Op.EINSUM)
            self._memo[key] = matmul_tile(self.g, self.node[first])
        return self._memo[key]

    def _cast_only(self, gid: int) -> bool:
        """Is the group a cast of an input (with views of it), which only its reader takes?"""
        key = ("cast", gid, self.version[gid])
        if key not in self._memo:
            ms = [self.node[n] for n in self.members[gid]]
            self._memo[key] = any(n.op is Op.CAST for n in ms) and all(
                n.op in OpGroup.VIEW or splittable(self.g, n.id) for n in ms)
        return self._memo[key]

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
        category = self.category(members, set(members))
        if category is None:
            self._refused(a, b, self.rules.why)
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
        self._memo[("category", keep, self.version[keep])] = category
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
            known = self._memo.get(("category", gid, self.version[gid]))
            s = self.summary(members, legal=known is None)
            s = s if known is None else _Summary(known, s.inputs, s.outputs, s.bytes)
            flops = sum(node_flops(self.node[n], self.g, self._body_flops(n)) for n in members)
            out.append(Kernel("", s.category, tuple(members), s.inputs, s.outputs, flops,
                              s.bytes))
        return out

    def _body_flops(self, nid: int) -> int:
        b = self.bodies.get(nid)
        return sum(k.flops for k in b.kernels) if b is not None else 0

