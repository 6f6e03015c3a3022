"""Rules of the ADAMW pattern op: the whole optimizer step (global-norm clipping and AdamW over
every parameter, `passes/optimizer.py`) as one node, made by `passes/fused_adamw.py`.

    ADAMW(param_0…, grad_0…, m_0…, v_0…, lr, step, grad_scale)
        -> (param_0'…, m_0'…, v_0'…, grad_norm)            n = attr `n` tensors per list

attrs: n, beta1, beta2, eps, weight_decay, clip (0: none), decay (per parameter). The
reference below is the optimizer graph's arithmetic in the same order (the float64 oracle).
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from titanc.ir.ops import Op
from titanc.ir.shapes import ShapeError
from titanc.ir.structural import Structural, register
from titanc.ir.types import TensorType


def _adamw_type(ts: list, a: dict) -> tuple[TensorType, ...]:
    n = a["n"]
    if len(ts) != 4 * n + 3 or len(a["decay"]) != n:
        raise ShapeError(f"ADAMW over n={n} parameters takes {4 * n + 3} inputs and n decay "
                         f"flags, got {len(ts)} and {len(a['decay'])}")
    for k in range(n):
        if not ts[k] == ts[n + k] == ts[2 * n + k] == ts[3 * n + k]:
            raise ShapeError(f"ADAMW parameter {k}: param, grad, m, v types differ")
    if any(t.shape != () for t in ts[4 * n:]):
        raise ShapeError("ADAMW lr, step and grad_scale must be scalars")
    return (*ts[:n], *ts[2 * n:4 * n], TensorType((), ts[0].dtype))


def adamw_ref(node: Any, xs: list[Tensor], it: Any) -> tuple[Tensor, ...]:
    a = node.attr_dict
    n, beta1, beta2 = a["n"], a["beta1"], a["beta2"]
    params, grads, ms, vs = (xs[k * n:(k + 1) * n] for k in range(4))
    lr, step, scale = xs[4 * n:]
    grads = [g * scale for g in grads]
    norm = sum((g * g).sum() for g in grads).sqrt()
    if a["clip"] > 0:
        factor = -torch.maximum(-(a["clip"] / (norm + 1e-6)), torch.tensor(-1.0, dtype=norm.dtype))
        grads = [g * factor for g in grads]
    bc1 = 1.0 - (step * math.log(beta1)).exp()
    bc2 = 1.0 - (step * math.log(beta2)).exp()
    new_p, new_m, new_v = [], [], []
    for w, g, m, v, decay in zip(params, grads, ms, vs, a["decay"]):
        m = m * beta1 + g * (1.0 - beta1)
        v = v * beta2 + g * g * (1.0 - beta2)
        upd = (m / bc1) / ((v / bc2).sqrt() + a["eps"])
        if decay and a["weight_decay"] > 0:
            w = w - w * (lr * a["weight_decay"])
        new_p.append(w - upd * lr)
        new_m.append(m)
        new_v.append(v)
    return (*new_p, *new_m, *new_v, norm)


def _in_place(a: dict) -> dict[int, int]:
    """New params, ms, vs are written over the params, ms, vs operands (grads are skipped)."""
    n = a["n"]
    return {k: k if k < n else k + n for k in range(3 * n)}


def _flops(node: Any, g: Any) -> int:
    """About 16 per parameter element: norm, clip, moments, update."""
    return 16 * sum(g.node(i).type.numel for i in node.inputs[:node.attr("n")])


# one template kernel over dense flat regions, float32, updating parameters and moments in place
register(Structural(Op.ADAMW, _adamw_type, adamw_ref, groups=("PATTERN",), flops=_flops,
                    precision="high", in_place=_in_place, family="adamw_multi"))
