"""Nodes and graphs.

A `Node` is a frozen value: op, input node ids, attrs and an inferred type. A `Graph` owns
nodes and keeps their edges in a `networkx.DiGraph`; no code outside `ir/` touches networkx.
Graph arguments are INPUT nodes (`graph.inputs`, in order); results are named
(`graph.outputs`, an ordered list of `(name, node id)`). Order is deterministic: node id
order, which is the lexicographic topological order (a graph only grows, and a node's
inputs exist before it).

The one textual form of the IR (`format_graph`, which `repr(graph)` prints) is a line per
node, in that order; scan bodies print indented under their scan, between braces:

    %7:f32[2,128,64] = einsum[btd,de->bte] %3 %5
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Iterator

import networkx as nx

from titanc.ir.ops import Op
from titanc.ir.types import Type, type_str


def freeze_attrs(attrs: dict[str, Any] | None) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted((attrs or {}).items()))


@dataclass(frozen=True, slots=True)
class Node:
    id: int
    op: Op
    inputs: tuple[int, ...]
    attrs: tuple[tuple[str, Any], ...]
    type: Type

    def attr(self, key: str, default: Any = ...) -> Any:
        for k, v in self.attrs:
            if k == key:
                return v
        if default is ...:
            raise KeyError(f"{self.op.name} node %{self.id} has no attr {key!r}")
        return default

    @property
    def attr_dict(self) -> dict[str, Any]:
        return dict(self.attrs)

    def replace(self, **changes: Any) -> "Node":
        return replace(self, **changes)


@dataclass(eq=False)
class Graph:
    name: str = "graph"
    _nodes: dict[int, Node] = field(default_factory=dict)
    _dg: nx.DiGraph = field(default_factory=nx.DiGraph)
    inputs: list[int] = field(default_factory=list)
    outputs: list[tuple[str, int]] = field(default_factory=list)
    _next_id: int = 0
    _order: list[int] | None = None      # cached topological order, reset by add()

    # -- construction -------------------------------------------------------------------------
    def add_like(self, node: "Node", inputs: Iterable[int] = (), **attrs: Any) -> int:
        """`node` (of any graph) rebuilt here on `inputs`, its attrs updated by `attrs`: the
        one copy step of every pass that rewrites a graph node by node."""
        return self.add(node.op, inputs, {**node.attr_dict, **attrs},
                        node.type if node.op is Op.INPUT else None)

    def copy(self) -> "Graph":
        """A node-for-node copy (fresh ids), same outputs."""
        out = Graph(self.name)
        env: dict[int, int] = {}
        for node in self:
            env[node.id] = out.add_like(node, (env[i] for i in node.inputs))
        out.set_outputs([(n, env[i]) for n, i in self.outputs])
        return out

    def add(self, op: Op, inputs: Iterable[int] = (), attrs: dict[str, Any] | None = None,
            type: Type | None = None) -> int:
        """Append a node; its type is inferred by the op's shape rule unless given."""
        from titanc.ir.infer import infer_type

        inputs = tuple(inputs)
        for i in inputs:
            if i not in self._nodes:
                raise KeyError(f"input %{i} of new {op.name} node is not in graph {self.name}")
        frozen = freeze_attrs(attrs)
        if type is None:
            type = infer_type(op, [self._nodes[i].type for i in inputs], dict(frozen))
        nid = self._next_id
        self._next_id += 1
        self._order = None
        self._nodes[nid] = Node(nid, op, inputs, frozen, type)
        self._dg.add_node(nid)
        for i in inputs:
            self._dg.add_edge(i, nid)
        if op is Op.INPUT:
            self.inputs.append(nid)
        return nid

    def set_outputs(self, outputs: Iterable[tuple[str, int]]) -> None:
        self.outputs = list(outputs)

    # -- queries ------------------------------------------------------------------------------
    def node(self, nid: int) -> Node:
        return self._nodes[nid]

    def __contains__(self, nid: int) -> bool:
        return nid in self._nodes

    def __len__(self) -> int:
        return len(self._nodes)

    def __iter__(self) -> Iterator[Node]:
        return (self._nodes[i] for i in self.order())

    def order(self) -> list[int]:
        """The nodes in id order: a topological order, since a node's inputs exist before it
        is added and nodes are never removed (the lexicographic topological sort by id)."""
        if self._order is None:
            self._order = list(self._nodes)
        return list(self._order)

    def users(self, nid: int) -> list[int]:
        return sorted(self._dg.successors(nid))

    def input_names(self) -> list[str]:
        return [self._nodes[i].attr("name") for i in self.inputs]

    def input_types(self) -> dict[str, Type]:
        """Each graph input's name and type."""
        return {self._nodes[i].attr("name"): self._nodes[i].type for i in self.inputs}

    def input_by_name(self, name: str) -> int:
        for i in self.inputs:
            if self._nodes[i].attr("name") == name:
                return i
        raise KeyError(f"graph {self.name} has no input {name!r}")

    def output(self, name: str) -> int:
        for n, i in self.outputs:
            if n == name:
                return i
        raise KeyError(f"graph {self.name} has no output {name!r}")

    def is_dag(self) -> bool:
        return nx.is_directed_acyclic_graph(self._dg)

    def edges(self) -> list[tuple[int, int]]:
        return sorted(self._dg.edges())

    def reachable_from_outputs(self) -> set[int]:
        live: set[int] = set()
        stack = [o for _, o in self.outputs]
        while stack:
            n = stack.pop()
            if n not in live:
                live.add(n)
                stack.extend(self._nodes[n].inputs)
        return live

    def __repr__(self) -> str:
        return format_graph(self)


# -- the textual form ----------------------------------------------------------------------------

_BARE = {Op.EINSUM: "spec", Op.INPUT: "name"}


def _value(v: Any) -> str:
    if isinstance(v, Graph):
        return f"<{v.name}>"
    if isinstance(v, (tuple, list)):
        return "[" + ",".join(_value(x) for x in v) + "]"
    if isinstance(v, float):
        return repr(v)
    return str(v)


def format_attrs(node: Node) -> str:
    if not node.attrs:
        return ""
    bare = _BARE.get(node.op)
    if bare is not None:
        return f"[{node.attr(bare)}]"
    parts = [f"{k}={_value(v)}" for k, v in node.attrs if not isinstance(v, Graph)]
    return "[" + ", ".join(parts) + "]"


def format_node(node: Node) -> str:
    args = "".join(f" %{i}" for i in node.inputs)
    return f"%{node.id}:{type_str(node.type)} = {node.op.name.lower()}{format_attrs(node)}{args}"


def format_lines(g: Graph, indent: int = 0) -> list[tuple[int | None, str]]:
    """(node id or None, text) per line, so callers can show context around a node."""
    pad = "  " * indent
    lines: list[tuple[int | None, str]] = []
    for node in g:
        body = node.attr("body", None) if node.op is Op.SCAN else None
        lines.append((node.id, pad + format_node(node) + (" {" if body is not None else "")))
        if body is not None:
            lines += [(None, text) for _, text in format_lines(body, indent + 1)]
            lines.append((None, pad + "}"))
    outs = ", ".join(f"{name}=%{nid}" for name, nid in g.outputs)
    lines.append((None, f"{pad}return {outs}"))
    return lines


def format_graph(g: Graph) -> str:
    header = f"graph {g.name} ({len(g)} nodes)"
    return "\n".join([header] + [text for _, text in format_lines(g, 1)]) + "\n"
