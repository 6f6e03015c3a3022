"""The compile pipeline: spec -> forward graph -> training graphs, with per-stage stats.

This is one flat function of named steps (STYLE.md 6). `TITANC_DEBUG=1` prints stage names
and timings, `=2` also the IR after each stage.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from titanc.ir import Graph, dtype_name, format_graph, graph_stats, verify
from titanc.passes.autodiff import grad_graph
from titanc.passes.optimizer import optimizer_graph

from .frontend import lower_forward
from .params import ParamSpec, param_specs


def debug_level() -> int:
    try:
        return int(os.environ.get("TITANC_DEBUG", "0"))
    except ValueError:
        return 0


@dataclass
class Compiled:
    spec: Any
    params: list[ParamSpec]
    forward: Graph
    grad: Graph
    optimizer: Graph
    stages: list[dict[str, Any]] = field(default_factory=list)
    dumps: list[tuple[str, Graph]] = field(default_factory=list)


def _stage(compiled_stages: list, dumps: list, name: str, fn: Callable[[], Graph],
           check: bool) -> Graph:
    t0 = time.perf_counter()
    g = fn()
    if check:
        verify(g)
    dt = time.perf_counter() - t0
    st = graph_stats(g)
    compiled_stages.append({"name": name, "nodes": st["nodes"],
                            "largest_tensor_bytes": st["largest_tensor_bytes"], "seconds": dt})
    dumps.append((name, g))
    level = debug_level()
    if level >= 1:
        print(f"[titanc] {name:<12} {dt * 1e3:8.1f} ms  {st['nodes']} nodes", file=sys.stderr)
    if level >= 2:
        print(format_graph(g), file=sys.stderr)
    return g


def compile_graphs(spec: Any, batch: int | None = None, verify_each: bool = True) -> Compiled:
    """Lower `spec` and build its training graphs. Allocates no model-sized tensors."""
    params = param_specs(spec.model)
    dtype = dtype_name(spec.train.dtype)
    stages: list[dict[str, Any]] = []
    dumps: list[tuple[str, Graph]] = []
    # 1. frontend: the direct program (per-token outer products, unchunked loss)
    fwd = _stage(stages, dumps, "frontend", lambda: lower_forward(spec, batch), verify_each)
    # 2. autodiff: forward + backward, scans recomputed from saved carries
    grad = _stage(stages, dumps, "autodiff",
                  lambda: grad_graph(fwd, [p.name for p in params]), verify_each)
    # 3. optimizer: clipping + AdamW over the flat parameter set
    opt = _stage(stages, dumps, "optimizer",
                 lambda: optimizer_graph(params, spec.train, dtype), verify_each)
    return Compiled(spec, params, fwd, grad, opt, stages, dumps)
