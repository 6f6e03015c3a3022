"""Kernel schedules: what fusion produces and codegen, the buffer planner and the runtime consume.

A `Schedule` is a graph cut into `Kernel`s listed in execution order. Every non-INPUT node of
the graph belongs to exactly one kernel; the ITEMs of a SCAN belong to the SCAN's kernel, and
a SCAN's body has its own `Schedule` (in `Schedule.bodies`, keyed by the SCAN node id), never
mixed with the outside. A SCAN's kernel may also hold its *prologue* (`scan_prologue`):
gathers (TAKE, and float casts of them) that only its carries read, as their initial values
(the embedding gather feeding the layer scan), computed where the scan starts instead of in
a kernel of their own.
A value goes to memory exactly when it crosses a kernel boundary: it is a graph input, a graph
output, or an output of one kernel that a later kernel reads. Two exceptions: an immediate
(`is_immediate`: a scalar FULL): a kernel that reads one it does not contain uses the literal
value (`node.attr("value")`), so it is in no kernel's `inputs`; and a carry operand the
prologue computes (`prologue_results`), which keeps storage during its scan's kernel: a scan
run as a host loop writes the gathered rows there first and starts the carry from them (a
scan kernel reads the carry's initial value through the gather instead).

Liveness is over kernel indices: value v is live during kernels `first..last` (inclusive),
where `first` is its producer's index (0 for graph inputs) and `last` the last kernel reading
it (the last kernel of the schedule for graph outputs); a prologue's result is live during its
scan's kernel alone.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Collection, Iterator

from titanc.ir import Graph, Op
from titanc.ir.kernel_family import categories, prefix
from titanc.ir.types import TensorType


@dataclass(frozen=True)
class Kernel:
    """One launch. `nodes` are IR node ids of the schedule's graph, in topological order.
    What each category may contain (and so what codegen must handle) is listed in
    `passes/fusion.py`; which kernel family renders it, `ir.kernel_family.family_of`."""
    name: str                    # titanc_<its family's prefix>_fused_<ops>_<n>
    category: str                # a category of `ir.kernel_family` (pointwise, reduction, ...)
    nodes: tuple[int, ...]       # nodes it computes (a SCAN's ITEMs belong to the SCAN's kernel)
    inputs: tuple[int, ...]      # values it reads that other kernels / graph inputs produce
    outputs: tuple[int, ...]     # values it produces that later kernels or graph outputs read
    flops: int                   # elementwise 1/element, einsum 2*prod(letter sizes),
                                 # reductions and scatter-adds 1/input element,
                                 # scan: length * its body's flops
    bytes: int                   # bytes of distinct inputs read + outputs written (a scan:
                                 # operands and results; its body's traffic is the body's)


@dataclass
class Schedule:
    graph: Graph
    kernels: list[Kernel]                                       # execution order
    bodies: dict[int, "Schedule"] = field(default_factory=dict)  # SCAN id -> body schedule
    waves: bool = False          # kernels in waves of independent ones (passes/waves.py): the
                                 # buffer plan keeps every value live across whole waves

    def kernel_index(self) -> dict[int, int]:
        """Node id -> index of the kernel computing it."""
        return {nid: k for k, kern in enumerate(self.kernels) for nid in kern.nodes}

    def walk(self, depth: int = 0) -> Iterator[tuple[int, "Schedule"]]:
        """(depth, schedule) for this schedule and every body schedule, pre-order."""
        yield depth, self
        for k in self.kernels:
            for nid in k.nodes:
                if nid in self.bodies:
                    yield from self.bodies[nid].walk(depth + 1)

    def all_kernels(self) -> list[Kernel]:
        """Every kernel of the schedule and its bodies, pre-order."""
        return [k for _, s in self.walk() for k in s.kernels]

    def to_text(self, indent: int = 0) -> str:
        """One line per kernel; body schedules indented under their scan."""
        pad = "  " * indent
        lines = [f"{pad}schedule {self.graph.name} ({len(self.kernels)} kernels)"]
        for i, k in enumerate(self.kernels):
            lines.append(f"{pad}  [{i}] {k.name} nodes={_ids(k.nodes)} in={_ids(k.inputs)} "
                         f"out={_ids(k.outputs)} flops={k.flops} bytes={k.bytes}")
            for nid in k.nodes:
                if nid in self.bodies:
                    lines.append(self.bodies[nid].to_text(indent + 2).rstrip("\n"))
        return "\n".join(lines) + "\n"

    def __repr__(self) -> str:
        return self.to_text()


def _ids(ids: tuple[int, ...]) -> str:
    return "[" + ",".join(f"%{i}" for i in ids) + "]"


def value_bytes(g: Graph, vid: int) -> int:
    """Bytes of one tensor value (tuple-typed SCAN nodes hold no buffer of their own)."""
    t = g.node(vid).type
    return t.nbytes if isinstance(t, TensorType) else 0


def liveness(schedule: Schedule) -> dict[int, tuple[int, int]]:
    """value id -> (first, last) kernel index for every value that lives in memory.

    Graph inputs that some kernel reads (or that are graph outputs) are live from kernel 0;
    kernel outputs (and prologue results, `prologue_results`) from their producer; graph
    outputs until the last kernel.
    """
    g, kernels = schedule.graph, schedule.kernels
    end = max(len(kernels) - 1, 0)
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for k, kern in enumerate(kernels):
        for v in kern.outputs + prologue_results(g, kern):
            first[v] = k
            last.setdefault(v, k)
        for v in kern.inputs:
            first.setdefault(v, 0)          # graph inputs: produced before kernel 0
            last[v] = max(last.get(v, k), k)
    for _, v in g.outputs:
        first.setdefault(v, 0)
        last[v] = end
    return {v: (first[v], last[v]) for v in sorted(first)}


def live_profile(schedule: Schedule, exclude: Collection[int] = (),
                 include_bodies: bool = True) -> list[int]:
    """Bytes live during each kernel; a SCAN kernel adds its body's peak (its workspace)."""
    g = schedule.graph
    diff = [0] * (len(schedule.kernels) + 1)
    for v, (a, b) in liveness(schedule).items():
        if v not in exclude:
            n = value_bytes(g, v)
            diff[a] += n
            diff[b + 1] -= n
    prof, run = [], 0
    for k, kern in enumerate(schedule.kernels):
        run += diff[k]
        extra = 0
        if include_bodies:
            extra = sum(peak_live_bytes(schedule.bodies[n], exclude_inputs=True)
                        for n in kern.nodes if n in schedule.bodies)
        prof.append(run + extra)
    return prof


