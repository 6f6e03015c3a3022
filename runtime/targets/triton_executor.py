"""The `triton` target: a schedule's kernels as generated Triton, over the same buffer plan.

`TritonExecutor` is the cpu target's sibling (`executor.PlanExecutor`): it walks the same
lowered program (`codegen.lowered`), binding as the cpu target binds (every value a kernel
reads or writes is a view of the activation arena, the persistent region or a caller-bound
tensor), and runs a `Launch` as one launch of its rendered kernel
(`codegen.lower.dispatch.render_kernel`) and a `LaunchGroup` (independent launches of one wave,
`codegen.horizontal`; off with `TITANC_GROUP_LAUNCHES=0`) as one launch of its group kernel
(`codegen.group`), prepared at bind time. A scan is one launch of its scan kernel
(`codegen.scan`: the iterations loop inside the kernel, grid over the scan's independent
axes, workspace made once at bind time, a prologue gather read through) where it renders as
one (`lower`); else a `ScanLoop`: one launch of its prologue gathers
(`ir.schedule.prologue_kernel`) into their planned storage, then the host loop (carry
slots, xs as views, ys in their ITEM buffers) over its body's launches, and its reason is kept
in `fallbacks` (`TITANC_DEBUG=2` prints it). `launches_per_run()` counts the launches of one
run; `count_launches(plan)` gives the same figure from the plan alone.
No kernel falls back to torch: a kernel no family can express fails at bind time with the
hooks' `NotImplementedError`.

Without CUDA the kernels run on CPU under Triton's interpreter (`interpreting()`); a caller
that wants the interpreter on a CUDA machine sets `TRITON_INTERPRET=1`. The executor sets
`TRITON_INTERPRET` only while it loads and runs kernels (`config.triton_interpret_mode`), so importing
or constructing nothing changes the environment. One limit is Triton's own: it fixes the mode of
its standard library (`tl.sigmoid`, the reductions' combine functions) when `triton.language`
is first imported, so a process that imported Triton in compile mode before (torch.func and
torch.compile import it) cannot interpret kernels; the executor then refuses with a one-line
error saying to set `TRITON_INTERPRET=1` before Python starts. With CUDA (and no interpreter)
the arena, the scratch region and the caller's bound tensors live on the GPU.
"""
from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

import torch

from titanc.codegen.lower.dispatch import KernelCode, graph_dtype, render_kernel
from titanc.codegen.lower.patterns import SCRATCH
from titanc.codegen.render import load_module, load_rendered, store_rendered
from titanc.codegen.scan.kernel import (ScanFallback, ScanKernel, count_launches,
                                        host_table, scan_kernel_for)
from titanc.errors import TitancError
from titanc.ir.types import TensorType
from titanc.config import current, debug_level, triton_interpret, triton_interpret_mode
from titanc.ir.buffer_plan import BufferPlan

from titanc.codegen.group import groupable, render_group
from titanc.codegen.lowered import Launch, LaunchGroup, Lowered, ScanLaunch, Step, lower
from titanc.runtime.targets.binder import Binder, Tensor
from titanc.runtime.targets.executor import PlanExecutor

__all__ = ["TritonExecutor", "count_launches", "interpreting", "launch_tensors", "module_for",
           "scan_kernel_for"]


def check_interpretable() -> None:
    """Raise unless Triton can interpret kernels in this process (see the module docstring)."""
    tl = sys.modules.get("triton.language")
    if tl is None or type(tl.standard.sigmoid).__name__ == "InterpretedFunction":
        return
    raise TitancError("the triton target on CPU runs kernels under Triton's interpreter, but "
                      "Triton was already imported in compile mode in this process (torch.func "
                      "and torch.compile import it): set TRITON_INTERPRET=1 before starting "
                      "Python")


def interpreting() -> bool:
    """Do Triton kernels run under the interpreter (on CPU tensors)? Yes without CUDA, or
    when `TRITON_INTERPRET` asks for it."""
    return not torch.cuda.is_available() or triton_interpret()


_MODULES: dict[tuple[str, bool], ModuleType] = {}


def swap_modules(table: dict[tuple[str, bool], ModuleType]) -> dict[tuple[str, bool], ModuleType]:
    """Install `table` as the modules `module_for` hands out and return the table it replaces
    (`aot.fresh_kernel_modules`)."""
    global _MODULES
    previous, _MODULES = _MODULES, table
    return previous


def module_for(code: KernelCode) -> ModuleType:
    """The imported module of `code`; kernels whose sources differ only in their header and
    name (`KernelCode.key`) share the module of the first one loaded."""
    key = (code.key, interpreting())
    if key not in _MODULES:
        _MODULES[key] = load_module(code.source, code.name, interpreting())
    return _MODULES[key]


