"""hoist_scan_invariants: a chunk recurrence's carry-independent work, hoisted before its scan,
computes what the body computed (float64, the reference interpreter), and nothing hoistable
stays behind."""
from __future__ import annotations

import pytest
import torch

from titanc.ir import Builder, Graph, Op, interpret, verify
from titanc.passes.hoist import hoist_scan_invariants

F64 = "f64"
L, T, I, O = 3, 5, 4, 6


def _graph(role: str, reverse: bool) -> Graph:
    """A scan whose body has carry-independent products, every batching rule on the way to
    them, and carry-dependent work that reads them."""
    b = Builder("g")
    k = b.input("k", (L, T, I), F64)
    w = b.input("w", (L, I, O), F64)               # a checkpointed state: an xs, not a carry
    v = b.input("v", (L, T, O), F64)
    bias = b.input("bias", (O,), F64)
    acc0 = b.input("acc0", (I, O), F64)

    def body(bb: Builder, carry, x, const):
        (acc,), (kt, wt, vt), (bs,) = carry, x, const
        pred = bb.einsum("ti,io->to", kt, wt)
        err = pred - vt + bs                            # a constant broadcast into it
        s = err.silu()
        r = s.sum([1], keepdim=True).expand(T, O)       # a reduction and a view of it
        cs = err.cumsum(0, reverse=True)
        edge = bb.concat([cs.slice(0, 0, 2), (s * r).slice(0, 2, T)], 0).permute(1, 0)
        gate = bb.mask(T, 0, [("causal", T, None)], F64).exp()   # a constant the products read
        mixed = bb.einsum("st,to->so", gate, s * r)
        grad = bb.einsum("ti,ot->io", kt, edge.pad(1, 0, 0))
        new = acc * 0.5 + grad
        y = bb.einsum("ti,io->to", kt, new) + mixed       # reads the carry: stays
        return [new], [y, cs.reshape(T * O)]

    (acc,), (ys, cs) = b.scan(body, [acc0], [k, w, v], [bias], role=role, reverse=reverse)
    b.graph.set_outputs([("acc", acc.id), ("ys", ys.id), ("cs", cs.id)])
    return verify(b.graph)


def _inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"k": (L, T, I), "w": (L, I, O), "v": (L, T, O), "bias": (O,), "acc0": (I, O)}
    return {n: torch.randn(s, generator=g, dtype=torch.float64) for n, s in shapes.items()}


def _scan(g: Graph):
    return next(n for n in g if n.op is Op.SCAN)


@pytest.mark.parametrize("reverse", [False, True])
def test_hoisted_scan_computes_the_same(reverse: bool) -> None:
    g = _graph("memory", reverse)
    h = verify(hoist_scan_invariants(g))
    want, got = interpret(g, _inputs()), interpret(h, _inputs())
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-12, atol=1e-12)
    before, after = _scan(g), _scan(h)
    assert after.attr("n_xs") > before.attr("n_xs")
    body = after.attr("body")
    carry = set(body.inputs[:after.attr("n_carry")])
    reached = set(carry)
    for v in body.order():
        if any(i in reached for i in body.node(v).inputs):
            reached.add(v)
    # every product left in the body multiplies by something the carry reaches
    products = [v for v in body.order() if body.node(v).op is Op.EINSUM]
    assert products and all(v in reached for v in products)
    assert len(products) < sum(1 for n in before.attr("body") if n.op is Op.EINSUM)


def test_other_scans_and_bodies_without_products_are_left_alone() -> None:
    g = _graph("segment", False)
    assert _scan(hoist_scan_invariants(g)).attr("n_xs") == _scan(g).attr("n_xs")
    b = Builder("g")
    x = b.input("x", (L, T), F64)
    c0 = b.input("c0", (T,), F64)
    (c,), _ = b.scan(lambda bb, c, xs, k: ([c[0] + xs[0].exp().cumsum(0)], []), [c0], [x],
                     role="memory")
    b.graph.set_outputs([("c", c.id)])
    g2 = verify(b.graph)
    assert _scan(hoist_scan_invariants(g2)).attr("n_xs") == 1     # no product to hoist