def peak_live_bytes(schedule: Schedule, exclude: Collection[int] = (),
                    exclude_inputs: bool = True, include_bodies: bool = True) -> int:
    """The largest number of bytes live during one kernel (0 for an empty schedule).

    By default graph inputs do not count (parameters and a scan body's inputs live outside
    the activation arena); `exclude` drops more values by id. A scan kernel adds its body's
    peak (`include_bodies`), the body's inputs excluded.
    """
    skip = set(exclude)
    if exclude_inputs:
        skip.update(schedule.graph.inputs)
    return max(live_profile(schedule, skip, include_bodies), default=0)


class ScheduleError(Exception):
    pass


def verify_schedule(schedule: Schedule) -> Schedule:
    """Check a schedule and its bodies; raise `ScheduleError` naming the kernel and the rule.

    1. cover: every non-INPUT node of the graph is in exactly one kernel, and kernels hold
       only nodes of this graph;
    2. scan: a SCAN's kernel is a template holding just the SCAN, its ITEMs and its
       prologue (`prologue_of`), and the SCAN has a body schedule over exactly its
       body graph (verified recursively);
    3. closed: each operand of a kernel's node is in the kernel, in its `inputs`, or an
       immediate;
    4. order: each input is a graph input or an output of an earlier kernel (so the kernel
       graph is a DAG and the list is a topological order of it);
    5. outputs: a kernel's `outputs` are exactly its values that a graph output names or
       another kernel lists as an input;
    6. names: unique, `titanc_<prefix>_fused_...` with the prefix of the kernel's category
       (`ir.kernel_family.prefix`).
    """
    g = schedule.graph
    seen: dict[int, str] = {}
    read: set[int] = set()
    made: set[int] = set()
    names: set[str] = set()
    graph_out = {v for _, v in g.outputs}

    def fail(k: Kernel | None, rule: str, msg: str) -> ScheduleError:
        return ScheduleError(f"{rule}: {g.name}: {k.name + ': ' if k else ''}{msg}")

    for k in schedule.kernels:
        if k.category not in categories() or not k.name.startswith(
                f"titanc_{prefix(k.category)}_fused_"):
            raise fail(k, "names", f"category {k.category!r} does not match the name")
        if k.name in names:
            raise fail(k, "names", "duplicate kernel name")
        names.add(k.name)
        inside = set(k.nodes)
        for nid in k.nodes:
            if nid not in g or g.node(nid).op is Op.INPUT:
                raise fail(k, "cover", f"%{nid} is not a non-INPUT node of the graph")
            if nid in seen:
                raise fail(k, "cover", f"%{nid} is also in {seen[nid]}")
            seen[nid] = k.name
            node = g.node(nid)
            for i in node.inputs:
                if i not in inside and i not in k.inputs and not is_immediate(g, i):
                    raise fail(k, "closed", f"%{nid} reads %{i}, neither computed nor an input")
            if node.op is Op.SCAN:
                extra = [n for n in k.nodes if n != nid and not (
                    g.node(n).op is Op.ITEM and g.node(n).inputs[0] == nid)
                    and prologue_of(g, n) != nid]
                body = schedule.bodies.get(nid)
                if k.category != "template" or extra:
                    raise fail(k, "scan", f"scan %{nid} shares its kernel with {extra}")
                if body is None or body.graph is not node.attr("body"):
                    raise fail(k, "scan", f"scan %{nid} has no schedule of its body")
                verify_schedule(body)
        for v in k.inputs:
            if v not in made and g.node(v).op is not Op.INPUT:
                raise fail(k, "order", f"input %{v} is not produced by an earlier kernel")
        read.update(k.inputs)
        made.update(k.outputs)
    missing = [n.id for n in g if n.op is not Op.INPUT and n.id not in seen]
    if missing:
        raise fail(None, "cover", f"nodes {missing[:10]} are in no kernel")
    for k in schedule.kernels:
        want = [n for n in k.nodes if not isinstance(g.node(n).type, tuple)
                and (n in graph_out or n in read)]
        if list(k.outputs) != want:
            raise fail(k, "outputs", f"outputs {list(k.outputs)} should be {want}")
    return schedule


