"""The lowered program: the compiler's last stage, one flat, typed list of steps per graph.

`lower(plan, scan_kernel)` turns a memory plan (its schedule and its scan bodies' plans) into a
`Lowered` program that every consumer walks in order, each as a sibling:

    the cpu target      runtime/targets/executor.py    a `Launch` as out= torch closures
    the triton target   runtime/targets/triton_executor.py   a `Launch` as its rendered kernel
    program.py          codegen/emit.py                the same steps printed as Python

Steps:

    Launch(k, kernel)                 kernel k of the schedule (one generated kernel on the
                                      triton target, its nodes' torch calls on the cpu target)
    ScanLaunch(k, kernel, scan, code) a scan that is one launch of its scan kernel
                                      (`codegen.scan`; a prologue gather is read through)
    LaunchGroup(members, kernel)      independent launches as one (`codegen.horizontal`: the
                                      memory plan's hazards put them in one wave); `kernel`
                                      is their union, named after the first member
    ScanLoop(k, kernel, scan, prologue, body)
                                      a scan run as a host loop over `body` (the body plan's
                                      own `Lowered`), after its prologue kernel (the carries'
                                      gathered rows, if any); where iteration i reads and
                                      writes is `BufferPlan.scan_homes` (`ScanHomes`)

No-op kernels (every output aliases storage that already holds them) are not steps. A consumer
binds every value a step uses once, before the first run: to planned storage
(`BufferPlan.location`) or as a view of a root (`BufferPlan.views`); what a `Launch` reads and
writes is its kernel's (the target's), what a scan step touches at its own level is
`scan_operands`. Nothing is bound per run.

Which scans are one kernel is the target's choice, passed in as `scan_kernel(plan, kernel,
scan node) -> code or None` (the cpu target has none: every scan is a loop); so is which
launches may be grouped, `groupable(graph, kernel) -> bool` (the cpu target groups none: it runs
the schedule's order). The module lives in
codegen/ because it is the last stage of compiling (after the memory plan, before a target's
kernels), and both the runtime and the emitter may import codegen (docs/architecture.md); it
imports only `ir` (the buffer plan and the schedule live there), `codegen.horizontal` (the
waves, read from the plan) and `codegen.meta` (a split-K matmul's launch is two kernels), so
the cpu target pulls in no kernel renderer.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Union

from titanc.codegen.horizontal import MAX_MEMBERS, waves
from titanc.codegen.meta import kernel_split_k
from titanc.ir import Graph
from titanc.ir.buffer_plan import BufferPlan
from titanc.ir.schedule import Kernel, is_immediate, prologue_kernel

__all__ = ["Launch", "LaunchGroup", "Lowered", "ScanLaunch", "ScanLoop", "Step", "lower"]


@dataclass(frozen=True)
class Launch:
    index: int                    # the kernel's position in the schedule
    kernel: Kernel


@dataclass(frozen=True)
class LaunchGroup:
    members: tuple[Launch, ...]   # in schedule order; no hazard between any two
    kernel: Kernel                # their union: nodes, inputs, outputs, flops and bytes

    @property
    def index(self) -> int:
        return self.members[0].index

    @classmethod
    def of(cls, members: list[Launch]) -> "LaunchGroup":
        ks = [m.kernel for m in members]
        outs = tuple(v for k in ks for v in k.outputs)
        ins = tuple(dict.fromkeys(v for k in ks for v in k.inputs))
        union = Kernel(f"titanc_group_of_{ks[0].name.removeprefix('titanc_')}", "group",
                       tuple(n for k in ks for n in k.nodes), ins, outs,
                       sum(k.flops for k in ks), sum(k.bytes for k in ks))
        return cls(tuple(members), union)


@dataclass(frozen=True)
class ScanLaunch:
    index: int
    kernel: Kernel
    scan: int                     # the SCAN node
    code: Any                     # the target's scan kernel (codegen.scan.ScanKernel)


@dataclass(frozen=True)
class ScanLoop:
    index: int
    kernel: Kernel
    scan: int
    prologue: Kernel | None       # the carries' gathered rows, a kernel of its own
    body: "Lowered"


Step = Union[Launch, LaunchGroup, ScanLaunch, ScanLoop]


@dataclass
class Lowered:
    """One graph's (or scan body's) steps over its memory plan."""

    plan: BufferPlan
    steps: list[Step] = field(default_factory=list)

    @property
    def graph(self) -> Graph:
        return self.plan.schedule.graph

    def scan_steps(self) -> list[ScanLaunch | ScanLoop]:
        return [s for s in self.steps if isinstance(s, (ScanLaunch, ScanLoop))]

    def launches(self) -> int:
        """Kernel launches of one run on the triton target (a loop: its prologue, then its
        body's launches per iteration; a split-K matmul two, `meta.kernel_split_k`)."""
        n = 0
        for s in self.steps:
            if isinstance(s, ScanLoop):
                n += (s.prologue is not None) + s.body.launches() * \
                    self.graph.node(s.scan).attr("length")
            elif isinstance(s, Launch):
                n += 1 + (kernel_split_k(self.graph, s.kernel) > 1)
            else:
                n += 1
        return n

    def walk(self) -> list["Lowered"]:
        """This program and every loop body's, nested bodies first (pre-order)."""
        out = [self]
        for s in self.steps:
            if isinstance(s, ScanLoop):
                out += s.body.walk()
        return out


def lower(plan: BufferPlan,
          scan_kernel: Callable[[BufferPlan, Kernel, int], Any] | None = None,
          groupable: Callable[[Graph, Kernel], bool] | None = None) -> Lowered:
    """The lowered program of `plan`: its schedule's kernels in order, no-ops dropped, each
    scan one launch where `scan_kernel` gives its code, else a loop over its body's own
    lowered program; with `groupable`, the launches between scan steps in waves and each
    wave's groupable launches one `LaunchGroup` (`codegen.horizontal`)."""
    g = plan.schedule.graph
    out = Lowered(plan)
    for k, kern in enumerate(plan.schedule.kernels):
        if plan.is_noop(k):
            continue
        scans = [n for n in kern.nodes if n in plan.bodies]
        if not scans:
            out.steps.append(Launch(k, kern))
            continue
        code = scan_kernel(plan, kern, scans[0]) if scan_kernel is not None else None
        if code is not None:
            out.steps.append(ScanLaunch(k, kern, scans[0], code))
        else:
            out.steps.append(ScanLoop(k, kern, scans[0], prologue_kernel(g, kern),
                                      lower(plan.bodies[scans[0]], scan_kernel, groupable)))
    if groupable is not None:
        out.steps = _group_launches(plan, out.steps, groupable)
    return out


def _group_launches(plan: BufferPlan, steps: list[Step],
                   groupable: Callable[[Graph, Kernel], bool]) -> list[Step]:
    """`steps` (a lowered program's) with each run of launches between scan steps reordered
    into waves and each wave's groupable launches made `LaunchGroup`s of at most
    `MAX_MEMBERS`; a wave's other launches stay single, in schedule order."""
    out: list[Step] = []
    run: list[Launch] = []

    def flush() -> None:
        wave = waves(plan, [s.kernel for s in run])
        for w in range(max(wave, default=-1) + 1):
            members = [s for s, x in zip(run, wave) if x == w]
            together = [s for s in members if groupable(plan.schedule.graph, s.kernel)]
            for s in members:
                if s not in together or len(together) < 2:
                    out.append(s)
            if len(together) >= 2:
                for i in range(0, len(together), MAX_MEMBERS):
                    chunk = together[i:i + MAX_MEMBERS]
                    out.append(chunk[0] if len(chunk) == 1 else LaunchGroup.of(chunk))
        run.clear()

    for st in steps:
        if isinstance(st, Launch):
            run.append(st)
            continue
        flush()
        out.append(st)
    flush()
    return out


def scan_operands(lowered: Lowered, step: ScanLaunch | ScanLoop) -> list[int]:
    """The values a scan step reads or writes at its level: a scan kernel's operands (a
    prologue gather read through) and the ITEMs the program reads; a loop's non-immediate
    operands and ITEMs (its prologue's arguments are a `Launch`'s)."""
    g = lowered.graph
    node = g.node(step.scan)
    if isinstance(step, ScanLaunch):
        used = [node.inputs[i] for i in step.code.inputs] + list(step.code.extra)
    else:
        used = [i for i in node.inputs if not is_immediate(g, i)]
    return used + [u for u in g.users(node.id) if u in step.kernel.outputs]
