"""The cpu target's pattern kernels (`OpGroup.PATTERN` ops, from `passes/flash_attention.py`):
a blocked loop of out= ATen calls each, writing the op's tuple elements into their planned
ITEM buffers.

    ATTENTION      per block of BLOCK_Q queries: scores of the block against the keys it can
                   see, scale, the MASK's additive table, softmax, times v; the block's
                   log-sum-exp is kept for the backward. Only a [B, H, BLOCK_Q, visible keys]
                   block exists, in scratch that every block reuses, so no [B, H, Tq, Tk]
                   tensor is ever allocated.
    ATTENTION_BWD  per block: the probabilities recomputed from q, k and the saved log-sum-exp,
                   dv and dk accumulated over blocks, dq written per block (FlashAttention-2's
                   backward, ordered by query block).

The keys and values come as one tensor per key group (persistent tokens, memory output,
segment or sequence keys; no kernel concatenates them), and the backward writes one dk and
one dv per group. With several groups the loop's first steps pack them into one dense scratch
(`_pack`: the BLAS calls want dense operands, and a block's visible keys become one run);
the backward accumulates into dense scratch and copies each group's slice out at the end. Keys come in blocks of BLOCK_K within a
group: a key block that no query of the query block can see (outside the sliding window, or
after the block's last query) is skipped, not computed and masked (`key_runs`: the visible
key blocks of each group, merged into runs of consecutive blocks).
    LINEAR_CROSS_ENTROPY      per block of `chunk` rows, per tile of VOCAB_TILE vocabulary
                   entries: the logits tile h_b · headᵀ, an online log-sum-exp (running max and
                   sum); the target logit is h_r · head[target_r] (a gather of head rows), so
                   only a [chunk, VOCAB_TILE] logits tile exists, reused by every tile.
    LINEAR_CROSS_ENTROPY_BWD  the same tiles recomputed, p = exp(logits − lse) · dloss;
                   dh_b += p · head_t, dhead_t += pᵀ · h_b; then the one-hot part of the
                   softmax gradient: dh_b −= dloss · head[target], dhead[target] −= dloss · h_b.
    ADAMW          the optimizer step in place over the program's flat parameter, gradient and
                   moment regions (per parameter when they are not flat).

Under bf16 mixed precision q, k, v, o, do (and dq, dk, dv) are bf16 and the log-sum-exp is
float32: each kernel upcasts its bf16 operands into float32 scratch (k and v once, a query
block's rows per block), computes scores, softmax and sums in float32, accumulates dk and dv in
float32 scratch and rounds each result once, into its bf16 buffer.

Within a visible key block the mask zeroes the invisible pairs. Every tensor is planned storage or scratch: a run allocates
nothing. A tuple element no later kernel reads (the forward graph's log-sum-exp) goes to
scratch.
"""
from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import Tensor

from titanc.ir import Node, Op
from titanc.ir.attention import split
from titanc.ir.tables import mask_table
from titanc.ir.types import TensorType

if TYPE_CHECKING:
    from .executor import _Builder

Step = Callable[[], Any]
BLOCK_Q = 64           # queries per block: scratch is O(BLOCK_Q · keys), not O(queries · keys)
BLOCK_K = 64           # keys per block: the unit of skipping invisible keys
VOCAB_TILE = 4096      # vocabulary entries per logits tile of the cross-entropy kernels


def pattern_steps(b: "_Builder", n: Node, outputs: set[int]) -> list[Step]:
    """The steps of pattern op `n`; binds the ITEMs later kernels read to their buffers."""
    xs = [b.operand(i) for i in n.inputs]
    for j, i in enumerate(n.inputs):                 # an inlined scalar (a constant dloss)
        if isinstance(xs[j], float):
            t = b.g.node(i).type
            xs[j] = b._const(torch.full(t.shape, xs[j], dtype=_TORCH[t.dtype]))
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
    if n.op is Op.LINEAR_CROSS_ENTROPY:
        return _lce(b, n, xs, outs)
    if n.op is Op.LINEAR_CROSS_ENTROPY_BWD:
        return _lce_bwd(b, n, xs, outs)
    raise NotImplementedError(f"the cpu target has no kernel for pattern op {n.op.name}")


def _visible(a: dict) -> Tensor | None:
    """[Tq, Tk] booleans of the visible (query, key) pairs, or None when all are visible."""
    if all(kind == "all" for kind, _, _ in a["groups"]):
        return None
    return _visible_table(a["n_q"], a["q_start"], tuple(map(tuple, a["groups"])))


@functools.lru_cache(maxsize=8)
def _visible_table(n_q: int, q_start: int, groups: tuple) -> Tensor:
    return mask_table(n_q, q_start, groups, torch.float64) == 0


