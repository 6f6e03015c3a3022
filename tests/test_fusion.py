"""Tier (c): kernel schedules after fusion — counts on hand-built graphs, refusals, and the
schedule invariants (`verify_schedule`) plus determinism on the real tiny graphs."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import pytest

from titanc.compiler import compile_graphs
from titanc.ir import Builder, Graph, Op, verify
from titanc.passes.fusion import _fuse_graph, fuse, unfused
from titanc.ir.schedule import (Schedule, ScheduleError, liveness, peak_live_bytes,
                                    verify_schedule)
from titanc.model.spec import load_spec

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TINY_EXAMPLES = sorted(p.name for p in EXAMPLES.glob("tiny*.yaml"))


@lru_cache(maxsize=None)
def example_graphs(name: str) -> tuple[Graph, Graph]:
    """The pipeline's forward and grad graphs of examples/<name> (batch/seq from the spec)."""
    c = compile_graphs(load_spec(EXAMPLES / name), verify_each=False)
    return c.forward, c.grad


@lru_cache(maxsize=None)
def example_schedules(name: str) -> tuple[Schedule, Schedule]:
    return tuple(fuse(g) for g in example_graphs(name))       # type: ignore[return-value]


def ops(s: Schedule) -> list[list[str]]:
    return [[s.graph.node(n).op.name.lower() for n in k.nodes] for k in s.kernels]


# -- hand-built graphs --------------------------------------------------------------------------

def test_pointwise_chain_of_five_ops_is_one_kernel() -> None:
    b = Builder("chain")
    x, y = b.input("x", (8, 16), "f32"), b.input("y", (8, 16), "f32")
    out = -((x.exp() * 2.0) + y).silu()
    b.graph.set_outputs([("out", out.id)])
    s = verify_schedule(fuse(verify(b.graph)))
    assert len(s.kernels) == 1
    (k,) = s.kernels
    assert k.category == "pointwise"
    assert k.name == "titanc_poi_fused_exp_mul_add_silu_0"
    assert k.inputs == (x.id, y.id) and k.outputs == (out.id,)
    assert k.bytes == 3 * 8 * 16 * 4 and k.flops == 5 * 8 * 16


def test_known_small_graph_kernel_count() -> None:
    # y = silu(x @ w + bias); out = y / sum(y, -1): matmul+epilogue, reduction with the
    # division of each row by its sum as the row epilogue
    b = Builder("small")
    x, w = b.input("x", (8, 16), "f32"), b.input("w", (16, 32), "f32")
    bias = b.input("b", (32,), "f32")
    y = (x @ w + bias).silu()
    out = y / y.sum((1,), keepdim=True)
    b.graph.set_outputs([("out", out.id)])
    s = verify_schedule(fuse(verify(b.graph)))
    assert [k.category for k in s.kernels] == ["matmul", "reduction"]
    assert ops(s) == [["einsum", "add", "silu"], ["sum", "div"]]
    assert len(unfused(b.graph).kernels) == 5
    mm = s.kernels[0]
    assert mm.flops == 2 * 8 * 16 * 32 + 2 * 8 * 32
    assert mm.bytes == (8 * 16 + 16 * 32 + 32 + 8 * 32) * 4


def test_broadcast_of_a_computed_value_is_not_fused() -> None:
    # exp(x) [8,1] broadcast over [8,64] would be evaluated 64 times per element
    b = Builder("bcast")
    x, big = b.input("x", (8, 1), "f32"), b.input("big", (8, 64), "f32")
    out = x.exp() * big
    b.graph.set_outputs([("out", out.id)])
    assert ops(fuse(b.graph)) == [["exp"], ["mul"]]


def peak_raising_graph() -> tuple[Graph, int, int]:
    """a = exp(x) feeds an early matmul; c = 2x feeds the last one. Fusing the siblings a and
    c reads x once but makes the [N, K] value c live across the middle, where x and the big
    product r are live too: the peak grows by N*K*4 bytes. (Both are graph outputs too, so
    neither is a matmul's prologue, computed as its operand tiles load, but a kernel.)"""
    N, K = 64, 32
    b = Builder("peak")
    x, w = b.input("x", (N, K), "f32"), b.input("w", (K,), "f32")
    a = x.exp()
    m = b.einsum("nk,k->n", a, w)
    r = b.einsum("n,k->nk", m, w) * x
    s = r.sum((1,))
    c = x * 2.0
    f = b.einsum("nk,n->", c, s)
    b.graph.set_outputs([("f", f.id), ("a", a.id), ("c", c.id)])
    return verify(b.graph), a.id, c.id


