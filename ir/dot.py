"""Graphviz DOT export of a graph (scan bodies as clusters)."""
from __future__ import annotations


from titanc.ir.ops import Op
from titanc.ir.graph import Graph, format_attrs
from titanc.ir.types import type_str


def _label(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _emit(g: Graph, prefix: str, lines: list[str], depth: int) -> None:
    pad = "  " * depth
    for node in g:
        label = _label(f"%{node.id} {node.op.name.lower()}{format_attrs(node)}")[:-1]
        label += "\\n" + type_str(node.type) + '"'
        lines.append(f"{pad}{prefix}{node.id} [label={label}];")
        for i in node.inputs:
            lines.append(f"{pad}{prefix}{i} -> {prefix}{node.id};")
        if node.op is Op.SCAN:
            sub = f"{prefix}{node.id}_"
            lines.append(f"{pad}subgraph cluster_{sub} {{ label={_label('scan body')};")
            _emit(node.attr("body"), sub, lines, depth + 1)
            lines.append(f"{pad}}}")


def to_dot(g: Graph) -> str:
    lines = [f"digraph {_label(g.name)} {{", "  node [shape=box, fontname=monospace];"]
    _emit(g, "n", lines, 1)
    for k, (name, nid) in enumerate(g.outputs):
        lines.append(f"  out{k} [label={_label(name)}, shape=oval];")
        lines.append(f"  n{nid} -> out{k};")
    lines.append("}")
    return "\n".join(lines) + "\n"
