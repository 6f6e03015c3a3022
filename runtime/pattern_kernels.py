"""The cpu target's pattern kernels (`OpGroup.PATTERN` ops, from `passes/flash_attention.py`):
a blocked loop of out= ATen calls each, writing the op's tuple elements into their planned
ITEM buffers.

    ATTENTION      per block of BLOCK_Q queries: scores of the block against every key, scale,
                   the MASK's additive table, softmax, times v; the block's log-sum-exp is kept
                   for the backward. Only a [B, H, BLOCK_Q, Tk] block exists, in scratch that
                   every block reuses, so no [B, H, Tq, Tk] tensor is ever allocated.
    ATTENTION_BWD  per block: the probabilities recomputed from q, k and the saved log-sum-exp,
                   dv and dk accumulated over blocks, dq written per block (FlashAttention-2's
                   backward, ordered by query block).
    ADAMW          the optimizer step in place over the program's flat parameter, gradient and
                   moment regions (per parameter when they are not flat).

Under bf16 mixed precision q, k, v, o, do (and dq, dk, dv) are bf16 and the log-sum-exp is
float32: each kernel upcasts its bf16 operands into float32 scratch (k and v once, a query
block's rows per block), computes scores, softmax and sums in float32, accumulates dk and dv in
float32 scratch and rounds each result once, into its bf16 buffer.

Work is that of the direct form (every (query, key) pair of a block is computed, the mask
zeroes the invisible ones). Every tensor is planned storage or scratch: a run allocates
nothing. A tuple element no later kernel reads (the forward graph's log-sum-exp) goes to
scratch.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import Tensor

from titanc.ir import Node, Op
from titanc.ir.tables import mask_table
from titanc.ir.types import TensorType

if TYPE_CHECKING:
    from .executor import _Builder

Step = Callable[[], Any]
BLOCK_Q = 64           # queries per block: scratch is O(BLOCK_Q · keys), not O(queries · keys)


def pattern_steps(b: "_Builder", n: Node, outputs: set[int]) -> list[Step]:
    """The steps of pattern op `n`; binds the ITEMs later kernels read to their buffers."""
    xs = [b.operand(i) for i in n.inputs]
    outs: list[Tensor] = []
    items = {b.g.node(u).attr("index"): u for u in b.g.users(n.id) if u in outputs}
    for k, t in enumerate(n.type):
        outs.append(b.located(items[k]) if k in items else b.scratch.alloc(t))
    for k, u in items.items():
        b.val[u] = outs[k]
    if n.op is Op.ATTENTION:
        return _attention(b, n, xs, outs)
    if n.op is Op.ATTENTION_BWD:
        return _attention_bwd(b, n, xs, outs)
    if n.op is Op.ADAMW:
        return _adamw(b, n, xs, outs)
    raise NotImplementedError(f"the cpu target has no kernel for pattern op {n.op.name}")


def _bias(b: "_Builder", n: Node, dtype: torch.dtype) -> Tensor | None:
    """The additive mask table [Tq, Tk], or None when every query sees every key."""
    a = n.attr_dict
    if all(kind == "all" for kind, _, _ in a["groups"]):
        return None
    return b._const(mask_table(a["n_q"], a["q_start"], a["groups"], dtype))


def _blocks(n_q: int) -> list[tuple[int, int]]:
    return [(i, min(i + BLOCK_Q, n_q)) for i in range(0, n_q, BLOCK_Q)]


def _tmp(b: "_Builder", like: Tensor, *shape: int) -> Tensor:
    """Scratch in the compute dtype beside `like` (float32 for bf16 operands)."""
    dtype = {torch.float64: "f64", torch.float32: "f32", torch.bfloat16: "f32"}[like.dtype]
    return b.scratch.alloc(TensorType(tuple(shape), dtype))


def _wide(b: "_Builder", x: Tensor, steps: list[Step]) -> Tensor:
    """`x` itself, or (bf16) a float32 scratch copy of it that `steps` fill."""
    if x.dtype != torch.bfloat16:
        return x
    t = _tmp(b, x, *x.shape)
    steps.append(lambda t=t, x=x: t.copy_(x))
    return t


def _einsum(b: "_Builder", spec: str, xs: list[Tensor], o: Tensor) -> list[Step]:
    from .executor import _einsum as einsum_steps     # (executor imports this module)
    return einsum_steps(b, spec, xs, o)


def _probabilities(b: "_Builder", n: Node, qb: Tensor, k: Tensor, bias: Tensor | None,
                   i0: int, i1: int, s: Tensor, steps: list[Step]) -> None:
    """s <- scale · qb kᵀ + bias[i0:i1] (the block's masked, scaled scores)."""
    steps += _einsum(b, "bhqe,bhke->bhqk", [qb, k], s)
    scale = n.attr("scale")
    steps.append(lambda: s.mul_(scale))
    if bias is not None:
        rows = bias[i0:i1]
        steps.append(lambda: s.add_(rows))


def _attention(b: "_Builder", n: Node, xs: list[Tensor], outs: list[Tensor]) -> list[Step]:
    q, k, v = xs
    o, lse = outs
    B, H, _, _ = q.shape
    steps: list[Step] = []
    k, v = _wide(b, k, steps), _wide(b, v, steps)
    bias = _bias(b, n, k.dtype)
    for i0, i1 in _blocks(q.shape[2]):
        mark, bq = b.scratch.top, i1 - i0
        s = _tmp(b, q, B, H, bq, k.shape[2])
        m, l = _tmp(b, q, B, H, bq, 1), _tmp(b, q, B, H, bq, 1)
        ob = _tmp(b, q, B, H, bq, v.shape[3])
        _probabilities(b, n, _wide(b, q[:, :, i0:i1], steps), k, bias, i0, i1, s, steps)
        steps += [lambda s=s, m=m: torch.amax(s, -1, keepdim=True, out=m),
                  lambda s=s, m=m: s.sub_(m).exp_(),
                  lambda s=s, l=l: torch.sum(s, -1, keepdim=True, out=l),
                  lambda s=s, l=l: s.div_(l)]
        steps += _einsum(b, "bhqk,bhke->bhqe", [s, v], ob)
        oo, ll = o[:, :, i0:i1], lse[:, :, i0:i1]
        steps += [lambda oo=oo, ob=ob: oo.copy_(ob),
                  lambda l=l, m=m, ll=ll: ll.copy_(l.log_().add_(m).squeeze(-1))]
        b.scratch.top = mark                         # the next block reuses this scratch
    return steps


def _attention_bwd(b: "_Builder", n: Node, xs: list[Tensor], outs: list[Tensor]) -> list[Step]:
    q, k, v, o, lse, do = xs
    dq, dk_out, dv_out = outs
    B, H, _, _ = q.shape
    steps: list[Step] = []
    k, v = _wide(b, k, steps), _wide(b, v, steps)
    # float32 accumulators for bf16 dk, dv (rounded once, after the last block)
    dk = dk_out if dk_out.dtype == k.dtype else _tmp(b, dk_out, *dk_out.shape)
    dv = dv_out if dv_out.dtype == v.dtype else _tmp(b, dv_out, *dv_out.shape)
    bias, scale = _bias(b, n, k.dtype), n.attr("scale")
    steps += [lambda: dk.zero_(), lambda: dv.zero_()]
    for i0, i1 in _blocks(q.shape[2]):
        mark, bq = b.scratch.top, i1 - i0
        qb, dob, ob = (_wide(b, x[:, :, i0:i1], steps) for x in (q, do, o))
        p = _tmp(b, q, B, H, bq, k.shape[2])
        ds = _tmp(b, q, B, H, bq, k.shape[2])
        delta = _tmp(b, q, B, H, bq, 1)
        t_o = _tmp(b, q, B, H, bq, v.shape[3])
        t_q = _tmp(b, q, B, H, bq, q.shape[3])
        t_k, t_v = _tmp(b, q, *k.shape), _tmp(b, q, *v.shape)
        _probabilities(b, n, qb, k, bias, i0, i1, p, steps)
        lb = lse[:, :, i0:i1].unsqueeze(-1)
        steps.append(lambda p=p, lb=lb: p.sub_(lb).exp_())          # p = exp(s - lse)
        steps += _einsum(b, "bhqk,bhqe->bhke", [p, dob], t_v)
        steps.append(lambda t_v=t_v: dv.add_(t_v))
        steps += _einsum(b, "bhqe,bhke->bhqk", [dob, v], ds)        # dp
        steps += [lambda t_o=t_o, dob=dob, ob=ob: torch.mul(dob, ob, out=t_o),
                  lambda t_o=t_o, delta=delta: torch.sum(t_o, -1, keepdim=True, out=delta),
                  lambda ds=ds, p=p, delta=delta: ds.sub_(delta).mul_(p).mul_(scale)]
        steps += _einsum(b, "bhqk,bhke->bhqe", [ds, k], t_q)
        dqb = dq[:, :, i0:i1]
        steps.append(lambda dqb=dqb, t_q=t_q: dqb.copy_(t_q))
        steps += _einsum(b, "bhqk,bhqe->bhke", [ds, qb], t_k)
        steps.append(lambda t_k=t_k: dk.add_(t_k))
        b.scratch.top = mark
    for acc, res in ((dk, dk_out), (dv, dv_out)):
        if acc is not res:
            steps.append(lambda acc=acc, res=res: res.copy_(acc))
    return steps


def flat_region(ts: list[Tensor]) -> Tensor | None:
    """One 1-D view over `ts` when they are consecutive contiguous pieces of one storage (the
    program's flat parameter, gradient and moment buffers), else None."""
    first = ts[0]
    at = first.storage_offset()
    for t in ts:
        if (not t.is_contiguous() or t.untyped_storage().data_ptr()
                != first.untyped_storage().data_ptr() or t.storage_offset() != at):
            return None
        at += t.numel()
    return first.as_strided((at - first.storage_offset(),), (1,))


def _adamw(b: "_Builder", n: Node, xs: list[Tensor], outs: list[Tensor]) -> list[Step]:
    """The optimizer step in place over the flat regions (per tensor where the layout is not
    flat): the same arithmetic as the optimizer graph, in a dozen ATen calls."""
    a = n.attr_dict
    k = a["n"]
    params, grads, ms, vs = (xs[j * k:(j + 1) * k] for j in range(4))
    lr, step, scale = (x if isinstance(x, Tensor) else b._const(torch.tensor(x))
                       for x in xs[4 * k:])
    new_p, new_m, new_v = (outs[j * k:(j + 1) * k] for j in range(3))
    norm = outs[3 * k]
    steps: list[Step] = []
    for olds, news in ((params, new_p), (ms, new_m), (vs, new_v)):
        for old, new in zip(olds, news):
            if new.data_ptr() != old.data_ptr():
                steps.append(lambda o=old, d=new: d.copy_(o))
    # pieces the arithmetic runs over: the flat regions, or one piece per parameter
    regions = [flat_region(list(ts)) for ts in (new_p, new_m, new_v, grads)]
    if all(r is not None for r in regions):
        pieces = [tuple(regions)]
    else:
        pieces = list(zip(new_p, new_m, new_v, grads))
    dt = "f64" if norm.dtype == torch.float64 else "f32"
    # one scratch vector of every parameter's size: the same whichever layout this binding
    # has (the executor measures its scratch on a first binding without the caller's tensors)
    t = b.scratch.alloc(TensorType((sum(w.numel() for w in new_p),), dt))
    c = [b.scratch.alloc(TensorType((), dt)) for _ in range(5)]       # scalars
    coef, bc1, bc2, acc, dfac = c
    b1, b2, eps, wd, clip = a["beta1"], a["beta2"], a["eps"], a["weight_decay"], a["clip"]
    steps.append(lambda: norm.zero_())
    for _, _, _, g in pieces:                          # ||grad · scale||
        tt = t[:g.numel()].view(g.shape)
        dims = tuple(range(g.dim()))
        steps += [lambda g=g, tt=tt: torch.mul(g, g, out=tt),
                  lambda tt=tt, dims=dims: torch.sum(tt, dims, out=acc), lambda: norm.add_(acc)]
    steps += [lambda: norm.sqrt_().mul_(scale), lambda: coef.copy_(scale)]
    if clip > 0:                                       # coef = scale · min(1, c / (norm + 1e-6))
        steps += [lambda: torch.add(norm, 1e-6, out=acc).reciprocal_().mul_(clip).clamp_(max=1.0),
                  lambda: coef.mul_(acc)]
    steps += [lambda: torch.mul(step, math.log(b1), out=bc1).exp_().neg_().add_(1.0),
              lambda: torch.mul(step, math.log(b2), out=bc2).exp_().neg_().add_(1.0),
              lambda: torch.mul(lr, wd, out=dfac).neg_().add_(1.0)]
    decay = a["decay"]
    for p, m, v, g in pieces:
        tt = t[:g.numel()].view(g.shape)
        steps += [lambda g=g, tt=tt: torch.mul(g, coef, out=tt),              # g
                  lambda m=m, tt=tt: m.mul_(b1).add_(tt, alpha=1.0 - b1),
                  lambda v=v, tt=tt: v.mul_(b2).addcmul_(tt, tt, value=1.0 - b2)]
        if wd > 0:                                     # decoupled decay of the decaying ones
            for w, d in zip(new_p, decay):
                if d and _inside(w, p):
                    steps.append(lambda w=w: w.mul_(dfac))
        steps += [lambda v=v, tt=tt: torch.div(v, bc2, out=tt).sqrt_().add_(eps),
                  lambda m=m, tt=tt: torch.div(m, tt, out=tt).div_(bc1).mul_(lr),
                  lambda p=p, tt=tt: p.sub_(tt)]
    return steps


def _inside(w: Tensor, region: Tensor) -> bool:
    """Is parameter `w` (a piece) within `region` (a flat region or the piece itself)?"""
    if w.untyped_storage().data_ptr() != region.untyped_storage().data_ptr():
        return False
    lo = region.storage_offset()
    return lo <= w.storage_offset() < lo + region.numel()
