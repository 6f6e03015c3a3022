"""Structural ops (everything but arithmetic elementwise): every rule of each op in one entry.

An entry (`Structural`) says, for one op, what the IR and its passes need:

    shape   (operand types, attrs) -> output type, raising `ShapeError` (the verifier, `Graph.add`)
    ref     reference semantics: (node, operand tensors, interpreter) -> tensor (the float64
            oracle; the interpreter argument gives `dtype(name)` and `run(graph, args)`)
    vjp     (builder, attrs, operands, output, output cotangent) -> operand cotangents, None
            where an operand has none (JAX's transpose table); None for SCAN, which autodiff
            differentiates by recomputation, and for ops with no operands
    reads   what the VJP reads, for rematerialisation: operand positions, "out", or "all"
    zero    constant folding of zeros: "all" (zero when every operand is zero), "any" (when
            one is), "first" (when the data operand is), "" (never)

and the facts the passes and tools read about the kernel that runs it (defaults fit most ops):

    groups     the `OpGroup` sets `register` adds the op to: "PATTERN" (a tuple-valued op that
               is one template kernel with its ITEMs), "INDEXING" (computed by index
               arithmetic on its operand's loads, free inside a fused kernel), ...
    flops      (node, graph) -> its modeled work (`passes.fusion.node_flops`; pattern ops)
    precision  under bf16 mixed precision (`passes/precision.py`): "low" (bf16 operands,
               float32 inside), "high" (float32 operands), "demanding" (float32 operands, and
               the elementwise chain feeding it computes in float32 too), "" (the pass's rule)
    strided    operand positions its kernel reads through their strides, "all" for every one
               (the memory plan binds a strided view to such an operand without a copy)
    in_place   attrs -> {output element: operand position} it updates where it is (the memory
               plan gives such an element the operand's persistent slot)
    family     the kernel family its template kernel runs (a `KernelFamily` record's name,
               `ir/kernel_family.py`): an op naming a template family is alone in its kernel

The arithmetic elementwise ops have their entries in `elementwise.py` (same idea, plus their
`out=` form and Triton expression). How an op runs on a target is that target's lowering
rule, registered per target (`ir/lowering.py`: the cpu target's table in
`runtime/targets/lowerings.py`, the triton target's in `codegen/lower/lowerings.py`), as JAX
keeps a primitive's lowering per platform.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from titanc.ir.tables import mask_table, rope_table
from titanc.ir.ops import SCAN_ROLES, Op, OpGroup
from titanc.ir.shapes import ShapeError, broadcast_shapes, parse_einsum
from titanc.ir.types import TensorType, Type

__all__ = ["STRUCTURAL", "Structural", "entry", "register", "unbroadcast", "unregister"]


@dataclass(frozen=True)
class Structural:
    op: Op
    shape: Callable[[list[Any], dict[str, Any]], Type]
    ref: Callable[..., Any]
    vjp: Callable[..., list[Any]] | None = None
    reads: tuple[int | str, ...] = ()
    zero: str = ""
    groups: tuple[str, ...] = ()
    flops: Callable[[Any, Any], int] | None = None
    precision: str = ""
    strided: tuple[int, ...] | str = ()
    in_place: Callable[[dict[str, Any]], dict[int, int]] | None = None
    family: str = ""

    def reads_strided(self, k: int) -> bool:
        """Does this op's kernel read operand `k` through its strides?"""
        return self.strided == "all" or k in self.strided


STRUCTURAL: dict[Op, Structural] = {}
PRECISIONS = ("", "low", "high", "demanding")


def register(*entries: Structural) -> None:
    """Add entries to the registry and their ops to the groups they name (`ir/attention.py`,
    `ir/adamw.py` and `ir/linear_cross_entropy.py` add the pattern ops')."""
    for e in entries:
        if e.precision not in PRECISIONS:
            raise ValueError(f"{e.op.name}: precision {e.precision!r}, one of {PRECISIONS}")
        STRUCTURAL[e.op] = e
        for group in e.groups:
            getattr(OpGroup, group).add(e.op)


