"""hoist_scan_invariants: the work of a chunk recurrence that does not depend on its carries
runs once, over every iteration at once, before the scan.

A memory-chunk scan's backward body (`passes/autodiff.py`) recomputes the chunk's forward from
the checkpointed state W_t, which it reads as an xs slice, not a carry: projections through
W_t, the inner loss's residuals, the gates' cumulative sums. None of it depends on the
cotangents the reverse scan carries, yet it ran inside the serial loop, once per chunk, in one
program per (batch, head): a third of tiny.yaml's chunk-backward kernel (the largest kernel
to compile) and work a GPU could spread over every chunk.

Rule. In the body of a SCAN whose role is a chunk recurrence (`codegen.scan.kernel.KERNEL_ROLES`), a
node is *hoisted* when an xs slice reaches it and no carry does, and it and every node on the
way have a batching rule (elementwise ops, reductions, cumsums, einsums and views: each
computes the same over a new leading axis of `length`; a nested scan whose body batches
whole: the same iterations over carries and slices with the new axis first, its stacked xs
and ys transposed to [steps, length, ...] and back, and the ITEMs of it). It is built outside on the stacked
operands ([length, ...]), and its result passed back in as a new xs where a node that stays
in the body (or a body output) reads it. Nodes that read no xs (constants) stay in the body,
and so do views at the edge of the hoisted set (free index arithmetic in a scan kernel).
Only a scan with a hoistable einsum is rewritten: a forward chunk scan multiplies by the
carried W in every product, and what it could hoist (the gates' cumsums, a few exps) costs
less in its loop than the kernels it would add (tiny.yaml: five, about 3 s of sm_90 compile,
for a forward scan kernel about 1 s cheaper). Where the scans run as host loops (large_125m,
`codegen.scan.kernel.scan_kernel_for`'s cost rule) the gates cost 3 of a chunk's 7 launches:
`gates` (spec `compile.hoist_gates`, off by default) rewrites those scans too (docs/gpu.md).

Cost: what the body reads of the hoisted work is stored for every iteration at once (the
new xs, [length, ...] each) instead of in the kernel's per-program workspace for one chunk
at a time. The training arena (report.json `memory.arena_bytes`): tiny.yaml 12.8 -> 14.3 MB
(+11%, 25 values of the chunk backward, 2 MB), tiny_lmm +10%, tiny_mag +9%, tiny_mal +4%,
large_125m 3.79 -> 3.88 GB (+2.3%: its chunk groups bound what one scan holds).

The result computes the same values (each hoisted node on each iteration's slice), in a
different order of loops: float64 parity holds exactly up to the summation order of a
batched matmul.

The nested rule (`nested`, spec `compile.hoist_groups`, off by default) is what a chunk-group
backward can use (role memory_group, passes/checkpoint_chunks.py): its body re-runs the
group's chunks forward from the group's saved state (an xs slice) before the reverse chunk
scan that reads the carried cotangents. Hoisted, that forward runs once for every group at
once (one scan kernel over groups x batch x heads: large_125m 4 x 8 x 4 = 128 programs, the
group backward's sm_90 compile 54.8 -> 33.2 s), and so does the work between it and the
reverse scan; the group loop keeps the reverse scan alone. The price is what the groups were
made to save: every group's recomputed activations live at once (training arena large_125m
3.61 -> 4.13 GiB, tiny_lmm 15.5 -> 24.7 MB), so it is a choice, not the default.

A cast of an xs slice (mixed precision's bf16 chunk checkpoint, widened by the backward) is
a conversion on load: the body keeps its own for its readers there and it is hoisted only for
hoisted readers. Hoisted for the body too, it stored a float32 copy of every chunk's
checkpoint for the body to read back (large_125m bf16: 43.5 GB a step).

The reads sink (`_sink_reads`, spec `compile.sink_reads`). A forward chunk scan's reads, each
chunk's queries through the memory at the chunk's start state (docs/semantics.md: a token
never reads its own chunk's write), feed its ys and no carry: they are computed after the
scan for every chunk at once, batched matmuls over chunks x batch x memory heads, from the
start states the scan stacks (a ys output it has already, such as the backward's saved
checkpoint, or a new one), as flash-linear-attention computes its outputs from the states it
saves per chunk. The serial loop keeps the write. Sunk: the nodes that no carry output needs,
that read only the start state (a carry input or a cast of one), the slices, constants and
each other, and that a ys output or another sunk node alone reads; a start state the scan
also stacks as the backward's checkpoint is stacked once (`_stack_once`), read by one ITEM.
Every other scan stacks each of its values once too: a MAC segment scan stacks the memory's
state at each segment start, cast to bf16, for its backward's checkpoint and again for the
start states of its chunk scans' sunk reads (large_125m bf16: 685 MiB of training arena and
0.9 GB a step of writes). `auto` sinks where a
(batch, memory head) slice's state exceeds `SINK_MIN_STATE` values, the size at which the
scan runs as a host loop of full-chip kernels: large_125m bf16 21,538 launches a step for
24,034 (the forward and its recompute lose their reads' launches every chunk), training
arena 2,085 MiB for 2,168, predicted 694 ms for 701 on an H200; with its memory scans as
scan kernels (`TITANC_SCAN_COST=0`) 2,450 -> 2,219 ms (the reads' FLOPs leave the 32-program
serial loop). The stacked start states cost [length] x the state where nothing stacked them.

Pre: `g` verifies. Post: the same outputs; no chunk-recurrence scan body holds a hoistable
node, nor (where its state is large) a sinkable read. Nested bodies are rewritten first (a scan inside a scan body: the hoisted work lands in
the enclosing body, and may be hoisted from there in turn).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from titanc.ir import Graph, Node, Op, OpGroup

__all__ = ["HoistScanInvariants", "hoist_scan_invariants", "HOIST_ROLES", "SINK_MIN_STATE"]

# scan roles whose bodies are rewritten (`codegen.scan.kernel.KERNEL_ROLES`: one kernel per scan)
HOIST_ROLES = frozenset({"memory", "memory_group"})
_WORK = frozenset({Op.SUM, Op.AMAX, Op.CUMSUM, Op.EINSUM})
# elements of carried state per (batch, memory head) slice above which a forward chunk scan's
# reads sink (`_sink_reads`): 64K float32 values fill an SM's register file, so one program
# cannot hold the state, and the scan runs as a host loop of full-chip kernels (the cost rule,
# `codegen.scan.kernel.scan_kernel_for`) where a read in the loop costs launches every chunk;
# below it the read is a few tile rounds of the scan kernel, cheaper than kernels outside
SINK_MIN_STATE = 65_536
_AXIS_OPS = frozenset({Op.SLICE, Op.PAD, Op.CONCAT, Op.CUMSUM})


def _batchable(n: Node, nested: bool = True) -> bool:
    """Does `n` have a batching rule (the same op over a new leading axis)? A nested scan has
    one (where `nested`) when every node of its body that its operands reach has (the scan
    over the same iterations, every carry and slice with the new axis first); an ITEM picks
    from a batched scan."""
    if n.op is Op.SCAN:
        if not nested:
            return False
        body = n.attr("body")
        reached = set(body.inputs)                     # every operand batched, at worst
        for v in body.order():
            m = body.node(v)
            if m.op is not Op.INPUT and any(i in reached for i in m.inputs):
                if not _batchable(m):
                    return False
                reached.add(v)
        return True
    return (n.op in OpGroup.ELEMENTWISE or n.op in _WORK or n.op in OpGroup.VIEW
            or n.op in (Op.PAD, Op.CONCAT, Op.ITEM))


@dataclass(frozen=True)
class HoistScanInvariants:
    """Carry-independent per-iteration work of chunk-recurrence scans, hoisted before them
    (module docstring).

    Pre: `g` verifies. Post: the same outputs; chunk-recurrence bodies hold no hoistable node.
    `nested`: nested scans are hoistable too (compile.hoist_groups); `gates`: a scan whose
    hoistable work holds no einsum is rewritten too (compile.hoist_gates); `sink`: a forward
    chunk scan's reads at its chunks' start states run after it where its state per slice
    exceeds this many values (compile.sink_reads; None: never); `once`: every other scan
    stacks a value it saves for two users once too (compile.stack_once)."""
    nested: bool = False
    gates: bool = False
    sink: int | None = SINK_MIN_STATE
    once: bool = True
    name: ClassVar[str] = "hoist_scan_invariants"

    def __call__(self, g: Graph) -> Graph:
        return hoist_scan_invariants(g, self.nested, self.gates, self.sink, self.once)


def hoist_scan_invariants(g: Graph, nested: bool = False, gates: bool = False,
                          sink: int | None = None, once: bool = True) -> Graph:
    if not any(n.op is Op.SCAN for n in g):
        return g
    out = Graph(g.name)
    env: dict[int, int] = {}
    # a scan whose reads sank: its old output index -> ("item", new index) or ("value", id)
    moved: dict[int, dict[int, tuple[str, int]]] = {}
    items: dict[tuple[int, int], int] = {}             # (rebuilt scan, element) -> its ITEM
    for n in g:
        ins = [env[i] for i in n.inputs]
        if n.op is Op.ITEM and n.inputs[0] in moved:
            kind, x = moved[n.inputs[0]][n.attr("index")]
            if kind == "item":                         # one ITEM an element (ir/verify.py)
                if (ins[0], x) not in items:
                    items[ins[0], x] = out.add_like(n, ins, index=x)
                x = items[ins[0], x]
            env[n.id] = x
            continue
        if n.op is not Op.SCAN:
            env[n.id] = out.add_like(n, ins)
            continue
        body = hoist_scan_invariants(n.attr("body"), nested, gates, sink, once)
        if n.attr("role", "loop") in HOIST_ROLES:
            env[n.id] = _hoist(out, n, body, ins, nested, gates)
            sunk = None if sink is None else _sink_reads(out, env[n.id], sink)
            if sunk is not None:
                env[n.id], moved[n.id] = sunk
            single = _stack_once(out, env[n.id])
            if single is not None:
                env[n.id], twice = single
                moved[n.id] = {k: twice[v[1]] if v[0] == "item" else v
                               for k, v in moved.get(n.id, {i: ("item", i) for i in twice}).items()}
        else:
            env[n.id] = out.add_like(n, ins, body=body)
            stacked = _stack_once(out, env[n.id]) if once else None   # a segment's checkpoint
            if stacked is not None:                                    # and its chunks' reads
                env[n.id], moved[n.id] = stacked
    out.set_outputs([(name, env[i]) for name, i in g.outputs])
    live = out.reachable_from_outputs()                # a rebuilt scan leaves its old one
    if all(n.id in live or n.op is Op.INPUT for n in out):
        return out
    kept = Graph(g.name)
    kenv: dict[int, int] = {}
    for n in out:
        if n.id in live or n.op is Op.INPUT:
            kenv[n.id] = kept.add_like(n, [kenv[i] for i in n.inputs])
    kept.set_outputs([(name, kenv[i]) for name, i in out.outputs])
    return kept


def _same_value(body: Graph, u: int, v: int) -> bool:
    """Are body values u and v the same: one node, or one cast of one value?"""
    mu, mv = body.node(u), body.node(v)
    return u == v or (mu.op is Op.CAST and mv.op is Op.CAST and mu.inputs == mv.inputs
                      and mu.type == mv.type)


def _stack_once(out: Graph, sid: int) -> tuple[int, dict[int, tuple[str, int]]] | None:
    """Scan `sid` of `out` rebuilt with each of its stacked ys once: a ys output that is the
    same value as an earlier one (the start state the sunk reads stack, when autodiff saves
    the same checkpoint of the same carry) is dropped and read from the earlier. Returns (the
    new scan's id, old output index -> ("item", new index)), or None where none repeats."""
    n = out.node(sid)
    body: Graph = n.attr("body")
    nc = n.attr("n_carry")
    ys = body.outputs[nc:]
    first: list[int] = []
    for k, (_, v) in enumerate(ys):
        first.append(next(j for j in range(k + 1) if _same_value(body, ys[j][1], v)))
    if first == list(range(len(ys))):
        return None
    keep = [k for k in range(len(ys)) if first[k] == k]
    outs = body.outputs[:nc] + [ys[k] for k in keep]
    live: set[int] = set()
    stack = [v for _, v in outs]
    while stack:
        v = stack.pop()
        if v not in live:
            live.add(v)
            stack.extend(body.node(v).inputs)
    nb = Graph(body.name)
    benv: dict[int, int] = {}
    for v in body.order():
        if v in body.inputs or v in live:
            benv[v] = nb.add_like(body.node(v), [benv[i] for i in body.node(v).inputs])
    nb.set_outputs([(name, benv[v]) for name, v in outs])
    new = out.add_like(n, n.inputs, body=nb)
    moved = {k: ("item", k) for k in range(nc)}
    for k in range(len(ys)):
        moved[nc + k] = ("item", nc + keep.index(first[k]))
    return new, moved


def _sink_reads(out: Graph, sid: int, above: int
                ) -> tuple[int, dict[int, tuple[str, int]]] | None:
    """Scan `sid` of `out` (a forward chunk recurrence) rebuilt with its reads after it: the
    nodes that only its ys need (no carry output does) and that read the iteration's start
    state (a carry input, or a cast of one), its slices and constants, computed for every
    iteration at once from the stacked start states (module docstring). Returns (the new
    scan's id, its old output index -> ("item", new index) or ("value", the sunk value)), or
    None where nothing with an einsum sinks."""
    n = out.node(sid)
    a = n.attr_dict
    body: Graph = a["body"]
    nc, nx, length = a["n_carry"], a["n_xs"], a["length"]
    if a.get("reverse") or length < 2:
        return None
    inputs = body.inputs
    slice_state = sum(math.prod(body.node(v).type.shape[2:]) for v in inputs[:nc])
    if slice_state <= above:
        return None
    carry_in, xs_in, const_in = inputs[:nc], inputs[nc:nc + nx], inputs[nc + nx:]
    ys = body.outputs[nc:]
    needed: set[int] = set()                           # what a carry output needs
    stack = [v for _, v in body.outputs[:nc]]
    while stack:
        v = stack.pop()
        if v not in needed:
            needed.add(v)
            stack.extend(body.node(v).inputs)
    varying = set(inputs) - set(const_in)              # reads a carry or a slice
    for v in body.order():
        if any(i in varying for i in body.node(v).inputs):
            varying.add(v)

    def start_state(v: int) -> bool:                   # a carry input, or a cast of one
        m = body.node(v)
        return v in carry_in or (m.op is Op.CAST and m.inputs[0] in carry_in)

    sink = {v for v in varying - needed - set(inputs)
            if not start_state(v) and _batchable(body.node(v), nested=False)}
    outputs = {v for _, v in ys}
    changed = True
    while changed:                                     # closed under its operands and users
        changed = False
        for v in sorted(sink):
            m = body.node(v)
            ok_in = all(i in sink or i in xs_in or i not in varying or start_state(i)
                        for i in m.inputs)
            ok_out = all(u in sink for u in body.users(v)) or (
                v in outputs and all(u in sink for u in body.users(v)))
            if not (ok_in and ok_out):
                sink.discard(v)
                changed = True
    if not any(body.node(v).op is Op.EINSUM for v in sink) or not outputs & sink:
        return None
    # the start states the sunk nodes read, stacked by the scan: an existing ys output that
    # is the same value (the backward's saved checkpoints), or a new one
    reads = [v for v in body.order() if v in varying and v not in sink and v not in xs_in
             and any(u in sink for u in body.users(v))]

    kept = [(name, v) for name, v in ys if v not in sink]
    stacked: dict[int, int] = {}                       # start-state value -> its ys index
    extra: list[tuple[str, int]] = []
    for v in reads:
        hit = next((k for k, (_, u) in enumerate(kept) if _same_value(body, u, v)), None)
        if hit is None:
            hit = len(kept) + len(extra)
            extra.append((f"start{len(extra)}", v))
        stacked[v] = hit
    # the body without the sunk nodes
    nb = Graph(body.name)
    benv: dict[int, int] = {}
    live: set[int] = set()
    stack = [v for _, v in body.outputs[:nc]] + [v for _, v in kept + extra]
    while stack:
        v = stack.pop()
        if v not in live:
            live.add(v)
            stack.extend(body.node(v).inputs)
    for v in body.order():
        if v in inputs or v in live:
            benv[v] = nb.add_like(body.node(v), [benv[i] for i in body.node(v).inputs])
    nb.set_outputs([(name, benv[v]) for name, v in body.outputs[:nc] + kept + extra])
    new = out.add_like(n, n.inputs, body=nb)
    # the sunk nodes over every iteration: slices and start states stacked [length, ...]
    bt = _Batcher(out, body, length)
    for j, v in enumerate(xs_in):
        bt.batched[v] = n.inputs[nc + j]
    for j, v in enumerate(const_in):
        bt.flat[v] = n.inputs[nc + nx + j]
    for v, k in stacked.items():
        bt.batched[v] = out.add(Op.ITEM, [new], {"index": nc + k})
    for v in body.order():
        if v in sink and any(i in bt.batched for i in body.node(v).inputs):
            bt.node(v)
    moved: dict[int, tuple[str, int]] = {k: ("item", k) for k in range(nc)}
    for k, (_, v) in enumerate(ys):
        moved[nc + k] = (("value", bt.full(v)) if v in sink else
                         ("item", nc + next(j for j, (_, u) in enumerate(kept) if u == v)))
    return new, moved


def _hoist(out: Graph, n: Node, body: Graph, ins: list[int], nested: bool,
           gates: bool = False) -> int:
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
        if reads_carry or (reads_xs and not _batchable(m, nested)):
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
    # a cast of an xs slice (the backward's widened checkpoint) is a conversion on load: the
    # body keeps its own for its readers there, and it is hoisted only for hoisted readers
    on_load = {v for v in hoisted if body.node(v).op is Op.CAST
               and all(i in xs_in for i in body.node(v).inputs)}
    hoisted -= {v for v in on_load
                if v not in outputs and all(u not in hoisted for u in body.users(v))}
    if not hoisted or not (gates or any(body.node(v).op is Op.EINSUM for v in hoisted)):
        return out.add_like(n, ins, body=body)
    # the hoisted values the body still reads, in body order: the new xs
    frontier = [v for v in body.order() if v in hoisted and v not in on_load and (
        v in outputs or any(u not in hoisted for u in body.users(v)))]

    bt = _Batcher(out, body, length)
    for j, v in enumerate(xs_in):
        bt.batched[v] = ins[nc + j]
    for j, v in enumerate(const_in):
        bt.flat[v] = ins[nc + nx + j]
    for v in body.order():
        if v in hoisted:
            bt.node(v)
    batched = bt.batched

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
            if v not in hoisted or v in on_load:
                stack.extend(body.node(v).inputs)
    for v in body.order():
        if v in benv or (v in hoisted and v not in on_load) or v not in live:
            continue
        m = body.node(v)
        benv[v] = nb.add_like(m, [benv[i] for i in m.inputs])
    nb.set_outputs([(name, benv[v]) for name, v in body.outputs])
    new_ins = ins[:nc + nx] + [batched[v] for v in frontier] + ins[nc + nx:]
    return out.add_like(n, new_ins, body=nb, n_xs=nx + len(frontier))


class _Batcher:
    """Builds nodes of `src` in `dst` over a new leading axis of `length`: `batched` maps a
    src value to its batched value in dst ([length] + its shape), `flat` a src value that
    reads nothing batched to its value in dst (built once, on demand)."""

    def __init__(self, dst: Graph, src: Graph, length: int):
        self.dst, self.src, self.length = dst, src, length
        self.batched: dict[int, int] = {}
        self.flat: dict[int, int] = {}

    def unbatched(self, v: int) -> int:
        """A src value that reads nothing batched, built once in dst."""
        if v not in self.flat:
            m = self.src.node(v)
            self.flat[v] = self.dst.add_like(m, [self.unbatched(i) for i in m.inputs])
        return self.flat[v]

    def full(self, v: int) -> int:
        """`v` batched: its batched value, or its unbatched one repeated over the new axis."""
        if v in self.batched:
            return self.batched[v]
        return _broadcast(self.dst, self.unbatched(v), self.length,
                          self.src.node(v).type.shape)

    def lift(self, v: int, rank: int) -> int:
        """Batched value `v` ([length] + s) as [length] + [1] * (rank - len(s)) + s."""
        x = self.batched[v]
        s = self.src.node(v).type.shape
        if len(s) == rank:
            return x
        return self.dst.add(Op.RESHAPE, [x],
                            {"shape": (self.length,) + (1,) * (rank - len(s)) + s})

    def node(self, v: int) -> None:
        """Build src node `v`, which reads a batched value, batched in dst."""
        out, length, m = self.dst, self.length, self.src.node(v)
        op, attrs = m.op, m.attr_dict
        batched, unbatched = self.batched, self.unbatched
        if op is Op.SCAN:
            batched[v] = self._scan(m)
            return
        if op is Op.ITEM:
            scan = self.src.node(m.inputs[0])
            k, item = attrs["index"], out.add(Op.ITEM, [batched[m.inputs[0]]], attrs)
            if k >= scan.attr("n_carry"):              # ys: [steps, length, ...] -> [length, steps, ...]
                rank = m.type.rank + 1
                item = out.add(Op.PERMUTE, [item], {"perm": (1, 0) + tuple(range(2, rank))})
            batched[v] = item
            return
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
            args = [self.lift(i, rank) if i in batched else unbatched(i) for i in m.inputs]
            batched[v] = out.add(op, args, attrs)
        elif op in (Op.SUM, Op.AMAX):
            src_rank = self.src.node(m.inputs[0]).type.rank
            axes = tuple(ax % src_rank + 1 for ax in attrs["axes"])
            batched[v] = out.add(op, [batched[m.inputs[0]]], {**attrs, "axes": axes})
        elif op in _AXIS_OPS:
            src_rank = self.src.node(m.inputs[0]).type.rank
            args = [self.full(i) for i in m.inputs]
            batched[v] = out.add(op, args, {**attrs, "axis": attrs["axis"] % src_rank + 1})
        elif op is Op.RESHAPE or op is Op.EXPAND:
            x = self.lift(m.inputs[0], rank) if op is Op.EXPAND else batched[m.inputs[0]]
            batched[v] = out.add(op, [x], {**attrs, "shape": (length,) + tuple(attrs["shape"])})
        elif op is Op.PERMUTE:
            perm = (0,) + tuple(p % rank + 1 for p in attrs["perm"])
            batched[v] = out.add(op, [batched[m.inputs[0]]], {**attrs, "perm": perm})
        else:                                          # _batchable and this list agree
            raise AssertionError(f"no batching rule for {op.name}")

    def _scan(self, m: Node) -> int:
        """A nested scan batched: the same iterations over carries [length, ...] and slices
        [length, ...] (xs stacked [steps, length, ...]); a constant operand that is batched is
        a batched constant of the body, one that is not stays as it was. Its body is batched
        whole (every node: `_batchable`)."""
        out, length = self.dst, self.length
        a = m.attr_dict
        nc, nx = a["n_carry"], a["n_xs"]
        body = a["body"]
        b_in = body.inputs
        operands: list[int] = []
        inner = _Batcher(Graph(body.name), body, length)
        for j, (v, bv) in enumerate(zip(m.inputs, b_in)):
            t = body.node(bv).type
            if j < nc + nx or v in self.batched:       # carries and slices always batched
                x = self.full(v)
                if nc <= j < nc + nx:                  # [length, steps, ...] -> [steps, length, ...]
                    x = out.add(Op.PERMUTE, [x], {"perm": (1, 0) + tuple(range(2, t.rank + 2))})
                operands.append(x)
                inner.batched[bv] = inner.dst.add(
                    Op.INPUT, (), body.node(bv).attr_dict,
                    type(t)((length,) + t.shape, t.dtype))
            else:
                operands.append(self.unbatched(v))
                inner.flat[bv] = inner.dst.add_like(body.node(bv))
        for v in body.order():
            if v in inner.batched or v in inner.flat:
                continue
            u = body.node(v)
            if any(i in inner.batched for i in u.inputs):
                inner.node(v)
        inner.dst.set_outputs([(name, inner.full(v)) for name, v in body.outputs])
        return out.add_like(m, operands, body=inner.dst)


def _broadcast(out: Graph, x: int, length: int, shape: tuple[int, ...]) -> int:
    """Unbatched value `x` of `shape` repeated over a new leading axis of `length`."""
    r = out.add(Op.RESHAPE, [x], {"shape": (1,) + tuple(shape)})
    return out.add(Op.EXPAND, [r], {"shape": (length,) + tuple(shape)})
