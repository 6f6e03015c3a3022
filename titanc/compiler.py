"""The compile pipeline: one flat function of named steps (STYLE.md 6).

spec -> forward graph -> optimised forward -> training graph -> optimizer graph. Every step
is a pure `Graph -> Graph` pass, verified after it runs (`verify_each`), recorded in
`Compiled.passes` (report.json `passes`) and dumped by `titanc compile` as `ir/NN_<pass>_<graph>.txt`.
`TITANC_DEBUG=1` prints pass timings, `=2` the IR after each pass.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from titanc.ir import Graph, dtype_name
from titanc.passes.aggregate import aggregate
from titanc.passes.autodiff import grad_graph
from titanc.passes.canonicalize import canonicalize
from titanc.passes.fusion import fuse
from titanc.passes.memory_plan import MemoryPlan, plan_memory
from titanc.passes.schedule import Schedule
from titanc.passes.chunked_loss import chunk_loss
from titanc.passes.remat import Policy, checkpoint_chunks, choose_policy
from titanc.passes.manager import PassLog
from titanc.passes.optimizer import optimizer_graph

from .frontend import lower_forward
from .params import ParamSpec, param_specs


@dataclass
class Compiled:
    spec: Any
    params: list[ParamSpec]
    forward: Graph
    grad: Graph
    optimizer: Graph
    log: PassLog = field(default_factory=PassLog)
    policy: Policy = field(default_factory=Policy)
    schedules: dict[str, Schedule] = field(default_factory=dict)   # forward/training/optimizer
    plans: dict[str, MemoryPlan] = field(default_factory=dict)

    @property
    def passes(self) -> list[dict[str, Any]]:
        return self.log.records


def compile_graphs(spec: Any, batch: int | None = None, verify_each: bool = True) -> Compiled:
    """Lower `spec` and build its training graphs. Allocates no model-sized tensors."""
    params = param_specs(spec.model)
    log = PassLog(verify_each=verify_each)
    # the direct program: per-token outer products, layers and memory chunks as scans
    fwd = log.run("frontend", lambda: lower_forward(spec, batch))
    # fold constants, simplify, CSE, DCE
    fwd = log.apply("canonicalize", canonicalize, fwd)
    # weighted sums of per-token outer products -> contractions (before autodiff, so the
    # backward differentiates the contraction and never builds the per-token tensor)
    fwd = log.apply("aggregate", aggregate, fwd)
    # LM head + cross-entropy over chunks of tokens: the [B·T, V] logits never exist
    fwd = log.apply("chunked_loss", lambda g: chunk_loss(g, spec.train.loss_chunk), fwd)
    # memory state saved every k ≈ sqrt(n) chunks, recomputed in between (not under `none`)
    if spec.train.remat != "none":
        fwd = log.apply("checkpoint_chunks", checkpoint_chunks, fwd)
    # what scans save for the backward: carries only, everything, or a budgeted min-cut
    policy = choose_policy(fwd, spec.train)
    # forward + backward; scans recompute what the policy does not save
    grad = log.apply("autodiff", lambda g: grad_graph(g, [p.name for p in params],
                                                      policy=policy), fwd)
    grad = log.apply("canonicalize", canonicalize, grad)
    # catch any weighted outer-product sum the backward exposes
    grad = log.apply("aggregate", aggregate, grad)
    # clipping + AdamW over the flat parameter set
    opt = log.run("optimizer", lambda: optimizer_graph(params, spec.train,
                                                      dtype_name(spec.train.dtype)))
    # group nodes into kernels (never across a scan boundary, never raising peak memory)
    schedules = {name: _timed(log, f"fusion_{name}", lambda g=g: fuse(g))
                 for name, g in (("forward", fwd), ("training", grad), ("optimizer", opt))}
    # liveness over the kernel order -> offsets in one arena; params/grads/state persistent
    persistent = {p.name for p in params} | {f"grad.{p.name}" for p in params} | {"loss"}
    persistent |= set(opt.input_names()) | {n for n, _ in opt.outputs}
    plans = {name: _timed(log, f"memory_plan_{name}",
                          lambda s=s: plan_memory(s, persistent))
             for name, s in schedules.items()}
    return Compiled(spec, params, fwd, grad, opt, log, policy, schedules, plans)


def _timed(log: PassLog, name: str, fn: Any) -> Any:
    """Run a non-graph step (fusion, planning) and record its time with the passes."""
    t0 = time.perf_counter()
    out = fn()
    log.records.append({"name": name, "seconds": time.perf_counter() - t0})
    return out


def launches_per_step(c: Compiled, target: str = "cpu",
                      fallbacks: list[dict[str, str]] | None = None) -> dict[str, int]:
    """Kernel launches on `target` ("cpu" or "triton") of a training step (grad_accum
    backward passes + one optimizer update), a decode step (one token, batch 1) and the
    memory write a decode makes once per completed chunk. On the cpu target every scan is a
    host loop over its body's kernels; on triton a scan that renders to one scan kernel is
    one launch (`codegen.scan_kernel.count_launches`); the scans it cannot render, and why,
    are appended to `fallbacks`."""
    from titanc.decode import lower_step, lower_write

    if target == "triton":
        from titanc.codegen.scan_kernel import count_launches

        def count(plan: MemoryPlan) -> int:
            return count_launches(plan, fallbacks=fallbacks)
    else:
        count = MemoryPlan.launches  # type: ignore[assignment]
    spec = c.spec
    counts = {"training": spec.train.grad_accum * count(c.plans["training"])
              + count(c.plans["optimizer"])}
    counts["decode"] = count(plan_memory(fuse(lower_step(spec, 1, 1))))
    if spec.model.block != "attn":
        counts["decode_write_per_chunk"] = count(plan_memory(fuse(lower_write(spec, 1))))
    return counts
