"""linear_cross_entropy: the LM head + cross-entropy -> one LINEAR_CROSS_ENTROPY pattern op.

    loss = mean(lse(h @ head) − take_along(h @ head, targets))           h (B, T, D)
      ->  loss = sum(ITEM 0 of LINEAR_CROSS_ENTROPY(h (B·T, D), head, targets (B, T))) / (B·T)

The op's kernels (`runtime/targets/pattern_kernels.py` on the cpu target, `cross_entropy.py.jinja`
through `codegen/lower/patterns.py` on triton) compute the logits one [rows, vocab] tile at
a time with an online log-sum-exp, so no [B·T, V] (nor [chunk, V]) logits value exists in the
graph or the plan. ITEM 1 is each row's log-sum-exp: the op's VJP (`ir/linear_cross_entropy.py`)
is one LINEAR_CROSS_ENTROPY_BWD that recomputes the logits tiles from it. Run it on the
forward graph before autodiff and before `chunked_loss`, which stays the fallback where this
pass leaves the loss as it is.

Precondition: `g` verifies and is canonical (the frontend's loss, as `chunked_loss.match_loss`
finds it). Postcondition: same loss; the head path of the loss is one pattern op. The rule
refuses (graph unchanged; the reason under `TITANC_DEBUG=2`) when the logits feed anything but
the loss's max, log-sum-exp and target gather (e.g. a graph that also outputs them).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import ClassVar

from titanc.ir import Builder, Graph, Op, Value

from titanc.passes.chunked_loss import match_loss
from titanc.config import debug_level


def _why_not(g: Graph, m: dict[str, int]) -> str:
    """Why the matched loss cannot become the op, or '' when it can."""
    logits = m["logits"]
    if logits in {i for _, i in g.outputs}:
        return f"the logits %{logits} are a graph output"
    path: set[int] = set()
    todo = [m["loss"]]
    while todo:                                   # the loss's ancestors down to the logits
        nid = todo.pop()
        if nid in path or nid == logits:
            continue
        path.add(nid)
        todo += list(g.node(nid).inputs)
    outside = [u for u in g.users(logits) if u not in path]
    if outside:
        return f"the logits %{logits} are also read by %{outside[0]}"
    return ""


@dataclass(frozen=True)
class LinearCrossEntropy:
    """The LM head + mean cross-entropy as one LINEAR_CROSS_ENTROPY op whose cpu kernel works
    on blocks of `chunk` rows (module docstring: pre/postconditions)."""
    chunk: int
    name: ClassVar[str] = "linear_cross_entropy"

    def __call__(self, g: Graph) -> Graph:
        m = match_loss(g)
        if m is None:
            return g
        why = _why_not(g, m)
        if why:
            if debug_level() >= 2:
                print(f"[titanc] linear_cross_entropy {g.name}: left as is: {why}",
                      file=sys.stderr)
            return g
        layout = "vd" if g.node(m["logits"]).attr("spec").startswith("btd,vd") else "dv"
        B, T, D = g.node(m["h"]).type.shape
        b = Builder(g.name)
        env: dict[int, Value] = {}
        for node in g:               # every node is rebuilt; the loss becomes the op, and the
            if node.id == m["loss"]:  # old head path dies (canonicalize's DCE)
                lce = b.op(Op.LINEAR_CROSS_ENTROPY, env[m["h"]].reshape(B * T, D),
                           env[m["head"]], env[m["targets"]],     # [B, T]: read strided
                           layout=layout, chunk=self.chunk if self.chunk > 0 else B * T)
                env[node.id] = b.item(lce, 0).sum((0,)) * (1.0 / (B * T))
                continue
            env[node.id] = b.like(node, *[env[i] for i in node.inputs])
        b.graph.set_outputs([(name, env[i].id) for name, i in g.outputs])
        from titanc.passes.canonicalize import canonicalize
        return canonicalize(b.graph)
