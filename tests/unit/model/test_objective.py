"""The memory's inner objective (titanc/model/objective.py): its derivative by the IR's
autodiff against the closed forms, l2's closed form in the lowering against autodiff of its
value, the graph it inlines, and the spec's one-line errors.

Tolerances: float64, 1e-14 absolute on derivatives of order 1 (the same expression up to the
order of its roundings)."""
from __future__ import annotations

import pytest
import torch

from tests.helpers import tiny_spec
from titanc.errors import SpecError
from titanc.ir import Builder, Op, interpret
from titanc.model.neural_memory import output_grad
from titanc.model.objective import LP_EPS, Objective, loss_graph, objective_of
from titanc.passes.autodiff import derivative

SHAPE = (2, 2, 4, 8)          # (B, Nm, u, e)
E = SHAPE[-1]


def _data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(SHAPE, generator=g, dtype=torch.float64),
            torch.randn(SHAPE, generator=g, dtype=torch.float64))


def _autodiff(obj: Objective, yhat: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    d = derivative(loss_graph(obj, SHAPE, "f64", total=True), "yhat")
    return interpret(d, {"yhat": yhat, "v": v})["grad.yhat"]


@pytest.mark.parametrize("obj,closed", [
    (Objective("l2"), lambda r: 2 * r / E),
    (Objective("huber", delta=0.5), lambda r: 2 * r.clamp(-0.5, 0.5) / E),
    (Objective("huber", delta=1e9), lambda r: 2 * r / E),               # δ → ∞: l2
    (Objective("lp", p=3.0), lambda r: 3.0 * r * (r * r + LP_EPS).pow(0.5) / E),
    (Objective("lp", p=1.0), lambda r: r * (r * r + LP_EPS).pow(-0.5) / E),
    (Objective("lp", p=2.0), lambda r: 2 * r / E),                      # p = 2: l2's gradient
])
def test_autodiff_derives_each_objectives_gradient(obj: Objective, closed) -> None:
    yhat, v = _data()
    torch.testing.assert_close(_autodiff(obj, yhat, v), closed(yhat - v), rtol=0, atol=1e-14)


def test_huber_covers_both_branches_and_is_continuous() -> None:
    """ρ = r² inside δ, 2δ|r| − δ² outside, equal at |r| = δ (values of loss_graph)."""
    r = torch.tensor([[-2.0, -0.5, -0.1, 0.0, 0.3, 0.5, 3.0, 0.5]], dtype=torch.float64)
    obj = Objective("huber", delta=0.5)
    g = loss_graph(obj, (1, 8), "f64")
    got = interpret(g, {"yhat": r, "v": torch.zeros_like(r)})["loss"]
    want = torch.where(r.abs() <= 0.5, r * r, 2 * 0.5 * r.abs() - 0.25).mean(-1)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-15)


def test_l2_closed_form_is_its_autodiff() -> None:
    """The lowering keeps ℓ2's closed form (the default graphs unchanged); its numbers are
    autodiff's of ℓ2's value."""
    yhat, v = _data(1)
    b = Builder("t")
    y_in, v_in = b.input("yhat", SHAPE, "f64"), b.input("v", SHAPE, "f64")
    out = output_grad(b, y_in, v_in, Objective("l2"))
    b.graph.set_outputs([("d", out.id)])
    got = interpret(b.graph, {"yhat": yhat, "v": v})["d"]
    torch.testing.assert_close(got, _autodiff(Objective("l2"), yhat, v), rtol=0, atol=1e-15)


def test_the_derivative_is_inlined_with_no_forward_left_over() -> None:
    """Huber's ∂ℓ/∂ŷ inlined into a builder: elementwise nodes only (no loss sum, no scan),
    every node read by the result."""
    b = Builder("t")
    y_in, v_in = b.input("yhat", SHAPE, "f64"), b.input("v", SHAPE, "f64")
    out = output_grad(b, y_in, v_in, Objective("huber", delta=0.5))
    b.graph.set_outputs([("d", out.id)])
    assert Op.SUM not in {n.op for n in b.graph} and Op.SCAN not in {n.op for n in b.graph}
    assert b.graph.reachable_from_outputs() == {n.id for n in b.graph}


def test_spec_declares_the_objective() -> None:
    m = tiny_spec().model.memory
    assert (m.objective, objective_of(m)) == ("l2", Objective("l2", 1.0, 3.0))
    h = tiny_spec(**{"model.memory.objective": "huber", "model.memory.huber_delta": 0.25})
    assert objective_of(h.model.memory) == Objective("huber", 0.25, 3.0)
    lp = tiny_spec(**{"model.memory.objective": "lp"})
    assert objective_of(lp.model.memory) == Objective("lp", 1.0, 3.0)


@pytest.mark.parametrize("over,message", [
    ({"objective": "l1"}, "model.memory.objective: 'l1' must be one of l2, huber, lp"),
    ({"objective": "huber", "huber_delta": 0}, "model.memory.huber_delta: 0.0 must be > 0"),
    ({"objective": "lp", "lp_p": 0.5}, "model.memory.lp_p: 0.5 must be in [1, 8]"),
    ({"huber_delta": 0.5}, "model.memory.huber_delta: 0.5 applies to model.memory.objective: "
                           "huber only (it is l2); remove it or set objective: huber"),
    ({"objective": "huber", "lp_p": 2}, "model.memory.lp_p: 2.0 applies to "
                                        "model.memory.objective: lp only (it is huber); remove "
                                        "it or set objective: lp"),
])
def test_spec_errors_name_the_field_and_the_fix(over: dict, message: str) -> None:
    with pytest.raises(SpecError) as e:
        tiny_spec(**{f"model.memory.{k}": v for k, v in over.items()})
    assert str(e.value) == message
