"""The torch executor (the `cpu` target): runs a kernel schedule inside its static buffer plan.

Every value of the schedule is bound to planned storage as every target binds it
(`binder.Binder`), and every node becomes a closure that writes its result with an `out=`
torch op (its rule in `cpu_rules.py`, a pattern op's in `pattern_kernels.py`). A step is then
a walk over the closures: it creates no tensor storage (tested with a dispatch-mode probe), so
a training step allocates nothing after warm-up. Every scan is a host loop (`Binder.scan`);
a scan kernel's prologue (the embedding gather its carry starts from) first gathers the rows
into their planned storage, which the scan's first iteration reads. Generators (ROPE, MASK)
are evaluated once into constant storage at build time, and so is a kernel-internal value
computed from them alone (a concatenation or cast of rotary tables).
"""
from __future__ import annotations

from typing import Any

import torch

from titanc.codegen.lowered import Launch, Lowered, ScanLoop, Step as LoweredStep, lower
from titanc.ir import Node, Op, OpGroup
from titanc.ir.buffer_plan import BufferPlan
from titanc.ir.elementwise import ELEMENTWISE
from titanc.ir.schedule import prologue_results, scan_prologue
from titanc.ir.tables import mask_table, rope_table

from titanc.runtime.targets.binder import Binder
from titanc.runtime.targets.cpu_rules import FOLDABLE, VIEWS, emit
from titanc.runtime.targets.pattern_kernels import pattern_steps
from titanc.runtime.targets.profiler import active_profiler
from titanc.runtime.targets.storage import Scratch, Storage, torch_dtype

Tensor = torch.Tensor


class _Builder(Binder):
    """The cpu target's builder: a kernel is its nodes' out= torch calls, one closure each
    (fusion changes what the triton target launches, not this target's work)."""

    def step(self, st: LoweredStep) -> None:
        if not isinstance(st, (Launch, ScanLoop)):
            raise NotImplementedError(f"the cpu target runs no scan kernel ({st.kernel.name})")
        self.kernel(st.kernel)

    def kernel(self, kern: Any) -> None:
        """Emit the steps of one kernel: one out= torch closure per node. A scan's prologue
        gathers (`scan_prologue`) run first, into their planned storage (`prologue`)."""
        outputs = set(kern.outputs)
        pro = scan_prologue(self.g, kern)
        if pro:
            self.prologue(kern, pro)
        for nid in kern.nodes:
            if nid not in pro:
                self.node(self.g.node(nid), outputs)
        self.kernel_outputs(kern)

    def prologue(self, kern: Any, nodes: tuple[int, ...]) -> None:
        """Run scan kernel `kern`'s prologue `nodes` (a gather, casts of it) into the planned
        storage of their results, where the scan's first iteration reads its carries (a host
        loop cannot read through a gather)."""
        results = set(prologue_results(self.g, kern))
        for nid in nodes:
            self.node(self.g.node(nid), results)

    def sub_builder(self, *args: Any) -> "_Builder":
        return _Builder(*args)

    def node(self, n: Node, outputs: set[int]) -> None:
        """Bind node `n`: a generator made once, a view, a value folded at bind time, or its
        out= closures writing into its planned home (`out`)."""
        op, a = n.op, n.attr_dict
        if op is Op.ITEM:
            return                                   # the scan writes its ITEM buffers
        if op is Op.FULL:
            if n.type.shape == ():
                dt = torch_dtype(a["dtype"], self.float_dtype)
                self.val[n.id] = self.const(torch.tensor(a["value"], dtype=dt))
                self.folded.add(n.id)
            else:
                o = self.out(n, outputs)
                self.steps.append(lambda o=o, v=a["value"]: o.fill_(v))
                self.val[n.id] = o
            return
        if op is Op.ROPE:
            dt = torch_dtype(a["dtype"], self.float_dtype)
            self.val[n.id] = self.const(rope_table(a["kind"], a["start"], a["count"], a["half"],
                                                   a["base"], dt))
            self.folded.add(n.id)
            return
        if op is Op.MASK:
            dt = torch_dtype(a["dtype"], self.float_dtype)
            self.val[n.id] = self.const(mask_table(a["n_q"], a["q_start"], a["groups"], dt))
            self.folded.add(n.id)
            return
        if op is Op.SCAN:
            self.scan(n, outputs)
            return
        if op in OpGroup.PATTERN:                    # one fused ATen call (pattern_kernels)
            self.steps.extend(pattern_steps(self, n, outputs))
            return
        xs = [self.operand(i) for i in n.inputs]
        view = VIEWS.get(op)
        if view is not None and isinstance(xs[0], float):     # a view of an inlined scalar
            dt = torch_dtype(n.type.dtype, self.float_dtype)
            xs[0] = self.const(torch.tensor(xs[0], dtype=dt))
        constant = all(self.is_constant(i) for i in n.inputs)
        if view is not None:
            v = view(xs[0], a, n)
            if v is not None:
                self.val[n.id] = v
                if constant:
                    self.folded.add(n.id)
                return
        if constant and n.id not in outputs and (op in ELEMENTWISE or op in FOLDABLE):
            self.val[n.id] = self._fold(n, xs)
            return
        o = self.out(n, outputs)
        self.steps.extend(emit(self, n, xs, o))
        self.val[n.id] = o

    def _fold(self, n: Node, xs: list[Any]) -> Tensor:
        """A kernel-internal value computed from constants alone (a concatenation of rotary
        tables, a negated half): computed once, now, instead of at every run."""
        like = next(x for x in xs if isinstance(x, Tensor))
        o = torch.empty(n.type.shape, dtype=torch_dtype(n.type.dtype, self.float_dtype),
                        device=like.device)
        for f in emit(self, n, xs, o):
            f()
        self.folded.add(n.id)
        return self.const(o)


