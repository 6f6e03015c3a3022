"""The `triton` target: a schedule's kernels as generated Triton, over the same memory plan.

`TritonExecutor` is an `ArenaExecutor` whose builder launches one rendered kernel per fused
kernel (`codegen.hooks.render_kernel`) instead of one torch closure per node. Binding is the
arena executor's: every value a kernel reads or writes is a view of the activation arena, the
persistent region or a caller-bound tensor. Scans keep its loop too (carry slots, xs staged
per iteration, ys copied into their ITEM buffers) and run their body's kernels the same way.
No kernel falls back to torch: a kernel no family can express fails at bind time with the
hooks' `NotImplementedError`.

Without CUDA the kernels run on CPU under Triton's interpreter. Triton reads
`TRITON_INTERPRET` when a kernel module is imported (decorated), so importing this module sets
`TRITON_INTERPRET=1` when no CUDA device is present, before any kernel is loaded; a caller that
wants the interpreter on a CUDA machine sets it itself. With CUDA (and no interpreter) the
arena, the scratch region and the caller's bound tensors live on the GPU.
"""
from __future__ import annotations

import os
import sys
from types import ModuleType
from typing import Any

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from titanc.codegen.hooks import KernelCode, graph_dtype, render_kernel  # noqa: E402
from titanc.codegen.render import load_module  # noqa: E402
from titanc.ir import Op  # noqa: E402
from titanc.passes.manager import debug_level  # noqa: E402
from titanc.passes.memory_plan import MemoryPlan  # noqa: E402

from .executor import ArenaExecutor, Tensor, _Builder  # noqa: E402

__all__ = ["TritonExecutor", "interpreting", "launch_tensors", "module_for"]


def interpreting() -> bool:
    """Do Triton kernels run under the interpreter (on CPU tensors)?"""
    return os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "yes", "on")


_MODULES: dict[tuple[str, bool], ModuleType] = {}


def module_for(code: KernelCode) -> ModuleType:
    """The imported module of `code`; kernels whose sources differ only in their header and
    name (`KernelCode.key`) share the module of the first one loaded."""
    key = (code.key, interpreting())
    if key not in _MODULES:
        _MODULES[key] = load_module(code.source, code.name)
    return _MODULES[key]


def launch_tensors(code: KernelCode, tensor_of: Any) -> list[Tensor]:
    """The tensors of `code`'s launch: `tensor_of(value id)`, viewed as each argument asks."""
    out = []
    for a in code.args:
        t = tensor_of(a.value)
        out.append(t.view(a.view) if a.view is not None else t)
    return out


class _TritonBuilder(_Builder):
    """Binds like `_Builder`; a non-scan kernel becomes one launch of its rendered module."""

    def __init__(self, owner: "TritonExecutor", *args: Any):
        super().__init__(*args)
        self.owner = owner

    def sub_builder(self, *args: Any) -> _Builder:
        return _TritonBuilder(self.owner, *args)

    def kernel(self, kern: Any) -> None:
        if any(self.g.node(n).op is Op.SCAN for n in kern.nodes):
            super().kernel(kern)                     # the loop; its body builds through us
            return
        code = self.owner.code(self.plan, kern)
        module = module_for(code)
        tensors = launch_tensors(code, self.home)
        sizes = code.sizes
        self.steps.append(lambda: module.launch(*tensors, *sizes))


class TritonExecutor(ArenaExecutor):
    """Run a graph's schedule in its memory plan with generated Triton kernels (same
    interface as `ArenaExecutor`: `run(inputs) -> outputs`, `storages()`).

    With `cuda_graphs` (on a CUDA device only) the first run is eager (Triton compiles its
    kernels there), the second is captured into a `torch.cuda.CUDAGraph` and every later
    run copies the inputs into their planned buffers and replays it: the kernels' addresses
    never change, because every tensor they touch is a fixed view of planned storage."""

    device = "cuda" if torch.cuda.is_available() and not interpreting() else "cpu"

    def __init__(self, plan: MemoryPlan, bound: dict[str, Tensor] | None = None,
                 float_dtype: torch.dtype | None = None, cuda_graphs: bool | None = None):
        self.dtype = {torch.float64: "float64", torch.float32: "float32"}.get(
            float_dtype, graph_dtype(plan.schedule.graph))
        self._codes: dict[tuple[int, str], KernelCode] = {}
        self.cuda_graphs = self.device == "cuda" and cuda_graphs is not False
        self._graph: Any = None
        self._runs = 0
        super().__init__(plan, bound, float_dtype)

    def run(self, inputs: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
        if not self.cuda_graphs:
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

    def make_builder(self, *args: Any) -> _Builder:
        return _TritonBuilder(self, *args)

    def code(self, plan: MemoryPlan, kern: Any) -> KernelCode:
        """The rendered kernel (once per executor: binding runs twice, measure then bind);
        `TITANC_DEBUG=3` prints each one."""
        key = (id(plan), kern.name)
        if key not in self._codes:
            self._codes[key] = code = render_kernel(plan.schedule.graph, kern, dtype=self.dtype,
                                                    skip=set(plan.aliases))
            if debug_level() >= 3:
                print(code.source, file=sys.stderr)
        return self._codes[key]

    def kernels(self) -> list[KernelCode]:
        """Every kernel rendered for this executor, in first-bind order."""
        return list(self._codes.values())

