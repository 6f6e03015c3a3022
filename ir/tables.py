"""The host-made tables of ROPE and MASK nodes: one definition, read by the interpreter, both
executors, the scan kernels and the decoding host (its RoPE tables at token positions)."""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from titanc.ir.ops import ROPE_BASE

Tensor = torch.Tensor

__all__ = ["mask_table", "rope_inv_freq", "rope_table"]


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
