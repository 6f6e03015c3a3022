"""A small builder so graph construction reads like array code.

    b = Builder("forward")
    x = b.input("x", (2, 8), "f64")
    y = (x * x).sum(axes=(-1,))      # Values overload + - * / @

Every method appends one node (plus a scalar FULL for Python-number operands).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

from titanc.ir.graph import Graph
from titanc.ir.ops import ROPE_BASE, SCAN_ROLES, Op
from titanc.ir.types import TensorType

Number = int | float


class Value:
    __slots__ = ("b", "id")

    def __init__(self, b: "Builder", nid: int):
        self.b, self.id = b, nid

    @property
    def type(self) -> TensorType:
        return self.b.graph.node(self.id).type

    @property
    def shape(self) -> tuple[int, ...]:
        return self.type.shape

    @property
    def dtype(self) -> str:
        return self.type.dtype

    @property
    def rank(self) -> int:
        return len(self.shape)

    def _bin(self, op: Op, other: "Value | Number", swap: bool = False) -> "Value":
        o = self.b.lift(other, self.dtype)
        return self.b.op(op, o, self) if swap else self.b.op(op, self, o)

    def __add__(self, o): return self._bin(Op.ADD, o)
    def __radd__(self, o): return self._bin(Op.ADD, o, swap=True)
    def __sub__(self, o): return self._bin(Op.SUB, o)
    def __rsub__(self, o): return self._bin(Op.SUB, o, swap=True)
    def __mul__(self, o): return self._bin(Op.MUL, o)
    def __rmul__(self, o): return self._bin(Op.MUL, o, swap=True)
    def __truediv__(self, o): return self._bin(Op.DIV, o)
    def __rtruediv__(self, o): return self._bin(Op.DIV, o, swap=True)
    def __neg__(self): return self.b.op(Op.NEG, self)
    def __matmul__(self, w: "Value") -> "Value": return self.b.matmul(self, w)

    # method forms
    def sum(self, axes: Sequence[int], keepdim: bool = False) -> "Value":
        return self.b.op(Op.SUM, self, axes=_axes(axes, self.rank), keepdim=keepdim)

    def amax(self, axes: Sequence[int], keepdim: bool = False) -> "Value":
        return self.b.op(Op.AMAX, self, axes=_axes(axes, self.rank), keepdim=keepdim)

    def mean(self, axes: Sequence[int], keepdim: bool = False) -> "Value":
        n = 1
        for a in _axes(axes, self.rank):
            n *= self.shape[a]
        return self.sum(axes, keepdim) * (1.0 / n)

    def reshape(self, *shape: int) -> "Value":
        if tuple(shape) == self.shape:
            return self
        return self.b.op(Op.RESHAPE, self, shape=tuple(shape))

    def permute(self, *perm: int) -> "Value":
        if tuple(perm) == tuple(range(self.rank)):
            return self
        return self.b.op(Op.PERMUTE, self, perm=tuple(perm))

    def expand(self, *shape: int) -> "Value":
        if tuple(shape) == self.shape:
            return self
        return self.b.op(Op.EXPAND, self, shape=tuple(shape))

    def slice(self, axis: int, start: int, stop: int) -> "Value":
        axis %= self.rank
        if (start, stop) == (0, self.shape[axis]):
            return self
        return self.b.op(Op.SLICE, self, axis=axis, start=start, stop=stop)

    def pad(self, axis: int, before: int, after: int) -> "Value":
        return self.b.op(Op.PAD, self, axis=axis % self.rank, before=before, after=after)

    def cumsum(self, axis: int, reverse: bool = False) -> "Value":
        return self.b.op(Op.CUMSUM, self, axis=axis % self.rank, reverse=reverse)

    def exp(self): return self.b.op(Op.EXP, self)
    def log(self): return self.b.op(Op.LOG, self)
    def sigmoid(self): return self.b.op(Op.SIGMOID, self)
    def silu(self): return self.b.op(Op.SILU, self)
    def rsqrt(self): return self.b.op(Op.RSQRT, self)
    def sqrt(self): return self.b.op(Op.SQRT, self)
    def recip(self): return self.b.op(Op.RECIP, self)

    def __repr__(self) -> str:
        return f"%{self.id}:{self.type}"


def _axes(axes: Sequence[int], rank: int) -> tuple[int, ...]:
    return tuple(sorted(a % rank for a in axes))


class Builder:
    def __init__(self, name: str = "graph", graph: Graph | None = None):
        self.graph = graph if graph is not None else Graph(name)

    def wrap(self, nid: int) -> Value:
        return Value(self, nid)

    def op(self, op: Op, *inputs: Value, type: Any = None, **attrs: Any) -> Value:
        return Value(self, self.graph.add(op, [v.id for v in inputs], attrs, type))

    def like(self, node: Any, *inputs: Value, **attrs: Any) -> Value:
        """`node` (of another graph) rebuilt here on `inputs` (`Graph.add_like`)."""
        return Value(self, self.graph.add_like(node, [v.id for v in inputs], **attrs))

    def inline(self, g: Graph, args: dict[str, Value]) -> dict[str, Value]:
        """`g`'s nodes emitted here, its inputs bound by name to `args`; its outputs by name
        (a function called by copying its body: no node refers to `g` afterwards)."""
        env: dict[int, int] = {}
        for node in g:
            if node.op is Op.INPUT:
                arg = args[node.attr("name")]
                if arg.type != node.type:
                    raise ValueError(f"inline {g.name}: input {node.attr('name')} is "
                                     f"{node.type}, given {arg.type}")
                env[node.id] = arg.id
            else:
                env[node.id] = self.graph.add_like(node, (env[i] for i in node.inputs))
        return {name: Value(self, env[nid]) for name, nid in g.outputs}

    def input(self, name: str, shape: Sequence[int], dtype: str) -> Value:
        return self.op(Op.INPUT, name=name, type=TensorType(tuple(shape), dtype))

    def full(self, value: Number, shape: Sequence[int] = (), dtype: str = "f32") -> Value:
        return self.op(Op.FULL, value=float(value), shape=tuple(shape), dtype=dtype)

    def lift(self, x: "Value | Number", dtype: str) -> Value:
        return x if isinstance(x, Value) else self.full(x, (), dtype)

    def einsum(self, spec: str, *xs: Value) -> Value:
        return self.op(Op.EINSUM, *xs, spec=spec)

    def matmul(self, x: Value, w: Value) -> Value:
        """x [..., i] @ w [i, o] (w may carry leading batch axes matching x's)."""
        letters = "abcdefghjklmnpqrstuvwxyz"
        lead = letters[: x.rank - 1]
        wlead = lead[: w.rank - 2] if w.rank > 2 else ""
        return self.einsum(f"{lead}i,{wlead}io->{lead}o", x, w)

    def concat(self, xs: Sequence[Value], axis: int) -> Value:
        if len(xs) == 1:
            return xs[0]
        return self.op(Op.CONCAT, *xs, axis=axis % xs[0].rank)

    def take(self, table: Value, idx: Value) -> Value:
        return self.op(Op.TAKE, table, idx)

    def take_along(self, x: Value, idx: Value) -> Value:
        return self.op(Op.TAKE_ALONG, x, idx)

    def maximum(self, x: Value, y: Value | Number) -> Value:
        return self.op(Op.MAX, x, self.lift(y, x.dtype))

    def item(self, tup: Value, index: int) -> Value:
        return self.op(Op.ITEM, tup, index=index)

    def rope(self, kind: str, start: int, count: int, half: int, dtype: str,
             base: float = ROPE_BASE) -> Value:
        return self.op(Op.ROPE, kind=kind, start=start, count=count, half=half,
                       base=float(base), dtype=dtype)

    def mask(self, n_q: int, q_start: int, groups: Sequence[tuple[str, int, int | None]],
             dtype: str) -> Value:
        return self.op(Op.MASK, n_q=n_q, q_start=q_start, groups=tuple(map(tuple, groups)),
                       dtype=dtype)

    def scan(self, fn: Callable[..., tuple[Sequence[Value], Sequence[Value]]],
             carries: Sequence[Value], xs: Sequence[Value] = (), consts: Sequence[Value] = (),
             *, length: int | None = None, reverse: bool = False, name: str = "body",
             names: Sequence[str] | None = None,
             role: str = "loop") -> tuple[list[Value], list[Value]]:
        """`fn(b, carries, x_slices, consts) -> (new_carries, ys)` traced into a body graph.

        Returns the final carries and the ys stacked along a new leading axis. `role` (one of
        `SCAN_ROLES`) says what the scan is to the passes and the profiler; `name` only
        names the body (kernel names, dumps).
        """
        if role not in SCAN_ROLES:
            raise ValueError(f"scan role {role!r}: one of {SCAN_ROLES}")
        length = length if length is not None else xs[0].shape[0]
        body = Builder(name)
        all_in = list(carries) + list(xs) + list(consts)
        kinds = ["c"] * len(carries) + ["x"] * len(xs) + ["k"] * len(consts)
        names = list(names) if names else [f"{k}{i}" for i, k in enumerate(kinds)]
        args = []
        for nm, kind, v in zip(names, kinds, all_in):
            shape = v.shape[1:] if kind == "x" else v.shape
            args.append(body.input(nm, shape, v.dtype))
        nc, nx_ = len(carries), len(xs)
        new_c, ys = fn(body, args[:nc], args[nc:nc + nx_], args[nc + nx_:])
        body.graph.set_outputs([(f"carry{i}", v.id) for i, v in enumerate(new_c)]
                               + [(f"y{i}", v.id) for i, v in enumerate(ys)])
        tup = self.op(Op.SCAN, *all_in, body=body.graph, length=length, n_carry=nc,
                      n_xs=nx_, reverse=reverse, role=role)
        outs = [self.item(tup, k) for k in range(len(new_c) + len(ys))]
        return outs[:nc], outs[nc:]