Run = tuple[int, int, int]      # (key group, first key, end key), keys numbered in the group


def key_runs(a: dict, i0: int, i1: int) -> list[Run]:
    """The keys queries i0..i1 of an attention op with attrs `a` compute against: per key
    group, the blocks of BLOCK_K keys holding a visible pair, consecutive ones merged, as
    [(group, lo, hi)] with keys numbered within their group."""
    vis = _visible(a)
    runs: list[Run] = []
    at = 0                                              # the group's first key in the table
    for grp, (_, length, _) in enumerate(a["groups"]):
        for lo in range(0, length, BLOCK_K):
            hi = min(lo + BLOCK_K, length)
            if vis is not None and not bool(vis[i0:i1, at + lo:at + hi].any()):
                continue                                # no query of the block sees these
            if runs and runs[-1][0] == grp and runs[-1][2] == lo:
                runs[-1] = (grp, runs[-1][1], hi)
            else:
                runs.append((grp, lo, hi))
        at += length
    return runs


def _starts(a: dict) -> list[int]:
    """Where each key group starts in the MASK's key axis."""
    out, at = [], 0
    for _, length, _ in a["groups"]:
        out.append(at)
        at += length
    return out


def _block_bias(b: "_Builder", n: Node, i0: int, i1: int, runs: list[Run],
                dtype: torch.dtype) -> Tensor | None:
    """The additive mask of queries i0..i1 over the keys of `runs` [bq, visible keys], or None
    when the block sees all of them."""
    a = n.attr_dict
    if _visible(a) is None:
        return None
    at = _starts(a)
    vis = torch.cat([_visible(a)[i0:i1, at[grp] + lo:at[grp] + hi] for grp, lo, hi in runs],
                    dim=1)
    if bool(vis.all()):
        return None
    zero, ninf = torch.zeros((), dtype=dtype), torch.tensor(-math.inf, dtype=dtype)
    return b._const(torch.where(vis, zero, ninf))


def _blocks(n_q: int, size: int = BLOCK_Q) -> list[tuple[int, int]]:
    return [(i, min(i + size, n_q)) for i in range(0, n_q, size)]


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


def _cols(runs: list[Run]) -> list[tuple[int, int, int, int]]:
    """(group, lo, hi, offset of the run in the block's score columns)."""
    out, off = [], 0
    for grp, lo, hi in runs:
        out.append((grp, lo, hi, off))
        off += hi - lo
    return out


def _probabilities(b: "_Builder", n: Node, qb: Tensor, ks: list[Tensor], i0: int, i1: int,
                   runs: list[Run], s: Tensor, steps: list[Step]) -> None:
    """s <- scale · qb kᵀ + bias over the keys of `runs` (the block's masked, scaled scores)."""
    for grp, lo, hi, off in _cols(runs):
        steps += _einsum(b, "bhqe,bhke->bhqk", [qb, ks[grp][:, :, lo:hi]],
                         s[..., off:off + hi - lo])
    scale = n.attr("scale")
    steps.append(lambda: s.mul_(scale))
    bias = _block_bias(b, n, i0, i1, runs, s.dtype)
    if bias is not None:
        steps.append(lambda: s.add_(bias))


def _pack(b: "_Builder", xs: list[Tensor], steps: list[Step]) -> list[Tensor]:
    """The key (or value) groups as one dense [B, H, keys, e] scratch in the compute dtype,
    filled by the kernel's first steps: the BLAS calls of the loop want dense operands (a
    batch-expanded persistent group would be copied by every call), and a block's visible
    keys are then one run across groups. One group: itself (widened under bf16)."""
    if len(xs) == 1:
        return [_wide(b, xs[0], steps)]
    B, H, _, e = xs[0].shape
    t = _tmp(b, xs[0], B, H, sum(x.shape[2] for x in xs), e)
    at = 0
    for x in xs:
        steps.append(lambda x=x, d=t[:, :, at:at + x.shape[2]]: d.copy_(x))
        at += x.shape[2]
    return [t]


def _runs(a: dict, i0: int, i1: int, packed: bool) -> list[Run]:
    """`key_runs`, or over packed groups: in key-axis numbering as group 0, runs that meet
    across a group boundary merged."""
    runs = key_runs(a, i0, i1)
    if not packed:
        return runs
    at, out = _starts(a), []
    for grp, lo, hi in runs:
        lo, hi = at[grp] + lo, at[grp] + hi
        if out and out[-1][2] == lo:
            out[-1] = (0, out[-1][1], hi)
        else:
            out.append((0, lo, hi))
    return out


