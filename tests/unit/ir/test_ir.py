"""Tiers (a) and (d) for the IR core: golden printer text, verifier negatives, interpreter."""
from __future__ import annotations

import pytest
import torch

from titanc.ir import Builder, Graph, IRError, Op, TensorType, interpret, to_dot, verify
from titanc.ir.graph import Node
from titanc.ir.stats import largest_tensor_bytes


def small_graph() -> Graph:
    b = Builder("small")
    x = b.input("x", (2, 3), "f32")
    w = b.input("w", (3, 4), "f32")
    y = (x @ w).silu()
    s = y.sum((1,))

    def body(bb, c, xs, k):
        return [c[0] + xs[0] * k[0]], [c[0]]

    (c,), (ys,) = b.scan(body, [b.full(0.0, (4,), "f32")], [y], [w.sum((0,))], name="acc")
    b.graph.set_outputs([("s", s.id), ("c", c.id), ("ys", ys.id)])
    return b.graph


GOLDEN = """\
graph small (10 nodes)
  %0:f32[2,3] = input[x]
  %1:f32[3,4] = input[w]
  %2:f32[2,4] = einsum[ai,io->ao] %0 %1
  %3:f32[2,4] = silu %2
  %4:f32[2] = sum[axes=[1], keepdim=False] %3
  %5:f32[4] = full[dtype=f32, shape=[4], value=0.0]
  %6:f32[4] = sum[axes=[0], keepdim=False] %1
  %7:(f32[4], f32[2,4]) = scan[length=2, n_carry=1, n_xs=1, reverse=False, role=loop] %5 %3 %6 {
    %0:f32[4] = input[c0]
    %1:f32[4] = input[x1]
    %2:f32[4] = input[k2]
    %3:f32[4] = mul %1 %2
    %4:f32[4] = add %0 %3
    return carry0=%4, y0=%0
  }
  %8:f32[4] = item[index=0] %7
  %9:f32[2,4] = item[index=1] %7
  return s=%4, c=%8, ys=%9
"""


def test_printer_golden() -> None:
    assert repr(small_graph()) == GOLDEN


def test_printer_is_deterministic() -> None:
    assert repr(small_graph()) == repr(small_graph())


def test_interpreter_scan_matches_loop() -> None:
    g = verify(small_graph())
    x, w = torch.randn(2, 3, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    out = interpret(g, {"x": x, "w": w})
    y = torch.nn.functional.silu(x @ w)
    c = torch.zeros(4, dtype=torch.float64)
    seen = []
    for t in range(2):
        seen.append(c)
        c = c + y[t] * w.sum(0)
    torch.testing.assert_close(out["c"], c)
    torch.testing.assert_close(out["ys"], torch.stack(seen))
    torch.testing.assert_close(out["s"], y.sum(1))


def test_interpreter_float32_and_float64() -> None:
    g = small_graph()
    ins = {"x": torch.randn(2, 3), "w": torch.randn(3, 4)}
    assert interpret(g, ins)["s"].dtype == torch.float32
    assert interpret(g, ins, float_dtype=torch.float64)["s"].dtype == torch.float64


def test_dot_export_names_every_node() -> None:
    dot = to_dot(small_graph())
    assert dot.startswith('digraph "small"')
    assert "scan body" in dot and "einsum[ai,io->ao]" in dot


def test_largest_tensor_counts_scan_body_per_iteration() -> None:
    assert largest_tensor_bytes(small_graph()) == 2 * 4 * 4      # the stacked ys


# -- verifier negatives (tier d): corrupt a graph, assert the exact message -------------------

def _corrupt(g: Graph, nid: int, **changes) -> Graph:
    g._nodes[nid] = g._nodes[nid].replace(**changes)
    return g


def _message(g: Graph) -> str:
    with pytest.raises(IRError) as e:
        verify(g)
    return e.value.message


def test_verifier_wrong_type() -> None:
    g = _corrupt(small_graph(), 3, type=TensorType((2, 5), "f32"))
    assert _message(g) == "types: %3: declared f32[2,5] but silu gives f32[2,4]"


def test_verifier_error_shows_context() -> None:
    g = _corrupt(small_graph(), 3, type=TensorType((2, 5), "f32"))
    with pytest.raises(IRError) as e:
        verify(g)
    text = str(e.value)
    assert "> " in text and "%3:f32[2,5] = silu %2" in text and "%2:f32[2,4]" in text


def test_verifier_bad_einsum() -> None:
    g = _corrupt(small_graph(), 2, attrs=(("spec", "ai,io->az"),))
    assert _message(g) == "types: %2: einsum output letters ['z'] appear in no operand"


def test_verifier_arity() -> None:
    g = small_graph()
    g._nodes[3] = g._nodes[3].replace(inputs=(2, 2))
    assert _message(g) == "arity: %3: SILU takes 1 operands, got 2"


def test_verifier_missing_operand() -> None:
    g = small_graph()
    g._nodes[3] = g._nodes[3].replace(inputs=(42,))
    assert _message(g) == "inputs-exist: small: %3 uses %42, which is not in the graph"


def test_verifier_cycle() -> None:
    g = small_graph()
    g._dg.add_edge(3, 2)
    assert _message(g) == "acyclic: small: graph small has a cycle"


def test_verifier_tuple_used_directly() -> None:
    g = small_graph()
    nid = g.add(Op.NEG, [8])
    g._nodes[nid] = g._nodes[nid].replace(inputs=(7,))
    g._dg.remove_edge(8, nid)
    g._dg.add_edge(7, nid)
    assert _message(g) == f"tuples: %{nid}: tuple value %7 used by NEG, not ITEM"


def test_verifier_duplicate_output() -> None:
    g = small_graph()
    g.set_outputs([("s", 4), ("s", 8)])
    assert _message(g) == "outputs: %8: duplicate output name 's'"


def test_verifier_scan_body_carry_mismatch() -> None:
    g = small_graph()
    scan = g.node(7)
    body = scan.attr("body")
    body.set_outputs([("carry0", 3), ("y0", 0)])             # still f32[4]: fine
    verify(g)
    body._nodes[3] = body._nodes[3].replace(type=TensorType((4,), "f64"))
    assert _message(g).startswith("scan: %7: body: types: %3: declared f64[4]")


def test_verifier_duplicate_input_name() -> None:
    g = small_graph()
    g.add(Op.INPUT, [], {"name": "x"}, TensorType((1,), "f32"))
    assert _message(g).startswith("inputs-listed: %10: duplicate input name 'x'")


def test_node_is_frozen() -> None:
    n = small_graph().node(3)
    with pytest.raises(AttributeError):
        n.op = Op.EXP  # type: ignore[misc]
    assert isinstance(n, Node) and n.replace(op=Op.EXP).op is Op.EXP