def unregister(op: Op) -> None:
    """Remove an op registered by `register` (a test's toy op)."""
    for group in STRUCTURAL.pop(op).groups:
        getattr(OpGroup, group).discard(op)


def entry(op: Op) -> Structural | None:
    """The structural entry of `op` (None for an arithmetic elementwise op)."""
    return STRUCTURAL.get(op)


def unbroadcast(ct: Any, shape: tuple[int, ...]) -> Any:
    """Sum ct over the axes broadcasting added, so it has `shape`."""
    if ct.shape == shape:
        return ct
    lead = ct.rank - len(shape)
    axes = list(range(lead)) + [lead + i for i, s in enumerate(shape)
                                if s == 1 and ct.shape[lead + i] != 1]
    return ct.sum(axes).reshape(*shape)


def _norm_axes(axes: tuple[int, ...], rank: int) -> tuple[int, ...]:
    return tuple(sorted(a % rank for a in axes))


def _check_index(t: TensorType) -> None:
    if t.dtype != "i64":
        raise ShapeError(f"index operand must be i64, got {t}")


# -- sources ------------------------------------------------------------------------------------

def _input_shape(ts: list, a: dict) -> Type:
    raise ShapeError("INPUT nodes carry an explicit type")


def _mask_keys(a: dict) -> int:
    return sum(length for _, length, _ in a["groups"])


register(
    Structural(Op.INPUT, _input_shape, lambda n, xs, it: None),
    Structural(Op.FULL, lambda ts, a: TensorType(tuple(a["shape"]), a["dtype"]),
               lambda n, xs, it: torch.full(n.attr("shape"), n.attr("value"),
                                            dtype=it.dtype(n.attr("dtype")))),
    Structural(Op.ROPE, lambda ts, a: TensorType((a["count"], a["half"]), a["dtype"]),
               lambda n, xs, it: rope_table(n.attr("kind"), n.attr("start"), n.attr("count"),
                                            n.attr("half"), n.attr("base"),
                                            it.dtype(n.attr("dtype")))),
    Structural(Op.MASK, lambda ts, a: TensorType((a["n_q"], _mask_keys(a)), a["dtype"]),
               lambda n, xs, it: mask_table(n.attr("n_q"), n.attr("q_start"), n.attr("groups"),
                                            it.dtype(n.attr("dtype")))),
)


# -- cast, reductions, contraction --------------------------------------------------------------

def _reduce_shape(ts: list, a: dict) -> TensorType:
    (t,) = ts
    axes = _norm_axes(a["axes"], t.rank)
    if a.get("keepdim", False):
        shape = tuple(1 if i in axes else s for i, s in enumerate(t.shape))
    else:
        shape = tuple(s for i, s in enumerate(t.shape) if i not in axes)
    return TensorType(shape, t.dtype)


def _sum_vjp(b, a, xs, y, ct):
    x = xs[0]
    keep = tuple(1 if i in a["axes"] else s for i, s in enumerate(x.shape))
    return [ct.reshape(*keep).expand(*x.shape)]


def _amax_vjp(b, a, xs, y, ct):
    x, axes = xs[0], a["axes"]
    keep_shape = tuple(1 if i in axes else s for i, s in enumerate(x.shape))
    yk, ck = y.reshape(*keep_shape), ct.reshape(*keep_shape)
    hit = 1.0 - x.b.op(Op.GT, yk.expand(*x.shape), x)            # 1 where x == max
    return [hit * ck / hit.sum(axes, keepdim=True)]


def _einsum_shape(ts: list, a: dict) -> TensorType:
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


def _einsum_vjp_one(b, spec: str, xs: list, ct, k: int):
    lhs, out = spec.split("->")
    terms = lhs.split(",")
    term = terms[k]
    others = [(t, x) for j, (t, x) in enumerate(zip(terms, xs)) if j != k]
    avail = set(out).union(*[set(t) for t, _ in others]) if others else set(out)
    kept = "".join(ch for ch in term if ch in avail)
    g = b.einsum(",".join([out] + [t for t, _ in others]) + "->" + kept,
                 ct, *[x for _, x in others])
    if kept != term:               # letters only this operand has: the output is constant in them
        shape = xs[k].shape
        g = g.reshape(*[shape[i] if ch in avail else 1 for i, ch in enumerate(term)])
        g = g.expand(*shape)
    return g