def test_fusion_that_raises_peak_memory_is_refused() -> None:
    g, a, c = peak_raising_graph()
    fused = verify_schedule(fuse(g))
    where = fused.kernel_index()
    assert where[a] != where[c]
    assert peak_live_bytes(fused) <= peak_live_bytes(unfused(g))
    # the same greedy without the peak check takes the merge, and the peak rises
    greedy = _fuse_graph(g, check_peak=False)
    assert greedy.kernel_index()[a] == greedy.kernel_index()[c]
    assert peak_live_bytes(greedy) > peak_live_bytes(fused) + 64 * 32 * 4 // 2


def test_scan_is_a_template_kernel_with_its_own_body_schedule() -> None:
    b = Builder("scan")
    xs = b.input("xs", (4, 8), "f32")
    w = b.input("w", (8,), "f32")

    def body(bb, c, x, k):
        h = (c[0] * k[0] + x[0]).silu()
        return [h], [h.sum((0,))]

    (c,), (ys,) = b.scan(body, [b.full(0.0, (8,), "f32")], [xs.exp()], [w], name="acc")
    out = c * 3.0
    b.graph.set_outputs([("c", out.id), ("ys", ys.id)])
    s = verify_schedule(fuse(verify(b.graph)))
    assert [k.category for k in s.kernels] == ["pointwise", "pointwise", "template", "pointwise"]
    scan_k = s.kernels[2]
    assert scan_k.name.startswith("titanc_tem_fused_scan_acc_")
    (sid,) = [n for n in scan_k.nodes if b.graph.node(n).op is Op.SCAN]
    assert set(scan_k.outputs) == {c.id, ys.id}
    body_s = s.bodies[sid]
    # one reduction kernel: prologue h = silu(c*w + x), stored (the new carry) and summed
    assert ops(body_s) == [["mul", "add", "silu", "sum"]]
    assert body_s.kernels[0].category == "reduction"
    assert scan_k.flops == 4 * sum(k.flops for k in body_s.kernels)


def test_verify_schedule_names_the_broken_rule() -> None:
    g, _, _ = peak_raising_graph()
    s = fuse(g)
    swapped = Schedule(g, [s.kernels[1], s.kernels[0]] + s.kernels[2:], s.bodies)
    with pytest.raises(ScheduleError, match=r"^order: peak: titanc_mm_fused_einsum_1: input %2 "
                                            r"is not produced by an earlier kernel"):
        verify_schedule(swapped)
    with pytest.raises(ScheduleError, match=r"^cover: peak: nodes \[9\] are in no kernel"):
        verify_schedule(Schedule(g, s.kernels[:-1], s.bodies))


# -- real graphs ---------------------------------------------------------------------------------

def _all_nodes_once(s: Schedule) -> None:
    for _, sub in s.walk():
        got = sorted(n for k in sub.kernels for n in k.nodes)
        assert got == sorted(n.id for n in sub.graph if n.op is not Op.INPUT)
        for k in sub.kernels:
            scans = [n for n in k.nodes if sub.graph.node(n).op is Op.SCAN]
            if scans:      # the only way into a body is the scan's own template kernel
                assert k.category == "template" and len(scans) == 1
                assert sub.bodies[scans[0]].graph is sub.graph.node(scans[0]).attr("body")


# tiny and tiny_mal (attention, memory, both in sequence) in `make test`; the others slow
@pytest.mark.parametrize("name", [n if n in ("tiny.yaml", "tiny_mal.yaml") else
                                  pytest.param(n, marks=pytest.mark.slow) for n in TINY_EXAMPLES])
def test_real_graphs_fuse_validly_and_deterministically(name: str) -> None:
    for g, s in zip(example_graphs(name), example_schedules(name)):
        verify_schedule(s)
        _all_nodes_once(s)
        assert s.to_text() == fuse(g).to_text()
        base = unfused(g)
        assert len(s.all_kernels()) < len(base.all_kernels()) / 2
        assert peak_live_bytes(s) <= peak_live_bytes(base)
        lv = liveness(s)
        assert all(0 <= a <= b < len(s.kernels) for a, b in lv.values())