def _attention(b: "_Builder", n: Node, xs: list[Tensor], outs: list[Tensor]) -> list[Step]:
    q, ks, vs, _ = split(xs, n.attr_dict)
    o, lse = outs
    B, H, _, _ = q.shape
    e_v = vs[0].shape[3]
    steps: list[Step] = []
    packed = len(ks) > 1
    ks, vs = _pack(b, ks, steps), _pack(b, vs, steps)
    for i0, i1 in _blocks(q.shape[2]):
        mark, bq = b.scratch.top, i1 - i0
        runs = _runs(n.attr_dict, i0, i1, packed)
        s = _tmp(b, q, B, H, bq, sum(hi - lo for _, lo, hi in runs))
        m, l = _tmp(b, q, B, H, bq, 1), _tmp(b, q, B, H, bq, 1)
        ob, t_o = _tmp(b, q, B, H, bq, e_v), _tmp(b, q, B, H, bq, e_v)
        _probabilities(b, n, _wide(b, q[:, :, i0:i1], steps), ks, i0, i1, runs, s, steps)
        steps += [lambda s=s, m=m: torch.amax(s, -1, keepdim=True, out=m),
                  lambda s=s, m=m: s.sub_(m).exp_(),
                  lambda s=s, l=l: torch.sum(s, -1, keepdim=True, out=l),
                  lambda s=s, l=l: s.div_(l)]
        for j, (grp, lo, hi, off) in enumerate(_cols(runs)):
            steps += _einsum(b, "bhqk,bhke->bhqe",
                             [s[..., off:off + hi - lo], vs[grp][:, :, lo:hi]],
                             ob if j == 0 else t_o)
            if j:
                steps.append(lambda ob=ob, t_o=t_o: ob.add_(t_o))
        oo, ll = o[:, :, i0:i1], lse[:, :, i0:i1]
        steps += [lambda oo=oo, ob=ob: oo.copy_(ob),
                  lambda l=l, m=m, ll=ll: ll.copy_(l.log_().add_(m).squeeze(-1))]
        b.scratch.top = mark                         # the next block reuses this scratch
    return steps


def _attention_bwd(b: "_Builder", n: Node, xs: list[Tensor], outs: list[Tensor]) -> list[Step]:
    a = n.attr_dict
    q, ks, vs, (o, lse, do) = split(xs, a)
    dq, dk_outs, dv_outs, _ = split(outs, a)
    B, H, _, _ = q.shape
    e_k, e_v = q.shape[3], vs[0].shape[3]
    scale = n.attr("scale")
    steps: list[Step] = []
    packed = len(ks) > 1
    ks, vs = _pack(b, ks, steps), _pack(b, vs, steps)
    # accumulators: float32 for bf16 dk, dv, dq (each rounded once, into its bf16 buffer);
    # over packed groups one dense scratch, copied into each group's gradient at the end
    if packed:
        dks, dvs = [_tmp(b, ks[0], *ks[0].shape)], [_tmp(b, vs[0], *vs[0].shape)]
    else:
        dks = [d if d.dtype == k.dtype else _tmp(b, d, *d.shape) for d, k in zip(dk_outs, ks)]
        dvs = [d if d.dtype == v.dtype else _tmp(b, d, *d.shape) for d, v in zip(dv_outs, vs)]
    steps += [lambda d=d: d.zero_() for d in dks + dvs]
    for i0, i1 in _blocks(q.shape[2]):
        mark, bq = b.scratch.top, i1 - i0
        runs = _runs(a, i0, i1, packed)
        n_vis = sum(hi - lo for _, lo, hi in runs)
        qb, dob, ob = (_wide(b, x[:, :, i0:i1], steps) for x in (q, do, o))
        p = _tmp(b, q, B, H, bq, n_vis)
        ds = _tmp(b, q, B, H, bq, n_vis)
        delta = _tmp(b, q, B, H, bq, 1)
        t_o = _tmp(b, q, B, H, bq, e_v)
        t_q, dq_out = _tmp(b, q, B, H, bq, e_k), dq[:, :, i0:i1]
        dqb = dq_out if dq_out.dtype == t_q.dtype else _tmp(b, q, B, H, bq, e_k)
        _probabilities(b, n, qb, ks, i0, i1, runs, p, steps)
        lb = lse[:, :, i0:i1].unsqueeze(-1)
        steps.append(lambda p=p, lb=lb: p.sub_(lb).exp_())          # p = exp(s - lse)
        steps += [lambda t_o=t_o, dob=dob, ob=ob: torch.mul(dob, ob, out=t_o),
                  lambda t_o=t_o, delta=delta: torch.sum(t_o, -1, keepdim=True, out=delta)]
        for j, (grp, lo, hi, off) in enumerate(_cols(runs)):
            pr, dsr, w = p[..., off:off + hi - lo], ds[..., off:off + hi - lo], hi - lo
            k, v, dk, dv = ks[grp], vs[grp], dks[grp], dvs[grp]
            t_k, t_v = _tmp(b, q, B, H, w, e_k), _tmp(b, q, B, H, w, e_v)
            steps += _einsum(b, "bhqk,bhqe->bhke", [pr, dob], t_v)
            steps.append(lambda t_v=t_v, dvr=dv[:, :, lo:hi]: dvr.add_(t_v))
            steps += _einsum(b, "bhqe,bhke->bhqk", [dob, v[:, :, lo:hi]], dsr)   # dp
            steps.append(lambda dsr=dsr, pr=pr, delta=delta: dsr.sub_(delta).mul_(pr).mul_(scale))
            steps += _einsum(b, "bhqk,bhke->bhqe", [dsr, k[:, :, lo:hi]], t_q)
            steps.append((lambda dqb=dqb, t_q=t_q: dqb.copy_(t_q)) if j == 0 else
                         (lambda dqb=dqb, t_q=t_q: dqb.add_(t_q)))
            steps += _einsum(b, "bhqk,bhqe->bhke", [dsr, qb], t_k)
            steps.append(lambda t_k=t_k, dkr=dk[:, :, lo:hi]: dkr.add_(t_k))
        if dqb is not dq_out:
            steps.append(lambda dqb=dqb, dq_out=dq_out: dq_out.copy_(dqb))
        b.scratch.top = mark
    if packed:                                       # each group's slice of the accumulators
        at = _starts(a)
        dks = [dks[0][:, :, s:s + d.shape[2]] for s, d in zip(at, dk_outs)]
        dvs = [dvs[0][:, :, s:s + d.shape[2]] for s, d in zip(at, dv_outs)]
    for acc, res in zip(dks + dvs, dk_outs + dv_outs):
        if acc is not res:
            steps.append(lambda acc=acc, res=res: res.copy_(acc))
    return steps


