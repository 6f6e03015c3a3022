"""Shape inference: `infer_type(op, operand types, attrs)`, from each op's registry entry
(numpy broadcasting for the elementwise ops, `structural.py` for the rest), and the helpers the
rules share. Rules raise `ShapeError` with a one-line reason; the verifier and `Graph.add`
report it with context.
"""
from __future__ import annotations

from typing import Any

from titanc.ir.ops import Op
from titanc.ir.types import TensorType, Type


class ShapeError(ValueError):
    pass


def broadcast_shapes(*shapes: tuple[int, ...]) -> tuple[int, ...]:
    rank = max(len(s) for s in shapes)
    out = []
    for dims in zip(*[(1,) * (rank - len(s)) + tuple(s) for s in shapes]):
        sizes = {d for d in dims if d != 1}
        if len(sizes) > 1:
            raise ShapeError(f"shapes {' and '.join(map(str, shapes))} do not broadcast")
        out.append(sizes.pop() if sizes else 1)
    return tuple(out)


def parse_einsum(spec: str, n_inputs: int) -> tuple[list[str], str]:
    if "->" not in spec:
        raise ShapeError(f"einsum spec {spec!r} needs an explicit '->' output")
    lhs, out = spec.split("->")
    terms = lhs.split(",")
    if len(terms) != n_inputs:
        raise ShapeError(f"einsum spec {spec!r} names {len(terms)} operands, got {n_inputs}")
    return terms, out


def _elementwise(ts: list[TensorType], op: Op) -> TensorType:
    dtypes = {t.dtype for t in ts}
    if len(dtypes) != 1:
        raise ShapeError(f"dtype mismatch {sorted(dtypes)}")
    if not ts[0].is_float:
        raise ShapeError(f"{op.name} needs float operands, got {ts[0].dtype}")
    return TensorType(broadcast_shapes(*[t.shape for t in ts]), ts[0].dtype)


def infer_type(op: Op, input_types: list[Type], attrs: dict[str, Any]) -> Type:
    """The output type of `op` on operands of `input_types`: numpy broadcasting for an
    arithmetic elementwise op, else the op's `structural.py` entry."""
    from titanc.ir.elementwise import ELEMENTWISE
    from titanc.ir.structural import STRUCTURAL

    if op in ELEMENTWISE:
        return _elementwise(list(input_types), op)
    return STRUCTURAL[op].shape(list(input_types), attrs)
