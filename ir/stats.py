"""Size statistics of a graph, computed from static types only (nothing is allocated)."""
from __future__ import annotations

from titanc.ir.graph import Graph
from titanc.ir.ops import Op
from titanc.ir.types import type_bytes


def _walk(g: Graph):
    for node in g:
        yield node
        if node.op is Op.SCAN:
            yield from _walk(node.attr("body"))


def largest_tensor_bytes(g: Graph) -> int:
    """The largest single intermediate value (INPUTs excluded), scan bodies per iteration."""
    return max((type_bytes(n.type) for n in _walk(g) if n.op is not Op.INPUT), default=0)


def count_nodes(g: Graph) -> int:
    """Nodes including those of scan bodies."""
    return sum(1 for _ in _walk(g))


def graph_stats(g: Graph) -> dict[str, int]:
    """`count_nodes`, `largest_tensor_bytes` (one walk), top-level nodes and input bytes."""
    nodes, largest = 0, 0
    for n in _walk(g):
        nodes += 1
        if n.op is not Op.INPUT:
            largest = max(largest, type_bytes(n.type))
    return {"nodes": nodes, "top_level_nodes": len(g), "largest_tensor_bytes": largest,
            "input_bytes": sum(type_bytes(g.node(i).type) for i in g.inputs)}
