"""A scan body's nodes in order, and each scan as a loop of the kernel.

`body` emits every node of a body graph by its op's TRITON_SCAN rule (`rules.py`): inputs,
items, literals and host tables are bound, views and single-use pointwise nodes are
inlined into their readers, stored pointwise nodes, einsums and reductions wait in runs
that become as few stages as they allow, a nested scan becomes a nested `scan_loop`.
`scan_loop` emits a scan's loop: its carries on chip or in two workspace slots each, its xs
read at iteration `t`, its ys and next carries copied after the body, its final carries
bound to its ITEMs (nested) or written to the kernel's outputs. `em` is the kernel's
`emitter.ScanEmitter`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from math import prod
from typing import Any

from titanc.ir import Graph, Node

from titanc.codegen.meta import pow2
from titanc.codegen.scan.carries import reg_store, reg_value, reg_why
from titanc.codegen.scan.einsum import einsum_shares, einsum_stage
from titanc.codegen.scan.independence import pax_of
from titanc.codegen.scan.index import (BodyRefs, PaxError, Ref, RegMiss, ScanFallback,
                                       local_shape)
from titanc.codegen.scan.reduce import reduce_key, reduce_stage
from titanc.codegen.scan.rules import ScanRule, scan_rule, stage_of
from titanc.codegen.scan.stages import copy, pointwise_run, pointwise_stage, ref_value

__all__ = ["body", "scan_loop"]

Pair = tuple[Node, Ref]
# where a stored value of a stage's operand already lives (a cast of one is inlined)
_STORED = ("ws", "arg", "lit", "at")


class _Redo(Exception):
    """A carry turned out to vary per program: emit its scan again with that `pax`."""

    def __init__(self, scan: int, k: int, pax: tuple[int, ...]):
        super().__init__(scan, k, pax)
        self.scan, self.k, self.pax = scan, k, pax


def _uses(g: Graph, vid: int) -> int:
    return len(g.users(vid)) + sum(1 for _, v in g.outputs if v == vid)


def _reads(sc: BodyRefs, members: set[int], v: int) -> bool:
    """Does value `v` read one of `members`: itself, or through the views and inlined
    elementwise nodes it is evaluated from."""
    todo, seen = [v], set()
    while todo:
        v = todo.pop()
        if v in members:
            return True
        if v in seen:
            continue
        seen.add(v)
        ref = sc.refs.get(v)
        if ref is not None and ref.kind == "node" and ref.scope is sc:
            todo.extend(sc.g.node(v).inputs)
    return False


@dataclass
class _Runs:
    """Nodes waiting for their stage: stored pointwise nodes of one local shape (`run`),
    reductions alike that read none of each other (`reds`), one-block einsums that read
    none of each other (`mms`)."""

    em: Any
    sc: BodyRefs
    run: list[Pair] = field(default_factory=list)
    reds: list[Pair] = field(default_factory=list)
    mms: list[Pair] = field(default_factory=list)

    def flush_reds(self) -> None:
        if self.reds:
            reduce_stage(self.em, self.sc, self.reds)
            self.reds = []

    def flush_mms(self) -> None:
        if self.mms:
            einsum_stage(self.em, self.sc, self.mms)
            self.mms = []

    def flush_run(self) -> None:
        if self.run:
            pointwise_run(self.em, self.sc, self.run)
            self.run = []

    def joins_reds(self, n: Node) -> bool:
        """May reduction `n` share the stage of `reds`: alike (`reduce_key`), and reading
        none of their results, directly or through the views and inlined elementwise nodes
        its input is evaluated from (a stage's members are stored after its loads)."""
        return reduce_key(self.sc, n) == reduce_key(self.sc, self.reds[0][0]) and \
            not _reads(self.sc, {m.id for m, _ in self.reds}, n.inputs[0])

    def joins_mms(self, n: Node) -> bool:
        """May einsum `n` share the stage of `mms`: it may share one (`einsum_shares`), and
        reads none of their results (`_reads`)."""
        return einsum_shares(self.em, self.sc, n) and not any(
            _reads(self.sc, {m.id for m, _ in self.mms}, v) for v in n.inputs)

    def before(self, kind: str, n: Node) -> None:
        """End the runs node `n` (of stage `kind`) cannot join."""
        if self.reds and (kind in ("scan", "einsum") or (kind == "reduce"
                                                         and not self.joins_reds(n))):
            self.flush_reds()
        if kind == "einsum":
            self.sc.pax[n.id] = pax_of(self.em, self.sc, n)      # (its blocks depend on it)
        if self.mms and (kind in ("scan", "reduce") or (kind == "einsum"
                                                        and not self.joins_mms(n))):
            self.flush_mms()
        if kind in ("scan", "einsum", "reduce"):
            self.flush_run()


def body(em: Any, sc: BodyRefs) -> None:
    """Emit every node of `sc.g` (its inputs are already in `sc.refs`). Consecutive
    stored elementwise nodes of one local shape wait in a run and become one stage
    (`pointwise_run`); consecutive reductions alike that read none of each other's
    results wait and become one stage (`reduce_stage`); one-block einsums alike too."""
    g = sc.g
    runs = _Runs(em, sc)
    for vid in g.order():
        n = g.node(vid)
        rule = scan_rule(n)
        kind = rule.stage
        runs.before(kind, n)
        if kind in ("input", "item"):                 # bound by their scan
            continue
        if kind == "literal":
            sc.refs[vid], sc.pax[vid] = Ref("lit", n.type.shape, None,
                                            value=float(n.attr("value"))), None
            continue
        if kind == "table":
            name = f"g{len(em.tables)}"
            em.tables.append((n.op.name, dict(n.attr_dict)))
            sc.refs[vid], sc.pax[vid] = Ref("arg", n.type.shape, None, name=name), None
            continue
        if kind in ("none", "expand"):
            raise ScanFallback(f"%{vid}: {rule.why_not or f'no scan-kernel rule for {n.op.name}'}")
        sc.pax[vid] = q = pax_of(em, sc, n) if kind != "scan" else None
        if kind == "view":
            sc.refs[vid] = Ref("node", n.type.shape, q, node=n, scope=sc)
        elif kind == "pointwise":
            _pointwise_node(em, runs, rule, n, q)
        elif kind == "einsum":
            sc.refs[vid] = dest = em.local_ref(n.type.shape, q)
            if einsum_shares(em, sc, n):
                runs.mms.append((n, dest))
            else:
                einsum_stage(em, sc, [(n, dest)])
        elif kind == "reduce":
            sc.refs[vid] = dest = em.local_ref(n.type.shape, q)
            runs.reds.append((n, dest))
        else:
            scan_loop(em, sc, n)
    runs.flush_reds()
    runs.flush_mms()
    runs.flush_run()


def _pointwise_node(em: Any, runs: _Runs, rule: ScanRule, n: Node,
                    q: tuple[int, ...] | None) -> None:
    """An elementwise node: inlined into its reader (a single use, or a cast of a stored
    value: one rounding per read), else stored, waiting in the run of its local shape."""
    sc, g, vid = runs.sc, runs.sc.g, n.id
    why = rule.check(n) if rule.check is not None else ""
    if why:
        raise ScanFallback(f"%{vid}: {why}")
    cheap = rule.inline_stored and sc.refs[n.inputs[0]].kind in _STORED
    if (_uses(g, vid) == 1 or cheap) and all(stage_of(g.node(u)) != "scan"
                                             for u in g.users(vid)):
        sc.refs[vid] = Ref("node", n.type.shape, q, node=n, scope=sc)
        return
    sc.refs[vid] = dest = em.local_ref(n.type.shape, q)
    runs.flush_reds()                              # a stored value: its stage comes after
    runs.flush_mms()
    if runs.run and (runs.run[0][0].type.shape, sc.pax[runs.run[0][0].id]) != (n.type.shape, q):
        runs.flush_run()
    runs.run.append((n, dest))


def scan_loop(em: Any, sc: BodyRefs, n: Node, top: dict | None = None) -> None:
    """Emit scan `n` of scope `sc` as a loop; bind its ITEMs (nested) or write the
    kernel's outputs (`top`: item index -> output Ref). A carry found to vary per program
    (`_Redo`) or unreadable on chip (`RegMiss`) emits the loop again without that miss."""
    while True:
        state = (len(em.lines), em.n, len(em.sizes), len(em.tables), em.stages,
                 em.depth, em.loop_depth, em.shared, em.reg_bytes,
                 len(em.carry_notes))
        try:
            _scan_loop(em, sc, n, top)
            return
        except (_Redo, RegMiss) as r:
            if r.scan != n.id:
                raise
            del em.lines[state[0]:]
            em.n, em.stages = state[1], state[4]
            del em.sizes[state[2]:]
            em.depth, em.loop_depth, em.shared = state[5], state[6], state[7]
            em.reg_bytes = state[8]
            del em.carry_notes[state[9]:]
            del em.tables[state[3]:]
            if isinstance(r, RegMiss):
                em.reg_demoted[(n.id, r.k)] = r.why
            else:
                em.carry_pax[(n.id, r.k)] = r.pax


@dataclass
class _Loop:
    """One scan loop being emitted: the scan, its body's scope, its loop variables, where
    each carry lives (`slots`: workspace offset or None, slot size, pax, shape) and the
    carries held on chip (`regs`: carry -> tile variable, padded dims)."""

    n: Node
    bsc: BodyRefs
    it: str
    t: str
    slots: list[tuple[Any, int, Any, tuple[int, ...]]] = field(default_factory=list)
    regs: dict[int, tuple[str, tuple[int, ...]]] = field(default_factory=dict)


def _scan_loop(em: Any, sc: BodyRefs, n: Node, top: dict | None) -> None:
    a = n.attr_dict
    body_g: Graph = a["body"]
    nc, L = a["n_carry"], a["length"]
    em.loop_depth += 1
    d = em.loop_depth
    lp = _Loop(n, BodyRefs(body_g), f"it{d}", f"t{d}")
    em.line(f"# scan %{n.id}: {L} iterations{', reversed' if a['reverse'] else ''}, "
            f"{nc} carries")
    held = em.reg_bytes
    with em.group():
        for k in range(nc):
            _bind_carry(em, sc, lp, k)
    _bind_operands(sc, lp)
    em.line(f"for {lp.it} in range(0, {L}):")
    em.depth += 1
    em.line(f"{lp.t} = {L - 1} - {lp.it}" if a["reverse"] else f"{lp.t} = {lp.it}")
    body(em, lp.bsc)
    outs = [v for _, v in body_g.outputs]
    for k, v in enumerate(outs[:nc]):
        qo = lp.bsc.pax.get(v)
        q = lp.slots[k][2]
        if qo is not None and q != qo:
            if q is None:
                raise _Redo(n.id, k, qo)
            raise PaxError(f"carry {k} of scan %{n.id} moves the independent axes")
    with em.group():          # the ys at t, the next carries
        items = _ys(em, lp, outs, top)
        _next_carries(em, lp, outs)
    em.depth -= 1
    em.loop_depth -= 1
    with em.group():
        _final_carries(em, lp, top, items)
    em.reg_bytes = held
    if top is None:
        for u in sc.g.users(n.id):
            un = sc.g.node(u)
            if stage_of(un) == "item":
                r = items[un.attr("index")]
                sc.refs[u] = r
                sc.pax[u] = r.pax


def _bind_carry(em: Any, sc: BodyRefs, lp: _Loop, k: int) -> None:
    """Carry `k`: on chip (a loop-carried tile), or two workspace slots (init -> slot 0)."""
    n, body_g = lp.n, lp.bsc.g
    ins = body_g.inputs
    shape = body_g.node(ins[k]).type.shape
    q = em.carry_pax.get((n.id, k), sc.pax.get(n.inputs[k]))
    local = local_shape(shape, q)
    why = reg_why(em, n.id, k, local, any(stage_of(m) == "scan" for m in body_g))
    em.carry_notes.append({"scan": f"%{n.id}", "carry": k, "shape": list(local),
                           "on_chip": why is None, "why": why or ""})
    lp.bsc.pax[ins[k]] = q
    if why is None:
        dims = tuple(pow2(d, 16) for d in local)
        em.reg_bytes += prod(dims) * em.itemsize
        em.line(f"# carry {k} of %{n.id}: initial value, held on chip")
        var = em.fresh("cr")
        em.line(f"{var} = {reg_value(em, sc, n.inputs[k], shape, q, dims)}")
        em.tiles.add(var)
        em.loads.add(var)
        lp.regs[k] = (var, dims)
        lp.slots.append((None, 0, q, shape))
        lp.bsc.refs[ins[k]] = Ref("reg", shape, q, name=var, dims=dims, scan=n.id, carry=k)
        return
    size = -(-prod(local) // 16) * 16
    off = em.alloc(2 * size)
    lp.slots.append((off, size, q, shape))
    copy(em, f"carry {k} of %{n.id}: initial value", sc, n.inputs[k], shape, q,
         Ref("ws", shape, q, base=off))
    lp.bsc.refs[ins[k]] = Ref("ws", shape, q, base=f"{off} + ({lp.it} % 2) * {size}")


def _bind_operands(sc: BodyRefs, lp: _Loop) -> None:
    """The xs (the stacked operand at t) and the closed-over operands of the body."""
    n, bsc = lp.n, lp.bsc
    nc, nx = n.attr("n_carry"), n.attr("n_xs")
    ins = bsc.g.inputs
    for j in range(nx):
        v = n.inputs[nc + j]
        q = sc.pax.get(v)
        if q is not None and 0 in q:
            raise PaxError(f"scan %{n.id} iterates along the independent axes")
        bsc.refs[ins[nc + j]] = Ref("at", (), None, lead=(lp.t,), node=sc.g.node(v), scope=sc)
        bsc.pax[ins[nc + j]] = tuple(x - 1 for x in q) if q is not None else None
    for i in range(nc + nx, len(ins)):
        v = n.inputs[i]
        bsc.refs[ins[i]] = Ref("at", (), None, node=sc.g.node(v), scope=sc)
        bsc.pax[ins[i]] = sc.pax.get(v)


def _ys(em: Any, lp: _Loop, outs: list[int], top: dict | None) -> dict[int, Ref]:
    """The ys at t into their slice: of the kernel's outputs (`top`), or of stacked
    workspace buffers (a nested scan's ITEMs, returned)."""
    n, bsc = lp.n, lp.bsc
    nc, L = n.attr("n_carry"), n.attr("length")
    items: dict[int, Ref] = {}
    for k, v in enumerate(outs[nc:], start=nc):
        qo = bsc.pax.get(v)
        shape = bsc.g.node(v).type.shape
        if top is not None:
            if k in top:
                copy(em, f"y {k - nc} of %{n.id} at t", bsc, v, shape, qo, top[k], (lp.t,),
                     guard=qo is None)
            continue
        qs = tuple(x + 1 for x in qo) if qo is not None else None
        dest = em.local_ref((L,) + shape, qs)
        copy(em, f"y {k - nc} of %{n.id} at t", bsc, v, shape, qo, dest, (lp.t,))
        items[k] = dest
    return items


def _next_carries(em: Any, lp: _Loop, outs: list[int]) -> None:
    """Each next carry into the other slot, or into its tile (assigned after all reads)."""
    n = lp.n
    nxt = {}
    for k, v in enumerate(outs[:n.attr("n_carry")]):
        off, size, q, shape = lp.slots[k]
        if k in lp.regs:
            em.line(f"# carry {k} of %{n.id}: next, on chip")
            nxt[k] = reg_value(em, lp.bsc, v, shape, q, lp.regs[k][1])
            continue
        copy(em, f"carry {k} of %{n.id}: next", lp.bsc, v, shape, q,
             Ref("ws", shape, q, base=f"{off} + (({lp.it} + 1) % 2) * {size}"))
    for k, x in nxt.items():
        em.line(f"{lp.regs[k][0]} = {x}")


def _final_carries(em: Any, lp: _Loop, top: dict | None, items: dict[int, Ref]) -> None:
    """The final carries: bound as ITEMs (nested; on chip: stored first), or written to the
    kernel's outputs (`top`)."""
    n, L = lp.n, lp.n.attr("length")
    for k in range(n.attr("n_carry")):
        off, size, q, shape = lp.slots[k]
        if k in lp.regs:
            em.line(f"# final carry {k} of %{n.id}, from chip")
            if top is None:
                items[k] = em.local_ref(shape, q)
                reg_store(em, *lp.regs[k], shape, q, items[k])
            elif k in top:
                reg_store(em, *lp.regs[k], shape, q, top[k], guard=q is None)
            continue
        final = Ref("ws", shape, q, base=f"{off} + {(L % 2) * size}")
        if top is None:
            items[k] = final
        elif k in top:
            pointwise_stage(em, f"final carry {k} of %{n.id}", shape, q, top[k], (),
                            lambda sec, c, final=final: ref_value(em, sec, final, c),
                            guard=q is None)
