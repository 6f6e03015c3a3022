"""Primitives of docs/semantics.md "Conventions", written out in plain torch.

Ein notation (shape comments):
    B batch, T time, D model width, H heads (attention or memory), C per-head width,
    K conv taps, F FFN hidden width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

EPS = 1e-6


def rmsnorm(x: Tensor, w: Tensor) -> Tensor:
    # x (..., D), w (D,)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def l2norm(u: Tensor) -> Tensor:
    # normalise over the last (head channel) axis
    return u * torch.rsqrt(u.pow(2).sum(-1, keepdim=True) + EPS)


def silu(z: Tensor) -> Tensor:
    return z * torch.sigmoid(z)


def dwconv(u: Tensor, w: Tensor, doc: Tensor | None = None) -> Tensor:
    """Causal depthwise conv with zero history: out[b,t,c] = sum_j w[c,j] u[b, t-(K-1)+j, c].
    `doc` (B, T) int, each token's document start in u's positions: a tap reading a position
    before it reads 0 (the conv history resets at a document start)."""
    # u (B, T, D), w (D, K)
    T, K = u.shape[1], w.shape[1]
    padded = F.pad(u, (0, 0, K - 1, 0))  # (B, K-1+T, D); padded[:, s] = u[:, s-(K-1)]
    out = torch.zeros_like(u)
    for j in range(K):
        term = w[:, j] * padded[:, j : j + T]  # (B, T, D)
        if doc is not None:
            src = torch.arange(T) - (K - 1) + j  # (T,) the position tap j reads
            term = term * (src[None, :] >= doc)[..., None].to(u.dtype)
        out = out + term
    return out


def rope(x: Tensor, pos: Tensor) -> Tensor:
    """Rotate halves: [x1 cos a - x2 sin a, x1 sin a + x2 cos a], a = p * 10000^(-2j/C)."""
    # x (..., T, C), pos (T,) or, per batch element, (B, T) with x (B, H, T, C)
    C = x.shape[-1]
    half = C // 2
    inv = 10000.0 ** (-2.0 * torch.arange(half, dtype=x.dtype) / C)  # (C/2,)
    a = pos.to(x.dtype)[..., None] * inv  # (T, C/2) or (B, T, C/2)
    if a.dim() == 3:
        a = a[:, None]  # (B, 1, T, C/2)
    cos, sin = torch.cos(a), torch.sin(a)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def split_heads(x: Tensor, heads: int) -> Tensor:
    # (B, T, D) -> (B, H, T, C)
    B, T, D = x.shape
    return x.view(B, T, heads, D // heads).transpose(1, 2)


def merge_heads(x: Tensor) -> Tensor:
    # (B, H, T, C) -> (B, T, H*C)
    B, H, T, C = x.shape
    return x.transpose(1, 2).reshape(B, T, H * C)


def ffn(p: dict[str, Tensor], u: Tensor) -> Tensor:
    # SwiGLU: (silu(u W1) * (u W3)) W2;  u (B, T, D) -> (B, T, F) -> (B, T, D)
    return (silu(u @ p["ffn_w1"]) * (u @ p["ffn_w3"])) @ p["ffn_w2"]


def layer_params(params: dict[str, Tensor], l: int) -> dict[str, Tensor]:
    """Slice layer l out of the stacked `layers.*` parameters, dropping the prefix."""
    return {k[len("layers.") :]: v[l] for k, v in params.items() if k.startswith("layers.")}
