"""The cpu target's flash-attention kernels: ATTENTION and ATTENTION_BWD (from
`passes/flash_attention.py`) as blocked loops of out= ATen calls.

    ATTENTION      per block of BLOCK_Q queries: the scaled, masked scores of the block against
                   the keys it can see (one baddbmm: scale and the MASK's additive table folded
                   into the GEMM), softmax in place (max; exp2 of the difference times
                   log2 e, as exp2 costs 2.5x less than exp in this CPU's ATen and exp is
                   7x slower still on the -inf of masked keys; sum; divide), times v; the
                   block's log-sum-exp is kept for the backward (max + log Σ). Only a
                   [B·H, BLOCK_Q, visible keys] block exists, in
                   scratch that every block reuses, so no [B, H, Tq, Tk] tensor is allocated.
    ATTENTION_BWD  per block: the probabilities recomputed from q, k and the saved log-sum-exp
                   (exp2 of log2 e · (scores − lse)),
                   dv and dk accumulated over blocks (baddbmm into the accumulators), dq
                   written per block, the softmax scale folded into the GEMMs' alpha
                   (FlashAttention-2's backward, ordered by query block).

Every GEMM is a bmm over [B·H, rows, cols] views. Operands that have no such view (a
permuted projection, a batch-expanded persistent group) or hold bf16 are staged once per
kernel into dense compute-dtype scratch; the keys and values come as one tensor per key group
(persistent tokens, memory output, segment or sequence keys; no kernel concatenates them), so
with several groups the first steps pack them into one dense scratch and a block's visible
keys become one run, and the backward accumulates dk and dv there and copies each group's
slice out at the end. Keys come in blocks of BLOCK_K within a group: a key block that no query
of the query block can see (outside the sliding window, or after the block's last query) is
skipped, not computed and masked (`key_runs`).

Under bf16 mixed precision q, k, v, o, do (and dq, dk, dv) are bf16 and the log-sum-exp is
float32: each kernel upcasts its bf16 operands into float32 scratch, computes scores, softmax
and sums in float32, accumulates in float32 and rounds each result once, into its bf16
buffer. Every tensor is planned storage or scratch: a run allocates nothing.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable, Protocol

import torch
from torch import Tensor

from titanc.ir import Graph, Node, Op
from titanc.ir.attention import split
from titanc.ir.lowering import register_lowering
from titanc.ir.tables import mask_table
from titanc.ir.types import TensorType

from titanc.runtime.targets.lowerings import CPU

Step = Callable[[], Any]


class StepBuilder(Protocol):
    """What the pattern kernels use of the cpu target's step builder (`executor._Builder`,
    which passes itself): the graph, its bound values and planned storage, scratch."""
    g: Graph
    val: dict[int, Any]
    scratch: Any                   # storage.Scratch: `alloc(type)`, `top` (a stack mark)

    def located(self, vid: int) -> Tensor: ...
    def operand(self, vid: int) -> Any: ...
    def const(self, t: Tensor) -> Tensor: ...
BLOCK_Q = 64           # queries per block: scratch is O(BLOCK_Q · keys), not O(queries · keys)
BLOCK_K = 64           # keys per block: the unit of skipping invisible keys
LOG2E = 1.0 / math.log(2.0)     # exp(x) = exp2(x · log2 e): exp2 is the cheaper ATen call
Run = tuple[int, int, int]      # (key group, first key, end key), keys numbered in the group


def blocks(n: int, size: int = BLOCK_Q) -> list[tuple[int, int]]:
    return [(i, min(i + size, n)) for i in range(0, n, size)]


def tmp(b: "StepBuilder", like: Tensor, *shape: int) -> Tensor:
    """Scratch in the compute dtype beside `like` (float32 for bf16 operands)."""
    dtype = {torch.float64: "f64", torch.float32: "f32", torch.bfloat16: "f32"}[like.dtype]
    return b.scratch.alloc(TensorType(tuple(shape), dtype))


# -- which keys a query block sees ---------------------------------------------------------------

def _visible(a: dict) -> Tensor | None:
    """[Tq, Tk] booleans of the visible (query, key) pairs, or None when all are visible."""
    if all(kind == "all" for kind, _, _ in a["groups"]):
        return None
    return _visible_table(a["n_q"], a["q_start"], tuple(map(tuple, a["groups"])))


@functools.lru_cache(maxsize=8)
def _visible_table(n_q: int, q_start: int, groups: tuple) -> Tensor:
    return mask_table(n_q, q_start, groups, torch.float64) == 0


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


def _cols(runs: list[Run]) -> list[tuple[int, int, int, int]]:
    """(group, lo, hi, offset of the run in the block's score columns)."""
    out, off = [], 0
    for grp, lo, hi in runs:
        out.append((grp, lo, hi, off))
        off += hi - lo
    return out


def _block_bias(b: "StepBuilder", n: Node, i0: int, i1: int, runs: list[Run],
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
    return b.const(torch.where(vis, zero, ninf))


# -- operands as [B·H, rows, cols] --------------------------------------------------------------

def _bh(x: Tensor) -> Tensor | None:
    """x [B, H, r, c] viewed as [B·H, r, c], or None when its strides do not allow it."""
    B, H, r, c = x.shape
    try:
        return x.view(B * H, r, c)
    except RuntimeError:
        return None


def _compute_dtype(x: Tensor) -> torch.dtype:
    return torch.float32 if x.dtype == torch.bfloat16 else x.dtype


def _rows(b: "StepBuilder", x: Tensor, steps: list[Step]) -> Tensor:
    """x [B, H, r, c] as a [B·H, r, c] view in the compute dtype, or (no such view, or bf16)
    a dense scratch copy that `steps` fill."""
    v = _bh(x) if x.dtype == _compute_dtype(x) else None
    if v is not None:
        return v
    t = tmp(b, x, *x.shape)
    steps.append(lambda t=t, x=x: t.copy_(x))
    return t.view(-1, *x.shape[2:])


def _pack(b: "StepBuilder", xs: list[Tensor], steps: list[Step]) -> Tensor:
    """The key (or value) groups as one [B·H, keys, e] tensor: one group as `_rows` gives it,
    several packed into dense scratch by the kernel's first steps (a block's visible keys
    are then one run across groups)."""
    if len(xs) == 1:
        return _rows(b, xs[0], steps)
    B, H, _, e = xs[0].shape
    t = tmp(b, xs[0], B, H, sum(x.shape[2] for x in xs), e)
    if all(x.dtype == t.dtype for x in xs):
        steps.append(lambda: torch.cat(xs, 2, out=t))
    else:                                            # bf16 groups: upcast while copying
        at = 0
        for x in xs:
            steps.append(lambda x=x, d=t[:, :, at:at + x.shape[2]]: d.copy_(x))
            at += x.shape[2]
    return t.view(B * H, -1, e)


def _result(b: "StepBuilder", out: Tensor, like: Tensor) -> tuple[Tensor, bool]:
    """Where a [B, H, r, c] result block is computed, and whether that is `out` itself: its
    [B·H, r, c] view when it has one in the compute dtype, else scratch that the caller
    copies into `out`."""
    v = _bh(out) if out.dtype == _compute_dtype(like) else None
    if v is not None:
        return v, True
    return tmp(b, like, out.shape[0] * out.shape[1], *out.shape[2:]), False


def _scores(b: "StepBuilder", n: Node, qb: Tensor, k: Tensor, i0: int, i1: int,
            runs: list[Run], s: Tensor, steps: list[Step]) -> None:
    """s <- scale · qb kᵀ + bias over the keys of `runs` (the block's masked, scaled scores):
    one baddbmm when the keys are one run, else a bmm per run, then scaled and masked."""
    scale = n.attr("scale")
    bias = _block_bias(b, n, i0, i1, runs, s.dtype)
    if len(runs) == 1:
        _, lo, hi = runs[0]
        kt = k[:, lo:hi].transpose(1, 2)
        if bias is None:
            steps.append(lambda: torch.baddbmm(s, qb, kt, beta=0, alpha=scale, out=s))
        else:
            steps.append(lambda: torch.baddbmm(bias, qb, kt, alpha=scale, out=s))
        return
    for _, lo, hi, off in _cols(runs):
        steps.append(lambda sr=s[:, :, off:off + hi - lo], kt=k[:, lo:hi].transpose(1, 2):
                     torch.bmm(qb, kt, out=sr))
    steps.append(lambda: s.mul_(scale))
    if bias is not None:
        steps.append(lambda: s.add_(bias))


def _key_group_slices(packed: Tensor, sizes: list[int]) -> list[Tensor]:
    out, at = [], 0
    for size in sizes:
        out.append(packed[:, at:at + size])
        at += size
    return out


# -- the kernels ---------------------------------------------------------------------------------

@register_lowering(Op.ATTENTION, CPU)
def attention(b: "StepBuilder", n: Node, xs: list[Tensor], outs: list[Tensor]) -> list[Step]:
    q, ks, vs, _ = split(xs, n.attr_dict)
    o, lse = outs
    B, H, _, _ = q.shape
    steps: list[Step] = []
    packed = len(ks) > 1
    k, v = _pack(b, ks, steps), _pack(b, vs, steps)
    for i0, i1 in blocks(q.shape[2]):
        mark, bq = b.scratch.top, i1 - i0
        runs = _runs(n.attr_dict, i0, i1, packed)
        qb = _rows(b, q[:, :, i0:i1], steps)
        s = tmp(b, q, B * H, bq, sum(hi - lo for _, lo, hi in runs))
        m, l = tmp(b, q, B * H, bq, 1), tmp(b, q, B * H, bq, 1)
        _scores(b, n, qb, k, i0, i1, runs, s, steps)
        steps += [lambda s=s, m=m: torch.amax(s, -1, keepdim=True, out=m),   # softmax by exp2
                  lambda s=s, m=m: torch.exp2(s.sub_(m).mul_(LOG2E), out=s),
                  lambda s=s, l=l: torch.sum(s, -1, keepdim=True, out=l),
                  lambda s=s, l=l: s.div_(l)]
        oo = o[:, :, i0:i1]
        ob, direct = _result(b, oo, q)
        for j, (_, lo, hi, off) in enumerate(_cols(runs)):
            pr, vr = s[:, :, off:off + hi - lo], v[:, lo:hi]
            steps.append((lambda pr=pr, vr=vr, ob=ob: torch.bmm(pr, vr, out=ob)) if j == 0 else
                         (lambda pr=pr, vr=vr, ob=ob: torch.baddbmm(ob, pr, vr, out=ob)))
        if not direct:
            steps.append(lambda oo=oo, ob=ob: oo.copy_(ob.view(oo.shape)))
        ll = lse[:, :, i0:i1]                           # lse = max + log Σ exp(s − max)
        steps.append(lambda ll=ll, m=m.view(ll.shape), l=l.view(ll.shape):
                     torch.add(m, l.log_(), out=ll))
        b.scratch.top = mark                         # the next block reuses this scratch
    return steps


@register_lowering(Op.ATTENTION_BWD, CPU)
def attention_bwd(b: "StepBuilder", n: Node, xs: list[Tensor], outs: list[Tensor]) -> list[Step]:
    a = n.attr_dict
    q, ks, vs, (o, lse, do) = split(xs, a)
    dq, dk_outs, dv_outs, _ = split(outs, a)
    B, H, _, _ = q.shape
    scale = n.attr("scale")
    steps: list[Step] = []
    packed = len(ks) > 1
    k, v = _pack(b, ks, steps), _pack(b, vs, steps)
    # dk, dv accumulate over query blocks: in their buffers (one group, viewable, the compute
    # dtype), else in dense scratch copied into each group's gradient at the end
    (dk, dk_direct), (dv, dv_direct) = (
        _result(b, grads[0], q) if not packed else (tmp(b, q, *keys.shape), False)
        for grads, keys in ((dk_outs, k), (dv_outs, v)))
    steps += [lambda: dk.zero_(), lambda: dv.zero_()]
    for i0, i1 in blocks(q.shape[2]):
        mark, bq = b.scratch.top, i1 - i0
        runs = _runs(a, i0, i1, packed)
        n_vis = sum(hi - lo for _, lo, hi in runs)
        qb, dob, ob = (_rows(b, x[:, :, i0:i1], steps) for x in (q, do, o))
        p, ds = tmp(b, q, B * H, bq, n_vis), tmp(b, q, B * H, bq, n_vis)
        delta, t_o = tmp(b, q, B * H, bq, 1), tmp(b, q, B * H, bq, ob.shape[2])
        lb = _rows(b, lse[:, :, i0:i1].unsqueeze(-1), steps)
        _scores(b, n, qb, k, i0, i1, runs, p, steps)
        steps += [lambda p=p, lb=lb: torch.exp2(p.sub_(lb).mul_(LOG2E), out=p),  # exp(s − lse)
                  lambda t_o=t_o, dob=dob, ob=ob: torch.mul(dob, ob, out=t_o),
                  lambda t_o=t_o, delta=delta: torch.sum(t_o, -1, keepdim=True, out=delta)]
        for _, lo, hi, off in _cols(runs):
            pr, dsr, dvr = p[:, :, off:off + hi - lo], ds[:, :, off:off + hi - lo], dv[:, lo:hi]
            vt = v[:, lo:hi].transpose(1, 2)
            steps += [lambda pr=pr, dob=dob, dvr=dvr:
                      torch.baddbmm(dvr, pr.transpose(1, 2), dob, out=dvr),   # dv += pᵀ do
                      lambda dsr=dsr, dob=dob, vt=vt: torch.bmm(dob, vt, out=dsr)]   # dp
        steps.append(lambda ds=ds, p=p, delta=delta: ds.sub_(delta).mul_(p))  # (dp − δ) ∘ p
        dqo = dq[:, :, i0:i1]
        dqb, direct = _result(b, dqo, q)
        for j, (_, lo, hi, off) in enumerate(_cols(runs)):
            dsr, kr, dkr = ds[:, :, off:off + hi - lo], k[:, lo:hi], dk[:, lo:hi]
            steps += [lambda dsr=dsr, kr=kr, dqb=dqb, beta=float(j > 0):   # dq = scale·ds k
                      torch.baddbmm(dqb, dsr, kr, beta=beta, alpha=scale, out=dqb),
                      lambda dsr=dsr, qb=qb, dkr=dkr:                    # dk += scale·dsᵀ q
                      torch.baddbmm(dkr, dsr.transpose(1, 2), qb, alpha=scale, out=dkr)]
        if not direct:
            steps.append(lambda dqo=dqo, dqb=dqb: dqo.copy_(dqb.view(dqo.shape)))
        b.scratch.top = mark
    sizes = [x.shape[2] for x in ks]
    for acc, results, direct in ((dk, dk_outs, dk_direct), (dv, dv_outs, dv_direct)):
        if not direct:                               # each group's slice of the accumulator
            for part, res in zip(_key_group_slices(acc, sizes), results):
                steps.append(lambda part=part, res=res: res.copy_(part.view(res.shape)))
    return steps
