"""The one textual form of the IR: a line per node, in deterministic order.

    %7:f32[2,128,64] = einsum[btd,de->bte] %3 %5

Scan bodies print indented under their scan, between braces.
"""
from __future__ import annotations

from typing import Any

from titanc.ir.graph import Graph, Node
from titanc.ir.ops import Op
from titanc.ir.types import type_str

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
