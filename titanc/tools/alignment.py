"""Matmul operands whose rows are not 16-byte aligned (report.json `gpu_alignment`).

A Triton kernel on a GPU loads a tile 16 bytes at a time, asynchronously and pipelined
(`cp.async`), only where it can prove every row of the tile starts on a 16-byte boundary: the
row stride is an argument the JIT specialises by whether it divides by 16. A tensor whose
innermost size times its element size is not a multiple of 16 bytes (tiny.yaml's
`ffn_hidden: 172` in bfloat16: 344-byte rows) is loaded one element at a time, synchronously,
in every iteration of the contraction loop: on an H100 the weight gradients of tiny.yaml's
FFN (three matmuls over the 1,024 tokens of a step) took 61 µs a launch. Compiled for sm_90
the same kernel with a 16-divisible stride loads both operands with `cp.async` (docs/gpu.md).

`unaligned_rows(c)` lists, per innermost size, the contractions of the training graph (scan
bodies included) that read or write such a tensor, the spec fields of that value, and the
next aligned size. The model is the user's: nothing is padded here; `titanc compile` prints
one note per size.
"""
from __future__ import annotations

from typing import Any

from titanc.ir import Graph, Op

__all__ = ["unaligned_rows", "note_lines"]

_ITEMSIZE = {"bf16": 2, "f16": 2, "f32": 4, "f64": 8}
ALIGN = 16     # bytes: one cp.async / vector load


def _fields(spec: Any) -> dict[int, list[str]]:
    """Each size a spec field (or a width derived from fields) gives, and those fields."""
    m = spec.model
    named: list[tuple[str, int]] = [("model.d_model", m.d_model),
                                    ("model.vocab_size", m.vocab_size),
                                    ("model.seq_len", m.seq_len)]
    if m.ffn_hidden:
        named.append(("model.ffn_hidden", m.ffn_hidden))
    if m.has_attention:
        named += [("model.d_model / model.attention.heads", m.head_dim),
                  ("model.attention.segment", m.attention.segment)]
    if m.has_memory:
        named += [("model.d_model / model.memory.heads", m.mem_head_dim),
                  ("model.memory.expansion x the memory head width",
                   m.mem_head_dim * m.memory.expansion),
                  ("model.memory.chunk_size", m.memory.chunk_size)]
    out: dict[int, list[str]] = {}
    for name, value in named:
        out.setdefault(int(value), []).append(name)
    return out


def _einsum_rows(g: Graph, found: dict[tuple[int, str], int]) -> None:
    """Count into `found`, per (innermost size, dtype) of an unaligned row wider than one
    load, the contractions of `g` and its scan bodies touching one."""
    for node in g:
        if node.op is Op.SCAN:
            _einsum_rows(node.attr("body"), found)
            continue
        if node.op is not Op.EINSUM:
            continue
        types = [g.node(i).type for i in node.inputs] + [node.type]
        seen = set()
        for t in types:
            shape, dtype = getattr(t, "shape", ()), getattr(t, "dtype", "")
            if not shape or dtype not in _ITEMSIZE or shape[-1] <= 1:
                continue
            row = shape[-1] * _ITEMSIZE[dtype]
            # a row narrower than one load (a per-head gate's 2 columns) has nothing to align
            if row > ALIGN and row % ALIGN and (shape[-1], dtype) not in seen:
                seen.add((shape[-1], dtype))
                found[(shape[-1], dtype)] = found.get((shape[-1], dtype), 0) + 1


def unaligned_rows(c: Any) -> list[dict[str, Any]]:
    """[{"size", "dtype", "row_bytes", "einsums", "fields", "aligned_size"}], one per innermost
    size and dtype of a contraction operand or result whose rows are wider than 16 bytes and
    not a multiple of 16 bytes (module docstring), most contractions first."""
    found: dict[tuple[int, str], int] = {}
    _einsum_rows(c.graph("training").graph, found)
    fields = _fields(c.spec)
    rows = []
    for (size, dtype), n in found.items():
        per = ALIGN // _ITEMSIZE[dtype]
        rows.append({"size": size, "dtype": dtype, "row_bytes": size * _ITEMSIZE[dtype],
                     "einsums": n, "fields": fields.get(size, []),
                     "aligned_size": -(-size // per) * per})
    return sorted(rows, key=lambda r: (-r["einsums"], r["size"]))


def note_lines(rows: list[dict[str, Any]]) -> list[str]:
    """One line per finding, for `titanc compile` to print."""
    out = []
    for r in rows:
        what = " = ".join(r["fields"]) if r["fields"] else "a width"
        out.append(f"note: {what} = {r['size']}: {r['einsums']} contraction(s) read "
                   f"{r['row_bytes']}-byte {r['dtype']} rows, not 16-byte aligned; on a GPU "
                   f"they load one element at a time ({r['aligned_size']} would align them; "
                   f"docs/gpu.md)")
    return out
