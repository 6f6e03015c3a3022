"""The helpers the ops' shape rules share (`ir/infer.py` applies the rules). Rules raise
`ShapeError` with a one-line reason; the verifier and `Graph.add` report it with context.
"""
from __future__ import annotations


class ShapeError(ValueError):
    pass


def broadcast_shapes(*shapes: tuple[int, ...]) -> tuple[int, ...]:
    first = tuple(shapes[0])
    if all(tuple(s) == first for s in shapes[1:]):       # the common case: nothing to broadcast
        return first
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
