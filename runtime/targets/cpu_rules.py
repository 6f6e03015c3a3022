"""The cpu target's rules for the ops that compute one tensor (its lowering table `CPU`,
`lowerings.py`): each writes the node's result into `o`, its planned tensor, with out= torch
calls (`emit`), staging an operand into scratch only where no view expresses it. A view op
that torch can express on its operand's storage costs nothing (`VIEWS`). The pattern ops'
rules are in `pattern_kernels.py` and `attention_kernels.py`.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from titanc.ir import Node, Op
from titanc.ir.elementwise import ELEMENTWISE
from titanc.ir.lowering import register_lowering
from titanc.ir.types import TensorType, dtype_name

from titanc.runtime.targets.attention_kernels import StepBuilder
from titanc.runtime.targets.lowerings import CPU

Tensor = torch.Tensor
Step = Callable[[], None]

FOLDABLE = frozenset({Op.CONCAT, Op.CAST, Op.PAD})   # `emit` needs no scratch for these

# -- views: no work when torch can express them on the operand's storage -------------------------

def _reshape(x: Tensor, a: dict, n: Node) -> Tensor | None:
    try:
        return x.view(a["shape"])
    except RuntimeError:
        return None                                   # needs a copy: computed below


VIEWS: dict[Op, Callable[[Tensor, dict, Node], Tensor | None]] = {
    Op.RESHAPE: _reshape,
    Op.PERMUTE: lambda x, a, n: x.permute(*a["perm"]),
    Op.EXPAND: lambda x, a, n: x.expand(*a["shape"]),
    Op.SLICE: lambda x, a, n: x.narrow(a["axis"], a["start"], a["stop"] - a["start"]),
}


# -- compute: every op writes into `o` (its rule in the cpu table, `lowerings.CPU`) --------------

def emit(b: StepBuilder, n: Node, xs: list[Any], o: Tensor) -> list[Step]:
    """The steps that write node `n`'s result into `o`: an elementwise op through its
    registry entry, any other through its rule in the cpu table."""
    if n.op in ELEMENTWISE:
        return _elementwise(b, n.op, xs, o)
    return CPU[n.op](b, n, xs, o)


@register_lowering(Op.CAST, CPU)
def _cast(b: StepBuilder, n: Node, xs: list[Any], o: Tensor) -> list[Step]:
    x = xs[0]
    return [lambda: o.copy_(x)]


@register_lowering(Op.RESHAPE, CPU)
def _reshape_copy(b: StepBuilder, n: Node, xs: list[Any], o: Tensor) -> list[Step]:
    x = xs[0]                                        # a reshape no view expresses
    flat = o.view(x.shape)
    return [lambda: flat.copy_(x)]


@register_lowering(Op.SUM, CPU)
@register_lowering(Op.AMAX, CPU)
def _reduce(b: StepBuilder, n: Node, xs: list[Any], o: Tensor) -> list[Step]:
    f = torch.sum if n.op is Op.SUM else torch.amax
    x, dims, keep = xs[0], tuple(n.attr("axes")), n.attr("keepdim")
    return [lambda: f(x, dim=dims, keepdim=keep, out=o)]


@register_lowering(Op.PAD, CPU)
def _pad(b: StepBuilder, n: Node, xs: list[Any], o: Tensor) -> list[Step]:
    x, ax, before = xs[0], n.attr("axis"), n.attr("before")
    inner = o.narrow(ax, before, x.shape[ax])
    after = o.shape[ax] - before - x.shape[ax]
    margins = [o.narrow(ax, 0, before)] if before else []
    margins += [o.narrow(ax, before + x.shape[ax], after)] if after else []
    return [*(lambda m=m: m.zero_() for m in margins), lambda: inner.copy_(x)]


@register_lowering(Op.CONCAT, CPU)
def _concat(b: StepBuilder, n: Node, xs: list[Any], o: Tensor) -> list[Step]:
    parts, ax = list(xs), n.attr("axis")
    return [lambda: torch.cat(parts, ax, out=o)]


def _elementwise(b: StepBuilder, op: Op, xs: list[Any], o: Tensor) -> list[Step]:
    """An elementwise op into `o` (its registry entry's `out`); a Python float operand (an
    immediate) folds away or takes a scalar overload where one exists, else becomes a 0-d
    constant tensor."""
    rule = ELEMENTWISE[op]
    if all(isinstance(x, float) for x in xs):
        v = rule.fold(*xs)
        return [lambda: o.fill_(v)]
    if len(xs) == 2:
        x, y = xs
        if isinstance(x, float):                      # constant on the left
            if op in (Op.ADD, Op.MUL):
                f = torch.add if op is Op.ADD else torch.mul
                return [lambda: f(y, x, out=o)]
            if op is Op.SUB:
                return [lambda: torch.neg(y, out=o), lambda: o.add_(x)]
            if op is Op.DIV:
                return [lambda: torch.reciprocal(y, out=o), lambda: o.mul_(x)]
            if op is Op.MAX:
                return [lambda: torch.clamp_min(y, x, out=o)]
        if isinstance(y, float) and op is Op.MAX:
            return [lambda: torch.clamp_min(x, y, out=o)]
        if isinstance(y, float) and op in (Op.ADD, Op.SUB, Op.MUL, Op.DIV):
            return [lambda: rule.out(o, x, y)]        # torch takes a scalar on the right
    ts = [b.const(torch.tensor(x, dtype=o.dtype)) if isinstance(x, float) else x for x in xs]
    return [lambda: rule.out(o, *ts)]


@register_lowering(Op.EINSUM, CPU)
def _einsum(b: StepBuilder, n: Node, xs: list[Tensor], o: Tensor) -> list[Step]:
    """A two-operand einsum as one bmm: operands permuted to (batch, M, K) / (batch, K, N),
    staged into scratch when not viewable that way; the result permuted into `o`."""
    spec = n.attr("spec")
    if len(xs) != 2:
        raise NotImplementedError("torch executor: einsum of more than two operands")
    (ta, tb), tc = spec.split("->")[0].split(","), spec.split("->")[1]
    steps: list[Step] = []
    x, y = xs
    # letters only one operand has and the output lacks: sum them out first
    for which in (0, 1):
        t, other, v = (ta, tb, x) if which == 0 else (tb, ta, y)
        lone = [i for i, ch in enumerate(t) if ch not in other and ch not in tc]
        if lone:
            keep = "".join(ch for ch in t if ch not in [t[i] for i in lone])
            kept = tuple(v.shape[i] for i, ch in enumerate(t) if ch in keep)
            s = b.scratch.alloc(TensorType(kept, dtype_name(v.dtype)))
            steps.append(lambda v=v, s=s, d=tuple(lone): torch.sum(v, dim=d, out=s))
            if which == 0:
                ta, x = keep, s
            else:
                tb, y = keep, s
    size = {ch: d for t, v in ((ta, x), (tb, y)) for ch, d in zip(t, v.shape)}
    batch = [ch for ch in tc if ch in ta and ch in tb]
    m = [ch for ch in tc if ch in ta and ch not in tb]
    nn = [ch for ch in tc if ch in tb and ch not in ta]
    k = [ch for ch in ta if ch in tb and ch not in tc]
    prod = lambda cs: int(torch.tensor([size[c] for c in cs] or [1]).prod())
    B, M, N, K = prod(batch), prod(m), prod(nn), prod(k)

    def arrange(v: Tensor, t: str, rows: list[str], cols: list[str]) -> Tensor:
        """v as (batch, rows, cols): a view, else staged into scratch whose innermost axis
        is v's unit-stride one (a contiguous copy; BLAS takes the transposed view as is)."""
        shape = (prod(batch), prod(rows), prod(cols))
        try:
            return v.permute(*[t.index(ch) for ch in batch + rows + cols]).view(shape)
        except RuntimeError:
            pass
        unit = [ch for i, ch in enumerate(t) if v.stride(i) == 1 and v.shape[i] > 1]
        flip = bool(unit) and unit[0] in rows
        p = v.permute(*[t.index(ch) for ch in batch + (cols + rows if flip else rows + cols)])
        s = b.scratch.alloc(TensorType(tuple(p.shape), dtype_name(v.dtype)))
        steps.append(lambda s=s, p=p: s.copy_(p))
        return s.view(shape[0], shape[2], shape[1]).transpose(1, 2) if flip else s.view(shape)

    A = arrange(x, ta, m, k)
    Bm = arrange(y, tb, k, nn)
    natural = batch + m + nn
    if list(tc) == natural:
        C = o.view(B, M, N)
        steps.append(lambda: torch.bmm(A, Bm, out=C))
    elif list(tc) == batch + nn + m:                 # C^T = B^T A^T: transposes are views
        Ct, At, Bt = o.view(B, N, M), A.transpose(1, 2), Bm.transpose(1, 2)
        steps.append(lambda: torch.bmm(Bt, At, out=Ct))
    else:
        s = b.scratch.alloc(TensorType((B, M, N), dtype_name(o.dtype)))
        back = s.view([size[c] for c in natural]).permute(*[natural.index(ch) for ch in tc])
        steps += [lambda: torch.bmm(A, Bm, out=s), lambda: o.copy_(back)]
    return steps


