"""Rules of the fused LM-head cross-entropy pattern ops:

    LINEAR_CROSS_ENTROPY      (h, head, targets) -> (loss, lse)
    LINEAR_CROSS_ENTROPY_BWD  (h, head, targets, lse, dloss) -> (dh, dhead)

`passes/linear_cross_entropy.py` rewrites the frontend's `lse(h @ headᵀ) − take_along(h @
headᵀ, targets)` into the forward op. Per row r: logits_r = h_r · head (never stored),
lse_r = log Σ_v exp(logits_rv), loss_r = lse_r − logits_r[targets_r]. The backward op
recomputes the logits from h, head and the saved lse: dlogits = (softmax − onehot(targets)) ·
dloss_r, dh = dlogits · head, dhead = dlogitsᵀ · h (transposed for a [d, v] head). Only the
per-row lse is saved between them. The targets are [rows] or [batch, T] (row r is
targets[r // T, r % T]): the [B, T] slice of the token windows is read in place, through its
strides, with no flattening copy.

attrs: `layout` "vd" (a tied embedding [vocab, d]) or "dv" (an untied head [d, vocab]), and
`chunk` (rows per block of the cpu kernel). The reference semantics below materialise the
[rows, vocab] logits: they are the float64 oracle, not a kernel.

Letters: r row (token), d model width, v vocabulary.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from titanc.ir.ops import Op
from titanc.ir.shapes import ShapeError
from titanc.ir.structural import Structural, register
from titanc.ir.types import TensorType

LAYOUTS = ("vd", "dv")


def _check(h: Any, head: Any, targets: Any, a: dict) -> int:
    """The vocabulary size, after checking the operands."""
    if a.get("layout") not in LAYOUTS:
        raise ShapeError(f"LINEAR_CROSS_ENTROPY layout {a.get('layout')!r}: one of {LAYOUTS}")
    if not all(isinstance(t, TensorType) for t in (h, head, targets)) or h.rank != 2 \
            or head.rank != 2 or targets.rank not in (1, 2):
        raise ShapeError("LINEAR_CROSS_ENTROPY needs h [rows, d], head [v, d] or [d, v], "
                         "targets [rows] or [batch, T] (batch · T = rows)")
    d = head.shape[1] if a["layout"] == "vd" else head.shape[0]
    if h.shape[1] != d or targets.numel != h.shape[0] or targets.is_float:
        raise ShapeError(f"LINEAR_CROSS_ENTROPY h {h}, head {head} ({a['layout']}), "
                         f"targets {targets} disagree")
    return head.shape[0] if a["layout"] == "vd" else head.shape[1]


def _type(ts: list, a: dict) -> tuple[TensorType, ...]:
    h, head, targets = ts
    _check(h, head, targets, a)
    row = TensorType(h.shape[:1], h.dtype)
    return (row, row)


def _bwd_type(ts: list, a: dict) -> tuple[TensorType, ...]:
    h, head, targets, lse, dloss = ts
    _check(h, head, targets, a)
    if lse.shape != h.shape[:1] or dloss.shape != h.shape[:1]:
        raise ShapeError(f"LINEAR_CROSS_ENTROPY_BWD lse {lse}, dloss {dloss} must be "
                         f"[{h.shape[0]}]")
    return (h, head)


def logits(h: Tensor, head: Tensor, layout: str) -> Tensor:
    """[rows, vocab] (the reference path only)."""
    return h @ (head.t() if layout == "vd" else head)


def lce_ref(node: Any, xs: list[Tensor], it: Any) -> tuple[Tensor, Tensor]:
    h, head, targets = xs
    targets = targets.reshape(-1)
    z = logits(h, head, node.attr("layout"))
    lse = torch.logsumexp(z, -1)
    return lse - z.gather(1, targets.long()[:, None])[:, 0], lse


def lce_bwd_ref(node: Any, xs: list[Tensor], it: Any) -> tuple[Tensor, Tensor]:
    h, head, targets, lse, dloss = xs
    targets = targets.reshape(-1)
    layout = node.attr("layout")
    p = torch.exp(logits(h, head, layout) - lse[:, None])              # softmax (r, v)
    p[torch.arange(h.shape[0]), targets.long()] -= 1.0                 # − onehot(targets)
    dz = p * dloss[:, None]
    dh = dz @ (head if layout == "vd" else head.t())
    dhead = dz.t() @ h if layout == "vd" else h.t() @ dz
    return dh, dhead


def _vjp(b: Any, a: dict, xs: list, y: Any, cts: list) -> list:
    """(loss, lse) -> one LINEAR_CROSS_ENTROPY_BWD recomputing the logits from the saved lse
    (cotangents: of the per-row loss; lse is read by the backward only)."""
    ct_loss, ct_lse = cts
    if ct_lse is not None:
        raise NotImplementedError("no VJP of LINEAR_CROSS_ENTROPY through its lse output")
    if ct_loss is None:
        return [None, None, None]
    bwd = b.op(Op.LINEAR_CROSS_ENTROPY_BWD, *xs, b.item(y, 1), ct_loss, **a)
    return [b.item(bwd, 0), b.item(bwd, 1), None]


def _flops(n: Any, g: Any) -> int:
    """2·d per logit per dot: the logits (backward: recomputed, then dh and dhead)."""
    rows, head = g.node(n.inputs[0]).type.shape[0], g.node(n.inputs[1]).type.shape
    return 2 * rows * head[0] * head[1] * (1 if n.op is Op.LINEAR_CROSS_ENTROPY else 3)


# one template kernel each, reading every operand through its strides, in float32: the
# forward's h demands float32 of the chain feeding it (the final norm is not rounded to bf16)
register(
    Structural(Op.LINEAR_CROSS_ENTROPY, _type, lce_ref, _vjp, reads=(0, 1, 2),
               groups=("PATTERN",), flops=_flops, precision="demanding", strided="all",
               family="cross_entropy"),
    Structural(Op.LINEAR_CROSS_ENTROPY_BWD, _bwd_type, lce_bwd_ref, groups=("PATTERN",),
               flops=_flops, precision="high", strided="all",
               family="cross_entropy_bwd"),
)