register(
    Structural(Op.CAST, lambda ts, a: TensorType(ts[0].shape, a["dtype"]),
               lambda n, xs, it: xs[0].to(it.dtype(n.attr("dtype"))),
               lambda b, a, xs, y, ct: [b.op(Op.CAST, ct, dtype=xs[0].dtype)], zero="all"),
    Structural(Op.SUM, _reduce_shape,
               lambda n, xs, it: torch.sum(xs[0], dim=tuple(n.attr("axes")),
                                           keepdim=n.attr("keepdim")),
               _sum_vjp, zero="all"),
    Structural(Op.AMAX, _reduce_shape,
               lambda n, xs, it: torch.amax(xs[0], dim=tuple(n.attr("axes")),
                                            keepdim=n.attr("keepdim")),
               _amax_vjp, reads=(0, "out")),
    Structural(Op.EINSUM, _einsum_shape,
               lambda n, xs, it: torch.einsum(n.attr("spec"), *xs),
               lambda b, a, xs, y, ct: [_einsum_vjp_one(b, a["spec"], xs, ct, k)
                                        for k in range(len(xs))],
               reads=("all",), zero="any"),
)


# -- movement -----------------------------------------------------------------------------------

def _reshape_shape(ts: list, a: dict) -> TensorType:
    (t,) = ts
    shape = tuple(a["shape"])
    if TensorType(shape).numel != t.numel:
        raise ShapeError(f"cannot reshape {t} to {list(shape)}")
    return TensorType(shape, t.dtype)


def _permute_shape(ts: list, a: dict) -> TensorType:
    (t,) = ts
    perm = tuple(a["perm"])
    if sorted(perm) != list(range(t.rank)):
        raise ShapeError(f"perm {list(perm)} is not a permutation of rank {t.rank}")
    return TensorType(tuple(t.shape[p] for p in perm), t.dtype)


def _expand_shape(ts: list, a: dict) -> TensorType:
    (t,) = ts
    shape = tuple(a["shape"])
    if broadcast_shapes(t.shape, shape) != shape:
        raise ShapeError(f"cannot expand {t} to {list(shape)}")
    return TensorType(shape, t.dtype)


def _slice_shape(ts: list, a: dict) -> TensorType:
    (t,) = ts
    ax = a["axis"] % t.rank
    start, stop = a["start"], a["stop"]
    if not 0 <= start <= stop <= t.shape[ax]:
        raise ShapeError(f"slice [{start}:{stop}] out of range for axis {ax} of {t}")
    shape = list(t.shape)
    shape[ax] = stop - start
    return TensorType(tuple(shape), t.dtype)


def _pad_shape(ts: list, a: dict) -> TensorType:
    (t,) = ts
    ax = a["axis"] % t.rank
    shape = list(t.shape)
    shape[ax] += a["before"] + a["after"]
    return TensorType(tuple(shape), t.dtype)


def _pad_ref(n, xs, it):
    x = xs[0]
    ax = n.attr("axis") % x.dim()
    spec = [0, 0] * (x.dim() - ax - 1) + [n.attr("before"), n.attr("after")]
    return torch.nn.functional.pad(x, spec)


def _concat_shape(ts: list, a: dict) -> TensorType:
    ax = a["axis"] % ts[0].rank
    for t in ts[1:]:
        if t.rank != ts[0].rank or t.dtype != ts[0].dtype or any(
                s != r for i, (s, r) in enumerate(zip(t.shape, ts[0].shape)) if i != ax):
            raise ShapeError(f"cannot concat {ts[0]} and {t} on axis {ax}")
    shape = list(ts[0].shape)
    shape[ax] = sum(t.shape[ax] for t in ts)
    return TensorType(tuple(shape), ts[0].dtype)


def _concat_vjp(b, a, xs, y, ct):
    ax, out, start = a["axis"], [], 0
    for x in xs:
        out.append(ct.slice(ax, start, start + x.shape[ax]))
        start += x.shape[ax]
    return out


