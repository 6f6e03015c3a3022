"""The cpu target's pattern kernels (`OpGroup.PATTERN` ops, from the pattern passes): a
blocked loop of out= ATen calls each, writing the op's tuple elements into their planned ITEM
buffers. ATTENTION and ATTENTION_BWD live in `attention_kernels`.

    LINEAR_CROSS_ENTROPY      per block of `chunk` rows, per tile of VOCAB_TILE vocabulary
                   entries: the logits tile h_b · headᵀ, an online log-sum-exp (running max and
                   sum); the target logit is h_r · head[target_r] (a gather of head rows), so
                   only a [chunk, VOCAB_TILE] logits tile exists, reused by every tile.
    LINEAR_CROSS_ENTROPY_BWD  the same tiles recomputed, p = exp(logits − lse) · dloss;
                   dh_b += p · head_t, dhead_t += pᵀ · h_b; then the one-hot part of the
                   softmax gradient: dh_b −= dloss · head[target], dhead[target] −= dloss · h_b.
    ADAMW          the optimizer step in place over the program's flat parameter, gradient and
                   moment regions (per parameter when they are not flat).

Every tensor is planned storage or scratch: a run allocates nothing. A tuple element no later
kernel reads (the forward graph's log-sum-exp) goes to scratch.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import Tensor

from titanc.ir import Node, Op
from titanc.ir.lowering import register_lowering
from titanc.ir.types import TensorType

from titanc.runtime.targets.attention_kernels import StepBuilder, blocks, tmp
from titanc.runtime.targets.lowerings import CPU

Step = Callable[[], Any]
VOCAB_TILE = 4096      # vocabulary entries per logits tile of the cross-entropy kernels


def pattern_steps(b: "StepBuilder", n: Node, outputs: set[int]) -> list[Step]:
    """The steps of pattern op `n` (its rule in the cpu table, `lowerings.CPU`); binds the
    ITEMs later kernels read to their buffers."""
    xs = [b.operand(i) for i in n.inputs]
    for j, i in enumerate(n.inputs):                 # an inlined scalar (a constant dloss)
        if isinstance(xs[j], float):
            t = b.g.node(i).type
            xs[j] = b.const(torch.full(t.shape, xs[j], dtype=_TORCH[t.dtype]))
    outs: list[Tensor] = []
    items = {b.g.node(u).attr("index"): u for u in b.g.users(n.id) if u in outputs}
    for k, t in enumerate(n.type):
        outs.append(b.located(items[k]) if k in items else b.scratch.alloc(t))
    for k, u in items.items():
        b.val[u] = outs[k]
    return CPU[n.op](b, n, xs, outs)


_TORCH = {"f64": torch.float64, "f32": torch.float32, "bf16": torch.bfloat16}


def _vocab_major(head: Tensor, layout: str) -> Tensor:
    """The head as [vocab, d] (a view)."""
    return head if layout == "vd" else head.t()


def _tiles(b: "StepBuilder", like: Tensor, rows: int, vocab: int) -> tuple[list[tuple[int, int]],
                                                                         dict[int, Tensor]]:
    """The vocabulary tiles and one logits scratch per distinct tile width."""
    tiles = blocks(vocab, VOCAB_TILE)
    return tiles, {w: tmp(b, like, rows, w) for w in {hi - lo for lo, hi in tiles}}


def _rows_of(b: "StepBuilder", tg: Tensor, steps: list[Step]) -> Tensor:
    """The targets as [rows]: a view of [rows] or dense [batch, T] ones; a [batch, T] slice of
    the token windows (strided) is gathered into int64 scratch by the kernel's first step."""
    if tg.dim() == 1:
        return tg
    if tg.is_contiguous():
        return tg.view(-1)
    t = b.scratch.alloc(TensorType((tg.numel(),), "i64"))
    steps.append(lambda t=t, tg=tg: t.view(tg.shape).copy_(tg))
    return t


