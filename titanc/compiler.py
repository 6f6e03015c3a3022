"""The compile pipeline: one flat function of named steps (STYLE.md 6).

spec -> forward graph -> optimised forward -> training graph -> optimizer graph. Every step
is a pure `Graph -> Graph` pass, verified after it runs (`verify_each`), recorded in
`Compiled.passes` (report.json `passes`) and dumped by `titanc compile` as `ir/NN_<pass>_<graph>.txt`.
`TITANC_DEBUG=1` prints pass timings, `=2` the IR after each pass.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from titanc.ir import Graph, dtype_name
from titanc.passes.aggregate import aggregate
from titanc.passes.autodiff import grad_graph
from titanc.passes.canonicalize import canonicalize
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
    return Compiled(spec, params, fwd, grad, opt, log, policy)
