"""Attention lowering, one definition for training and decoding: the queries of u attend over
[persistent ‖ history₀ ‖ new keys of source₀ ‖ history₁ ‖ new keys of source₁ ‖ …].

Sliding-window attention (attn, mag, mal) has one source, u; memory-as-context attention (mac)
has two, the memory read h and the segment u. Training passes no history and a compiled mask;
decoding (`decode._Step`) passes each source's cached keys/values as its history, the host's
visibility bias and RoPE tables at the tokens' positions, and stores the new keys/values.

Letters: b batch, h heads, q query position, k key position, e head width.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

from titanc.ir import Builder, Value

from titanc.model.documents import attention_bias, positions, rope_tables
from titanc.model.nn import merge_heads, rope, rotate, softmax_last, split_heads

Rotate = Callable[[Value], Value]          # RoPE of (B, H, T, e) at the tokens' positions
KV = tuple[Value, Value]


def _persistent_kv(p: dict[str, Value], heads: int, B: int) -> KV | None:
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
    # q (B, H, Tq, e), k/v (B, H, Tk, e), bias broadcastable to (B, H, Tq, Tk) -> (B, H, Tq, e)
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = q.b.einsum("bhqe,bhke->bhqk", q, k) * scale + bias
    return q.b.einsum("bhqk,bhke->bhqe", softmax_last(scores), v)


def attention(b: Builder, u: Value, p: dict[str, Value], heads: int, sources: Sequence[Value],
              bias: Callable[[int], Value], rotate: Rotate,
              history: Sequence[KV] | None = None) -> tuple[Value, list[KV]]:
    """Queries of u (B, Tq, D) over the persistent keys, then for each source its history
    (decoding) and its own keys. `bias(P)` is the additive visibility for P persistent keys.
    Returns the output projected by W_O (B, Tq, D) and each source's new (k, v) (B, H, T, e)."""
    q = rotate(split_heads(u @ p["attn_wq"], heads))
    new = [(rotate(split_heads(x @ p["attn_wk"], heads)), split_heads(x @ p["attn_wv"], heads))
           for x in sources]
    pkv = _persistent_kv(p, heads, u.shape[0])
    keys, values = ([pkv[0]], [pkv[1]]) if pkv is not None else ([], [])
    for j, (k, v) in enumerate(new):
        if history is not None:
            keys.append(history[j][0])
            values.append(history[j][1])
        keys.append(k)
        values.append(v)
    k, v = (keys[0], values[0]) if len(keys) == 1 else (b.concat(keys, 2), b.concat(values, 2))
    o = _attend(q, k, v, bias(pkv[0].shape[2] if pkv is not None else 0))
    return merge_heads(o) @ p["attn_wo"], new


def _groups(P: int, groups: list[tuple[str, int, int | None]]) -> list[tuple[str, int, int | None]]:
    return ([("all", P, None)] if P else []) + groups


def _masked(b: Builder, n_q: int, groups: list[tuple[str, int, int | None]], dtype: str,
            doc: Value | None) -> Callable[[int], Value]:
    """The visibility bias for P persistent keys: the static MASK, plus, with `doc` (B, n_q)
    (each query's document start in the keys' positions), −BIG on earlier documents' keys."""
    def bias(P: int) -> Value:
        mask = b.mask(n_q, 0, _groups(P, groups), dtype)
        return mask if doc is None else mask + attention_bias(doc, P, len(groups))
    return bias


def _rotation(b: Builder, doc: Value | None, start: Value | None = None) -> Rotate:
    """RoPE at positions 0.. of the sequence, or, with `doc` (B, T), at each token's position
    in its document, t − `start` (default: doc)."""
    if doc is None:
        return lambda x: rope(b, x)
    rel = positions(doc, doc.shape[1]).reshape(1, doc.shape[1]) - (doc if start is None
                                                                    else start)
    tables: list[tuple[Value, Value]] = []

    def rot(x: Value) -> Value:
        if not tables:
            tables.append(rope_tables(rel, x.shape[-1] // 2))
        return rotate(b, x, *tables[0])
    return rot


def swa(b: Builder, u: Value, p: dict[str, Value], heads: int, window: int,
        doc: Value | None = None) -> Value:
    """SWA(u): every query sees all persistent keys and the last `window` positions (of its
    own document, with `doc`, and RoPE at positions in the document)."""
    T = u.shape[1]
    out, _ = attention(b, u, p, heads, [u], _masked(b, T, [("causal", T, window)], u.dtype, doc),
                       _rotation(b, doc))
    return out                                                    # (B, T, D)


def mac_attention(b: Builder, u: Value, h: Value, p: dict[str, Value], heads: int,
                  doc: Value | None = None) -> Value:
    """Causal attention of segment u over [persistent ‖ h ‖ u]; h_j, u_j visible for j ≤ i
    (and j ≥ doc[i], `doc` (B, S) each query's document start in segment positions)."""
    S = u.shape[1]
    start = None if doc is None else b.maximum(doc, 0.0)   # the segment's or the document's
    out, _ = attention(b, u, p, heads, [h, u],
                       _masked(b, S, [("causal", S, None)] * 2, u.dtype, doc),
                       _rotation(b, doc, start))
    return out                                                    # (B, S, D)
