"""Attention lowering: sliding-window causal attention with persistent tokens (attn, mag,
mal) and the memory-as-context attention over [persistent ‖ h ‖ u] (mac).

Letters: b batch, h heads, q query position, k key position, e head width.
"""
from __future__ import annotations

import math

from titanc.ir import Builder, Value

from .nn import merge_heads, rope, softmax_last, split_heads


def _persistent_kv(p: dict[str, Value], heads: int, B: int) -> tuple[Value, Value] | None:
    if "attn_persistent" not in p:
        return None
    pers = p["attn_persistent"]                                   # (P, D)
    P, D = pers.shape
    kv = []
    for w in ("attn_wk", "attn_wv"):
        x = (pers @ p[w]).reshape(P, heads, D // heads).permute(1, 0, 2)   # (H, P, e)
        kv.append(x.reshape(1, heads, P, D // heads).expand(B, heads, P, D // heads))
    return kv[0], kv[1]


def _attend(q: Value, k: Value, v: Value, bias: Value) -> Value:
    # q (B, H, Tq, e), k/v (B, H, Tk, e), bias (Tq, Tk) -> (B, H, Tq, e)
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = q.b.einsum("bhqe,bhke->bhqk", q, k) * scale + bias
    return q.b.einsum("bhqk,bhke->bhqe", softmax_last(scores), v)


def swa(b: Builder, u: Value, p: dict[str, Value], heads: int, window: int) -> Value:
    """SWA(u): every query sees all persistent keys and the last `window` positions."""
    B, T, D = u.shape
    q = rope(b, split_heads(u @ p["attn_wq"], heads))             # (B, H, T, e)
    k = rope(b, split_heads(u @ p["attn_wk"], heads))
    v = split_heads(u @ p["attn_wv"], heads)
    groups = [("causal", T, window)]
    pkv = _persistent_kv(p, heads, B)
    if pkv is not None:
        k, v = b.concat([pkv[0], k], 2), b.concat([pkv[1], v], 2)
        groups.insert(0, ("all", pkv[0].shape[2], None))
    o = _attend(q, k, v, b.mask(T, 0, groups, u.dtype))
    return merge_heads(o) @ p["attn_wo"]                         # (B, T, D)


def mac_attention(b: Builder, u: Value, h: Value, p: dict[str, Value], heads: int) -> Value:
    """Causal attention of segment u over [persistent ‖ h ‖ u]; h_j, u_j visible for j ≤ i."""
    B, S, D = u.shape
    q = rope(b, split_heads(u @ p["attn_wq"], heads))             # (B, H, S, e)
    ks = [rope(b, split_heads(x @ p["attn_wk"], heads)) for x in (h, u)]
    vs = [split_heads(x @ p["attn_wv"], heads) for x in (h, u)]
    groups = [("causal", S, None), ("causal", S, None)]
    pkv = _persistent_kv(p, heads, B)
    if pkv is not None:
        ks, vs = [pkv[0]] + ks, [pkv[1]] + vs
        groups.insert(0, ("all", pkv[0].shape[2], None))
    o = _attend(q, b.concat(ks, 2), b.concat(vs, 2), b.mask(S, 0, groups, u.dtype))
    return merge_heads(o) @ p["attn_wo"]