_TORCH = {"f64": torch.float64, "f32": torch.float32, "bf16": torch.bfloat16}


def _vocab_major(head: Tensor, layout: str) -> Tensor:
    """The head as [vocab, d] (a view)."""
    return head if layout == "vd" else head.t()


def _tiles(b: "_Builder", like: Tensor, rows: int, vocab: int) -> tuple[list[tuple[int, int]],
                                                                         dict[int, Tensor]]:
    """The vocabulary tiles and one logits scratch per distinct tile width."""
    tiles = _blocks(vocab, VOCAB_TILE)
    return tiles, {w: _tmp(b, like, rows, w) for w in {hi - lo for lo, hi in tiles}}


def _rows_of(b: "_Builder", tg: Tensor, steps: list[Step]) -> Tensor:
    """The targets as [rows]: a view of [rows] or dense [batch, T] ones; a [batch, T] slice of
    the token windows (strided) is gathered into int64 scratch by the kernel's first step."""
    if tg.dim() == 1:
        return tg
    if tg.is_contiguous():
        return tg.view(-1)
    t = b.scratch.alloc(TensorType((tg.numel(),), "i64"))
    steps.append(lambda t=t, tg=tg: t.view(tg.shape).copy_(tg))
    return t


def _lce(b: "_Builder", n: Node, xs: list[Tensor], outs: list[Tensor]) -> list[Step]:
    h, head, tg = xs
    loss, lse = outs
    w = _vocab_major(head, n.attr("layout"))            # (V, D)
    steps: list[Step] = []
    tg = _rows_of(b, tg, steps)
    for r0, r1 in _blocks(h.shape[0], n.attr("chunk")):
        mark, rb = b.scratch.top, r1 - r0
        hb, tb = h[r0:r1], tg[r0:r1]
        tiles, z = _tiles(b, h, rb, w.shape[0])
        m, l, mt, t = (_tmp(b, h, rb, 1) for _ in range(4))
        tw = _tmp(b, h, rb, h.shape[1])
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


def _lce_bwd(b: "_Builder", n: Node, xs: list[Tensor], outs: list[Tensor]) -> list[Step]:
    h, head, tg, lse, dloss = xs
    dh, dhead = outs
    w = _vocab_major(head, n.attr("layout"))            # (V, D)
    dw = _vocab_major(dhead, n.attr("layout"))
    steps: list[Step] = [lambda: dw.zero_()]
    tg = _rows_of(b, tg, steps)
    for r0, r1 in _blocks(h.shape[0], n.attr("chunk")):
        mark, rb = b.scratch.top, r1 - r0
        hb, tb, dhb = h[r0:r1], tg[r0:r1], dh[r0:r1]
        lb, db = lse[r0:r1].unsqueeze(-1), dloss[r0:r1].unsqueeze(-1)
        tiles, z = _tiles(b, h, rb, w.shape[0])
        t_h = _tmp(b, h, rb, h.shape[1])
        t_w = {width: _tmp(b, h, width, h.shape[1]) for width in z}
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