def launch_tensors(code: KernelCode, tensor_of: Any, scratch: Any = None) -> list[Tensor]:
    """The tensors of `code`'s launch: `tensor_of(value id)`, viewed as each argument asks;
    a temporary (`pattern_kernels.SCRATCH`) is `scratch(shape)` (default: a new tensor like
    the first argument)."""
    out = []
    for a in code.args:
        if a.value == SCRATCH:
            out.append(scratch(a.view) if scratch is not None else out[0].new_empty(a.view))
            continue
        t = tensor_of(a.value)
        out.append(t.view(a.view) if a.view is not None else t)
    return out


class _TritonBuilder(Binder):
    """Binds as every target's builder does (`Binder`); a `Launch` is one launch of its
    rendered module, a `ScanLaunch` one launch of its scan kernel (`codegen.scan`), a
    `ScanLoop` its prologue kernel's launch then the host loop over its body's launches.
    `launches` counts the kernel launches of one run of the schedule (a host-loop scan: its
    body's launches times its length)."""

    def __init__(self, owner: "TritonExecutor", *args: Any):
        super().__init__(*args)
        self.owner = owner
        self.launches = 0
        self._subs: list[_TritonBuilder] = []

    def sub_builder(self, *args: Any) -> Binder:
        sub = _TritonBuilder(self.owner, *args)
        self._subs.append(sub)
        return sub

    def step(self, st: Step) -> None:
        kern = st.kernel
        if isinstance(st, Launch):
            self._launch(kern)
            return
        if isinstance(st, LaunchGroup):
            self._launch(kern, self.owner.group_code(self.plan, st))
            return
        if isinstance(st, ScanLaunch):
            self._scan_kernel(kern, st.scan, st.code)
            return
        if st.prologue is not None:                 # the carries' rows, gathered first
            self._launch(st.prologue)
            for v in st.prologue.outputs:
                self.val[v] = self.located(v)
        self.scan(self.g.node(st.scan), set(kern.outputs))   # the loop over its body
        self.kernel_outputs(kern)
        self.launches += self._subs[-1].launches * self.g.node(st.scan).attr("length")

    def carry_init(self, vid: int, x: Tensor) -> Tensor:
        """A constant initial carry that broadcasts (a stride-0 axis of size > 1: the zero
        state, the zero cotangent) is made dense once, at bind time. Triton specialises a
        kernel on its stride arguments (1 is a constant, 0 is not), so a loop body whose
        first iteration read the broadcast and the others a dense carry would be compiled
        twice (tiny.yaml: 13 of 109 compiles, 35 s of 165)."""
        broadcast = any(st == 0 and sz > 1 for st, sz in zip(x.stride(), x.shape))
        if not (broadcast and self.is_constant(vid)):
            return x
        # one dense copy per scan operand, whichever iteration of an enclosing host loop binds
        # it (read only: the first iteration reads it, the others their carry slots);
        # large_125m's nested memory scans made 1.1 GB of copies of the zero state otherwise
        key = (id(self.plan), vid)
        dense = self.owner.dense_carries.get(key)
        if dense is None:
            dense = self.owner.dense_carries[key] = self.const(x.contiguous())
        return dense

    def _launch(self, kern: Any, code: KernelCode | None = None) -> None:
        """One launch of a rendered (non-scan) kernel, or of a launch group's `code`."""
        code = code if code is not None else self.owner.code(self.plan, kern)
        module = module_for(code)
        tensors = launch_tensors(code, self.home, self._scratch)
        sizes = code.sizes
        if code.family == "group":        # its members' arguments gathered once (`bind`)
            self.steps.append(module.bind(*tensors, *sizes))
        else:
            self.steps.append(lambda: module.launch(*tensors, *sizes))
        self.launches += 1

    def _scratch(self, shape: tuple[int, ...]) -> Tensor:
        """A temporary of a pattern kernel (an unread tuple element, attention's delta rows)."""
        dt = "f64" if self.owner.dtype == "float64" else "f32"
        return self.scratch.alloc(TensorType(tuple(shape), dt))

    def _scan_kernel(self, kern: Any, sid: int, sk: ScanKernel) -> None:
        """Bind one scan kernel: operands, the ITEM outputs the program reads, tables, and a
        workspace of GRID x WS elements (the executor's one scan workspace, grown at bind
        time to the largest kernel's need: scan kernels run one after another)."""
        n = self.g.node(sid)
        dt = {"float64": torch.float64}.get(self.owner.dtype, torch.float32)
        args = [self.operand(n.inputs[i]) for i in sk.inputs] + [self.operand(v)
                                                                 for v in sk.extra]
        outs = set(kern.outputs)
        items = {self.g.node(u).attr("index"): u for u in self.g.users(sid) if u in outs}
        for k in sk.outputs:
            self.val[items[k]] = self.located(items[k])
        tables = [self.const(host_table(op, a, dt)) for op, a in sk.tables]
        owner = self.owner
        owner.scan_workspace(sk.grid * sk.ws_per_program, dt, self.arena.data.device)
        module = owner.scan_module(sk)
        tensors = [*args, *(self.val[items[k]] for k in sk.outputs), *tables]
        self.steps.append(lambda: module.launch(owner.scan_ws, *tensors))
        self.launches += 1


