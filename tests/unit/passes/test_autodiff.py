"""Per-op VJP rules against central finite differences (float64)."""
from __future__ import annotations

from typing import Callable

import pytest
import torch

from titanc.ir import Builder, Value, interpret, verify
from titanc.passes.autodiff import grad_graph

torch.manual_seed(0)
F64 = "f64"


def _check(build: Callable[[Builder, list[Value]], Value], shapes: list[tuple[int, ...]],
           positive: bool = False, extra: dict[str, torch.Tensor] | None = None) -> None:
    b = Builder("f")
    xs = [b.input(f"x{i}", s, F64) for i, s in enumerate(shapes)]
    extra = extra or {}
    ex = {k: b.input(k, tuple(v.shape), "i64") for k, v in extra.items()}
    y = build(b, xs + list(ex.values()))
    weights = b.input("w", y.shape, F64)
    loss = (y * weights).sum(range(y.rank)) if y.rank else y * weights
    b.graph.set_outputs([("loss", loss.id)])
    g = verify(b.graph)
    vals = {f"x{i}": torch.randn(s, dtype=torch.float64) for i, s in enumerate(shapes)}
    if positive:
        vals = {k: v.abs() + 0.5 for k, v in vals.items()}
    vals["w"] = torch.randn(y.shape, dtype=torch.float64)
    vals.update(extra)
    grads = interpret(verify(grad_graph(g, [f"x{i}" for i in range(len(shapes))])), vals)
    eps = 1e-6
    for i in range(len(shapes)):
        x = vals[f"x{i}"]
        fd = torch.zeros_like(x)
        for j in range(x.numel()):
            d = torch.zeros_like(x).view(-1)
            d[j] = eps
            d = d.view(x.shape)
            hi = interpret(g, {**vals, f"x{i}": x + d})["loss"]
            lo = interpret(g, {**vals, f"x{i}": x - d})["loss"]
            fd.view(-1)[j] = (hi - lo) / (2 * eps)
        torch.testing.assert_close(grads[f"grad.x{i}"], fd, rtol=1e-6, atol=1e-7)


UNARY = {
    "neg": lambda v: -v, "exp": lambda v: v.exp(), "log": lambda v: v.log(),
    "sigmoid": lambda v: v.sigmoid(), "silu": lambda v: v.silu(), "rsqrt": lambda v: v.rsqrt(),
    "sqrt": lambda v: v.sqrt(), "recip": lambda v: v.recip(),
}


@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary(name: str) -> None:
    _check(lambda b, x: UNARY[name](x[0]), [(3, 4)], positive=name in ("log", "rsqrt", "sqrt", "recip"))


@pytest.mark.parametrize("op", ["add", "sub", "mul", "div", "max"])
def test_binary_with_broadcasting(op: str) -> None:
    fns = {"add": lambda a, c: a + c, "sub": lambda a, c: a - c, "mul": lambda a, c: a * c,
           "div": lambda a, c: a / c, "max": lambda a, c: a.b.maximum(a, c)}
    _check(lambda b, x: fns[op](x[0], x[1]), [(2, 3, 4), (3, 1)], positive=op == "div")


def test_reductions() -> None:
    _check(lambda b, x: x[0].sum((0, 2), keepdim=True), [(2, 3, 4)])
    _check(lambda b, x: x[0].amax((-1,)), [(3, 5)])
    _check(lambda b, x: x[0].mean((1,)), [(3, 5)])


def test_einsum_including_unique_letters() -> None:
    _check(lambda b, x: b.einsum("bij,bjk->bik", x[0], x[1]), [(2, 3, 4), (2, 4, 2)])
    _check(lambda b, x: b.einsum("bu,buc,buh->bch", *x), [(2, 3), (2, 3, 2), (2, 3, 4)])
    _check(lambda b, x: b.einsum("ij,k->ik", x[0], x[1]), [(2, 3), (4,)])


def test_movement() -> None:
    _check(lambda b, x: x[0].reshape(6, 2).permute(1, 0), [(3, 4)])
    _check(lambda b, x: x[0].expand(2, 3, 4), [(3, 1)])
    _check(lambda b, x: x[0].slice(1, 1, 3).pad(0, 1, 2), [(3, 4)])
    _check(lambda b, x: b.concat([x[0], x[1]], 1), [(2, 3), (2, 2)])
    _check(lambda b, x: x[0].cumsum(1) + x[0].cumsum(0, reverse=True), [(3, 4)])


def test_gathers() -> None:
    idx = torch.tensor([[0, 2, 1], [3, 3, 0]])
    _check(lambda b, x: b.take(x[0], x[1]), [(4, 2)], extra={"idx": idx})
    _check(lambda b, x: b.take_along(x[0], x[1]), [(2, 3, 4)], extra={"idx": idx})


def test_scan_with_carries_xs_and_consts() -> None:
    def build(b: Builder, x: list[Value]) -> Value:
        def body(bb, c, xs, k):
            h = (c[0] * k[0] + xs[0]).silu()
            return [h, c[1] + h.sum((0,))], [h * c[1]]
        (h, acc), (ys,) = b.scan(body, [x[0], b.full(0.5, (), F64)], [x[1]], [x[2]])
        return ys.sum((0,)) + h * acc

    _check(build, [(3,), (4, 3), (3,)])


def test_nested_scan_reverse() -> None:
    def build(b: Builder, x: list[Value]) -> Value:
        def outer(bb, c, xs, k):
            def inner(bi, ci, xi, ki):
                return [ci[0] * ki[0] + xi[0].exp()], [ci[0]]
            (h,), (ys,) = bb.scan(inner, [c[0]], [xs[0]], [k[0]], reverse=True)
            return [h], [ys.sum((0,))]
        (h,), (ys,) = b.scan(outer, [x[0]], [x[1]], [x[2]])
        return ys.sum((0,)) + h

    _check(build, [(2,), (3, 2, 2), (2,)])
