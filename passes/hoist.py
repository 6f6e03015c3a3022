"""hoist_scan_invariants: the work of a chunk recurrence that does not depend on its carries
runs once, over every iteration at once, before the scan.

A memory-chunk scan's backward body (`passes/autodiff.py`) recomputes the chunk's forward from
the checkpointed state W_t, which it reads as an xs slice, not a carry: projections through
W_t, the inner loss's residuals, the gates' cumulative sums. None of it depends on the
cotangents the reverse scan carries, yet it ran inside the serial loop, once per chunk, in one
program per (batch, head): a third of tiny.yaml's chunk-backward kernel (the largest kernel
to compile) and work a GPU could spread over every chunk.

Rule. In the body of a SCAN whose role is a chunk recurrence (`codegen.scan.KERNEL_ROLES`), a
node is *hoisted* when an xs slice reaches it and no carry does, and it and every node on the
way have a batching rule (elementwise ops, reductions, cumsums, einsums and views: each
computes the same over a new leading axis of `length`). It is built outside on the stacked
operands ([length, ...]), and its result passed back in as a new xs where a node that stays
in the body (or a body output) reads it. Nodes that read no xs (constants) stay in the body,
and so do views at the edge of the hoisted set (free index arithmetic in a scan kernel).
Only a scan with a hoistable einsum is rewritten: a forward chunk scan multiplies by the
carried W in every product, and what it could hoist (the gates' cumsums, a few exps) costs
less in its loop than the kernels it would add (tiny.yaml: five, about 3 s of sm_90 compile,
for a forward scan kernel about 1 s cheaper).

Cost: what the body reads of the hoisted work is stored for every iteration at once (the
new xs, [length, ...] each) instead of in the kernel's per-program workspace for one chunk
at a time. The training arena (report.json `memory.arena_bytes`): tiny.yaml 12.8 -> 14.3 MB
(+11%, 25 values of the chunk backward, 2 MB), tiny_lmm +10%, tiny_mag +9%, tiny_mal +4%,
large_125m 3.79 -> 3.88 GB (+2.3%: its chunk groups bound what one scan holds).

The result computes the same values (each hoisted node on each iteration's slice), in a
different order of loops: float64 parity holds exactly up to the summation order of a
batched matmul.

Pre: `g` verifies. Post: the same outputs; no chunk-recurrence scan body holds a hoistable
node. Nested bodies are rewritten first (a scan inside a scan body: the hoisted work lands in
the enclosing body).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from titanc.ir import Graph, Node, Op, OpGroup

__all__ = ["HoistScanInvariants", "hoist_scan_invariants", "HOIST_ROLES"]

# scan roles whose bodies are rewritten (`codegen.scan.KERNEL_ROLES`: one kernel per scan)
HOIST_ROLES = frozenset({"memory", "memory_group"})
_WORK = frozenset({Op.SUM, Op.AMAX, Op.CUMSUM, Op.EINSUM})
_AXIS_OPS = frozenset({Op.SLICE, Op.PAD, Op.CONCAT, Op.CUMSUM})


def _batchable(n: Node) -> bool:
    """Does `n` have a batching rule (the same op over a new leading axis)?"""
    return (n.op in OpGroup.ELEMENTWISE or n.op in _WORK or n.op in OpGroup.VIEW
            or n.op in (Op.PAD, Op.CONCAT))


@dataclass(frozen=True)
class HoistScanInvariants:
    """Carry-independent per-iteration work of chunk-recurrence scans, hoisted before them
    (module docstring).

    Pre: `g` verifies. Post: the same outputs; chunk-recurrence bodies hold no hoistable node."""
    name: ClassVar[str] = "hoist_scan_invariants"

    def __call__(self, g: Graph) -> Graph:
        return hoist_scan_invariants(g)


def hoist_scan_invariants(g: Graph) -> Graph:
    if not any(n.op is Op.SCAN for n in g):
        return g
    out = Graph(g.name)
    env: dict[int, int] = {}
    for n in g:
        ins = [env[i] for i in n.inputs]
        if n.op is not Op.SCAN:
            env[n.id] = out.add_like(n, ins)
            continue
        body = hoist_scan_invariants(n.attr("body"))
        if n.attr("role", "loop") in HOIST_ROLES:
            env[n.id] = _hoist(out, n, body, ins)
        else:
            env[n.id] = out.add_like(n, ins, body=body)
    out.set_outputs([(name, env[i]) for name, i in g.outputs])
    return out


def _hoist(out: Graph, n: Node, body: Graph, ins: list[int]) -> int:
    """Scan `n` (body `body`, operands `ins` in `out`) rebuilt in `out` with its hoistable
    nodes computed before it; returns the new scan's id."""
    a = n.attr_dict
    nc, nx, length = a["n_carry"], a["n_xs"], a["length"]
    inputs = body.inputs
    carry_in, xs_in, const_in = inputs[:nc], inputs[nc:nc + nx], inputs[nc + nx:]
    variant = set(carry_in)                            # a carry reaches them
    per_iter = set(xs_in)                              # an xs slice does, and no carry
    for v in body.order():
        m = body.node(v)
        if m.op is Op.INPUT:
            continue
        reads_carry = any(i in variant for i in m.inputs)
        reads_xs = any(i in per_iter for i in m.inputs)
        if m.op is Op.SCAN or reads_carry or (reads_xs and not _batchable(m)):
            variant.add(v)
        elif reads_xs:
            per_iter.add(v)
    hoisted = per_iter - set(xs_in)
    outputs = {v for _, v in body.outputs}
    # views at the edge of the hoisted set stay in the body (index arithmetic there)
    changed = True
    while changed:
        changed = False
        for v in sorted(hoisted):
            m = body.node(v)
            if m.op in OpGroup.INDEXING and v not in outputs and all(
                    u not in hoisted for u in body.users(v)):
                hoisted.discard(v)
                changed = True
    if not any(body.node(v).op is Op.EINSUM for v in hoisted):
        return out.add_like(n, ins, body=body)
    # the hoisted values the body still reads, in body order: the new xs
    frontier = [v for v in body.order() if v in hoisted and (
        v in outputs or any(u not in hoisted for u in body.users(v)))]

    batched: dict[int, int] = {}                       # body id -> [length, ...] value in out
    for j, v in enumerate(xs_in):
        batched[v] = ins[nc + j]
    flat: dict[int, int] = {}                          # body id -> unbatched value in out
    for j, v in enumerate(const_in):
        flat[v] = ins[nc + nx + j]

    def unbatched(v: int) -> int:
        """A body value that reads no xs and no carry, built once in `out`."""
        if v not in flat:
            m = body.node(v)
            flat[v] = out.add_like(m, [unbatched(i) for i in m.inputs])
        return flat[v]

    def lift(v: int, rank: int) -> int:
        """Batched value `v` ([length] + s) as [length] + [1] * (rank - len(s)) + s."""
        x = batched[v]
        s = body.node(v).type.shape
        if len(s) == rank:
            return x
        return out.add(Op.RESHAPE, [x], {"shape": (length,) + (1,) * (rank - len(s)) + s})

    for v in body.order():
        if v not in hoisted:
            continue
        m = body.node(v)
        op, attrs = m.op, m.attr_dict
        rank = m.type.rank
        if op is Op.EINSUM:
            lhs, res = attrs["spec"].split("->")
            used = set(attrs["spec"])
            z = next(ch for ch in "zyxwvutsrqponmlkjihgfedcbaZYXWVUTSRQPONMLKJIHGFEDCBA"
                     if ch not in used)
            terms, args = [], []
            for term, i in zip(lhs.split(","), m.inputs):
                if i in batched:
                    terms.append(z + term)
                    args.append(batched[i])
                else:
                    terms.append(term)
                    args.append(unbatched(i))
            batched[v] = out.add(op, args, {**attrs, "spec": ",".join(terms) + "->" + z + res})
        elif op in OpGroup.ELEMENTWISE:
            args = [lift(i, rank) if i in batched else unbatched(i) for i in m.inputs]
            batched[v] = out.add(op, args, attrs)
        elif op in (Op.SUM, Op.AMAX):
            src_rank = body.node(m.inputs[0]).type.rank
            axes = tuple(ax % src_rank + 1 for ax in attrs["axes"])
            batched[v] = out.add(op, [batched[m.inputs[0]]], {**attrs, "axes": axes})
        elif op in _AXIS_OPS:
            src_rank = body.node(m.inputs[0]).type.rank
            args = [batched[i] if i in batched else _broadcast(out, unbatched(i), length,
                                                               body.node(i).type.shape)
                    for i in m.inputs]
            batched[v] = out.add(op, args, {**attrs, "axis": attrs["axis"] % src_rank + 1})
        elif op is Op.RESHAPE or op is Op.EXPAND:
            x = lift(m.inputs[0], rank) if op is Op.EXPAND else batched[m.inputs[0]]
            batched[v] = out.add(op, [x], {**attrs, "shape": (length,) + tuple(attrs["shape"])})
        elif op is Op.PERMUTE:
            perm = (0,) + tuple(p % rank + 1 for p in attrs["perm"])
            batched[v] = out.add(op, [batched[m.inputs[0]]], {**attrs, "perm": perm})
        else:                                          # _batchable and this list agree
            raise AssertionError(f"no batching rule for {op.name}")

    # the body without the hoisted nodes: the frontier values become xs after the old ones
    nb = Graph(body.name)
    benv: dict[int, int] = {}
    for v in carry_in + xs_in:
        benv[v] = nb.add_like(body.node(v))
    for k, v in enumerate(frontier):
        benv[v] = nb.add(Op.INPUT, (), {"name": f"hoisted{k}"}, body.node(v).type)
    for v in const_in:
        benv[v] = nb.add_like(body.node(v))
    live: set[int] = set()                             # what the body still computes
    stack = [v for _, v in body.outputs]
    while stack:
        v = stack.pop()
        if v not in live:
            live.add(v)
            if v not in hoisted:
                stack.extend(body.node(v).inputs)
    for v in body.order():
        if v in benv or v in hoisted or v not in live:
            continue
        m = body.node(v)
        benv[v] = nb.add_like(m, [benv[i] for i in m.inputs])
    nb.set_outputs([(name, benv[v]) for name, v in body.outputs])
    new_ins = ins[:nc + nx] + [batched[v] for v in frontier] + ins[nc + nx:]
    return out.add_like(n, new_ins, body=nb, n_xs=nx + len(frontier))


def _broadcast(out: Graph, x: int, length: int, shape: tuple[int, ...]) -> int:
    """Unbatched value `x` of `shape` repeated over a new leading axis of `length`."""
    r = out.add(Op.RESHAPE, [x], {"shape": (1,) + tuple(shape)})
    return out.add(Op.EXPAND, [r], {"shape": (length,) + tuple(shape)})