class PlanExecutor:
    """Run a graph's lowered program (`codegen.lowered`) in its memory plan: what the targets
    share (storage, binding, `run`). `bound` maps persistent names to tensors the caller owns
    (parameters, gradient buffers): they are used in place. A target says how it lowers
    (`lower`: which scans are one kernel) and builds (`make_builder`)."""

    device = "cpu"                                   # where the arena and scratch live

    def __init__(self, plan: BufferPlan, bound: dict[str, Tensor] | None = None,
                 float_dtype: torch.dtype | None = None):
        self.plan = plan
        self.g = plan.schedule.graph
        self.bound = dict(bound or {})
        self.float_dtype = float_dtype
        self.program = self.lower(plan)              # the steps both binding passes walk
        # pass 1 measures the scratch stack on meta storage, pass 2 binds real storage
        probe = Scratch(Storage(0, meta=True), float_dtype)
        self._bind(probe, measure=True)
        self.scratch = Scratch(Storage(probe.high, device=self.device), float_dtype)
        self._bind(self.scratch, measure=False)

    def lower(self, plan: BufferPlan) -> Lowered:
        return lower(plan)

    def make_builder(self, *args: Any) -> Binder:
        raise NotImplementedError

    def _bind(self, scratch: Scratch, measure: bool) -> None:
        self.arena = Storage(self.plan.arena_bytes, meta=measure, device=self.device)
        self.persistent = Storage(self.plan.persistent_bytes, meta=measure, device=self.device)
        self.consts: list[Tensor] = []
        bound = {} if measure else self.bound
        self._b = self.make_builder(self.plan, self.arena, self.persistent, bound, {}, scratch,
                                    self.consts, self.float_dtype)
        self._b.lowered = self.program
        self.steps = self._b.build()
        self.inputs = {self.g.node(i).attr("name"): self._b.home(i) for i in self.g.inputs}
        self.outputs = {name: self._b.home(v) if v not in self._b.val else self._b.val[v]
                        for name, v in self.g.outputs}

    def run(self, inputs: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
        """Copy `inputs` (by graph input name) into their buffers, run every kernel, return
        the outputs as views of planned storage (valid until the next run)."""
        for name, t in (inputs or {}).items():
            dst = self.inputs[name]
            if dst.data_ptr() != t.data_ptr():
                dst.copy_(t)
        prof = active_profiler()
        if prof is not None:
            for label, fns in self._b.groups:
                prof.run(label, fns)
        else:
            for s in self.steps:
                s()
        return self.outputs

    def storages(self) -> list[Tensor]:
        """Every storage the executor writes (for allocation probes)."""
        return [self.arena.data, self.persistent.data, self.scratch.storage.data,
                *self.bound.values(), *self.consts]


class ArenaExecutor(PlanExecutor):
    """The cpu target: a kernel is its nodes' out= torch calls; every scan a loop."""

    def make_builder(self, *args: Any) -> Binder:
        return _Builder(*args)