register(
    Structural(Op.RESHAPE, _reshape_shape, lambda n, xs, it: xs[0].reshape(n.attr("shape")),
               lambda b, a, xs, y, ct: [ct.reshape(*xs[0].shape)], zero="all"),
    Structural(Op.PERMUTE, _permute_shape, lambda n, xs, it: xs[0].permute(*n.attr("perm")),
               lambda b, a, xs, y, ct: [ct.permute(*[a["perm"].index(i)
                                                     for i in range(len(a["perm"]))])],
               zero="all"),
    Structural(Op.EXPAND, _expand_shape, lambda n, xs, it: xs[0].expand(*n.attr("shape")),
               lambda b, a, xs, y, ct: [unbroadcast(ct, xs[0].shape)], zero="all"),
    Structural(Op.SLICE, _slice_shape,
               lambda n, xs, it: xs[0].narrow(n.attr("axis"), n.attr("start"),
                                              n.attr("stop") - n.attr("start")),
               lambda b, a, xs, y, ct: [ct.pad(a["axis"], a["start"],
                                               xs[0].shape[a["axis"]] - a["stop"])],
               zero="all"),
    Structural(Op.PAD, _pad_shape, _pad_ref,
               lambda b, a, xs, y, ct: [ct.slice(a["axis"], a["before"],
                                                 ct.shape[a["axis"]] - a["after"])],
               zero="all"),
    Structural(Op.CONCAT, _concat_shape,
               lambda n, xs, it: torch.cat(xs, dim=n.attr("axis")), _concat_vjp, zero="all"),
)


# -- gathers and their transposes ---------------------------------------------------------------

def _take_shape(ts: list, a: dict) -> TensorType:
    table, idx = ts
    _check_index(idx)
    return TensorType(idx.shape + table.shape[1:], table.dtype)


def _index_add_shape(ts: list, a: dict) -> TensorType:
    grad, idx = ts
    _check_index(idx)
    if grad.shape[: idx.rank] != idx.shape:
        raise ShapeError(f"INDEX_ADD grad {grad} does not start with index shape {idx.shape}")
    return TensorType((a["rows"],) + grad.shape[idx.rank:], a.get("dtype", grad.dtype))


def _index_add_ref(n, xs, it):
    grad, idx = xs
    rest = grad.shape[idx.dim():]
    out = torch.zeros((n.attr("rows"),) + tuple(rest), dtype=it.dtype(n.type.dtype))
    return out.index_add(0, idx.reshape(-1), grad.reshape((-1,) + tuple(rest)).to(out.dtype))


def _as(b: Any, v: Any, dtype: str) -> Any:
    """`v` in `dtype` (a CAST where it differs: INDEX_ADD may sum a narrower gradient)."""
    return v if v.dtype == dtype else b.op(Op.CAST, v, dtype=dtype)


def _take_along_shape(ts: list, a: dict) -> TensorType:
    x, idx = ts
    _check_index(idx)
    if x.shape[:-1] != idx.shape:
        raise ShapeError(f"TAKE_ALONG index {idx} must match {x} without its last axis")
    return TensorType(idx.shape, x.dtype)


def _scatter_along_shape(ts: list, a: dict) -> TensorType:
    grad, idx = ts
    _check_index(idx)
    if grad.shape != idx.shape:
        raise ShapeError(f"SCATTER_ALONG grad {grad} and index {idx} differ in shape")
    return TensorType(grad.shape + (a["size"],), grad.dtype)


def _scatter_along_ref(n, xs, it):
    grad, idx = xs
    out = torch.zeros(tuple(grad.shape) + (n.attr("size"),), dtype=grad.dtype)
    return out.scatter_add(-1, idx.unsqueeze(-1), grad.unsqueeze(-1))


