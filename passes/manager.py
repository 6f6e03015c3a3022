"""The pass manager: run passes over a graph, with callbacks between them.

A pass is a typed object (`Pass`: its options are fields, `name` a class attribute, its
pre/postconditions in its docstring) called on a graph, e.g. `Canonicalize()`,
`ChunkedLoss(chunk=1024)`, `Autodiff(wrt, policy)`. `PassLog.apply(p, g)` runs one and
records `{name, graph, nodes_before, nodes_after, largest_tensor_bytes_before,
largest_tensor_bytes_after, seconds}` (report.json `passes`), then calls every callback with
the record and the new graph. The default callbacks verify the graph (`verify_each`), keep it
for `titanc compile`'s dumps, and print under `TITANC_DEBUG` (`=1` pass names and timings, `=2`
the IR after each pass); add your own to `PassLog.callbacks`.
"""
from __future__ import annotations

import sys
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Protocol

from titanc.config import debug_level
from titanc.ir import Graph, format_graph, graph_stats, verify


class Pass(Protocol):
    name: ClassVar[str]

    def __call__(self, g: Graph) -> Graph: ...


Callback = Callable[[dict[str, Any], Graph], None]


@dataclass
class PassLog:
    """What a pipeline run did: per-pass records and the graph after each (for dumps)."""
    records: list[dict[str, Any]] = field(default_factory=list)
    dumps: list[tuple[str, Graph]] = field(default_factory=list)
    verify_each: bool = True
    callbacks: list[Callback] = field(default_factory=list)   # run after the built-in ones
    keep_dumps: bool = True         # off for a program that only runs (no graph kept per pass)

    def run(self, name: str, fn: Callable[[], Graph], before: Graph | None = None) -> Graph:
        """Run one step (`fn` closes over its input, `before`, if any) and record it."""
        pre = _stats(before) if before is not None else {"nodes": 0, "largest_tensor_bytes": 0}
        t0 = time.perf_counter()
        g = fn()
        if self.verify_each:
            verify(g)
        post = _stats(g)
        record = {
            "name": name, "graph": g.name,
            "nodes_before": pre["nodes"], "nodes_after": post["nodes"],
            "largest_tensor_bytes_before": pre["largest_tensor_bytes"],
            "largest_tensor_bytes_after": post["largest_tensor_bytes"],
            "seconds": time.perf_counter() - t0}
        self.records.append(record)
        for callback in (self._dump, _debug_print, *self.callbacks):
            callback(record, g)
        return g

    def apply(self, p: Pass, g: Graph) -> Graph:
        return self.run(p.name, lambda: p(g), before=g)

    def _dump(self, record: dict[str, Any], g: Graph) -> None:
        if self.keep_dumps:
            self.dumps.append((f"{record['name']}_{g.name}", g))


# each graph's stats at its node count: a step's input is usually the previous one's output
_STATS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _stats(g: Graph) -> dict[str, int]:
    """`graph_stats(g)`, computed once per graph and size (a graph only grows)."""
    hit = _STATS.get(g)
    if hit is None or hit[0] != len(g):
        hit = _STATS[g] = (len(g), graph_stats(g))
    return hit[1]


def _debug_print(record: dict[str, Any], g: Graph) -> None:
    level = debug_level()
    if level >= 1:
        print(f"[titanc] {record['name']:<16} {g.name:<10} {record['seconds'] * 1e3:8.1f} ms  "
              f"{record['nodes_before']:>6} -> {record['nodes_after']:<6} nodes", file=sys.stderr)
    if level >= 2:
        print(format_graph(g), file=sys.stderr)
