"""The buffer plan: where every value of a schedule lives, the data the backends bind.

`passes/buffer_plan.py` makes a `BufferPlan` from a `Schedule` (its module docstring states the
invariants and what gets a buffer); the cpu and triton targets, codegen and the emitted
program.py read it: `location` of a value, the views bound as strided torch views of their
root (`view_of`), and `ScanHomes`, where each iteration of a host-loop scan reads and writes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, Collection, Sequence

import torch

from titanc.ir.graph import Graph, Node
from titanc.ir.ops import Op
from titanc.ir.schedule import Schedule, scan_prologue
from titanc.ir.types import TensorType

OUTPUT_PREFIX = "out:"                   # external names of scan-body outputs


# -- the plan ------------------------------------------------------------------------------------

Home = tuple  # ("operand", j) | ("slot", set, j) | ("item", k, index or None) | ("scratch", k)


@dataclass(frozen=True)
class ScanHomes:
    """Where each iteration of a host-loop scan reads its carries and writes its outputs, as
    data: the one statement of the zero-copy scan loop, which the cpu/triton executors bind
    (unrolled at build time) and the emitted program.py walks at run time.

    Iteration i (over `order()`, reversed for a reverse scan) reads carry j from `carry_in(i)`
    (the scan's operand on the first iteration, else where iteration i-1 wrote it) and writes
    body output k to `homes(i)[k]`: a carry into slot set i % 2 (on the last iteration into
    its ITEM buffer when the program reads it; then the iterations of the last one's parity
    write that ITEM buffer too, in place of a slot: no iteration reads what it writes, and a
    carry costs one slot, `slot_used`), a ys value into its slice of the stacked ITEM buffer
    (a fresh scratch tensor when nothing reads it). A carry the body also returns as
    a ys value (a residual saved for the backward) lives in that stacked buffer instead of a
    slot: saved as it enters an iteration (`saved_in`: the previous iteration writes it into
    this iteration's slice) or as it leaves (`saved_out`)."""

    length: int
    reverse: bool
    n_carry: int
    n_outputs: int
    items: frozenset[int]                  # body outputs whose ITEM the program reads
    saved_in: tuple[tuple[int, int], ...] = ()     # (carry, ys output)
    saved_out: tuple[tuple[int, int], ...] = ()
    lent: frozenset[int] = frozenset()     # carries whose operand is their slot B (dead after)
    in_place: frozenset[int] = frozenset()  # lent carries every iteration updates in place

    @classmethod
    def of(cls, g: Graph, sid: int, items: Collection[int],
           lent: Collection[int] = (), in_place: Collection[int] = ()) -> "ScanHomes":
        """The homes of scan node `sid` of `g` whose ITEM outputs `items` are read later;
        `lent`: carries whose operand nothing reads after the scan (`BufferPlan.lent`), so
        that the iterations after the first may write it in place of slot B; `in_place`:
        lent carries whose body reads the carry before it writes the next one
        (`BufferPlan.in_place`), so that every iteration writes the operand (the last one
        the ITEM when it is read): no slot at all."""
        a = g.node(sid).attr_dict
        body: Graph = a["body"]
        nc, outs = a["n_carry"], [v for _, v in body.outputs]
        read = frozenset(items)
        ys = [k for k in reversed(range(nc, len(outs))) if k in read]
        saved_in = {j: k for k in ys for j in range(nc) if outs[k] == body.inputs[j]}
        saved_out = {j: k for k in ys for j in range(nc) if outs[k] == outs[j]}
        return cls(a["length"], bool(a["reverse"]), nc, len(outs), read,
                   tuple(sorted(saved_in.items())), tuple(sorted(saved_out.items())),
                   frozenset(j for j in lent if j not in saved_in and j not in saved_out),
                   frozenset(j for j in in_place if j in lent and j not in saved_in
                             and j not in saved_out))

    def order(self) -> list[int]:
        """The xs index of each iteration."""
        return list(range(self.length - 1, -1, -1) if self.reverse else range(self.length))

    def homes(self, i: int) -> list[Home]:
        order, last = self.order(), i == self.length - 1
        t, saved_in, saved_out = order[i], dict(self.saved_in), dict(self.saved_out)
        out: list[Home] = []
        for j in range(self.n_carry):
            if j in self.in_place:
                out.append(("item", j, None) if last and j in self.items else ("operand", j))
                continue
            out.append(("item", j, None) if last and j in self.items else
                       ("slot", i % 2, j) if last else
                       ("item", saved_in[j], order[i + 1]) if j in saved_in else
                       ("item", saved_out[j], t) if j in saved_out else
                       ("item", j, None) if j in self.items
                       and i % 2 == (self.length - 1) % 2 else
                       ("operand", j) if i % 2 and j in self.lent else
                       ("slot", i % 2, j))
        out += [("item", k, t) if k in self.items else ("scratch", k)
                for k in range(self.n_carry, self.n_outputs)]
        return out

    def slot_used(self, s: int, j: int) -> bool:
        """Does any iteration keep carry j in slot set s? (Else the plan reserves no bytes
        for it and the executors bind no tensor.)"""
        return any(h == ("slot", s, j) for i in range(self.length)
                   for h in self.homes(i)[:self.n_carry])

    def carry_in(self, i: int) -> list[Home]:
        return ([("operand", j) for j in range(self.n_carry)] if i == 0
                else self.homes(i - 1)[:self.n_carry])

    @staticmethod
    def resolve(home: Home, operands: Sequence, slots: Sequence[Sequence],
                items: dict, scratch: Callable) -> object:
        """The tensor a home names: `operands` are the scan's, `slots` the two carry slot
        sets, `items` the stacked ITEM buffers by output index, `scratch(k)` a tensor for an
        output nothing reads."""
        kind, k, *at = home
        if kind == "operand":
            return operands[k]
        if kind == "slot":
            return slots[k][at[0]]
        if kind == "scratch":
            return scratch(k)
        return items[k] if at[0] is None else items[k][at[0]]



@dataclass(frozen=True)
class Buffer:
    value: int            # value id; for a workspace, the SCAN node id
    offset: int           # bytes from the arena base
    size: int             # bytes reserved (aligned)
    first: int            # live during kernels first..last (inclusive)
    last: int
    producer: str         # producing kernel's name; "input:<name>" for a graph input
    kind: str = "value"   # "value" | "input" | "workspace"


@dataclass
class BufferPlan:
    schedule: Schedule
    buffers: list[Buffer]                      # activation arena, by (first, offset)
    aliases: dict[int, int]                    # value -> value whose storage it shares (a root)
    persistent: dict[str, tuple[int, int]]     # name -> (offset, size) in the persistent region
    persistent_values: dict[int, list[str]]    # value -> its persistent names (home = first)
    external: dict[int, str]                   # scan-body inputs: value -> input name
    arena_bytes: int
    lower_bound_bytes: int
    peak_activation_bytes: int
    persistent_bytes: int
    alignment: int
    bodies: dict[int, "BufferPlan"] = field(default_factory=dict)   # SCAN id -> body plan
    carry_state: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    # SCAN id -> (offset within the workspace, size) of each carry slot: slots A of every
    # carry, then slots B; the body arena starts right after the last slot (at
    # `workspace_body_offset(scan_id)`)
    views: dict[int, tuple[int, tuple[int, ...]]] = field(default_factory=dict)
    # value -> (root, view node ids applied to the root in order): bound as a strided view of
    # the root's storage, or of a constant when the root is a generator (module docstring)
    strided: frozenset[int] = frozenset()
    # values that may be bound non-dense: the views, and body inputs whose operand is one
    constants: frozenset[int] = frozenset()
    # roots of views that are generators without storage (made once at bind time)
    lent: dict[int, frozenset[int]] = field(default_factory=dict)
    in_place: dict[int, frozenset[int]] = field(default_factory=dict)
    # SCAN id -> lent carries updated in place by every iteration
    # (`_carry_in_place_each_iteration`)
    # SCAN id -> carries whose operand nothing reads after the scan: the iterations after
    # the first may overwrite it (`ScanHomes.lent`: it is their slot B; the body, given the
    # matching inputs as `clobber`, may lend them to its own scans in turn)

    def location(self, vid: int) -> tuple[str, int | str]:
        """Where a value lives: ("arena", offset), ("persistent", offset) or, in a scan body,
        ("external", input name)."""
        root = self.aliases.get(vid, vid)
        if root in self.persistent_values:
            return "persistent", self.persistent[self.persistent_values[root][0]][0]
        if root in self.external:
            return "external", self.external[root]
        if root in self._arena_offsets:
            return "arena", self._arena_offsets[root]
        raise KeyError(f"value %{vid} of {self.schedule.graph.name} is not in memory "
                       f"(it never leaves its kernel)")

    @cached_property
    def _arena_offsets(self) -> dict[int, int]:
        return {b.value: b.offset for b in self.buffers if b.kind != "workspace"}

    def direct_output(self, index: int) -> bool:
        """Does a body plan write output `index` straight where the scan passes it
        (rather than into its own arena, to be copied)?"""
        name, v = self.schedule.graph.outputs[index]
        return self.external.get(self.aliases.get(v, v)) == OUTPUT_PREFIX + name

    def launches(self, one_kernel: Callable[["BufferPlan", int], bool] | None = None) -> int:
        """Kernel launches in one run of this plan: every kernel that is not a no-op; a scan
        launches its body's kernels once per iteration (a host loop, after one launch of its
        prologue gathers, if any), or is one launch in all where `one_kernel(plan, scan id)`
        says the target runs it as a single kernel."""
        g, count = self.schedule.graph, 0
        for k, kern in enumerate(self.schedule.kernels):
            if self.is_noop(k):
                continue
            scans = [n for n in kern.nodes if n in self.bodies]
            if not scans:
                count += 1
            for sid in scans:
                if one_kernel is not None and one_kernel(self, sid):
                    count += 1
                else:
                    count += g.node(sid).attr("length") * self.bodies[sid].launches(one_kernel)
                    count += bool(scan_prologue(g, kern))
        return count

    def workspace_body_offset(self, scan_id: int) -> int:
        """Where the body's arena starts inside the scan's workspace (after the carry slots)."""
        return sum(s for _, s in self.carry_state.get(scan_id, []))

    def scan_homes(self, sid: int, items: Collection[int]) -> ScanHomes:
        """Where scan `sid`'s iterations read and write (its ITEMs `items` read later)."""
        return ScanHomes.of(self.schedule.graph, sid, items, self.lent.get(sid, ()),
                            self.in_place.get(sid, ()))

    def is_noop(self, kernel_index: int) -> bool:
        """A kernel all of whose outputs alias storage that already holds them (a lone
        reshape): the executor skips it. A scan's ITEM that shares its carry operand's
        buffer (`_carry_in_place`) is still written by the scan: not a no-op."""
        outs = self.schedule.kernels[kernel_index].outputs
        g = self.schedule.graph
        return bool(outs) and all(v in self.aliases and g.node(v).op is not Op.ITEM
                                  for v in outs)

    def is_constant_root(self, vid: int) -> bool:
        """Is `vid` the root of a view that a generator makes at bind time (no storage)?"""
        return vid in self.constants

    def peak(self) -> tuple[int, list[Buffer]]:
        """The kernel at which the most planned bytes are live (workspaces at their planned
        size; their sum there is `peak_activation_bytes`) and the buffers live then, largest
        first: what the arena is made of (`benchmarks/arena_peak.py` prints it, recursively)."""
        best, at = -1, 0
        for k in range(len(self.schedule.kernels)):
            live = sum(b.size for b in self.buffers if b.first <= k <= b.last)
            if live > best:
                best, at = live, k
        return at, sorted((b for b in self.buffers if b.first <= at <= b.last),
                          key=lambda b: (-b.size, b.value))

    @property
    def ratio(self) -> float:
        return self.arena_bytes / self.lower_bound_bytes if self.lower_bound_bytes else 1.0

    def to_text(self, indent: int = 0) -> str:
        """The readable map: buffer, offset, size, live range, producing kernel."""
        pad = "  " * indent
        g = self.schedule.graph
        lines = [f"{pad}buffer plan {g.name}: {len(self.schedule.kernels)} kernels, arena "
                 f"{self.arena_bytes} B, lower bound {self.lower_bound_bytes} B (ratio "
                 f"{self.ratio:.3f})",
                 f"{pad}  peak activation {self.peak_activation_bytes} B, persistent "
                 f"{self.persistent_bytes} B, alignment {self.alignment}"]
        if self.persistent:
            lines.append(f"{pad}  persistent region:")
            lines.append(f"{pad}    {'offset':>12} {'size':>12}  name")
            for name, (off, size) in self.persistent.items():
                lines.append(f"{pad}    {off:>12} {size:>12}  {name}")
        if self.external:
            names = ", ".join(f"%{v}={n}" for v, n in sorted(self.external.items()))
            lines.append(f"{pad}  bound by the scan (inputs; outputs as out:NAME): {names}")
        lines.append(f"{pad}  activation arena:")
        lines.append(f"{pad}    {'buffer':<10} {'offset':>12} {'size':>12}  {'live':<11} kernel")
        for b in self.buffers:
            t = g.node(b.value).type
            what = f"%{b.value}" if b.kind != "workspace" else f"ws %{b.value}"
            lines.append(f"{pad}    {what:<10} {b.offset:>12} {b.size:>12}  "
                         f"{f'[{b.first},{b.last}]':<11} {b.producer}"
                         + (f"  {t}" if isinstance(t, TensorType) else ""))
            if b.kind == "workspace":
                slots = self.carry_state.get(b.value, [])
                if slots:
                    lines.append(f"{pad}      carry state: " + ", ".join(
                        f"+{o}:{s}" for o, s in slots))
                lines.append(self.bodies[b.value].to_text(indent + 3).rstrip("\n"))
        if self.aliases:
            lines.append(f"{pad}  aliases (reshapes sharing their source's storage; views of a "
                         f"stored value or a constant):")
            for v, r in sorted(self.aliases.items()):
                root, chain = self.views.get(v, (r, ()))
                how = "".join(f" {g.node(c).op.name.lower()}" for c in chain)
                src = (f"constant {g.node(root).op.name.lower()}" if root in self.constants
                       else f"%{r}")
                lines.append(f"{pad}    %{v} -> {src}" + (f" via{how}" if how else ""))
        return "\n".join(lines) + "\n"


def view_of(t: torch.Tensor, n: Node) -> torch.Tensor:
    """View node `n` (RESHAPE, PERMUTE, EXPAND, SLICE) applied to tensor `t`, without a copy
    (RuntimeError where torch cannot: a reshape of a non-dense view)."""
    a = n.attr_dict
    if n.op is Op.RESHAPE:
        return t.view(tuple(a["shape"]))
    if n.op is Op.PERMUTE:
        return t.permute(tuple(a["perm"]))
    if n.op is Op.EXPAND:
        return t.expand(tuple(a["shape"]))
    assert n.op is Op.SLICE, n.op
    return t.narrow(a["axis"], a["start"], a["stop"] - a["start"])
