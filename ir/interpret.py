"""Reference interpreter: runs a Graph on torch, op by op, in float64 or float32.

It is the numerical oracle for every pass and backend. It uses only out-of-place torch ops,
so autograd can also differentiate through it (tests use that as a cross-check of autodiff).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Sequence

import torch

from .elementwise import ELEMENTWISE
from .graph import Graph, Node
from .ops import ROPE_BASE, Op
from .types import DTYPES

Tensor = torch.Tensor


def rope_inv_freq(half: int, base: float = ROPE_BASE) -> Tensor:
    """RoPE's inverse frequencies base^(-2j / 2·half), j < half, in float64."""
    return base ** (-torch.arange(half, dtype=torch.float64) * 2.0 / (2 * half))


def rope_table(kind: str, start: int, count: int, half: int, base: float,
               dtype: torch.dtype) -> Tensor:
    """cos or sin of position × inverse frequency, positions start..start+count-1: [count, half]."""
    pos = torch.arange(start, start + count, dtype=torch.float64)
    inv = rope_inv_freq(half, base)
    ang = pos[:, None] * inv[None, :]
    return (torch.cos(ang) if kind == "cos" else torch.sin(ang)).to(dtype)


def mask_table(n_q: int, q_start: int, groups: Sequence[tuple[str, int, Any]],
               dtype: torch.dtype) -> Tensor:
    """Additive attention bias [n_q, n_k]: 0 where visible, -inf elsewhere.

    Key groups: ('all', n, None) always visible; ('causal', n, window) key j visible to the
    query at position p = q_start + i when j <= p and (window is None or p - j < window).
    """
    qpos = torch.arange(q_start, q_start + n_q)[:, None]
    cols = []
    for kind, length, window in groups:
        j = torch.arange(length)[None, :]
        if kind == "all":
            vis = torch.ones(n_q, length, dtype=torch.bool)
        else:
            vis = j <= qpos
            if window is not None:
                vis = vis & (qpos - j < window)
        cols.append(vis)
    vis = torch.cat(cols, dim=1)
    zero = torch.zeros((), dtype=dtype)
    return torch.where(vis, zero, torch.tensor(-math.inf, dtype=dtype))


def _scan(node: Node, args: list[Tensor], run: Callable) -> tuple[Tensor, ...]:
    a = node.attr_dict
    nc, nx_, length, body = a["n_carry"], a["n_xs"], a["length"], a["body"]
    carries, xs, consts = list(args[:nc]), args[nc:nc + nx_], args[nc + nx_:]
    ys: list[list[Tensor]] = []
    steps = range(length - 1, -1, -1) if a.get("reverse", False) else range(length)
    for t in steps:
        outs = run(body, carries + [x[t] for x in xs] + list(consts))
        carries = outs[:nc]
        ys.append(outs[nc:])
    if a.get("reverse", False):
        ys.reverse()
    n_y = len(body.outputs) - nc
    stacked = [torch.stack([y[k] for y in ys]) for k in range(n_y)]
    return tuple(carries) + tuple(stacked)


_EVAL: dict[Op, Callable[..., Any]] = {
    Op.SUM: lambda n, x: torch.sum(x, dim=tuple(n.attr("axes")), keepdim=n.attr("keepdim")),
    Op.AMAX: lambda n, x: torch.amax(x, dim=tuple(n.attr("axes")), keepdim=n.attr("keepdim")),
    Op.EINSUM: lambda n, *xs: torch.einsum(n.attr("spec"), *xs),
    Op.RESHAPE: lambda n, x: x.reshape(n.attr("shape")),
    Op.PERMUTE: lambda n, x: x.permute(*n.attr("perm")),
    Op.EXPAND: lambda n, x: x.expand(*n.attr("shape")),
    Op.SLICE: lambda n, x: x.narrow(n.attr("axis"), n.attr("start"),
                                    n.attr("stop") - n.attr("start")),
    Op.CONCAT: lambda n, *xs: torch.cat(xs, dim=n.attr("axis")),
    Op.TAKE: lambda n, t, i: t[i],
    Op.TAKE_ALONG: lambda n, x, i: torch.gather(x, -1, i.unsqueeze(-1)).squeeze(-1),
    Op.ITEM: lambda n, t: t[n.attr("index")],
}


