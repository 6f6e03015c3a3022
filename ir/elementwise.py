"""Arithmetic elementwise ops: every rule of each op in one entry.

An entry (`Elementwise`) says, for one op, everything the compiler needs:

    ref     reference semantics on torch tensors (the interpreter; also the float64 oracle)
    out     the same written into a preallocated tensor `o` (the cpu target: allocates nothing;
            `o` may serve as scratch)
    fold    the same on Python floats (constant folding; a domain error folds nothing)
    vjp     (ct, xs, y) -> the cotangent of each operand at the output's shape (autodiff sums
            away broadcast axes itself), None for an operand with no gradient
    reads   what the VJP reads, for rematerialisation: operand positions and "out"
    triton  the Triton expression, `{0}`, `{1}` naming the operands
    precision  "demanding" where its float32 demand reaches back through the elementwise
            chain feeding it under mixed precision (LOG), else "" (`structural.py` lists the
            classes)

Shapes follow numpy broadcasting for every entry (`shapes.py`), fusion and codegen treat every
entry as a pointwise node, and `OpGroup.UNARY` / `BINARY` / `ELEMENTWISE` list every entry.
Adding an op: `Op.define("NAME")` (or a line in ops.py for a built-in one) and `register(...)`
here; docs/architecture.md walks through it and tests/test_pipeline.py does it in a fixture.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from titanc.ir.ops import Op, OpGroup

__all__ = ["ELEMENTWISE", "Elementwise", "register", "silu_grad", "unregister"]


@dataclass(frozen=True)
class Elementwise:
    op: Op
    arity: int
    ref: Callable[..., torch.Tensor]
    out: Callable[..., Any]
    fold: Callable[..., float]
    vjp: Callable[[Any, list[Any], Any], list[Any]]
    reads: tuple[int | str, ...]
    triton: str
    precision: str = ""


ELEMENTWISE: dict[Op, Elementwise] = {}


def register(entry: Elementwise) -> Elementwise:
    """Add `entry` to the registry and its op to the elementwise groups."""
    if entry.arity not in (1, 2):
        raise ValueError(f"{entry.op.name}: elementwise ops take 1 or 2 operands")
    ELEMENTWISE[entry.op] = entry
    (OpGroup.UNARY if entry.arity == 1 else OpGroup.BINARY).add(entry.op)
    OpGroup.ELEMENTWISE.add(entry.op)
    return entry


def unregister(op: Op) -> None:
    """Remove an op registered by `register` (a test's toy op)."""
    del ELEMENTWISE[op]
    for group in (OpGroup.UNARY, OpGroup.BINARY, OpGroup.ELEMENTWISE):
        group.discard(op)


def silu_grad(z: Any) -> Any:
    """d silu(z)/dz = σ(z)(1 + z(1 − σ(z))), on IR values."""
    s = z.sigmoid()
    return s * (z * (1.0 - s) + 1.0)


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def _gt_out(o: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> None:
    # 1 where x > y, else 0 (sign of the difference, negatives clamped), with no bool buffer
    torch.sub(x, y, out=o)
    o.sign_().clamp_min_(0.0)


def _silu_out(o: torch.Tensor, x: torch.Tensor) -> None:
    torch.sigmoid(x, out=o)
    o.mul_(x)


def _max_vjp(ct: Any, xs: list[Any], y: Any) -> list[Any]:
    pick = ct.b.op(Op.GT, xs[0], xs[1])                  # ties go to the second operand
    return [ct * pick, ct * (1.0 - pick)]


for _e in (
    Elementwise(Op.NEG, 1, lambda x: -x, lambda o, x: torch.neg(x, out=o), lambda a: -a,
                lambda ct, xs, y: [-ct], (), "-{0}"),
    Elementwise(Op.EXP, 1, torch.exp, lambda o, x: torch.exp(x, out=o), math.exp,
                lambda ct, xs, y: [ct * y], ("out",), "tl.exp({0})"),
    Elementwise(Op.LOG, 1, torch.log, lambda o, x: torch.log(x, out=o), math.log,
                lambda ct, xs, y: [ct / xs[0]], (0,), "tl.log({0})", "demanding"),
    Elementwise(Op.SIGMOID, 1, torch.sigmoid, lambda o, x: torch.sigmoid(x, out=o), _sigmoid,
                lambda ct, xs, y: [ct * y * (1.0 - y)], ("out",), "tl.sigmoid({0})"),
    Elementwise(Op.SILU, 1, lambda x: x * torch.sigmoid(x), _silu_out, lambda a: a * _sigmoid(a),
                lambda ct, xs, y: [ct * silu_grad(xs[0])], (0,), "{0} * tl.sigmoid({0})"),
    Elementwise(Op.RSQRT, 1, torch.rsqrt, lambda o, x: torch.rsqrt(x, out=o),
                lambda a: 1.0 / math.sqrt(a),
                lambda ct, xs, y: [ct * (y * y * y) * -0.5], ("out",), "tl.rsqrt({0})"),
    Elementwise(Op.SQRT, 1, torch.sqrt, lambda o, x: torch.sqrt(x, out=o), math.sqrt,
                lambda ct, xs, y: [ct * 0.5 / y], ("out",), "tl.sqrt({0})"),
    Elementwise(Op.RECIP, 1, lambda x: 1.0 / x, lambda o, x: torch.reciprocal(x, out=o),
                lambda a: 1.0 / a, lambda ct, xs, y: [-(ct * y * y)], ("out",), "1.0 / {0}"),
    Elementwise(Op.ADD, 2, torch.add, lambda o, x, y: torch.add(x, y, out=o), lambda a, b: a + b,
                lambda ct, xs, y: [ct, ct], (), "{0} + {1}"),
    Elementwise(Op.SUB, 2, torch.sub, lambda o, x, y: torch.sub(x, y, out=o), lambda a, b: a - b,
                lambda ct, xs, y: [ct, -ct], (), "{0} - {1}"),
    Elementwise(Op.MUL, 2, torch.mul, lambda o, x, y: torch.mul(x, y, out=o), lambda a, b: a * b,
                lambda ct, xs, y: [ct * xs[1], ct * xs[0]], (0, 1), "{0} * {1}"),
    Elementwise(Op.DIV, 2, torch.div, lambda o, x, y: torch.div(x, y, out=o), lambda a, b: a / b,
                lambda ct, xs, y: [ct / xs[1], -(ct * y / xs[1])], (1, "out"), "{0} / {1}"),
    Elementwise(Op.MAX, 2, torch.maximum, lambda o, x, y: torch.maximum(x, y, out=o), max,
                _max_vjp, (0, 1), "tl.maximum({0}, {1})"),
    Elementwise(Op.GT, 2, lambda x, y: (x > y).to(x.dtype), _gt_out, lambda a, b: float(a > b),
                lambda ct, xs, y: [None, None], (), "tl.where({0} > {1}, 1.0, 0.0)"),
):
    register(_e)
