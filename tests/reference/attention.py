"""Sliding-window attention over [persistent ‖ sequence]: `SWA(u)` of docs/semantics.md.

Used by the attn, mag and mal blocks (MAC's attention lives in mac.py).

Ein notation: B batch, T query time, S key time (P persistent + T sequence), D model
width, H heads, C = D / H head width, P persistent tokens.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .ops import merge_heads, rope, split_heads


def attend(q: Tensor, k: Tensor, v: Tensor, visible: Tensor) -> Tensor:
    """Softmax attention restricted to the visible keys."""
    # q (B, H, T, C), k/v (B, H, S, C), visible (T, S) bool
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (B, H, T, S)
    scores = scores.masked_fill(~visible, float("-inf"))
    return scores.softmax(dim=-1) @ v  # (B, H, T, C)


def persistent_kv(p: dict[str, Tensor], B: int, heads: int) -> tuple[Tensor, Tensor] | None:
    """Keys and values of the persistent tokens (no rope), or None when P = 0."""
    if "attn_persistent" not in p:
        return None
    pm = p["attn_persistent"][None]  # (1, P, D)
    pk = split_heads(pm @ p["attn_wk"], heads).expand(B, -1, -1, -1)  # (B, H, P, C)
    pv = split_heads(pm @ p["attn_wv"], heads).expand(B, -1, -1, -1)  # (B, H, P, C)
    return pk, pv


def same_document(visible: Tensor, doc: Tensor | None, start: int = 0) -> Tensor:
    """`visible` (T, S) restricted to keys in the query's document: (B, 1, T, S) with `doc`
    (B, T) each query's document start; key j sits at position start + j."""
    if doc is None:
        return visible
    j = start + torch.arange(visible.shape[1])
    return visible & (j[None, None, :] >= doc[:, :, None])[:, None]


def swa(p: dict[str, Tensor], u: Tensor, cfg, doc: Tensor | None = None) -> Tensor:
    """Query i sees every persistent key and sequence keys j with i - W < j <= i (and, with
    `doc` (B, T) each token's document start, j >= doc[i]; RoPE then at i - doc[i])."""
    # u (B, T, D)
    B, T, D = u.shape
    H = cfg.attention.heads
    W = cfg.attention.window
    pos = torch.arange(T)
    rel = pos if doc is None else pos - doc  # RoPE at positions in the document
    q = rope(split_heads(u @ p["attn_wq"], H), rel)  # (B, H, T, C)
    k = rope(split_heads(u @ p["attn_wk"], H), rel)  # (B, H, T, C)
    v = split_heads(u @ p["attn_wv"], H)  # (B, H, T, C)

    i, j = pos[:, None], pos[None, :]
    visible = j <= i  # (T, T)
    if W is not None and W > 0:
        visible = visible & (j > i - W)
    visible = same_document(visible, doc)
    pkv = persistent_kv(p, B, H)
    if pkv is not None:
        k = torch.cat([pkv[0], k], dim=2)  # (B, H, P+T, C)
        v = torch.cat([pkv[1], v], dim=2)
        ones = torch.ones(*visible.shape[:-1], pkv[0].shape[2], dtype=torch.bool)
        visible = torch.cat([ones, visible], dim=-1)
    return merge_heads(attend(q, k, v, visible)) @ p["attn_wo"]  # (B, T, D)