@register_lowering(Op.LINEAR_CROSS_ENTROPY, CPU)
def _lce(b: "StepBuilder", n: Node, xs: list[Tensor], outs: list[Tensor]) -> list[Step]:
    h, head, tg = xs
    loss, lse = outs
    w = _vocab_major(head, n.attr("layout"))            # (V, D)
    steps: list[Step] = []
    tg = _rows_of(b, tg, steps)
    for r0, r1 in blocks(h.shape[0], n.attr("chunk")):
        mark, rb = b.scratch.top, r1 - r0
        hb, tb = h[r0:r1], tg[r0:r1]
        tiles, z = _tiles(b, h, rb, w.shape[0])
        m, l, mt, t = (tmp(b, h, rb, 1) for _ in range(4))
        tw = tmp(b, h, rb, h.shape[1])
        for j, (v0, v1) in enumerate(tiles):
            zt, wt = z[v1 - v0], w[v0:v1]
            steps.append(lambda zt=zt, hb=hb, wt=wt: torch.mm(hb, wt.t(), out=zt))
            if j == 0:                                   # running max and sum of the tiles
                steps += [lambda zt=zt, m=m: torch.amax(zt, -1, keepdim=True, out=m),
                          lambda zt=zt, m=m: zt.sub_(m).exp_(),
                          lambda zt=zt, l=l: torch.sum(zt, -1, keepdim=True, out=l)]
                continue
            steps += [lambda zt=zt, mt=mt: torch.amax(zt, -1, keepdim=True, out=mt),
                      lambda m=m, mt=mt: torch.maximum(m, mt, out=mt),
                      lambda zt=zt, mt=mt: zt.sub_(mt).exp_(),
                      lambda zt=zt, t=t: torch.sum(zt, -1, keepdim=True, out=t),
                      lambda m=m, mt=mt, l=l: l.mul_(m.sub_(mt).exp_()),   # rescale the sum
                      lambda m=m, mt=mt, l=l, t=t: (l.add_(t), m.copy_(mt))]
        lb, ob = lse[r0:r1], loss[r0:r1]
        steps += [lambda tw=tw, tb=tb: torch.index_select(w, 0, tb, out=tw),   # head[target]
                  lambda tw=tw, hb=hb, t=t: torch.sum(tw.mul_(hb), -1, keepdim=True, out=t),
                  lambda lb=lb, l=l, m=m: lb.copy_(l.log_().add_(m).squeeze(-1)),
                  lambda ob=ob, lb=lb, t=t: torch.sub(lb, t.squeeze(-1), out=ob)]
        b.scratch.top = mark                             # the next block reuses the tiles
    return steps


@register_lowering(Op.LINEAR_CROSS_ENTROPY_BWD, CPU)
def _lce_bwd(b: "StepBuilder", n: Node, xs: list[Tensor], outs: list[Tensor]) -> list[Step]:
    h, head, tg, lse, dloss = xs
    dh, dhead = outs
    w = _vocab_major(head, n.attr("layout"))            # (V, D)
    dw = _vocab_major(dhead, n.attr("layout"))
    steps: list[Step] = [lambda: dw.zero_()]
    tg = _rows_of(b, tg, steps)
    for r0, r1 in blocks(h.shape[0], n.attr("chunk")):
        mark, rb = b.scratch.top, r1 - r0
        hb, tb, dhb = h[r0:r1], tg[r0:r1], dh[r0:r1]
        lb, db = lse[r0:r1].unsqueeze(-1), dloss[r0:r1].unsqueeze(-1)
        tiles, z = _tiles(b, h, rb, w.shape[0])
        t_h = tmp(b, h, rb, h.shape[1])
        t_w = {width: tmp(b, h, width, h.shape[1]) for width in z}
        for j, (v0, v1) in enumerate(tiles):
            zt, wt, tw, dwt = z[v1 - v0], w[v0:v1], t_w[v1 - v0], dw[v0:v1]
            steps += [lambda zt=zt, hb=hb, wt=wt: torch.mm(hb, wt.t(), out=zt),
                      lambda zt=zt, lb=lb, db=db: zt.sub_(lb).exp_().mul_(db),  # p · dloss
                      (lambda zt=zt, wt=wt, dhb=dhb: torch.mm(zt, wt, out=dhb)) if j == 0 else
                      (lambda zt=zt, wt=wt, dhb=dhb, t_h=t_h: dhb.add_(torch.mm(zt, wt, out=t_h))),
                      lambda zt=zt, hb=hb, tw=tw, dwt=dwt:
                          dwt.add_(torch.mm(zt.t(), hb, out=tw))]
        steps += [lambda t_h=t_h, tb=tb: torch.index_select(w, 0, tb, out=t_h),  # − onehot part
                  lambda t_h=t_h, db=db, dhb=dhb: dhb.sub_(t_h.mul_(db)),
                  lambda t_h=t_h, db=db, hb=hb: torch.mul(hb, db, out=t_h),
                  lambda t_h=t_h, tb=tb: dw.index_add_(0, tb, t_h, alpha=-1.0)]
        b.scratch.top = mark
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


@register_lowering(Op.ADAMW, CPU)
def _adamw(b: "StepBuilder", n: Node, xs: list[Tensor], outs: list[Tensor]) -> list[Step]:
    """The optimizer step in place over the flat regions (per tensor where the layout is not
    flat): the same arithmetic as the optimizer graph, in a dozen ATen calls."""
    a = n.attr_dict
    k = a["n"]
    params, grads, ms, vs = (xs[j * k:(j + 1) * k] for j in range(4))
    lr, step, scale = (x if isinstance(x, Tensor) else b.const(torch.tensor(x))
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