register(
    Structural(Op.TAKE, _take_shape, lambda n, xs, it: xs[0][xs[1]],
               lambda b, a, xs, y, ct: [b.op(Op.INDEX_ADD, ct, xs[1], rows=xs[0].shape[0]),
                                        None], reads=(1,)),
    Structural(Op.INDEX_ADD, _index_add_shape, _index_add_ref,
               lambda b, a, xs, y, ct: [_as(b, b.take(ct, xs[1]), xs[0].dtype), None],
               reads=(1,), zero="first", strided=(1,), family="segment_sum"),
    Structural(Op.TAKE_ALONG, _take_along_shape,
               lambda n, xs, it: torch.gather(xs[0], -1, xs[1].unsqueeze(-1)).squeeze(-1),
               lambda b, a, xs, y, ct: [b.op(Op.SCATTER_ALONG, ct, xs[1],
                                             size=xs[0].shape[-1]), None], reads=(1,)),
    Structural(Op.SCATTER_ALONG, _scatter_along_shape, _scatter_along_ref,
               lambda b, a, xs, y, ct: [b.take_along(ct, xs[1]), None], reads=(1,),
               zero="first", family="scatter_along"),
)


# -- scans --------------------------------------------------------------------------------------

def _cumsum_ref(n, xs, it):
    x, ax = xs[0], n.attr("axis")
    if n.attr("reverse"):
        return torch.flip(torch.cumsum(torch.flip(x, (ax,)), ax), (ax,))
    return torch.cumsum(x, ax)


def scan_signature(ts: list[Type], a: dict[str, Any]) -> Type:
    """Type of a SCAN node from its operand types; checks the body's signature (verify rule 8)."""
    body = a["body"]
    if a.get("role", "loop") not in SCAN_ROLES:
        raise ShapeError(f"scan role {a['role']!r}: one of {SCAN_ROLES}")
    nc, nx_, length = a["n_carry"], a["n_xs"], a["length"]
    carries, xs, consts = ts[:nc], ts[nc:nc + nx_], ts[nc + nx_:]
    expected = list(carries)
    for x in xs:
        if not isinstance(x, TensorType) or x.rank == 0 or x.shape[0] != length:
            raise ShapeError(f"scan xs operand {x} must have leading axis length {length}")
        expected.append(TensorType(x.shape[1:], x.dtype))
    expected += consts
    got = [body.node(i).type for i in body.inputs]
    if got != expected:
        raise ShapeError(f"scan body inputs {[str(t) for t in got]} do not match "
                         f"{[str(t) for t in expected]}")
    outs = [body.node(i).type for _, i in body.outputs]
    if outs[:nc] != list(carries):
        raise ShapeError(f"scan body carries out {[str(t) for t in outs[:nc]]} do not match "
                         f"carries in {[str(t) for t in carries]}")
    ys = [TensorType((length,) + t.shape, t.dtype) for t in outs[nc:]]
    return tuple(carries) + tuple(ys)


def scan_ref(n, xs, it) -> tuple:
    """The scan's reference semantics: the body run `length` times by the interpreter."""
    a = n.attr_dict
    nc, nx_, length, body = a["n_carry"], a["n_xs"], a["length"], a["body"]
    carries, seqs, consts = list(xs[:nc]), xs[nc:nc + nx_], xs[nc + nx_:]
    ys: list[list] = []
    steps = range(length - 1, -1, -1) if a.get("reverse", False) else range(length)
    for t in steps:
        outs = it.run(body, carries + [x[t] for x in seqs] + list(consts))
        carries = outs[:nc]
        ys.append(outs[nc:])
    if a.get("reverse", False):
        ys.reverse()
    n_y = len(body.outputs) - nc
    return tuple(carries) + tuple(torch.stack([y[k] for y in ys]) for k in range(n_y))


def _item_shape(ts: list, a: dict) -> Type:
    (t,) = ts
    if not isinstance(t, tuple):
        raise ShapeError("ITEM needs a tuple-typed input")
    return t[a["index"]]


register(
    Structural(Op.CUMSUM, lambda ts, a: ts[0], _cumsum_ref,
               lambda b, a, xs, y, ct: [ct.cumsum(a["axis"], reverse=not a["reverse"])],
               zero="all", precision="demanding"),
    Structural(Op.SCAN, scan_signature, scan_ref, None, reads=("all",), strided="all",
               family="scan"),
    Structural(Op.ITEM, _item_shape, lambda n, xs, it: xs[0][n.attr("index")]),
)
