"""Rules of the attention pattern ops: ATTENTION (q, k_1..k_G, v_1..v_G) -> (o, lse) and
ATTENTION_BWD (q, k_1..k_G, v_1..v_G, o, lse, do) -> (dq, dk_1..dk_G, dv_1..dv_G).

The keys and values come one operand per key group of the MASK (`groups`, G of them: the
persistent tokens, the memory output, the segment or sequence keys), each [b, h, length of
the group, e]: no kernel concatenates them, every implementation reads each group through its
own strides (a permuted or batch-expanded projection is a strided view), and the backward
writes one dk and one dv per group.

`passes/flash_attention.py` rewrites `softmax(q kᵀ · scale + MASK) v` into ATTENTION; its
attrs are the scale and the MASK's (`n_q`, `q_start`, `groups`), so the visible (query, key)
pairs are known statically and no [B, H, Tq, Tk] table has to exist. `lse` is the natural
log-sum-exp of each query row's masked, scaled scores: the backward recomputes the
probabilities from it (FlashAttention).

Under bf16 mixed precision q, k, v, o and do (and dq, dk, dv) are bf16 while `lse` is float32:
the scores, softmax and accumulations are float32 inside every implementation (the blocked cpu
loop upcasts, the Triton templates accumulate `tl.dot` in float32, the reference below computes
in float32 and rounds its results to their types). The reference semantics below materialise the scores:
they are the float64 oracle, not a kernel.

Letters: b batch, h heads, q query position, k key position, e head width.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from titanc.ir.ops import Op
from titanc.ir.shapes import ShapeError
from titanc.ir.structural import Structural, register
from titanc.ir.tables import mask_table
from titanc.ir.types import TensorType


def n_groups(a: dict) -> int:
    """G, the number of key groups (and of key operands, and of value operands)."""
    return len(a["groups"])


def split(xs: list, a: dict) -> tuple[Any, list, list, list]:
    """(q, keys per group, values per group, the operands after them) of an attention op."""
    n = n_groups(a)
    return xs[0], list(xs[1:1 + n]), list(xs[1 + n:1 + 2 * n]), list(xs[1 + 2 * n:])


def _check_qkv(q: Any, ks: list, vs: list, a: dict) -> None:
    if not all(isinstance(t, TensorType) and t.rank == 4 for t in (q, *ks, *vs)):
        raise ShapeError("ATTENTION needs rank-4 q, k, v [batch, head, position, width]")
    for (_, length, _), k, v in zip(a["groups"], ks, vs):
        if (q.shape[:2] != k.shape[:2] or k.shape[:3] != v.shape[:3] or q.shape[3] != k.shape[3]
                or v.shape[3] != vs[0].shape[3]):
            raise ShapeError(f"ATTENTION q {q}, k {k}, v {v} disagree")
        if k.shape[2] != length:
            raise ShapeError(f"ATTENTION k {k} does not match its key group of {length} keys")
    if q.shape[2] != a["n_q"]:
        raise ShapeError(f"ATTENTION q {q} does not match n_q={a['n_q']}")


def stat_dtype(dtype: str) -> str:
    """The dtype of the log-sum-exp beside q of `dtype`: float32 under bf16."""
    return "f32" if dtype == "bf16" else dtype


def _attention_type(ts: list, a: dict) -> tuple[TensorType, ...]:
    q, ks, vs, rest = split(ts, a)
    if rest or len(vs) != n_groups(a):
        raise ShapeError(f"ATTENTION takes q and one key and one value per group "
                         f"({1 + 2 * n_groups(a)} operands), got {len(ts)}")
    _check_qkv(q, ks, vs, a)
    if len({t.dtype for t in ts}) != 1:
        raise ShapeError(f"ATTENTION q {q}, k {ks}, v {vs} must share one dtype")
    return (TensorType(q.shape[:3] + vs[0].shape[3:], q.dtype),
            TensorType(q.shape[:3], stat_dtype(q.dtype)))


def _attention_bwd_type(ts: list, a: dict) -> tuple[TensorType, ...]:
    q, ks, vs, rest = split(ts, a)
    if len(rest) != 3:
        raise ShapeError(f"ATTENTION_BWD takes q, a key and a value per group, o, lse, do "
                         f"({4 + 2 * n_groups(a)} operands), got {len(ts)}")
    o, lse, do = rest
    _check_qkv(q, ks, vs, a)
    v = vs[0]
    if o.shape != do.shape or o.shape != q.shape[:3] + v.shape[3:] or lse.shape != q.shape[:3]:
        raise ShapeError(f"ATTENTION_BWD o {o}, lse {lse}, do {do} do not match q {q}, v {v}")
    if {o.dtype, do.dtype} != {q.dtype} or lse.dtype != stat_dtype(q.dtype):
        raise ShapeError(f"ATTENTION_BWD o {o}, do {do} must have q's dtype and lse {lse} "
                         f"{stat_dtype(q.dtype)}")
    return (q, *ks, *vs)


def scores(q: Tensor, k: Tensor, a: dict) -> Tensor:
    """Scaled, masked scores [b, h, q, k] (the reference path only)."""
    bias = mask_table(a["n_q"], a["q_start"], a["groups"], q.dtype)
    return torch.einsum("bhqe,bhke->bhqk", q, k) * a["scale"] + bias


def _wide(xs: list[Tensor]) -> list[Tensor]:
    """bf16 operands in float32 (the ops compute in float32 under mixed precision)."""
    return [x.float() if x.dtype == torch.bfloat16 else x for x in xs]


def attention_ref(node: Any, xs: list[Tensor], it: Any) -> tuple[Tensor, Tensor]:
    q, ks, vs, _ = split(_wide(xs), node.attr_dict)
    k, v = torch.cat(ks, 2), torch.cat(vs, 2)
    s = scores(q, k, node.attr_dict)
    lse = torch.logsumexp(s, -1)
    o = torch.einsum("bhqk,bhke->bhqe", torch.exp(s - lse[..., None]), v)
    return o.to(xs[0].dtype), lse


def attention_bwd_ref(node: Any, xs: list[Tensor], it: Any) -> tuple[Tensor, ...]:
    a = node.attr_dict
    q, ks, vs, (o, lse, do) = split(_wide(xs), a)
    k, v = torch.cat(ks, 2), torch.cat(vs, 2)
    lengths = [length for _, length, _ in a["groups"]]
    p = torch.exp(scores(q, k, a) - lse[..., None])                   # (b, h, q, k)
    dv = torch.einsum("bhqk,bhqe->bhke", p, do)
    dp = torch.einsum("bhqe,bhke->bhqk", do, v)
    ds = p * (dp - (do * o).sum(-1, keepdim=True))                     # softmax VJP
    dq = torch.einsum("bhqk,bhke->bhqe", ds, k) * a["scale"]
    dk = torch.einsum("bhqk,bhqe->bhke", ds, q) * a["scale"]
    grads = (dq, *torch.split(dk, lengths, 2), *torch.split(dv, lengths, 2))
    return tuple(t.to(x.dtype) for t, x in zip(grads, xs))


def _attention_vjp(b: Any, a: dict, xs: list, y: Any, cts: list) -> list:
    """ATTENTION (q, k_1.., v_1..) -> (o, lse): one ATTENTION_BWD, which recomputes the
    probabilities from the saved log-sum-exp (cotangents: of o; lse is read by the backward
    only); its results are the gradients of q and of every key and value group."""
    ct_o, ct_lse = cts
    if ct_lse is not None:
        raise NotImplementedError("no VJP of ATTENTION through its log-sum-exp output")
    if ct_o is None:
        return [None] * len(xs)
    bwd = b.op(Op.ATTENTION_BWD, *xs, b.item(y, 0), b.item(y, 1), ct_o, **a)
    return [b.item(bwd, i) for i in range(len(xs))]


def visible_pairs(n_q: int, groups: tuple) -> int:
    """(query, key) pairs a MASK's groups let through, for queries 0..n_q-1 (q_start 0)."""
    total = 0
    for kind, length, window in groups:
        if kind == "all":
            total += n_q * length
        else:
            w = length if window is None else window
            total += sum(min(i + 1, w, length) for i in range(n_q))
    return total


def _flops(n: Any, g: Any) -> int:
    """Only the visible (query, key) pairs count: 2·e per pair for q kᵀ and 2·e for p v
    (backward: 2·e each for s, dp, dv, dq, dk)."""
    q = g.node(n.inputs[0]).type.shape
    v = g.node(n.inputs[1 + n_groups(n.attr_dict)]).type.shape     # the first value group
    pairs = q[0] * q[1] * visible_pairs(n.attr("n_q"), n.attr("groups"))
    return pairs * (2 * q[3] + 2 * v[3] if n.op is Op.ATTENTION else 6 * q[3] + 4 * v[3])


# one template kernel each, reading q, k, v through their strides, bf16 operands under mixed
# precision (float32 inside)
_KERNEL = dict(groups=("PATTERN",), flops=_flops, precision="low", strided="all")

register(
    Structural(Op.ATTENTION, _attention_type, attention_ref, _attention_vjp, reads=("all",),
               family="attention_fwd", **_KERNEL),
    Structural(Op.ATTENTION_BWD, _attention_bwd_type, attention_bwd_ref,
               family="attention_bwd", **_KERNEL),
)