@register_lowering(Op.CUMSUM, CPU)
def _cumsum(b: StepBuilder, n: Node, xs: list[Tensor], o: Tensor) -> list[Step]:
    x, axis, reverse = xs[0], n.attr("axis"), n.attr("reverse")
    if not reverse:
        return [lambda: torch.cumsum(x, axis, out=o)]
    n = x.shape[axis]
    rev = b.const(torch.arange(n - 1, -1, -1))
    s = b.scratch.alloc(TensorType(tuple(x.shape), dtype_name(x.dtype)))
    s2 = b.scratch.alloc(TensorType(tuple(x.shape), dtype_name(x.dtype)))
    return [lambda: torch.index_select(x, axis, rev, out=s), lambda: torch.cumsum(s, axis, out=s2),
            lambda: torch.index_select(s2, axis, rev, out=o)]


def _contiguous(b: StepBuilder, v: Tensor, steps: list[Step]) -> Tensor:
    if v.is_contiguous():
        return v
    s = b.scratch.alloc(TensorType(tuple(v.shape), dtype_name(v.dtype)))
    steps.append(lambda: s.copy_(v))
    return s


@register_lowering(Op.TAKE, CPU)
def _take(b: StepBuilder, n: Node, xs: list[Tensor], o: Tensor) -> list[Step]:
    steps: list[Step] = []
    src, idx = xs[0], _contiguous(b, xs[1], steps).view(-1)
    flat_out = o.view(-1, *src.shape[1:])
    return steps + [lambda: torch.index_select(src, 0, idx, out=flat_out)]


