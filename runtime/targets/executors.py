"""A program's executors: one per compiled graph, on the program's target, bound on first use
to the program's own tensors.

A target names its executor class (`executor_class`: `cpu` the torch `ArenaExecutor`, `triton`
the `TritonExecutor`; `auto` is `triton` when CUDA is present, `resolve_target`). A graph's
executor binds, by name, the parameters, the gradient buffer its kind writes (the optimizer
reads the accumulator, the training graph writes the micro-batch buffer) and the AdamW
moments (`Executors.bind`), so a step copies none of them. On CUDA the first bind compiles,
in one parallel pool, every kernel a training run launches (`Executors.precompile`).
"""
from __future__ import annotations

from typing import Any

import torch

Tensor = torch.Tensor


def resolve_target(target: str) -> str:
    """auto -> triton with CUDA, else the torch executor ('cpu')."""
    if target == "auto":
        return "triton" if torch.cuda.is_available() else "cpu"
    return target


def executor_class(target: str) -> Any:
    """The executor of a target (the triton one is imported only when used: importing it
    selects Triton's interpreter when no CUDA device is present)."""
    if target == "triton":
        from titanc.runtime.targets.triton_executor import TritonExecutor
        return TritonExecutor
    from titanc.runtime.targets.executor import ArenaExecutor
    return ArenaExecutor


class Executors:
    """The executors of program `prog`'s compiled graphs (runtime/program.py `Program`), by
    graph (`by_graph`), on `target` (resolved; none for `reference`, whose graphs run on the
    interpreter). `device` is where the program's state lives."""

    def __init__(self, prog: Any, target: str):
        self.prog = prog
        self.target = target
        self.cls = None if target == "reference" else executor_class(target)
        self.device = getattr(self.cls, "device", "cpu")
        cc = prog.spec.compile
        self.options = ({"cuda_graphs": cc.cuda_graphs, "allow_tf32": cc.allow_tf32}
                        if target == "triton" else {})
        self.by_graph: dict[int, Any] = {}

    def of(self, cg: Any) -> Any:
        """The executor of compiled graph `cg`, bound on first use."""
        ex = self.by_graph.get(id(cg))
        if ex is None:
            if not self.by_graph and self.target == "triton" and self.device == "cuda":
                self.precompile()
            ex = self.by_graph[id(cg)] = self.bind(cg)
        return ex

    def storages(self) -> list[Tensor]:
        """Every tensor storage the executors own (for allocation probes)."""
        return [t for ex in self.by_graph.values() for t in ex.storages()]

    def precompile(self, batch: int | None = None) -> None:
        """On CUDA: compile, in one parallel pool, every kernel a training run launches (the
        training and optimizer programs, and the forward and logits programs its evaluation
        runs (held-out loss, recall accuracy), at `batch` rows, default train.batch_size)
        before the first of them binds, so the first step waits for one pool and a second
        run compiles nothing (`runtime.targets.precompile`). Called on the first bind; a
        no-op elsewhere."""
        if not (self.target == "triton" and self.device == "cuda"):
            return
        from titanc.runtime.targets.precompile import precompile_for_device

        plans, keys = self.plans(batch)
        precompile_for_device(plans, self.prog.spec.compile.allow_tf32, keys=keys)

    def plans(self, batch: int | None = None) -> tuple[list[Any], list[str]]:
        """The plans `precompile` compiles at `batch` rows, and for each what it was compiled
        from (the compile cache's key, the compiler's sources, the graph): the same in a
        second process, whose plans the compile cache gives back, so it finds the markers
        the first one wrote."""
        prog = self.prog
        b = batch or prog.batch_size
        graphs = [prog.graph("training", b), prog.compiled.graph("optimizer"),
                  prog.graph("forward", b), prog.graph("logits", b)]
        return [cg.plan for cg in graphs], [self.plan_key(cg) for cg in graphs]

    def plan_key(self, cg: Any) -> str:
        """What compiled graph `cg`'s plan was compiled from (`Compiled.graph_key`): the same
        in every process, so a second run finds the precompile's markers and the rendered
        kernels the first one kept."""
        for c in [self.prog.compiled, *self.prog.by_batch.values()]:
            key = c.graph_key(cg)
            if key is not None:
                return key
        raise KeyError(f"graph {cg.kind} is not one of this program's compiles")

    def bind(self, cg: Any) -> Any:
        """A new executor of compiled graph `cg` over the program's parameters, the gradient
        buffer of its kind and the AdamW moments, each bound under every name `cg` uses."""
        prog, g = self.prog, cg.graph
        names = set(g.input_names()) | {n for n, _ in g.outputs}
        bound: dict[str, Tensor] = {}
        for n, t in prog.params.items():
            for alias in (n, f"param.{n}"):
                if alias in names:
                    bound[alias] = t
            if f"grad.{n}" in names:
                bound[f"grad.{n}"] = prog.grad_acc[n] if cg.kind == "optimizer" \
                    else prog.grad_tmp[n]
            if f"opt.m.{n}" in names:
                bound[f"opt.m.{n}"], bound[f"opt.v.{n}"] = prog.opt_m[n], prog.opt_v[n]
        options = dict(self.options)
        if prog.stepper.capture and cg.kind in ("training", "optimizer"):
            options["cuda_graphs"] = False           # inside the step's own graph
        if self.target == "triton":
            options["plan_key"] = self.plan_key(cg)
        return self.cls(cg.plan, bound, **options)
