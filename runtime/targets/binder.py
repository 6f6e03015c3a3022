"""The binder every target shares: one lowered program (a graph's or a scan body's,
`codegen.lowered`) bound to planned storage, emitted as a list of steps (closures).

At build time every value that crosses kernels is bound to a view of planned storage (the
activation arena, the persistent region or tensors the caller binds), every kernel-internal
value to a view of one shared scratch region, and a target's builder turns each step into
closures (`step`: the cpu target's out= torch calls in `executor.py`, the triton target's
launches in `triton_executor.py`). A step is then a walk over the closures: it creates no
tensor storage, so a training step allocates nothing after warm-up.

Scans that run as host loops are unrolled at build time (`Binder.scan`): each iteration is
its own instance of the body's closures, bound to that iteration's xs slices (views of the
stacked operands), its carry slots (ping-pong) and its ys slices, so a scan copies nothing at
run time. Generators (ROPE, MASK, FULL) are made once into constant storage at bind time.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from titanc.codegen.lowered import LaunchGroup, Lowered, ScanLoop, Step as LoweredStep, lower
from titanc.ir import Graph, Node, Op
from titanc.ir.buffer_plan import OUTPUT_PREFIX, BufferPlan, Home, ScanHomes, view_of
from titanc.ir.schedule import is_immediate
from titanc.ir.tables import mask_table, rope_table

from titanc.runtime.targets.profiler import active_profiler, kernel_label
from titanc.runtime.targets.storage import Scratch, Storage, torch_dtype

Tensor = torch.Tensor
Step = Callable[[], None]


class Binder:
    """Binds one lowered program (a graph's or a scan body's, `codegen.lowered`) to storage
    and emits its steps: what every target shares (planned storage, constants, the host loop
    of a scan). A target's builder says how a step runs (`step`)."""

    def __init__(self, plan: BufferPlan, arena: Storage, persistent: Storage,
                 bound: dict[str, Tensor], external: dict[str, Tensor], scratch: Scratch,
                 consts: list[Tensor], float_dtype: torch.dtype | None):
        self.plan, self.g = plan, plan.schedule.graph
        self.arena, self.persistent, self.bound = arena, persistent, bound
        self.external, self.scratch, self.consts = external, scratch, consts
        self.float_dtype = float_dtype
        self.val: dict[int, Any] = {}
        self.folded: set[int] = set()                    # values made once, at build time
        self.loc: dict[int, Tensor] = {}
        # the planned storage of the values every iteration of the enclosing host loop
        # locates alike (`scan`: the body's arena and persistent values, not its inputs and
        # outputs), shared by the iterations' builders: large_125m binds 35,266 launches
        self.shared: dict[int, Tensor] | None = None
        self.steps: list[Step] = []
        self.groups: list[tuple[str, list[Step]]] = []   # (profile label, a kernel's steps)
        self.order: list[str] = []                       # the kernels bound, in run order
        self.role = ""                                   # of the scan whose body this is
        self.lowered: Lowered | None = None              # what `build` walks (set by the owner)
        self._loops: dict[int, Lowered] = {}             # scan node -> its loop body's program

    # -- storage of values that cross kernels ---------------------------------------------------
    def located(self, vid: int) -> Tensor:
        """The planned storage of a value that leaves its kernel (cached)."""
        if vid in self.loc:
            return self.loc[vid]
        if self.shared is not None and vid in self.shared:
            self.loc[vid] = self.shared[vid]
            return self.loc[vid]
        t = self._locate(vid)
        self.loc[vid] = t
        if self.shared is not None:
            root = self.plan.views[vid][0] if vid in self.plan.views else vid
            if self.plan.is_constant_root(root) or self.plan.location(root)[0] != "external":
                self.shared[vid] = t
        return t

    def _locate(self, vid: int) -> Tensor:
        node = self.g.node(vid)
        if vid in self.plan.views:                   # a strided view of a root (no copy)
            root, chain = self.plan.views[vid]
            t = self._constant(self.g.node(root)) if self.plan.is_constant_root(root) \
                else self.located(root)
            for c in chain:
                t = view_of(t, self.g.node(c))
            return t
        where, at = self.plan.location(vid)
        if where == "external":
            t = self.external[at]
        elif where == "persistent":
            name = self.plan.persistent_values[self.plan.aliases.get(vid, vid)][0]
            t = self.bound[name] if name in self.bound else \
                self.persistent.view(at, node.type, self.float_dtype)
        else:
            t = self.arena.view(at, node.type, self.float_dtype)
        if tuple(t.shape) != node.type.shape:
            t = t.view(node.type.shape)
        return t

    def home(self, vid: int) -> Tensor:
        """The tensor holding a value: what its producer bound, else its planned storage."""
        return self.val[vid] if vid in self.val else self.located(vid)

    def operand(self, vid: int) -> Any:
        if is_immediate(self.g, vid):                 # scalar constants are inlined literals
            return float(self.g.node(vid).attr("value"))
        return self.home(vid)

    def out(self, node: Node, outputs: set[int]) -> Tensor:
        """Where node's result goes: its planned home if it leaves the kernel; the home of a
        reshape of it that leaves the kernel (viewed in node's shape, so the reshape costs
        nothing); else scratch."""
        if node.id in outputs and node.id not in self.plan.aliases:
            return self.located(node.id)
        for u in self.g.users(node.id):
            if (u in outputs and u not in self.plan.aliases and self.g.node(u).op is Op.RESHAPE
                    and self.located(u).is_contiguous()):
                return self.located(u).view(node.type.shape)
        return self.scratch.alloc(node.type)

    # -- kernels ---------------------------------------------------------------------------------
    def build(self) -> list[Step]:
        """Bind every step of the lowered program, in order (its scratch released after)."""
        lowered = self.lowered if self.lowered is not None else lower(self.plan)
        self._loops = {s.scan: s.body for s in lowered.steps if isinstance(s, ScanLoop)}
        for st in lowered.steps:
            mark = self.scratch.top
            first = len(self.steps)
            self.step(st)
            self.order.append(st.kernel.name)
            # a launch group: its first member's label (its members are of groupable families)
            one = st.members[0].kernel if isinstance(st, LaunchGroup) else st.kernel
            self.groups.append((kernel_label(self.g, one, self.role),
                                self.steps[first:]))
            self.scratch.top = mark
        return self.steps

    def step(self, st: LoweredStep) -> None:
        raise NotImplementedError

    def kernel_outputs(self, kern: Any) -> None:
        """A kernel's outputs that leave it: bound views cost nothing; a value computed
        elsewhere than its planned home is copied there."""
        for v in kern.outputs:
            if v in self.plan.views:                 # bound as a view: nothing to copy
                self.val[v] = self.located(v)
                continue
            if v in self.plan.aliases or self.g.node(v).op is Op.ITEM:
                continue
            src, dst = self.val[v], self.located(v)
            if src is not dst and not same_view(src, dst):
                self.steps.append(copy_step(dst, src))
                self.val[v] = dst

    def sub_builder(self, *args: Any) -> "Binder":
        """The builder of a scan body (the target's own builder)."""
        raise NotImplementedError

    def _constant(self, n: Node) -> Tensor:
        """A generator's value, made once at bind time (a FULL as a 0-d tensor expanded)."""
        a = n.attr_dict
        dt = torch_dtype(a["dtype"], self.float_dtype)
        if n.op is Op.FULL:
            return self.const(torch.tensor(a["value"], dtype=dt)).expand(n.type.shape)
        if n.op is Op.ROPE:
            return self.const(rope_table(a["kind"], a["start"], a["count"], a["half"],
                                         a["base"], dt))
        return self.const(mask_table(a["n_q"], a["q_start"], a["groups"], dt))

    def is_constant(self, vid: int) -> bool:
        """Is value `vid` the same at every run (a generator, an immediate, a view of a
        constant root, or folded here)?"""
        if vid in self.folded or is_immediate(self.g, vid):
            return True
        if self.g.node(vid).op in (Op.ROPE, Op.MASK):
            return True
        view = self.plan.views.get(vid)
        return view is not None and self.plan.is_constant_root(view[0])

    def const(self, t: Tensor) -> Tensor:
        """`t`, made at bind time, on the executor's device and kept alive by it."""
        device = self.arena.data.device
        if device.type not in ("cpu", "meta"):
            t = t.to(device)
        self.consts.append(t)                        # built once; kept alive by the executor
        return t

    # -- scans -------------------------------------------------------------------------------------
    def carry_init(self, vid: int, x: Tensor) -> Tensor:
        """The tensor a host loop's first iteration reads as carry `vid`'s initial value (the
        operand itself here; a target may lay it out as the later iterations' carries are)."""
        return x

    def scan(self, n: Node, outputs: set[int]) -> None:
        """A scan, unrolled at build time into one body instance per iteration, each bound to
        that iteration's storage, so running it copies nothing: iteration i reads the carry
        operands (i = 0) or the slot set iteration i-1 wrote, reads its xs as views of the
        stacked operands, and writes its carries into the other slot set (on the last
        iteration straight into the carries' ITEM buffers) and its ys into their slice of the
        stacked ITEM buffers (`ScanHomes`, shared with the emitted program.py). Only outputs
        the body plan cannot write in place (see `BufferPlan.direct_output`) are copied."""
        a = n.attr_dict
        body: Graph = a["body"]
        body_plan = self.plan.bodies[n.id]
        nc, nx_ = a["n_carry"], a["n_xs"]
        args = [self.operand(i) for i in n.inputs]
        args = [x if isinstance(x, Tensor) else self.const(torch.tensor(
            x, dtype=torch_dtype(self.g.node(i).type.dtype, self.float_dtype)))
            for i, x in zip(n.inputs, args)]
        args = [self.carry_init(i, x) if k < nc else x
                for k, (i, x) in enumerate(zip(n.inputs, args))]
        ws = next(b for b in self.plan.buffers if b.kind == "workspace" and b.value == n.id)
        region = self.arena.region(ws.offset, ws.size)
        state = self.plan.carry_state[n.id]
        carry_types = list(n.type[:nc])
        slot_sets = [[region.view(off, t, self.float_dtype) if size else None   # unused slot
                      for (off, size), t in zip(state[s * nc:(s + 1) * nc], carry_types)]
                     for s in (0, 1)]
        body_offset = self.plan.workspace_body_offset(n.id)
        body_arena = region.region(body_offset, ws.size - body_offset)
        used = [u for u in self.g.users(n.id) if u in outputs]      # ITEMs read later
        items = {self.g.node(u).attr("index"): self.located(u) for u in used}
        for u in used:
            self.val[u] = items[self.g.node(u).attr("index")]
        in_names = body.input_names()
        out_names = [name for name, _ in body.outputs]
        layout = self.plan.scan_homes(n.id, items)

        def tensor(home: Home) -> Tensor:
            return ScanHomes.resolve(home, args, slot_sets, items, lambda k: self.scratch.alloc(
                body.node(body.outputs[k][1]).type))

        iterations: list[list[tuple[str, list[Step]]]] = []
        shared: dict[int, Tensor] = {}
        carry_in = [tensor(h) for h in layout.carry_in(0)]
        for i, t in enumerate(layout.order()):
            homes = [tensor(h) for h in layout.homes(i)]
            external = dict(zip(in_names, carry_in + [x[t] for x in args[nc:nc + nx_]]
                                + args[nc + nx_:]))
            external.update({OUTPUT_PREFIX + name: home for name, home in zip(out_names, homes)})
            sub = self.sub_builder(body_plan, body_arena, self.persistent, {}, external,
                                   self.scratch, self.consts, self.float_dtype)
            sub.role = a.get("role", "loop")
            sub.shared = shared
            sub.lowered = self._loops.get(n.id)
            sub.build()
            groups = list(sub.groups)
            copies = [copy_step(home, sub.home(v)) for k, ((_, v), home)
                      in enumerate(zip(body.outputs, homes))
                      if not body_plan.direct_output(k) and not same_view(home, sub.home(v))]
            if copies:
                groups.append(("scan", copies))
            iterations.append(groups)
            carry_in = homes[:nc]
        flat = [f for groups in iterations for _, fns in groups for f in fns]

        def run() -> None:
            prof = active_profiler()
            if prof is not None:
                timed = prof.run
                for groups in iterations:
                    for label, fns in groups:
                        timed(label, fns)
            else:
                for f in flat:
                    f()

        self.steps.append(run)


def same_view(a: Tensor, b: Tensor) -> bool:
    """Do a and b view the same elements in the same layout (a copy would change nothing)?"""
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype and a.device == b.device)


def copy_step(dst: Tensor, src: Tensor) -> Step:
    return lambda: dst.copy_(src)