@register_lowering(Op.INDEX_ADD, CPU)
def _index_add(b: StepBuilder, n: Node, xs: list[Tensor], o: Tensor) -> list[Step]:
    steps: list[Step] = []
    idx, g = _contiguous(b, xs[1], steps), _contiguous(b, xs[0], steps)
    if g.dtype != o.dtype:                  # a narrower gradient summed in o's dtype
        wide = b.scratch.alloc(TensorType(tuple(g.shape), dtype_name(o.dtype)))
        steps.append(lambda g=g: wide.copy_(g))
        g = wide
    flat_idx, flat_g = idx.view(-1), g.view(-1, *o.shape[1:])
    return steps + [lambda: o.zero_(), lambda: o.index_add_(0, flat_idx, flat_g)]


@register_lowering(Op.TAKE_ALONG, CPU)
def _take_along(b: StepBuilder, n: Node, xs: list[Tensor], o: Tensor) -> list[Step]:
    steps: list[Step] = []
    src, i2, o2 = xs[0], _contiguous(b, xs[1], steps).unsqueeze(-1), o.unsqueeze(-1)
    return steps + [lambda: torch.gather(src, -1, i2, out=o2)]


@register_lowering(Op.SCATTER_ALONG, CPU)
def _scatter_along(b: StepBuilder, n: Node, xs: list[Tensor], o: Tensor) -> list[Step]:
    steps: list[Step] = []
    i2, g2 = _contiguous(b, xs[1], steps).unsqueeze(-1), xs[0].unsqueeze(-1)
    return steps + [lambda: o.zero_(), lambda: o.scatter_add_(-1, i2, g2)]
