"""flash_attention: the attention subgraph -> one ATTENTION pattern op (a template kernel).

    p = div(exp(s - amax(s)), sum(exp(s - amax(s))))       s = einsum[xyqe,xyke->xyqk](q, k)
                                                                · scale + MASK
    o = einsum[xyqk,xyke->xyqf](p, v)
      ->  o = ITEM 0 of ATTENTION(q, k_1..k_G, v_1..v_G; scale, n_q, q_start, groups)

The op takes one key and one value operand per key group of the MASK: where k (v) is a
CONCAT along the key axis whose pieces are the groups (MAC's [persistent ‖ memory ‖
segment], SWA's [persistent ‖ sequence]), the pieces themselves, so the concatenation is
never materialised (each piece, often a permuted or batch-expanded view, is read through its
strides); otherwise a SLICE view of k per group.

The MASK's attrs become the op's attrs, so the visible (query, key) pairs are known statically:
the flash kernels (`codegen/lower/patterns.py`, `runtime/targets/pattern_kernels.py`) never hold a
[B, H, Tq, Tk] scores or probabilities tensor. The op also returns the log-sum-exp of each
query row (ITEM 1): its VJP (`passes/autodiff.py`) is one ATTENTION_BWD that recomputes the
probabilities from it. Run it after canonicalize and before autodiff (so the backward
differentiates the op, never the softmax).

Precondition: `g` verifies and is canonical. Postcondition: the result verifies and computes
the same values; no scores -> softmax -> PV chain of the form above remains where it applies.
The rule refuses (leaves the chain as it is) when
- an intermediate of the chain (scores, probabilities, their max or sum) has a reader outside
  the chain, or is a graph output;
- the mask is not aligned with the queries (a decoder's `q_start > 0`, or a causal key group
  whose length differs from the number of queries): the kernels number keys of a causal group
  from query 0.
`TITANC_DEBUG=2` prints each refusal. Scan bodies are rewritten recursively.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, ClassVar

from titanc.ir import Graph, Node, Op
from titanc.ir.attention import split, stat_dtype

from titanc.config import debug_level


def _einsum_terms(n: Node) -> tuple[str, str, str] | None:
    if n.op is not Op.EINSUM or len(n.inputs) != 2:
        return None
    lhs, out = n.attr("spec").split("->")
    a, b = lhs.split(",")
    return a, b, out


def _is_scores(n: Node) -> bool:
    """einsum[xyqe,xyke->xyqk]: q kᵀ per (batch, head)."""
    t = _einsum_terms(n)
    if t is None:
        return False
    a, b, out = t
    return (len(a) == len(b) == len(out) == 4 and len(set(a + b)) == 5
            and a[:2] == b[:2] == out[:2] and a[3] == b[3] and out[2:] == a[2] + b[2])


def _is_pv(n: Node) -> bool:
    """einsum[xyqk,xyke->xyqe]: probabilities times values."""
    t = _einsum_terms(n)
    if t is None:
        return False
    a, b, out = t
    return (len(a) == len(b) == len(out) == 4 and len(set(a + b)) == 5
            and a[:2] == b[:2] == out[:2] and a[3] == b[2] and out[2:] == a[2] + b[3])


def _last_axis(n: Node) -> bool:
    return tuple(n.attr("axes")) in ((3,), (-1,)) and n.attr("keepdim")


class _Matcher:
    def __init__(self, g: Graph):
        self.g = g
        self.outs = {i for _, i in g.outputs}
        self.why = ""

    def refuse(self, why: str) -> None:
        self.why = why
        return None

    def only_users(self, nid: int, allowed: set[int]) -> bool:
        return nid not in self.outs and set(self.g.users(nid)) <= allowed

    def match(self, pv: Node) -> tuple[tuple[int, int, int], dict[str, Any], set[int]] | None:
        """((q, k, v), attrs, chain node ids) if `pv` ends an attention chain."""
        g = self.g
        if not _is_pv(pv):
            return None
        div = g.node(pv.inputs[0])
        if div.op is not Op.DIV:
            return None
        e, s = (g.node(i) for i in div.inputs)
        if e.op is not Op.EXP or s.op is not Op.SUM or s.inputs[0] != e.id or not _last_axis(s):
            return None
        sub = g.node(e.inputs[0])
        if sub.op is not Op.SUB:
            return None
        x, m = (g.node(i) for i in sub.inputs)
        if m.op is not Op.AMAX or m.inputs[0] != x.id or not _last_axis(m):
            return None
        # x = scores · scale + mask, in either operand order; scale and mask optional
        mask, scale, node = None, 1.0, x
        chain = {div.id, e.id, s.id, sub.id, m.id, x.id}
        if node.op is Op.ADD:
            a, b = (g.node(i) for i in node.inputs)
            mask, node = (a, b) if a.op is Op.MASK else (b, a) if b.op is Op.MASK else (None, node)
            if mask is None:
                return self.refuse(f"%{x.id}: an added bias that is not a MASK")
            if mask.type.shape != x.type.shape[2:]:
                return self.refuse(f"%{mask.id}: a mask that varies over batch or heads")
        if node.op is Op.MUL:
            a, b = (g.node(i) for i in node.inputs)
            const = a if a.op is Op.FULL and a.type.shape == () else (
                b if b.op is Op.FULL and b.type.shape == () else None)
            if const is None:
                return self.refuse(f"%{node.id}: scores scaled by a non-constant")
            scale = float(const.attr("value"))
            chain.add(node.id)
            node = b if const is a else a
        if not _is_scores(node):
            return None
        chain.add(node.id)
        q, k = node.inputs
        n_q, n_k = x.type.shape[2], x.type.shape[3]
        if mask is None:
            attrs = {"n_q": n_q, "q_start": 0, "groups": (("all", n_k, None),)}
        else:
            attrs = {key: mask.attr(key) for key in ("n_q", "q_start", "groups")}
            bad = [gr for gr in attrs["groups"] if gr[0] == "causal" and gr[1] != n_q]
            if attrs["q_start"] != 0 or bad:
                return self.refuse(f"%{mask.id}: mask not aligned with the queries "
                                   f"(q_start={attrs['q_start']}, causal groups {bad})")
        # every intermediate is read only inside the chain
        readers = {x.id: {m.id, sub.id}, m.id: {sub.id}, sub.id: {e.id}, e.id: {s.id, div.id},
                   s.id: {div.id}, div.id: {pv.id}}
        for nid in chain - set(readers):                 # scores and scale-mul feed forward
            readers[nid] = {u for u in chain | {pv.id} if nid in g.node(u).inputs}
        for nid, allowed in readers.items():
            if not self.only_users(nid, allowed):
                return self.refuse(f"%{nid} of the attention chain ending at %{pv.id} is read "
                                   f"outside it")
        attrs["scale"] = scale
        return (q, k, pv.inputs[1]), attrs, chain


def _pieces(g: Graph, x: int) -> list[int]:
    """The operands of `x` concatenated along the key axis (2), nested CONCATs flattened."""
    n = g.node(x)
    if n.op is not Op.CONCAT or n.attr("axis") % 4 != 2:
        return [x]
    return [p for i in n.inputs for p in _pieces(g, i)]


def _per_group(g: Graph, out: Graph, env: dict[int, int], x: int, lengths: list[int]) -> list[int]:
    """Key (or value) `x` of an attention op as one operand per key group of `lengths` (in
    `out`): the CONCAT pieces when they are exactly the groups, else a SLICE view per group."""
    pieces = _pieces(g, x)
    if [g.node(p).type.shape[2] for p in pieces] == lengths:
        return [env[p] for p in pieces]
    if len(lengths) == 1:
        return [env[x]]
    res, lo = [], 0
    for length in lengths:
        res.append(out.add(Op.SLICE, (env[x],), {"axis": 2, "start": lo, "stop": lo + length}))
        lo += length
    return res


def flash_attention(g: Graph) -> Graph:
    """`g` with every attention chain replaced by ATTENTION (scan bodies too)."""
    mt = _Matcher(g)
    found: dict[int, tuple[tuple[int, int, int], dict[str, Any]]] = {}
    dead: set[int] = set()
    for node in g:
        if node.op is Op.EINSUM:
            hit = mt.match(node)
            if hit is not None:
                found[node.id] = hit[:2]
                dead |= hit[2]
            elif mt.why and debug_level() >= 2:
                print(f"[titanc] flash_attention {g.name}: %{node.id} left as is: {mt.why}",
                      file=sys.stderr)
            mt.why = ""
    out = Graph(g.name)
    env: dict[int, int] = {}
    for node in g:
        if node.id in dead:
            continue
        if node.id in found:
            (q, k, v), attrs = found[node.id]
            lengths = [length for _, length, _ in attrs["groups"]]
            ks, vs = (_per_group(g, out, env, x, lengths) for x in (k, v))
            att = out.add(Op.ATTENTION, (env[q], *ks, *vs), attrs)
            env[node.id] = out.add(Op.ITEM, (att,), {"index": 0})
            continue
        extra = {"body": flash_attention(node.attr("body"))} if node.op is Op.SCAN else {}
        env[node.id] = out.add_like(node, (env[i] for i in node.inputs), **extra)
    out.set_outputs([(name, env[i]) for name, i in g.outputs])
    return _prune(out) if found else out


def _prune(g: Graph) -> Graph:
    """`g` without the nodes no output reads (the chain's now unread MASK and scale)."""
    live = g.reachable_from_outputs()
    out = Graph(g.name)
    env: dict[int, int] = {}
    for node in g:
        if node.id in live or node.op is Op.INPUT:
            env[node.id] = out.add_like(node, (env[i] for i in node.inputs))
    out.set_outputs([(name, env[i]) for name, i in g.outputs])
    return out


@dataclass(frozen=True)
class FlashAttention:
    """Attention chains -> ATTENTION pattern ops: `flash_attention(g)`.

    Pre: `g` verifies and is canonical. Post: same values; every scores -> mask -> softmax ->
    PV chain whose intermediates nothing else reads is one ATTENTION (module docstring)."""
    name: ClassVar[str] = "flash_attention"

    def __call__(self, g: Graph) -> Graph:
        return flash_attention(g)


# -- the inverse, for kernels that compute the chain themselves ----------------------------------

def _add(out: Graph, op: Op, ins: tuple[int, ...], **attrs: Any) -> int:
    return out.add(op, ins, attrs)


def _scores(out: Graph, q: int, k: int, a: dict, dt: str) -> int:
    """scale · q kᵀ + MASK, [b, h, q, k]."""
    s = _add(out, Op.EINSUM, (q, k), spec="bhqe,bhke->bhqk")
    scale = _add(out, Op.FULL, (), value=float(a["scale"]), shape=(), dtype=dt)
    mask = _add(out, Op.MASK, (), n_q=a["n_q"], q_start=a["q_start"], groups=a["groups"],
                dtype=dt)
    return _add(out, Op.ADD, (_add(out, Op.MUL, (s, scale)), mask))


def _rows(out: Graph, x: int, shape: tuple[int, ...]) -> int:
    """[b, h, q] -> [b, h, q, 1]."""
    return _add(out, Op.RESHAPE, (x,), shape=tuple(shape) + (1,))


def _narrow(out: Graph, x: int, dtype: str) -> int:
    """`x` cast to `dtype` (the op's result type) when the chain computed it wider."""
    return x if out.node(x).type.dtype == dtype else _add(out, Op.CAST, (x,), dtype=dtype)


def expand_attention(g: Graph) -> Graph:
    """`g` with every ATTENTION / ATTENTION_BWD (scan bodies too) written back as the
    primitive chain it stands for (the reference semantics of `ir/attention.py`): for a kernel
    that computes the chain itself, a scan kernel, whose body's values live in its own
    workspace rather than in the buffer plan."""
    if not any(n.op in (Op.ATTENTION, Op.ATTENTION_BWD) or n.op is Op.SCAN for n in g):
        return g
    out = Graph(g.name)
    env: dict[int, int] = {}
    parts: dict[int, tuple[int, ...]] = {}               # pattern op -> its results
    for node in g:
        ins = tuple(env[i] for i in node.inputs if i in env)
        if node.op is Op.ITEM and node.inputs[0] in parts:
            env[node.id] = parts[node.inputs[0]][node.attr("index")]
            continue
        if node.op not in (Op.ATTENTION, Op.ATTENTION_BWD):
            extra = {"body": expand_attention(node.attr("body"))} if node.op is Op.SCAN else {}
            env[node.id] = out.add_like(node, (env[i] for i in node.inputs), **extra)
            continue
        a, low = node.attr_dict, g.node(node.inputs[0]).type.dtype
        # bf16 operands: the chain runs in float32 (as the op does inside), results cast back
        dt = stat_dtype(low)
        ins = tuple(i if out.node(i).type.dtype == dt else _add(out, Op.CAST, (i,), dtype=dt)
                    for i in ins)
        q, ks, vs, rest = split(list(ins), a)
        k, v = (x[0] if len(x) == 1 else _add(out, Op.CONCAT, tuple(x), axis=2) for x in (ks, vs))
        rows = tuple(g.node(node.inputs[0]).type.shape[:3])
        z = _scores(out, q, k, a, dt)
        if node.op is Op.ATTENTION:
            mx = _add(out, Op.AMAX, (z,), axes=(3,), keepdim=True)
            e = _add(out, Op.EXP, (_add(out, Op.SUB, (z, mx)),))
            den = _add(out, Op.SUM, (e,), axes=(3,), keepdim=True)
            o = _add(out, Op.EINSUM, (_add(out, Op.DIV, (e, den)), v), spec="bhqk,bhke->bhqe")
            lse = _add(out, Op.ADD, (_add(out, Op.RESHAPE, (mx,), shape=rows),
                                     _add(out, Op.LOG, (_add(out, Op.RESHAPE, (den,),
                                                              shape=rows),))))
            parts[node.id] = (_narrow(out, o, low), lse)
            continue
        o, lse, do = rest
        p = _add(out, Op.EXP, (_add(out, Op.SUB, (z, _rows(out, lse, rows))),))
        dv = _add(out, Op.EINSUM, (p, do), spec="bhqk,bhqe->bhke")
        dp = _add(out, Op.EINSUM, (do, v), spec="bhqe,bhke->bhqk")
        delta = _add(out, Op.SUM, (_add(out, Op.MUL, (do, o)),), axes=(3,), keepdim=True)
        ds = _add(out, Op.MUL, (p, _add(out, Op.SUB, (dp, delta))))
        scale = _add(out, Op.FULL, (), value=float(a["scale"]), shape=(), dtype=dt)
        dq = _add(out, Op.MUL, (_add(out, Op.EINSUM, (ds, k), spec="bhqk,bhke->bhqe"), scale))
        dk = _add(out, Op.MUL, (_add(out, Op.EINSUM, (ds, q), spec="bhqk,bhqe->bhke"), scale))
        grads = [dq]
        for full in (dk, dv):
            lo = 0
            for _, length, _ in a["groups"]:
                grads.append(full if len(ks) == 1 else
                             _add(out, Op.SLICE, (full,), axis=2, start=lo, stop=lo + length))
                lo += length
        parts[node.id] = tuple(_narrow(out, x, low) for x in grads)
    out.set_outputs([(name, env[i]) for name, i in g.outputs])
    return out
