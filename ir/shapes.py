"""Shape rules: one function per op kind mapping input types and attrs to the output type.

Rules raise `ShapeError` with a one-line reason; the verifier and `Graph.add` report it with
context.
"""
from __future__ import annotations

from typing import Any, Callable

from .ops import Op, OpGroup
from .types import TensorType, Type


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


def _norm_axes(axes: tuple[int, ...], rank: int) -> tuple[int, ...]:
    return tuple(sorted(a % rank for a in axes))


def _elementwise(ts: list[TensorType], a: dict[str, Any], op: Op) -> TensorType:
    if op is Op.CAST:
        return TensorType(ts[0].shape, a["dtype"])
    dtypes = {t.dtype for t in ts}
    if len(dtypes) != 1:
        raise ShapeError(f"dtype mismatch {sorted(dtypes)}")
    if not ts[0].is_float:
        raise ShapeError(f"{op.name} needs float operands, got {ts[0].dtype}")
    return TensorType(broadcast_shapes(*[t.shape for t in ts]), ts[0].dtype)


def _reduce(ts: list[TensorType], a: dict[str, Any], op: Op) -> TensorType:
    (t,) = ts
    axes = _norm_axes(a["axes"], t.rank)
    if a.get("keepdim", False):
        shape = tuple(1 if i in axes else s for i, s in enumerate(t.shape))
    else:
        shape = tuple(s for i, s in enumerate(t.shape) if i not in axes)
    return TensorType(shape, t.dtype)


def _einsum(ts: list[TensorType], a: dict[str, Any], op: Op) -> TensorType:
    terms, out = parse_einsum(a["spec"], len(ts))
    sizes: dict[str, int] = {}
    for term, t in zip(terms, ts):
        if len(term) != t.rank:
            raise ShapeError(f"einsum term {term!r} has rank {len(term)}, operand is {t}")
        for ch, s in zip(term, t.shape):
            if sizes.setdefault(ch, s) != s:
                raise ShapeError(f"einsum letter {ch!r} is {sizes[ch]} and {s}")
    if {t.dtype for t in ts} != {ts[0].dtype}:
        raise ShapeError("einsum operands differ in dtype")
    missing = set(out) - set(sizes)
    if missing:
        raise ShapeError(f"einsum output letters {sorted(missing)} appear in no operand")
    return TensorType(tuple(sizes[ch] for ch in out), ts[0].dtype)


def _reshape(ts, a, op):
    (t,) = ts
    shape = tuple(a["shape"])
    if TensorType(shape).numel != t.numel:
        raise ShapeError(f"cannot reshape {t} to {list(shape)}")
    return TensorType(shape, t.dtype)


def _permute(ts, a, op):
    (t,) = ts
    perm = tuple(a["perm"])
    if sorted(perm) != list(range(t.rank)):
        raise ShapeError(f"perm {list(perm)} is not a permutation of rank {t.rank}")
    return TensorType(tuple(t.shape[p] for p in perm), t.dtype)


def _expand(ts, a, op):
    (t,) = ts
    shape = tuple(a["shape"])
    if broadcast_shapes(t.shape, shape) != shape:
        raise ShapeError(f"cannot expand {t} to {list(shape)}")
    return TensorType(shape, t.dtype)


def _slice(ts, a, op):
    (t,) = ts
    ax = a["axis"] % t.rank
    start, stop = a["start"], a["stop"]
    if not 0 <= start <= stop <= t.shape[ax]:
        raise ShapeError(f"slice [{start}:{stop}] out of range for axis {ax} of {t}")
    shape = list(t.shape)
    shape[ax] = stop - start
    return TensorType(tuple(shape), t.dtype)


def _pad(ts, a, op):
    (t,) = ts
    ax = a["axis"] % t.rank
    shape = list(t.shape)
    shape[ax] += a["before"] + a["after"]
    return TensorType(tuple(shape), t.dtype)


def _concat(ts, a, op):
    ax = a["axis"] % ts[0].rank
    for t in ts[1:]:
        if t.rank != ts[0].rank or t.dtype != ts[0].dtype or any(
                s != r for i, (s, r) in enumerate(zip(t.shape, ts[0].shape)) if i != ax):
            raise ShapeError(f"cannot concat {ts[0]} and {t} on axis {ax}")
    shape = list(ts[0].shape)
    shape[ax] = sum(t.shape[ax] for t in ts)
    return TensorType(tuple(shape), ts[0].dtype)


def _check_index(t: TensorType) -> None:
    if t.dtype != "i64":
        raise ShapeError(f"index operand must be i64, got {t}")


def _take(ts, a, op):
    table, idx = ts
    _check_index(idx)
    return TensorType(idx.shape + table.shape[1:], table.dtype)


def _index_add(ts, a, op):
    grad, idx = ts
    _check_index(idx)
    if grad.shape[: idx.rank] != idx.shape:
        raise ShapeError(f"INDEX_ADD grad {grad} does not start with index shape {idx.shape}")
    return TensorType((a["rows"],) + grad.shape[idx.rank:], grad.dtype)


def _take_along(ts, a, op):
    x, idx = ts
    _check_index(idx)
    if x.shape[:-1] != idx.shape:
        raise ShapeError(f"TAKE_ALONG index {idx} must match {x} without its last axis")
    return TensorType(idx.shape, x.dtype)


def _scatter_along(ts, a, op):
    grad, idx = ts
    _check_index(idx)
    if grad.shape != idx.shape:
        raise ShapeError(f"SCATTER_ALONG grad {grad} and index {idx} differ in shape")
    return TensorType(grad.shape + (a["size"],), grad.dtype)


def _cumsum(ts, a, op):
    return ts[0]


def _item(ts, a, op):
    (t,) = ts
    if not isinstance(t, tuple):
        raise ShapeError("ITEM needs a tuple-typed input")
    return t[a["index"]]


def _generator(ts, a, op):
    if op is Op.FULL:
        return TensorType(tuple(a["shape"]), a["dtype"])
    if op is Op.ROPE:
        return TensorType((a["count"], a["half"]), a["dtype"])
    if op is Op.MASK:
        n_k = sum(length for _, length, _ in a["groups"])
        return TensorType((a["n_q"], n_k), a["dtype"])
    raise ShapeError(f"INPUT nodes carry an explicit type")


def _scan(ts, a, op) -> Type:
    from .verify import scan_signature

    return scan_signature(ts, a)


_RULES: dict[Op, Callable[..., Type]] = {
    Op.CAST: _elementwise,
    **{o: _reduce for o in OpGroup.REDUCE},
    **{o: _generator for o in OpGroup.SOURCE},
    Op.EINSUM: _einsum, Op.RESHAPE: _reshape, Op.PERMUTE: _permute, Op.EXPAND: _expand,
    Op.SLICE: _slice, Op.PAD: _pad, Op.CONCAT: _concat, Op.TAKE: _take,
    Op.INDEX_ADD: _index_add, Op.TAKE_ALONG: _take_along, Op.SCATTER_ALONG: _scatter_along,
    Op.CUMSUM: _cumsum, Op.SCAN: _scan, Op.ITEM: _item,
}


def infer_type(op: Op, input_types: list[Type], attrs: dict[str, Any]) -> Type:
    rule = _elementwise if op in OpGroup.ELEMENTWISE else _RULES[op]
    return rule(list(input_types), attrs, op)
