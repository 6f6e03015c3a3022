"""The IR verifier.

`verify(g)` checks, in this order, and raises `IRError` naming the node, the rule broken and
about ten printed lines of IR around it:

1. acyclic: the graph is a DAG.
2. inputs-exist: every operand id names a node of this graph, and the edge set matches
   the operands.
3. inputs-listed: `graph.inputs` are exactly the INPUT nodes, with unique names.
4. arity: source ops (INPUT, FULL, ROPE, MASK) have no operands; unary ops one; binary two.
5. types: every node's type equals what its op's shape rule infers from operand types.
6. tuples: a tuple-typed value is consumed only by ITEM, with an index in range.
7. outputs: every output names an existing node, names are unique, no output is a tuple.
8. scan: the body verifies; its inputs are carries, per-iteration slices (xs without the
   leading axis, which must equal `length`) and constants, in that order, with matching
   types; its first `n_carry` outputs have the carries' types.
"""
from __future__ import annotations

from titanc.ir.ops import Op, OpGroup
from titanc.ir.graph import Graph, format_lines
from titanc.ir.infer import infer_type
from titanc.ir.shapes import ShapeError


class IRError(Exception):
    def __init__(self, message: str, context: str = ""):
        super().__init__(message + ("\n" + context if context else ""))
        self.message = message


def _context(g: Graph, nid: int | None, radius: int = 5) -> str:
    lines = format_lines(g, 1)
    at = next((k for k, (i, _) in enumerate(lines) if i == nid), 0)
    lo, hi = max(0, at - radius), min(len(lines), at + radius)
    return "\n".join(("> " if k == at and nid is not None else "  ") + text
                     for k, (_, text) in enumerate(lines[lo:hi], lo))


def _arity(op: Op) -> int | None:
    """Operands an op takes, where fixed."""
    if op in OpGroup.SOURCE:
        return 0
    return 1 if op in OpGroup.UNARY else 2 if op in OpGroup.BINARY else None


def verify(g: Graph) -> Graph:
    """Check every invariant listed in the module docstring; return `g` unchanged."""
    def fail(nid: int | None, rule: str, msg: str) -> IRError:
        where = f"%{nid}" if nid is not None else g.name
        ctx = _context(g, nid) if g.is_dag() else ""
        return IRError(f"{rule}: {where}: {msg}", ctx)

    if not g.is_dag():
        raise fail(None, "acyclic", f"graph {g.name} has a cycle")
    names: set[str] = set()
    input_nodes = []
    for nid in g.order():
        node = g.node(nid)
        for i in node.inputs:
            if i not in g:
                raise fail(None, "inputs-exist", f"%{nid} uses %{i}, which is not in the graph")
        if sorted(set(node.inputs)) != sorted(i for i in g._dg.predecessors(nid)):
            raise fail(nid, "inputs-exist", "edges do not match the operand list")
        if node.op is Op.INPUT:
            input_nodes.append(nid)
            if node.attr("name") in names:
                raise fail(nid, "inputs-listed", f"duplicate input name {node.attr('name')!r}")
            names.add(node.attr("name"))
        arity = _arity(node.op)
        if arity is not None and len(node.inputs) != arity:
            raise fail(nid, "arity", f"{node.op.name} takes {arity} operands, got "
                                     f"{len(node.inputs)}")
        in_types = [g.node(i).type for i in node.inputs]
        for i, t in zip(node.inputs, in_types):
            if isinstance(t, tuple) and node.op is not Op.ITEM:
                raise fail(nid, "tuples", f"tuple value %{i} used by {node.op.name}, not ITEM")
        if node.op is Op.ITEM and not 0 <= node.attr("index") < len(in_types[0]):
            raise fail(nid, "tuples", f"ITEM index {node.attr('index')} out of range")
        if node.op is Op.SCAN:
            try:
                verify(node.attr("body"))
            except IRError as e:
                raise fail(nid, "scan", f"body: {e.message}") from None
        if node.op is not Op.INPUT:
            try:
                want = infer_type(node.op, in_types, node.attr_dict)
            except ShapeError as e:
                rule = "scan" if node.op is Op.SCAN else "types"
                raise fail(nid, rule, str(e)) from None
            if want != node.type:
                from titanc.ir.types import type_str
                raise fail(nid, "types", f"declared {type_str(node.type)} but "
                                         f"{node.op.name.lower()} gives {type_str(want)}")
    if sorted(input_nodes) != sorted(g.inputs):
        raise fail(None, "inputs-listed", "graph.inputs does not list exactly the INPUT nodes")
    seen: set[str] = set()
    for name, nid in g.outputs:
        if nid not in g:
            raise fail(None, "outputs", f"output {name!r} names missing node %{nid}")
        if name in seen:
            raise fail(nid, "outputs", f"duplicate output name {name!r}")
        seen.add(name)
        if isinstance(g.node(nid).type, tuple):
            raise fail(nid, "outputs", f"output {name!r} is a tuple; pick elements with ITEM")
    return g
