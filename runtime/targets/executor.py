"""The torch executor: runs a kernel schedule inside its static buffer plan.

At build time every value of the schedule is bound to a view of planned storage (the
activation arena, the persistent region or tensors the caller binds), every kernel-internal
value to a view of one shared scratch region, and every node becomes a closure that writes
its result with an `out=` torch op. A step is then a walk over the closures: it creates no
tensor storage (tested with a dispatch-mode probe), so a training step allocates nothing
after warm-up.

Scans are unrolled at build time (`_Builder._scan`): each iteration is its own instance of
the body's closures, bound to that iteration's xs slices (views of the stacked operands),
its carry slots (ping-pong) and its ys slices, so a scan copies nothing at run time. A scan
kernel's prologue (the embedding gather its carry starts from) first gathers the rows into
their planned storage, which the scan's first iteration reads.
Generators (ROPE, MASK) are evaluated once into constant storage at build time, and so is a
kernel-internal value computed from them alone (a concatenation or cast of rotary tables).
"""
from __future__ import annotations

from contextvars import ContextVar
from typing import Any, Callable

import time

import torch

from titanc.codegen.lowered import (Launch, LaunchGroup, Lowered, ScanLoop, Step as LoweredStep,
                                    lower)
from titanc.ir import Graph, Node, Op, OpGroup
from titanc.ir.elementwise import ELEMENTWISE
from titanc.ir.lowering import register_lowering
from titanc.ir.tables import mask_table, rope_table
from titanc.ir.types import DTYPES, ITEMSIZE, TensorType, dtype_name
from titanc.ir.buffer_plan import OUTPUT_PREFIX, Home, BufferPlan, ScanHomes, view_of
from titanc.ir.kernel_family import PROFILE_LABELS, family_of
from titanc.ir.schedule import is_immediate, prologue_results, scan_prologue

from titanc.runtime.targets.lowerings import CPU
from titanc.runtime.targets.pattern_kernels import pattern_steps

Tensor = torch.Tensor
Step = Callable[[], None]


class Profiler:
    """Exclusive wall time per kernel category (a scan's own time excludes its body's, and
    the profiler's own bookkeeping for the body's kernels)."""

    def __init__(self) -> None:
        self.seconds = {c: 0.0 for c in PROFILE_LABELS}
        self.calls = {c: 0 for c in PROFILE_LABELS}
        self._child = [0.0]

    def run(self, label: str, fns: list[Step]) -> None:
        clock = time.perf_counter
        enter = clock()
        stack = self._child
        stack.append(0.0)
        t0 = clock()
        for f in fns:
            f()
        dt = clock() - t0
        self.seconds[label] += dt - stack.pop()
        self.calls[label] += 1
        stack[-1] += clock() - enter          # the parent is not charged our bookkeeping


# the profiler of the run in progress in this context (thread, task), if any: `profiling`
_PROFILER: ContextVar["Profiler | None"] = ContextVar("titanc_profiler", default=None)


def kernel_label(g: Graph, kernel: Any, role: str = "") -> str:
    """Profile category: its family's (`KernelFamily.profile`: attention for the flash
    attention kernels, scan for a scan's own time, its loop excluding its body's kernels), except
    where it runs: optimizer (the optimizer graph), memory update (a kernel in the body of a
    scan of role "memory")."""
    if g.name.startswith("optimizer"):
        return "optimizer"
    fam = family_of(g, kernel)
    if role == "memory" and fam.category != "template":
        return "memory update"
    return fam.profile


class Storage:
    """A byte region handing out typed views; `meta` regions only measure (no memory)."""

    def __init__(self, nbytes: int, meta: bool = False, device: str = "cpu"):
        self.nbytes = nbytes
        self.data = torch.empty(nbytes, dtype=torch.uint8, device="meta" if meta else device)

    def view(self, offset: int, t: TensorType, float_dtype: torch.dtype | None) -> Tensor:
        dt = _dtype(t.dtype, float_dtype)
        size = t.numel * dt.itemsize
        if offset + size > self.nbytes:
            raise ValueError(f"view [{offset}, {offset + size}) beyond {self.nbytes} bytes")
        return self.data[offset:offset + size].view(dt).view(t.shape)