def _pad(n: Node, x: Tensor) -> Tensor:
    ax = n.attr("axis") % x.dim()
    spec = [0, 0] * (x.dim() - ax - 1) + [n.attr("before"), n.attr("after")]
    return torch.nn.functional.pad(x, spec)


def _index_add(n: Node, grad: Tensor, idx: Tensor) -> Tensor:
    rest = grad.shape[idx.dim():]
    out = torch.zeros((n.attr("rows"),) + tuple(rest), dtype=grad.dtype)
    return out.index_add(0, idx.reshape(-1), grad.reshape((-1,) + tuple(rest)))


def _scatter_along(n: Node, grad: Tensor, idx: Tensor) -> Tensor:
    out = torch.zeros(tuple(grad.shape) + (n.attr("size"),), dtype=grad.dtype)
    return out.scatter_add(-1, idx.unsqueeze(-1), grad.unsqueeze(-1))


def _cumsum(n: Node, x: Tensor) -> Tensor:
    ax = n.attr("axis")
    if n.attr("reverse"):
        return torch.flip(torch.cumsum(torch.flip(x, (ax,)), ax), (ax,))
    return torch.cumsum(x, ax)


_EVAL.update({Op.PAD: _pad, Op.INDEX_ADD: _index_add, Op.SCATTER_ALONG: _scatter_along,
              Op.CUMSUM: _cumsum})


class Interpreter:
    """Evaluate graphs; `float_dtype` (if given) replaces every float dtype of the graph."""

    def __init__(self, float_dtype: torch.dtype | None = None):
        self.float_dtype = float_dtype

    def dtype(self, name: str) -> torch.dtype:
        if self.float_dtype is not None and name in ("f32", "f64"):
            return self.float_dtype
        return DTYPES[name]

    def run(self, g: Graph, args: Sequence[Tensor]) -> list[Tensor]:
        """Positional: args in `g.inputs` order; returns outputs in `g.outputs` order."""
        env: dict[int, Any] = dict(zip(g.inputs, args))
        order = g.order()
        last_use: dict[int, int] = {}
        for pos, nid in enumerate(order):
            for i in g.node(nid).inputs:
                last_use[i] = pos
        keep = {nid for _, nid in g.outputs}
        for pos, nid in enumerate(order):
            node = g.node(nid)
            if node.op is not Op.INPUT:
                env[nid] = self._eval(node, [env[i] for i in node.inputs])
            for i in set(node.inputs):
                if last_use[i] == pos and i not in keep:
                    del env[i]
        return [env[nid] for _, nid in g.outputs]

    def __call__(self, g: Graph, inputs: Mapping[str, Tensor]) -> dict[str, Tensor]:
        missing = [n for n in g.input_names() if n not in inputs]
        if missing:
            raise KeyError(f"graph {g.name} needs inputs {missing}")
        args = [self._cast(inputs[n]) for n in g.input_names()]
        return dict(zip((n for n, _ in g.outputs), self.run(g, args)))

    def _cast(self, x: Tensor) -> Tensor:
        if self.float_dtype is not None and x.is_floating_point():
            return x.to(self.float_dtype)
        return x

    def _eval(self, node: Node, args: list[Any]) -> Any:
        op = node.op
        if op is Op.FULL:
            return torch.full(node.attr("shape"), node.attr("value"),
                              dtype=self.dtype(node.attr("dtype")))
        if op is Op.ROPE:
            a = node.attr_dict
            return rope_table(a["kind"], a["start"], a["count"], a["half"], a["base"],
                              self.dtype(a["dtype"]))
        if op is Op.MASK:
            a = node.attr_dict
            return mask_table(a["n_q"], a["q_start"], a["groups"], self.dtype(a["dtype"]))
        if op is Op.CAST:
            return args[0].to(self.dtype(node.attr("dtype")))
        if op is Op.SCAN:
            return _scan(node, args, self.run)
        if op in ELEMENTWISE:
            return ELEMENTWISE[op].ref(*args)
        return _EVAL[op](node, *args)


def interpret(g: Graph, inputs: Mapping[str, Tensor],
              float_dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    return Interpreter(float_dtype)(g, inputs)
