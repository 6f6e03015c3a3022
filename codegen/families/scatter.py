"""The scatter families (`tem`): the VJPs of the gathers, each output element written once (no
atomics), so results do not depend on the launch order.

    render_segment_sum    launch(grad [n, C], index [n], out [R, C])   VJP of TAKE (INDEX_ADD)
    render_scatter_along  launch(grad [R], index [R], out [R, size])   VJP of TAKE_ALONG

The embedding gradient (INDEX_ADD, the VJP of a row gather) is a deterministic segment sum.

`render_segment_sum` renders `segment_sum.py.jinja`: a stable sort of the indices and each
row's segment start (the counting step, in the launcher), then one program per (row, column
block) adding its segment's grad rows in sorted order. `index_add_work` is the cost model the
hooks and tests read: the segment sum touches each grad row once and each out row once,
O((n_idx + n_rows) · n_cols); the one-hot product it replaces (`index_add.py.jinja`) does
n_rows · n_idx · n_cols multiply-adds, prohibitive at a 151,936-token vocabulary.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from titanc.codegen.meta import check_block, compute_dtype
from titanc.codegen.render import render

__all__ = ["index_add_work", "render_scatter_along", "render_segment_sum"]


def render_segment_sum(
    name: str,
    *,
    dtype: str = "float32",
    header_lines: Sequence[str] = (),
    block_c: int = 64,
    num_warps: int = 4,
) -> str:
    """`out = zeros; out.index_add_(0, index, grad)` as a sorted segment sum (no atomics).
    Launcher: `launch(grad [n, C], index [n], out [R, C])`."""
    check_block("block_c", block_c, 16)
    return render("segment_sum.py.jinja", name=name, header_lines=header_lines,
                  block_c=block_c, num_warps=num_warps, compute_dtype=compute_dtype(dtype))


def index_add_work(family: str, n_idx: int, n_rows: int, n_cols: int) -> int:
    """Modeled element operations of an INDEX_ADD kernel of `family` ('segment_sum': the sort
    n·log2(n), one load and add per grad element, one store per out element; 'index_add':
    the one-hot product, a multiply-add per (row, index, column))."""
    if family == "segment_sum":
        return n_idx * max(1, math.ceil(math.log2(max(n_idx, 2)))) + (n_idx + n_rows) * n_cols
    if family == "index_add":
        return n_rows * n_idx * n_cols
    raise ValueError(f"no INDEX_ADD family {family!r}; one of segment_sum, index_add")


def render_scatter_along(
    name: str,
    *,
    dtype: str = "float32",
    header_lines: Sequence[str] = (),
    block_r: int = 16,
    block_c: int = 64,
    num_warps: int = 4,
    wide: bool = False,
) -> str:
    """`out = zeros; out.scatter_add_(-1, index[:, None], grad[:, None])`: one value per row;
    `wide`: offsets in int64 (out has >= 2**31 elements, `meta.needs_int64`)."""
    check_block("block_r", block_r)
    check_block("block_c", block_c, 16)
    return render("scatter_along.py.jinja", name=name, header_lines=header_lines,
                  block_r=block_r, block_c=block_c, num_warps=num_warps,
                  compute_dtype=compute_dtype(dtype), wide=wide)