def _dtype(name: str, float_dtype: torch.dtype | None) -> torch.dtype:
    if float_dtype is not None and name in ("f32", "f64"):
        return float_dtype
    return DTYPES[name]


class Scratch:
    """A stack allocator over one region: kernels allocate from `mark`, release on exit."""

    def __init__(self, storage: Storage, float_dtype: torch.dtype | None):
        self.storage, self.float_dtype = storage, float_dtype
        self.top = 0
        self.high = 0

    def alloc(self, t: TensorType) -> Tensor:
        size = -(-t.numel * ITEMSIZE[t.dtype] // 64) * 64
        if self.float_dtype is not None and t.is_float:
            size = -(-t.numel * torch.empty((), dtype=self.float_dtype).element_size() // 64) * 64
        off = self.top
        self.top += max(size, 64)
        self.high = max(self.high, self.top)
        if self.storage.data.device.type == "meta" or off + size > self.storage.nbytes:
            return torch.empty(t.shape, dtype=_dtype(t.dtype, self.float_dtype), device="meta")
        return self.storage.view(off, t, self.float_dtype)


class Binder:
    """Binds one lowered program (a graph's or a scan body's, `codegen.lowered`) to storage
    and emits its steps: what every target shares (planned storage, constants, the host loop
    of a scan). A target's builder says how a `Launch` runs (`step`). `node` is the cpu
    target's per-node lowering (its `_Builder` calls it)."""

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
        # locates alike (`_scan`: the body's arena and persistent values, not its inputs and
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
            if src is not dst and not _same_view(src, dst):
                self.steps.append(_copy(dst, src))
                self.val[v] = dst

    def sub_builder(self, *args: Any) -> "Binder":
        """The builder of a scan body (the target's own builder)."""
        raise NotImplementedError

    def node(self, n: Node, outputs: set[int]) -> None:
        op, a = n.op, n.attr_dict
        if op is Op.ITEM:
            return                                   # the scan writes its ITEM buffers
        if op is Op.FULL:
            if n.type.shape == ():
                self.val[n.id] = self._const(torch.tensor(a["value"], dtype=_dtype(a["dtype"], self.float_dtype)))
                self.folded.add(n.id)
            else:
                o = self.out(n, outputs)
                self.steps.append(lambda o=o, v=a["value"]: o.fill_(v))
                self.val[n.id] = o
            return
        if op is Op.ROPE:
            self.val[n.id] = self._const(rope_table(a["kind"], a["start"], a["count"], a["half"],
                                                    a["base"], _dtype(a["dtype"], self.float_dtype)))
            self.folded.add(n.id)
            return
        if op is Op.MASK:
            self.val[n.id] = self._const(mask_table(a["n_q"], a["q_start"], a["groups"],
                                                    _dtype(a["dtype"], self.float_dtype)))
            self.folded.add(n.id)
            return
        if op is Op.SCAN:
            self._scan(n, outputs)
            return
        if op in OpGroup.PATTERN:                    # one fused ATen call (pattern_kernels)
            self.steps.extend(pattern_steps(self, n, outputs))
            return
        xs = [self.operand(i) for i in n.inputs]
        view = _VIEWS.get(op)
        if view is not None and isinstance(xs[0], float):     # a view of an inlined scalar
            xs[0] = self._const(torch.tensor(xs[0], dtype=_dtype(n.type.dtype, self.float_dtype)))
        constant = all(self._is_constant(i) for i in n.inputs)
        if view is not None:
            v = view(xs[0], a, n)
            if v is not None:
                self.val[n.id] = v
                if constant:
                    self.folded.add(n.id)
                return
        if constant and n.id not in outputs and (op in ELEMENTWISE or op in _FOLDABLE):
            self.val[n.id] = self._fold(n, xs)
            return
        o = self.out(n, outputs)
        self.steps.extend(_emit(self, n, xs, o))
        self.val[n.id] = o

    def _constant(self, n: Node) -> Tensor:
        """A generator's value, made once at bind time (a FULL as a 0-d tensor expanded)."""
        a = n.attr_dict
        dt = _dtype(a["dtype"], self.float_dtype)
        if n.op is Op.FULL:
            return self._const(torch.tensor(a["value"], dtype=dt)).expand(n.type.shape)
        if n.op is Op.ROPE:
            return self._const(rope_table(a["kind"], a["start"], a["count"], a["half"],
                                          a["base"], dt))
        return self._const(mask_table(a["n_q"], a["q_start"], a["groups"], dt))

    def _is_constant(self, vid: int) -> bool:
        """Is value `vid` the same at every run (a generator, an immediate, a view of a
        constant root, or folded here)?"""
        if vid in self.folded or is_immediate(self.g, vid):
            return True
        if self.g.node(vid).op in (Op.ROPE, Op.MASK):
            return True
        view = self.plan.views.get(vid)
        return view is not None and self.plan.is_constant_root(view[0])

    def _fold(self, n: Node, xs: list[Any]) -> Tensor:
        """A kernel-internal value computed from constants alone (a concatenation of rotary
        tables, a negated half): computed once, now, instead of at every run."""
        like = next(x for x in xs if isinstance(x, Tensor))
        o = torch.empty(n.type.shape, dtype=_dtype(n.type.dtype, self.float_dtype),
                        device=like.device)
        for f in _emit(self, n, xs, o):
            f()
        self.folded.add(n.id)
        return self._const(o)

    def _const(self, t: Tensor) -> Tensor:
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

    def _scan(self, n: Node, outputs: set[int]) -> None:
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
        args = [x if isinstance(x, Tensor) else self._const(torch.tensor(
            x, dtype=_dtype(self.g.node(i).type.dtype, self.float_dtype)))
            for i, x in zip(n.inputs, args)]
        args = [self.carry_init(i, x) if k < nc else x
                for k, (i, x) in enumerate(zip(n.inputs, args))]
        ws = next(b for b in self.plan.buffers if b.kind == "workspace" and b.value == n.id)
        region = _region(self.arena, ws.offset, ws.size)
        state = self.plan.carry_state[n.id]
        carry_types = list(n.type[:nc])
        slot_sets = [[region.view(off, t, self.float_dtype) if size else None   # unused slot
                      for (off, size), t in zip(state[s * nc:(s + 1) * nc], carry_types)]
                     for s in (0, 1)]
        body_offset = self.plan.workspace_body_offset(n.id)
        body_arena = _region(region, body_offset, ws.size - body_offset)
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
            copies = [_copy(home, sub.home(v)) for k, ((_, v), home)
                      in enumerate(zip(body.outputs, homes))
                      if not body_plan.direct_output(k) and not _same_view(home, sub.home(v))]
            if copies:
                groups.append(("scan", copies))
            iterations.append(groups)
            carry_in = homes[:nc]
        flat = [f for groups in iterations for _, fns in groups for f in fns]

        def run() -> None:
            prof = _PROFILER.get()
            if prof is not None:
                timed = prof.run
                for groups in iterations:
                    for label, fns in groups:
                        timed(label, fns)
            else:
                for f in flat:
                    f()

        self.steps.append(run)


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


def _region(storage: Storage, offset: int, size: int) -> Storage:
    """A sub-region of `storage` as a Storage of its own."""
    region = Storage(0)
    region.data = storage.data[offset:offset + size]
    region.nbytes = size
    return region


def _dname(dt: torch.dtype) -> str:
    return dtype_name(dt)


def _same_view(a: Tensor, b: Tensor) -> bool:
    """Do a and b view the same elements in the same layout (a copy would change nothing)?"""
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype and a.device == b.device)


def _copy(dst: Tensor, src: Tensor) -> Step:
    return lambda: dst.copy_(src)


_FOLDABLE = frozenset({Op.CONCAT, Op.CAST, Op.PAD})   # `_emit` needs no scratch for these

# -- views: no work when torch can express them on the operand's storage -------------------------

def _reshape(x: Tensor, a: dict, n: Node) -> Tensor | None:
    try:
        return x.view(a["shape"])
    except RuntimeError:
        return None                                   # needs a copy: computed below


_VIEWS: dict[Op, Callable[[Tensor, dict, Node], Tensor | None]] = {
    Op.RESHAPE: _reshape,
    Op.PERMUTE: lambda x, a, n: x.permute(*a["perm"]),
    Op.EXPAND: lambda x, a, n: x.expand(*a["shape"]),
    Op.SLICE: lambda x, a, n: x.narrow(a["axis"], a["start"], a["stop"] - a["start"]),
}


# -- compute: every op writes into `o` (its rule in the cpu table, `lowerings.CPU`) --------------

def _emit(b: _Builder, n: Node, xs: list[Any], o: Tensor) -> list[Step]:
    if n.op in ELEMENTWISE:
        return _elementwise(b, n.op, xs, o)
    return CPU[n.op](b, n, xs, o)


@register_lowering(Op.CAST, CPU)
def _cast(b: _Builder, n: Node, xs: list[Any], o: Tensor) -> list[Step]:
    x = xs[0]
    return [lambda: o.copy_(x)]


@register_lowering(Op.RESHAPE, CPU)
def _reshape_copy(b: _Builder, n: Node, xs: list[Any], o: Tensor) -> list[Step]:
    x = xs[0]                                        # a reshape no view expresses
    flat = o.view(x.shape)
    return [lambda: flat.copy_(x)]


@register_lowering(Op.SUM, CPU)
@register_lowering(Op.AMAX, CPU)
def _reduce(b: _Builder, n: Node, xs: list[Any], o: Tensor) -> list[Step]:
    f = torch.sum if n.op is Op.SUM else torch.amax
    x, dims, keep = xs[0], tuple(n.attr("axes")), n.attr("keepdim")
    return [lambda: f(x, dim=dims, keepdim=keep, out=o)]


@register_lowering(Op.PAD, CPU)
def _pad(b: _Builder, n: Node, xs: list[Any], o: Tensor) -> list[Step]:
    x, ax, before = xs[0], n.attr("axis"), n.attr("before")
    inner = o.narrow(ax, before, x.shape[ax])
    after = o.shape[ax] - before - x.shape[ax]
    margins = [o.narrow(ax, 0, before)] if before else []
    margins += [o.narrow(ax, before + x.shape[ax], after)] if after else []
    return [*(lambda m=m: m.zero_() for m in margins), lambda: inner.copy_(x)]


@register_lowering(Op.CONCAT, CPU)
def _concat(b: _Builder, n: Node, xs: list[Any], o: Tensor) -> list[Step]:
    parts, ax = list(xs), n.attr("axis")
    return [lambda: torch.cat(parts, ax, out=o)]


def _elementwise(b: _Builder, op: Op, xs: list[Any], o: Tensor) -> list[Step]:
    """An elementwise op into `o` (its registry entry's `out`); a Python float operand (an
    immediate) folds away or takes a scalar overload where one exists, else becomes a 0-d
    constant tensor."""
    rule = ELEMENTWISE[op]
    if all(isinstance(x, float) for x in xs):
        v = rule.fold(*xs)
        return [lambda: o.fill_(v)]
    if len(xs) == 2:
        x, y = xs
        if isinstance(x, float):                      # constant on the left
            if op in (Op.ADD, Op.MUL):
                f = torch.add if op is Op.ADD else torch.mul
                return [lambda: f(y, x, out=o)]
            if op is Op.SUB:
                return [lambda: torch.neg(y, out=o), lambda: o.add_(x)]
            if op is Op.DIV:
                return [lambda: torch.reciprocal(y, out=o), lambda: o.mul_(x)]
            if op is Op.MAX:
                return [lambda: torch.clamp_min(y, x, out=o)]
        if isinstance(y, float) and op is Op.MAX:
            return [lambda: torch.clamp_min(x, y, out=o)]
        if isinstance(y, float) and op in (Op.ADD, Op.SUB, Op.MUL, Op.DIV):
            return [lambda: rule.out(o, x, y)]        # torch takes a scalar on the right
    ts = [b._const(torch.tensor(x, dtype=o.dtype)) if isinstance(x, float) else x for x in xs]
    return [lambda: rule.out(o, *ts)]


@register_lowering(Op.EINSUM, CPU)
def _einsum(b: _Builder, n: Node, xs: list[Tensor], o: Tensor) -> list[Step]:
    """A two-operand einsum as one bmm: operands permuted to (batch, M, K) / (batch, K, N),
    staged into scratch when not viewable that way; the result permuted into `o`."""
    spec = n.attr("spec")
    if len(xs) != 2:
        raise NotImplementedError("torch executor: einsum of more than two operands")
    (ta, tb), tc = spec.split("->")[0].split(","), spec.split("->")[1]
    steps: list[Step] = []
    x, y = xs
    # letters only one operand has and the output lacks: sum them out first
    for which in (0, 1):
        t, other, v = (ta, tb, x) if which == 0 else (tb, ta, y)
        lone = [i for i, ch in enumerate(t) if ch not in other and ch not in tc]
        if lone:
            keep = "".join(ch for ch in t if ch not in [t[i] for i in lone])
            s = b.scratch.alloc(TensorType(tuple(v.shape[i] for i, ch in enumerate(t) if ch in keep),
                                           _dname(v.dtype)))
            steps.append(lambda v=v, s=s, d=tuple(lone): torch.sum(v, dim=d, out=s))
            if which == 0:
                ta, x = keep, s
            else:
                tb, y = keep, s
    size = {ch: d for t, v in ((ta, x), (tb, y)) for ch, d in zip(t, v.shape)}
    batch = [ch for ch in tc if ch in ta and ch in tb]
    m = [ch for ch in tc if ch in ta and ch not in tb]
    nn = [ch for ch in tc if ch in tb and ch not in ta]
    k = [ch for ch in ta if ch in tb and ch not in tc]
    prod = lambda cs: int(torch.tensor([size[c] for c in cs] or [1]).prod())
    B, M, N, K = prod(batch), prod(m), prod(nn), prod(k)

    def arrange(v: Tensor, t: str, rows: list[str], cols: list[str]) -> Tensor:
        """v as (batch, rows, cols): a view, else staged into scratch whose innermost axis
        is v's unit-stride one (a contiguous copy; BLAS takes the transposed view as is)."""
        shape = (prod(batch), prod(rows), prod(cols))
        try:
            return v.permute(*[t.index(ch) for ch in batch + rows + cols]).view(shape)
        except RuntimeError:
            pass
        unit = [ch for i, ch in enumerate(t) if v.stride(i) == 1 and v.shape[i] > 1]
        flip = bool(unit) and unit[0] in rows
        p = v.permute(*[t.index(ch) for ch in batch + (cols + rows if flip else rows + cols)])
        s = b.scratch.alloc(TensorType(tuple(p.shape), _dname(v.dtype)))
        steps.append(lambda s=s, p=p: s.copy_(p))
        return s.view(shape[0], shape[2], shape[1]).transpose(1, 2) if flip else s.view(shape)

    A = arrange(x, ta, m, k)
    Bm = arrange(y, tb, k, nn)
    natural = batch + m + nn
    if list(tc) == natural:
        C = o.view(B, M, N)
        steps.append(lambda: torch.bmm(A, Bm, out=C))
    elif list(tc) == batch + nn + m:                 # C^T = B^T A^T: transposes are views
        Ct, At, Bt = o.view(B, N, M), A.transpose(1, 2), Bm.transpose(1, 2)
        steps.append(lambda: torch.bmm(Bt, At, out=Ct))
    else:
        s = b.scratch.alloc(TensorType((B, M, N), _dname(o.dtype)))
        back = s.view([size[c] for c in natural]).permute(*[natural.index(ch) for ch in tc])
        steps += [lambda: torch.bmm(A, Bm, out=s), lambda: o.copy_(back)]
    return steps


@register_lowering(Op.CUMSUM, CPU)
def _cumsum(b: _Builder, n: Node, xs: list[Tensor], o: Tensor) -> list[Step]:
    x, axis, reverse = xs[0], n.attr("axis"), n.attr("reverse")
    if not reverse:
        return [lambda: torch.cumsum(x, axis, out=o)]
    n = x.shape[axis]
    rev = b._const(torch.arange(n - 1, -1, -1))
    s = b.scratch.alloc(TensorType(tuple(x.shape), _dname(x.dtype)))
    s2 = b.scratch.alloc(TensorType(tuple(x.shape), _dname(x.dtype)))
    return [lambda: torch.index_select(x, axis, rev, out=s), lambda: torch.cumsum(s, axis, out=s2),
            lambda: torch.index_select(s2, axis, rev, out=o)]


def _contiguous(b: _Builder, v: Tensor, steps: list[Step]) -> Tensor:
    if v.is_contiguous():
        return v
    s = b.scratch.alloc(TensorType(tuple(v.shape), _dname(v.dtype)))
    steps.append(lambda: s.copy_(v))
    return s


@register_lowering(Op.TAKE, CPU)
def _take(b: _Builder, n: Node, xs: list[Tensor], o: Tensor) -> list[Step]:
    steps: list[Step] = []
    src, idx = xs[0], _contiguous(b, xs[1], steps).view(-1)
    flat_out = o.view(-1, *src.shape[1:])
    return steps + [lambda: torch.index_select(src, 0, idx, out=flat_out)]


@register_lowering(Op.INDEX_ADD, CPU)
def _index_add(b: _Builder, n: Node, xs: list[Tensor], o: Tensor) -> list[Step]:
    steps: list[Step] = []
    idx, g = _contiguous(b, xs[1], steps), _contiguous(b, xs[0], steps)
    if g.dtype != o.dtype:                  # a narrower gradient summed in o's dtype
        wide = b.scratch.alloc(TensorType(tuple(g.shape), _dname(o.dtype)))
        steps.append(lambda g=g: wide.copy_(g))
        g = wide
    flat_idx, flat_g = idx.view(-1), g.view(-1, *o.shape[1:])
    return steps + [lambda: o.zero_(), lambda: o.index_add_(0, flat_idx, flat_g)]


@register_lowering(Op.TAKE_ALONG, CPU)
def _take_along(b: _Builder, n: Node, xs: list[Tensor], o: Tensor) -> list[Step]:
    steps: list[Step] = []
    src, i2, o2 = xs[0], _contiguous(b, xs[1], steps).unsqueeze(-1), o.unsqueeze(-1)
    return steps + [lambda: torch.gather(src, -1, i2, out=o2)]


@register_lowering(Op.SCATTER_ALONG, CPU)
def _scatter_along(b: _Builder, n: Node, xs: list[Tensor], o: Tensor) -> list[Step]:
    steps: list[Step] = []
    i2, g2 = _contiguous(b, xs[1], steps).unsqueeze(-1), xs[0].unsqueeze(-1)
    return steps + [lambda: o.zero_(), lambda: o.scatter_add_(-1, i2, g2)]


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
        prof = _PROFILER.get()
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


class profiling:
    """`with profiling() as prof:` times every kernel run inside, by category."""

    def __enter__(self) -> Profiler:
        prof = Profiler()
        self._token = _PROFILER.set(prof)
        return prof

    def __exit__(self, *exc: Any) -> None:
        _PROFILER.reset(self._token)