def is_immediate(g: Graph, vid: int) -> bool:
    """A scalar constant (FULL of shape ()). It sits in one kernel like every node, but other
    pointwise/reduction/matmul kernels that read it inline its value instead of listing it as
    an input; it goes to memory only when a template kernel reads it or it is a graph output."""
    n = g.node(vid)
    return n.op is Op.FULL and tuple(n.attr("shape")) == ()


def prologue_of(g: Graph, vid: int) -> int | None:
    """The SCAN whose prologue node `vid` may be (None otherwise): a gather (TAKE), then
    float casts of it, each read by the next alone, the last read by one SCAN alone and only
    as carry operands (their initial value), so that the scan's kernel computes them as it
    starts (under mixed precision the embedding rows are gathered, then cast to bf16)."""
    head = vid
    while g.node(head).op is Op.CAST and _float_cast(g, head):
        head = g.node(head).inputs[0]
    if g.node(head).op is not Op.TAKE:
        return None
    chain, cur = [head], head
    outs = {v for _, v in g.outputs}
    while True:
        users = list(dict.fromkeys(g.users(cur)))
        if cur in outs or len(users) != 1:
            return None
        nxt = g.node(users[0])
        if nxt.op is Op.CAST and _float_cast(g, nxt.id):
            chain.append(nxt.id)
            cur = nxt.id
            continue
        if nxt.op is not Op.SCAN or vid not in chain:
            return None
        nc = nxt.attr("n_carry")
        return nxt.id if all(i < nc for i, x in enumerate(nxt.inputs) if x == cur) else None


def _float_cast(g: Graph, vid: int) -> bool:
    n = g.node(vid)
    return n.type.is_float and g.node(n.inputs[0]).type.is_float


def scan_prologue(g: Graph, kern: Kernel) -> tuple[int, ...]:
    """The prologue nodes a scan kernel holds (empty for any other kernel), in order."""
    if kern.category != "template":
        return ()
    return tuple(n for n in kern.nodes if g.node(n).op in (Op.TAKE, Op.CAST)
                 and prologue_of(g, n) in kern.nodes)


def prologue_results(g: Graph, kern: Kernel) -> tuple[int, ...]:
    """The prologue values the scan reads (its carry operands): what keeps storage."""
    nodes = scan_prologue(g, kern)
    return tuple(n for n in nodes if all(u not in nodes for u in g.users(n)))


def prologue_kernel(g: Graph, kern: Kernel) -> Kernel | None:
    """A scan kernel's prologue as a pointwise kernel of its own, for a target that runs the
    scan as a host loop (it writes the carries' initial values into their planned storage
    first); its name carries the scan kernel's number. None without a prologue."""
    nodes = scan_prologue(g, kern)
    if not nodes:
        return None
    ops = "_".join(dict.fromkeys(g.node(n).op.name.lower() for n in nodes))
    ins = tuple(dict.fromkeys(i for n in nodes for i in g.node(n).inputs if i not in nodes))
    return Kernel(f"titanc_{prefix('pointwise')}_fused_{ops}_{kern.name.rsplit('_', 1)[-1]}",
                  "pointwise", nodes, ins, prologue_results(g, kern), 0, 0)
