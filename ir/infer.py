"""Shape inference: `infer_type(op, operand types, attrs)`, from each op's registry entry
(numpy broadcasting for the elementwise ops, `structural.py` for the rest).
"""
from __future__ import annotations

from typing import Any

from titanc.ir.elementwise import ELEMENTWISE
from titanc.ir.ops import Op
from titanc.ir.shapes import ShapeError, broadcast_shapes
from titanc.ir.structural import STRUCTURAL
from titanc.ir.types import TensorType, Type


def _elementwise(ts: list[TensorType], op: Op) -> TensorType:
    first = ts[0]
    if all(t is first or t == first for t in ts[1:]):    # the common case: one type
        if not first.is_float:
            raise ShapeError(f"{op.name} needs float operands, got {first.dtype}")
        return first
    dtypes = {t.dtype for t in ts}
    if len(dtypes) != 1:
        raise ShapeError(f"dtype mismatch {sorted(dtypes)}")
    if not ts[0].is_float:
        raise ShapeError(f"{op.name} needs float operands, got {ts[0].dtype}")
    return TensorType(broadcast_shapes(*[t.shape for t in ts]), ts[0].dtype)


def infer_type(op: Op, input_types: list[Type], attrs: dict[str, Any]) -> Type:
    """The output type of `op` on operands of `input_types`: numpy broadcasting for an
    arithmetic elementwise op, else the op's `structural.py` entry."""
    if op in ELEMENTWISE:
        return _elementwise(list(input_types), op)
    return STRUCTURAL[op].shape(list(input_types), attrs)
