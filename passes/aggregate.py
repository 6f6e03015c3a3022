"""aggregate: a weighted sum over an axis of outer products over that axis -> one contraction.

    Σ_u w_u (a_u ⊗ b_u)  ==  sum[u](mul(einsum[..u o,..u i->..u o i](a, b), w))
                          ->  einsum[..u o,..u i->..o i](a · w, b)

The weights are folded into the smaller operand, so the result is a batched matmul and the
per-position outer products ([.., u, o, i]) never exist.

Precondition: `g` verifies. Postcondition: the result verifies and computes the same values;
no SUM of a MUL of an outer-product EINSUM over a shared axis remains where the rule applies.
The rule refuses (leaves the graph as it is) when
- the outer product or the weighted product has a user that needs it un-summed, or
- the weights are not per-position scalars: they vary along an axis of only one side of
  the outer product (o or i), or
- the summed axis is not shared by both sides of the outer product.
Scan bodies are rewritten recursively. The input should be canonical (views folded). Run it before autodiff: the VJP of the contraction
is itself a pair of contractions, so the backward never builds the per-position tensor.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from titanc.ir import Graph, Node, Op

from titanc.passes.canonicalize import canonicalize

LETTERS = "abcdefghjklmnopqrstuvwxyz"


def _outer(g: Graph, nid: int) -> tuple[str, str, str] | None:
    """(lhs, rhs, out) of a two-operand einsum that contracts nothing (an outer product)."""
    n = g.node(nid)
    if n.op is not Op.EINSUM or len(n.inputs) != 2:
        return None
    lhs, out = n.attr("spec").split("->")
    a, b = lhs.split(",")
    if set(a) | set(b) != set(out) or len(set(out)) != len(out) or len(set(a)) != len(a):
        return None
    return a, b, out


def _single_user(g: Graph, nid: int, op: Op) -> bool:
    """nid's one use is an `op` node (a graph output counts as a use)."""
    users = g.users(nid)
    is_output = any(i == nid for _, i in g.outputs)
    return len(users) == 1 and not is_output and g.node(users[0]).op is op


def match(g: Graph, s: Node) -> tuple[int, int, tuple[str, str, str]] | None:
    """For SUM s: (outer einsum id, weight id, letters) if s is Σ_u w_u (a_u ⊗ b_u)."""
    if s.op is not Op.SUM or s.attr("keepdim"):
        return None
    m = g.node(s.inputs[0])
    if m.op is not Op.MUL or not _single_user(g, m.id, Op.SUM):
        return None
    for e_id, w_id in (m.inputs, m.inputs[::-1]):
        spec = _outer(g, e_id)
        if spec is None or g.node(w_id).type.rank != m.type.rank:
            continue
        a, b, out = spec
        summed = {out[ax] for ax in s.attr("axes")}
        shared = set(a) & set(b)
        wshape = g.node(w_id).type.shape
        varying = {out[ax] for ax, size in enumerate(wshape) if size != 1}
        if not summed <= shared or not varying <= shared:
            return None                           # not a contraction / not per-position weights
        # every user of the outer product must be such a weighted sum (no un-summed use)
        if any(i == e_id for _, i in g.outputs):
            return None
        for u in g.users(e_id):
            un = g.node(u)
            if un.op is not Op.MUL or not _single_user(g, u, Op.SUM):
                return None
        return e_id, w_id, spec
    return None


def _rewrite(g: Graph) -> Graph:
    out = Graph(g.name)
    env: dict[int, int] = {}
    for n in g:
        body = {"body": _rewrite(n.attr("body"))} if n.op is Op.SCAN else {}
        hit = match(g, n) if n.op is Op.SUM else None
        if hit is None:
            env[n.id] = out.add_like(n, (env[i] for i in n.inputs), **body)
            continue
        e_id, w_id, (a, b, spec_out) = hit
        e = g.node(e_id)
        x, y = e.inputs
        summed = {spec_out[ax] for ax in n.attr("axes")}
        # fold the weights into the smaller operand: w lives on shared letters only
        fold_left = g.node(x).type.numel <= g.node(y).type.numel
        tgt, letters = (x, a) if fold_left else (y, b)
        wshape = g.node(w_id).type.shape
        w_sizes = {spec_out[ax]: size for ax, size in enumerate(wshape)}
        w_view = out.add(Op.RESHAPE, (env[w_id],),
                         {"shape": tuple(w_sizes[ch] for ch in letters)})
        scaled = out.add(Op.MUL, (env[tgt], w_view))
        result = "".join(ch for ch in spec_out if ch not in summed)
        ops = (scaled, env[y]) if fold_left else (env[x], scaled)
        env[n.id] = out.add(Op.EINSUM, ops, {"spec": f"{a},{b}->{result}"})
    out.set_outputs([(name, env[i]) for name, i in g.outputs])
    return out


@dataclass(frozen=True)
class Aggregate:
    """Every weighted sum over an axis of outer products over that axis -> one contraction.

    Pre: `g` verifies and is canonical (the pipeline canonicalizes first). Post: same values;
    no SUM of a per-token outer product is left (`match` finds none); canonicalized after, so
    the dead outer products are gone."""
    name: ClassVar[str] = "aggregate"

    def __call__(self, g: Graph) -> Graph:
        return canonicalize(_rewrite(g))


aggregate = Aggregate()
