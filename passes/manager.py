"""The pass manager: run named `Graph -> Graph` passes, verify after each, record stats.

Each record is `{name, nodes_before, nodes_after, largest_tensor_bytes_before,
largest_tensor_bytes_after, seconds}` (report.json `passes`). `TITANC_DEBUG=1` prints pass
names and timings, `=2` the IR after each pass.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from titanc.ir import Graph, format_graph, graph_stats, verify


def debug_level() -> int:
    try:
        return int(os.environ.get("TITANC_DEBUG", "0"))
    except ValueError:
        return 0


@dataclass
class PassLog:
    """What a pipeline run did: per-pass records and the graph after each (for dumps)."""
    records: list[dict[str, Any]] = field(default_factory=list)
    dumps: list[tuple[str, Graph]] = field(default_factory=list)
    verify_each: bool = True

    def run(self, name: str, fn: Callable[[], Graph], before: Graph | None = None) -> Graph:
        """Run one pass (`fn` closes over its input, `before`, if any) and record it."""
        pre = graph_stats(before) if before is not None else {"nodes": 0, "largest_tensor_bytes": 0}
        t0 = time.perf_counter()
        g = fn()
        if self.verify_each:
            verify(g)
        dt = time.perf_counter() - t0
        post = graph_stats(g)
        self.records.append({
            "name": name, "graph": g.name,
            "nodes_before": pre["nodes"], "nodes_after": post["nodes"],
            "largest_tensor_bytes_before": pre["largest_tensor_bytes"],
            "largest_tensor_bytes_after": post["largest_tensor_bytes"],
            "seconds": dt})
        self.dumps.append((f"{name}_{g.name}", g))
        level = debug_level()
        if level >= 1:
            print(f"[titanc] {name:<16} {g.name:<10} {dt * 1e3:8.1f} ms  "
                  f"{pre['nodes']:>6} -> {post['nodes']:<6} nodes", file=sys.stderr)
        if level >= 2:
            print(format_graph(g), file=sys.stderr)
        return g

    def apply(self, name: str, pass_fn: Callable[[Graph], Graph], g: Graph) -> Graph:
        return self.run(name, lambda: pass_fn(g), before=g)
