"""remat: what each scan saves for its backward, and what the backward recomputes.

A scan's backward is a reverse scan; for every iteration it needs the body's intermediate
values. A `Policy` decides which of them the forward saves (stacked over iterations) and
which the backward recomputes from the saved carry:

- `recompute` (train.remat = per_layer, per_segment): save only the carry at the start of every
  iteration. For the layer scan that is the per-layer checkpoint; for the memory scan the
  memory state at every chunk boundary. The backward re-runs one iteration at a time. Its
  `replay` says what that re-run saves for the backward of the scans nested in it:
  `recompute` (per_segment, and per_layer with `remat_group` > 1 or with chunk groups,
  `compile.chunk_groups`: options chosen for memory) only their carries, so their backward
  runs their bodies a third time (a MAC layer's segment scan, the memory's chunk scans);
  `mincut` (per_layer) a minimum cut of each nested body as below, so each layer's forward
  runs twice in a step and no more, at the cost of one layer's saved values live in its
  backward.
- `save_all` (train.remat = none): save every non-view intermediate; nothing is recomputed.
- `mincut` (train.remat = budget): the saved set is a minimum cut of the body's joint graph
  (the approach of PyTorch's partitioner, solved with networkx): the fewest saved bytes from
  which everything the backward reads can be recomputed. Matmuls (EINSUM) and nested scans
  are kept off the recompute side unless `ban_matmul` is off.

`choose_policy(g, train)` turns the spec's policy and byte budget into a Policy: for
`budget` it tries save_all, then the matmul-preserving min-cut, then the unrestricted
min-cut, then recompute, and takes the first whose saved bytes fit. The choice never
changes what is computed (tests: identical loss and gradients across policies).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import networkx as nx

from titanc.ir import Graph, Op, OpGroup
from titanc.ir.elementwise import ELEMENTWISE
from titanc.ir.structural import STRUCTURAL
from titanc.ir.types import type_bytes



def _saveable(g: Graph, nid: int) -> bool:
    n = g.node(nid)
    return (n.op not in OpGroup.SOURCE and n.op not in OpGroup.VIEW and n.op is not Op.SCAN
            and not isinstance(n.type, tuple))


def needed_by_backward(g: Graph) -> set[int]:
    """Body values some VJP reads (each op's registry entry's `reads`)."""
    need: set[int] = set()
    for n in g:
        reads = ELEMENTWISE[n.op].reads if n.op in ELEMENTWISE else STRUCTURAL[n.op].reads
        for r in reads:
            if r == "all":
                need.update(n.inputs)
            else:
                need.add(n.id if r == "out" else n.inputs[r])
    return {i for i in need if not isinstance(g.node(i).type, tuple)}


def _free(g: Graph) -> set[int]:
    """Values recomputable from the body's inputs at no cost (inputs, generators, views)."""
    free: set[int] = set()
    for n in g:
        if n.op in OpGroup.SOURCE or (n.op in OpGroup.VIEW and n.inputs[0] in free):
            free.add(n.id)
    return free


def mincut_saves(g: Graph, ban_matmul: bool = True) -> set[int]:
    """Node ids to save so that every value the backward reads is saved or recomputable."""
    net = nx.DiGraph()
    src, sink = "source", "sink"
    for n in g:
        vin, vout = ("in", n.id), ("out", n.id)
        if n.op is Op.INPUT:
            net.add_edge(src, vout)                               # carries/xs/consts: free
            continue
        cap = type_bytes(n.type) if _saveable(g, n.id) else None
        net.add_edge(vin, vout, **({"capacity": cap} if cap is not None else {}))
        if n.op is Op.SCAN or n.op is Op.ITEM or (ban_matmul and n.op is Op.EINSUM):
            net.add_edge(src, vin)                                # never recomputed
        for i in n.inputs:
            net.add_edge(("out", i), vin)
    for i in needed_by_backward(g) - _free(g):
        net.add_edge(("out", i), sink)
    if sink not in net:
        return set()
    _, (reach, _) = nx.minimum_cut(net, src, sink)
    return {n.id for n in g if n.op is not Op.INPUT and ("in", n.id) in reach
            and ("out", n.id) not in reach}


@dataclass(frozen=True)
class Policy:
    mode: str = "recompute"          # recompute | save_all | mincut
    ban_matmul: bool = True
    replay: str = "recompute"        # the mode of a body the backward recomputes

    @property
    def keeps_nested(self) -> bool:
        """Nested scans are not re-run in the backward: save what they need, too."""
        return self.mode != "recompute"

    def nested(self) -> "Policy":
        return self if self.mode == "save_all" else Policy("recompute")

    def replayed(self) -> "Policy":
        """The policy of a body the backward recomputes (one iteration of this scan, run again
        from its saved carry): `replay` mincut saves, for the scans nested in it, what their own
        backward reads, so that no part of the body is run a third time."""
        return self.nested() if self.replay == "recompute" else Policy(self.replay, self.ban_matmul)

    def select(self, body: Graph) -> set[int]:
        if self.mode == "recompute":
            return set()
        if self.mode == "save_all":
            return {n.id for n in body if _saveable(body, n.id)}
        return mincut_saves(body, self.ban_matmul)


def saved_bytes(g: Graph, policy: Policy) -> int:
    """Bytes the forward keeps for the backward of every scan in g (stacked over iterations)."""
    total = 0
    for n in g:
        if n.op is not Op.SCAN:
            continue
        body: Graph = n.attr("body")
        length = n.attr("length")
        per_iter = sum(type_bytes(body.node(i).type) for i in body.inputs[:n.attr("n_carry")])
        per_iter += sum(type_bytes(body.node(i).type) for i in policy.select(body))
        if policy.keeps_nested:
            per_iter += saved_bytes(body, policy.nested() if policy.mode == "save_all"
                                    else Policy("recompute"))
        total += length * per_iter
    return total


def _has_role(g: Graph, role: str) -> bool:
    """Some scan of `g` or of a body in it has `role`."""
    return any(n.op is Op.SCAN and (n.attr("role") == role or _has_role(n.attr("body"), role))
               for n in g)


def choose_policy(g: Graph, train: Any) -> Policy:
    if train.remat == "none":
        return Policy("save_all")
    if train.remat == "per_layer" and train.remat_group == 1 and not _has_role(g, "memory_group"):
        return Policy("recompute", replay="mincut")
    if train.remat in ("per_layer", "per_segment"):
        return Policy("recompute")
    budget = (train.remat_budget_mb or 0) * 2**20
    for p in (Policy("save_all"), Policy("mincut", True), Policy("mincut", False)):
        if saved_bytes(g, p) <= budget:
            return p
    return Policy("recompute")