class TritonExecutor(PlanExecutor):
    """Run a graph's lowered program in its memory plan with generated Triton kernels (the
    cpu target's sibling: `run(inputs) -> outputs`, `storages()`).

    With `cuda_graphs` (on a CUDA device only) the first run is eager (Triton compiles its
    kernels there), the second is captured into a `torch.cuda.CUDAGraph` and every later
    run copies the inputs into their planned buffers and replays it: the kernels' addresses
    never change, because every tensor they touch is a fixed view of planned storage."""

    device = "cuda" if torch.cuda.is_available() and not interpreting() else "cpu"

    def __init__(self, plan: BufferPlan, bound: dict[str, Tensor] | None = None,
                 float_dtype: torch.dtype | None = None, cuda_graphs: bool | None = None,
                 allow_tf32: bool = False, plan_key: str | None = None):
        self.allow_tf32 = allow_tf32                  # float32 dots in tf32 (compile.allow_tf32)
        self.dtype = {torch.float64: "float64", torch.float32: "float32"}.get(
            float_dtype, graph_dtype(plan.schedule.graph))
        self._codes: dict[tuple[int, str], KernelCode] = {}
        self.grouped: dict[str, list[str]] = {}       # launch group -> its members' kernels
        self.cuda_graphs = self.device == "cuda" and cuda_graphs is not False
        self._graph: Any = None
        self._runs = 0
        self._scans: dict[tuple[int, str], ScanKernel | str] = {}
        self._scan_modules: dict[str, ModuleType] = {}
        self.fallbacks: list[dict[str, str]] = []     # scans run as host loops, and why
        self.scan_kernels = current().scan_kernels
        self.scan_ws: Tensor | None = None            # shared by every scan kernel
        self.dense_carries: dict[tuple[int, int], Tensor] = {}   # `_TritonBuilder.carry_init`
        # `plan_key`: what the plan was compiled from (a Program passes it, `Executors.plan_key`).
        # The precompile's marker and the rendered kernels of an earlier process are found
        # under it; a plan's scan bodies are told apart by the order binding meets them
        # (the same for the same plan)
        cfg = current()
        self._disk_key = (f"{plan_key}|{self.dtype}|{allow_tf32}|split_k={cfg.split_k}"
                          f"|gpu_blocks={cfg.gpu_blocks}|scan_cost={cfg.scan_cost}"
                          if plan_key is not None and cfg.compile_cache and not cfg.debug
                          else None)
        self._disk = load_rendered(self._disk_key) if self._disk_key else {}
        self._disk_new = False
        self._plan_ordinal: dict[int, int] = {}
        if interpreting():
            check_interpretable()
        elif self.device == "cuda":      # every kernel compiled in parallel, before binding
            from titanc.runtime.targets.precompile import precompile_for_device
            precompile_for_device(plan, allow_tf32, float_dtype,
                                  keys=None if plan_key is None else [plan_key])
        super().__init__(plan, bound, float_dtype)
        if self._disk_new:
            store_rendered(self._disk_key, self._disk)

    def run(self, inputs: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
        if not self.cuda_graphs:
            with triton_interpret_mode(interpreting()):
                return super().run(inputs)
        if self._graph is None and self._runs >= 1:
            self._graph = torch.cuda.CUDAGraph()
            torch.cuda.synchronize()
            with torch.cuda.graph(self._graph):
                super().run(None)                    # captures the launches, not the copies
        self._runs += 1
        if self._graph is None:
            return super().run(inputs)
        for name, t in (inputs or {}).items():
            dst = self.inputs[name]
            if dst.data_ptr() != t.data_ptr():
                dst.copy_(t)
        self._graph.replay()
        return self.outputs

    def make_builder(self, *args: Any) -> Binder:
        return _TritonBuilder(self, *args)

    def lower(self, plan: BufferPlan) -> Lowered:
        """The lowered program: a scan is one launch of its scan kernel where it renders as
        one (else a loop, its reason in `fallbacks`)."""
        def scan_kernel(p: BufferPlan, kern: Any, sid: int) -> ScanKernel | None:
            sk = self.scan_code(p, kern, sid)
            return sk if isinstance(sk, ScanKernel) else None
        return lower(plan, scan_kernel, groupable if current().group_launches else None)

    def scan_workspace(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        """Grow the scan workspace to at least `numel` elements (bind time only)."""
        if device.type != "meta" and (self.scan_ws is None or self.scan_ws.numel() < numel):
            self.scan_ws = torch.empty(numel, dtype=dtype, device=device)

    def storages(self) -> list[Tensor]:
        return super().storages() + ([self.scan_ws] if self.scan_ws is not None else [])

    def code(self, plan: BufferPlan, kern: Any) -> KernelCode:
        """The rendered kernel (once per executor: binding runs twice, measure then bind);
        `TITANC_DEBUG=3` prints each one."""
        key = (id(plan), kern.name)
        if key not in self._codes:
            code = self._stored("code", plan, kern.name)
            if code is None:
                code = render_kernel(plan.schedule.graph, kern, dtype=self.dtype,
                                     skip=set(plan.aliases), allow_tf32=self.allow_tf32,
                                     strided=plan.strided)
                self._store("code", plan, kern.name, code)
            self._codes[key] = code
            if debug_level() >= 3:
                print(code.source, file=sys.stderr)
        return self._codes[key]

    def group_code(self, plan: BufferPlan, st: LaunchGroup) -> KernelCode:
        """The kernel of a launch group (`codegen.group`), over its members' rendered ones."""
        key = (id(plan), st.kernel.name)
        if key not in self._codes:
            members = [self.code(plan, m.kernel) for m in st.members]
            self.grouped[st.kernel.name] = [m.name for m in members]
            code = self._stored("code", plan, st.kernel.name)
            if code is None:
                code = render_group(st.kernel.name, plan.schedule.graph.name, members)
                self._store("code", plan, st.kernel.name, code)
            self._codes[key] = code
            if debug_level() >= 3:
                print(code.source, file=sys.stderr)
        return self._codes[key]

    def _slot(self, kind: str, plan: BufferPlan, name: str) -> tuple[str, int, str]:
        return kind, self._plan_ordinal.setdefault(id(plan), len(self._plan_ordinal)), name

    def _stored(self, kind: str, plan: BufferPlan, name: str) -> Any:
        """What an earlier process rendered for kernel `name` of `plan`, or None."""
        return self._disk.get(self._slot(kind, plan, name)) if self._disk_key else None

    def _store(self, kind: str, plan: BufferPlan, name: str, value: Any) -> None:
        if self._disk_key:
            self._disk[self._slot(kind, plan, name)] = value
            self._disk_new = True

    def scan_code(self, plan: BufferPlan, kern: Any, sid: int) -> ScanKernel | str:
        """The scan kernel of `kern`'s scan, or the reason it runs as a host loop (recorded
        in `fallbacks`; `TITANC_DEBUG=2` prints it)."""
        key = (id(plan), kern.name)
        if key not in self._scans and not self.scan_kernels:
            self._scans[key] = "scan kernels are off (TITANC_SCAN_KERNELS=0)"
        if key not in self._scans:
            g = plan.schedule.graph
            sk: ScanKernel | str | None = self._stored("scan", plan, kern.name)
            if sk is None:
                try:
                    sk = scan_kernel_for(plan, kern, sid, self.dtype, self.allow_tf32)
                except ScanFallback as e:
                    sk = str(e)
                self._store("scan", plan, kern.name, sk)
            if isinstance(sk, str):
                self.fallbacks.append({"graph": g.name, "scan": kern.name, "reason": sk})
                if debug_level() >= 2:
                    print(f"titanc: scan {kern.name} of graph {g.name} runs as a host loop: "
                          f"{sk}", file=sys.stderr)
            elif debug_level() >= 3:
                print(sk.source, file=sys.stderr)
            self._scans[key] = sk
        return self._scans[key]

    def scan_module(self, sk: ScanKernel) -> ModuleType:
        key = f"{sk.key}|{interpreting()}"
        if key not in self._scan_modules:
            self._scan_modules[key] = load_module(sk.source, sk.name, interpreting())
        return self._scan_modules[key]

    def launches_per_run(self) -> int:
        """Kernel launches of one `run` (a host-loop scan counts its body's launches once per
        iteration)."""
        return self._b.launches

    def kernels(self) -> list[KernelCode]:
        """Every kernel rendered for this executor, in first-bind order."""
        return list(self._codes.values())

