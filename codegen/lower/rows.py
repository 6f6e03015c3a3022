"""Hooks for the kernels over a [rows, cols] index space: SUM/AMAX reductions onto the
reduction family, CUMSUM onto scan_cumsum.

A reduction's kept axes become the rows and its reduced axes the columns (in index
arithmetic, so reducing non-trailing axes needs no copy); a cumsum's scanned axis is the
columns. Input-domain nodes are the prologue, nodes after a reduction its epilogue (per row).
"""

from __future__ import annotations

from math import prod
from typing import Callable

from titanc.ir import Op

from titanc.codegen.families.cumsum import CumsumScan, render_cumsum
from titanc.codegen.families.fused import ReductionStage, render_reduction
from titanc.codegen.lower.indexing import Ix, Names, Section, const, delinearize, reshape_coords
from titanc.codegen.lower.code import KernelCode, TensorArg, code_of, index_tile, indexed_args, store
from titanc.codegen.lower.nodes import KernelLowering, Val
from titanc.codegen.meta import cuda_column_blocks, cuda_row_block, needs_int64, pow2

__all__ = ["MAX_ROW_BLOCK", "lower_cumsum", "lower_reduction"]

MAX_ROW_BLOCK = 4096     # widest row a reduction or cumsum loads at once (tests lower it)


def _depends(low: KernelLowering, roots: set[int]) -> set[int]:
    """Kernel nodes that depend on `roots` (roots excluded), within the kernel."""
    out: set[int] = set()
    for nid in low.kernel.nodes:
        if any(i in roots or i in out for i in low.node(nid).inputs):
            out.add(nid)
    return out - roots


def _ancestors(low: KernelLowering, ids: list[int]) -> set[int]:
    seen: set[int] = set()
    stack = [i for i in ids if i in low.inside]
    while stack:
        v = stack.pop()
        if v not in seen:
            seen.add(v)
            stack.extend(i for i in low.node(v).inputs if i in low.inside)
    return seen


def lower_reduction(low: KernelLowering, outs: list[int], header: list[str],
                    dtype: str, allow_tf32: bool = False) -> KernelCode:
    g, kernel = low.g, low.kernel
    reds = [n for n in kernel.nodes if g.node(n).op in (Op.SUM, Op.AMAX)]
    x = low.shape(g.node(reds[0]).inputs[0])
    axes = sorted(a % len(x) for a in g.node(reds[0]).attr("axes"))
    kept = [d for d in range(len(x)) if d not in axes]
    n_rows, n_cols = prod(x[d] for d in kept), prod(x[d] for d in axes)
    n_in = n_rows * n_cols
    post = _depends(low, set(reds))
    feeds = _ancestors(low, [g.node(r).inputs[0] for r in reds])

    def on_input(nid: int) -> bool:
        if nid in post:
            return False
        if n_cols == 1:                    # degenerate: only what the reductions read
            return nid in feeds
        return g.node(nid).type.numel == n_in

    def late(nid: int) -> bool:            # input-domain work on the reduced rows
        return nid in post and n_cols > 1 and g.node(nid).type.numel == n_in != n_rows

    names = Names()
    pre = Section(names, "mask", "[BLOCK_R, BLOCK_C]", frozenset({"r", "c"}))
    epi = Section(names, "row_mask", "[BLOCK_R, 1]", frozenset({"r"}))
    xc: list[Ix] = [const(0)] * len(x)
    for d, c in zip(kept, delinearize(pre, index_tile(pre, "rows", "r"), [x[d] for d in kept])):
        xc[d] = c
    for d, c in zip(axes, delinearize(pre, index_tile(pre, "cols", "c"), [x[d] for d in axes])):
        xc[d] = c

    def in_coords(shape: tuple[int, ...]) -> list[Ix]:
        return reshape_coords(pre, xc, x, shape)

    stages: list[tuple[str, str, str]] = []
    for nid in kernel.nodes:                  # input domain and the reductions first
        n = g.node(nid)
        if nid in reds:
            src = n.inputs[0]
            v = pre.values.get(src) or low.read(pre, src, in_coords(low.shape(src)))
            result = names.fresh("r")
            stages.append(("sum" if n.op is Op.SUM else "max", low.block(pre, v).expr, result))
            epi.values[nid] = Val(result, epi.dims)
        elif low.computed(nid) and on_input(nid):
            pre.values[nid] = low.compute(pre, n, in_coords(n.type.shape))
    prologue, pre.stmts = pre.stmts, []       # what follows is the row epilogue
    for nid in kernel.nodes:                  # then the output domain
        n = g.node(nid)
        if low.computed(nid) and nid not in reds and not on_input(nid) and not late(nid):
            for i in n.inputs:                # degenerate rows: a column-0 value per row
                if i in pre.values and i not in epi.values:
                    epi.values[i] = Val(epi.let(
                        f"tl.sum(tl.where(mask, {pre.values[i].expr}, 0.0), axis=1, "
                        f"keep_dims=True)"), epi.dims)
            epi.values[nid] = low.compute(epi, n, delinearize(epi, index_tile(epi, "rows", "r"),
                                                              n.type.shape))
    _late_nodes(low, pre, epi, [n for n in kernel.nodes if low.computed(n) and late(n)],
                n_rows, in_coords)
    reduced, row_stores, args = _row_outputs(low, outs, pre, epi, in_coords, n_in, n_cols,
                                             n_rows)
    stage_objs = [ReductionStage(op, operand, result,
                                 prologue=tuple(prologue) if k == 0 else (),
                                 epilogue=tuple(epi.stmts) if k == len(stages) - 1 else ())
                  for k, (op, operand, result) in enumerate(stages)]
    block_r, block_c, warps, cuda_r, cuda_c = _reduction_launch(
        n_rows, n_cols, len(args) + len(low.indexed()), bool(kept) and kept[-1] == len(x) - 1)
    source = render_reduction(
        kernel.name, inputs=[], stages=stage_objs, n_cols=n_cols, row_epilogue=pre.stmts,
        reduced_outputs=reduced, indexed=low.indexed(), row_stores=row_stores, dtype=dtype,
        header_lines=header, block_r=block_r, block_c=block_c, wide=_wide(low),
        num_warps=warps, cuda_block_r=cuda_r, cuda_block_c=cuda_c)
    return code_of(low, "reduction", source, args + indexed_args(low), (n_rows, n_cols))


def _late_nodes(low: KernelLowering, pre: Section, epi: Section, late: list[int], n_rows: int,
                in_coords: Callable[[tuple[int, ...]], list[Ix]]) -> None:
    """The input-domain nodes that read the reduced values, into `pre` (fusion checked that
    each reads its own row's: the node has the input's shape, the value the keep-dims
    shape)."""
    g = low.g
    rowwise = {v: val for v, val in epi.values.items()
               if g.node(v).type.numel == n_rows and v not in pre.values}
    for nid in late:
        n = g.node(nid)
        if n.op is Op.EXPAND:              # the row's value, broadcast over its columns
            pre.values[nid] = rowwise[n.inputs[0]]
            continue
        pre.values.update(rowwise)
        pre.values[nid] = low.compute(pre, n, in_coords(n.type.shape))
        for v in rowwise:
            del pre.values[v]


def _row_outputs(low: KernelLowering, outs: list[int], pre: Section, epi: Section,
                 in_coords: Callable[[tuple[int, ...]], list[Ix]], n_in: int, n_cols: int,
                 n_rows: int) -> tuple[list[tuple[str, str]], list[tuple[str, str, str]],
                                       list[TensorArg]]:
    """(reduced outputs, row stores, the reduced outputs' arguments): an output of the input
    domain is stored per element, one of the rows per row."""
    reduced: list[tuple[str, str]] = []
    row_stores: list[tuple[str, str, str]] = []
    args: list[TensorArg] = []
    for v in outs:
        if v in pre.values or (v not in epi.values and low.g.node(v).type.numel == n_in
                               and n_cols > 1):
            store(low, pre, v, in_coords(low.shape(v)), row_stores)
        else:
            val = epi.values.get(v) or low.read(
                epi, v, delinearize(epi, index_tile(epi, "rows", "r"), low.shape(v)))
            reduced.append((f"red{len(reduced)}", low.block(epi, val).expr))
            args.append(TensorArg(v, (n_rows,)))
    return reduced, row_stores, args


def _reduction_launch(n_rows: int, n_cols: int, n_tensors: int, rows_adjacent: bool
                      ) -> tuple[int, int, int, int, int]:
    """(block_r, block_c, num_warps, CUDA block_r, CUDA block_c) of a reduction kernel: rows
    side by side in memory (the input's last axis is kept) take, on CUDA, adjacent rows a
    program and a loop over column blocks (`meta.cuda_column_blocks`)."""
    block_r, block_c = _row_blocks(n_rows, n_cols)
    warps = 4 if n_tensors <= MANY_TENSORS else 8
    column = cuda_column_blocks(n_rows, n_cols) if rows_adjacent else None
    cuda_r, cuda_c = column or (cuda_row_block(n_rows, block_r, block_c, warps), block_c)
    return block_r, block_c, warps, cuda_r, cuda_c


def _wide(low: KernelLowering) -> bool:
    """int64 row/column indices: some tensor of the kernel reaches 2**31 elements (decided at
    compile time from the shapes)."""
    g = low.g
    ids = set(low.kernel.nodes) | {i for n in low.kernel.nodes for i in g.node(n).inputs}
    return needs_int64(*(t.numel for t in (g.node(i).type for i in ids)
                         if not isinstance(t, tuple)))


# A reduction kernel that reads and writes more tensors than this runs 8 warps instead of 4:
# their tiles are alive together and share a thread's 255 registers. tiny.yaml's segment-
# backward reductions touch 17-21 tensors; at 4 warps they needed 255 registers and spilled
# 264-276 B per thread on sm_90, at 8 185 registers and none. (The tile, and so the work
# of the interpreter, is unchanged.)
MANY_TENSORS = 12


def _row_blocks(n_rows: int, n_cols: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_C) of a [rows, cols] kernel: a row in one block up to `MAX_ROW_BLOCK`
    columns (else a loop over column blocks), rows batched up to ~4096 elements a program
    (the interpreter's: on CUDA `meta.cuda_row_block` cuts BLOCK_R to spread the rows)."""
    block_c = pow2(n_cols, 16) if n_cols <= MAX_ROW_BLOCK else min(1024, MAX_ROW_BLOCK)
    return max(1, min(pow2(n_rows), 4096 // block_c, 64)), block_c


def lower_cumsum(low: KernelLowering, outs: list[int], header: list[str],
                 dtype: str, allow_tf32: bool = False) -> KernelCode:
    g, kernel = low.g, low.kernel
    scans = [n for n in kernel.nodes if g.node(n).op is Op.CUMSUM]
    first = g.node(scans[0])
    x = first.type.shape
    ax = first.attr("axis") % len(x)
    others = [d for d in range(len(x)) if d != ax]
    n_rows, n_cols = prod(x[d] for d in others), x[ax]
    sec = Section(Names(), "mask", "[BLOCK_R, BLOCK_C]", frozenset({"r", "c"}))
    xc: list[Ix] = [index_tile(sec, "cols", "c")] * len(x)
    for d, c in zip(others, delinearize(sec, index_tile(sec, "rows", "r"), [x[d] for d in others])):
        xc[d] = c

    def coords(shape: tuple[int, ...]) -> list[Ix]:
        return reshape_coords(sec, xc, x, shape)

    post = _depends(low, set(scans))
    items: list[CumsumScan] = []
    for nid in kernel.nodes:
        n = g.node(nid)
        if nid in scans:
            src = n.inputs[0]
            v = sec.values.get(src) or low.read(sec, src, coords(low.shape(src)))
            result = sec.names.fresh("r")
            items.append(CumsumScan(low.block(sec, v).expr, result))
            sec.values[nid] = Val(result, sec.dims)
        elif low.computed(nid) and nid not in post:
            sec.values[nid] = low.compute(sec, n, coords(n.type.shape))
    prologue, sec.stmts = sec.stmts, []
    for nid in kernel.nodes:
        if nid in post and low.computed(nid):
            n = g.node(nid)
            sec.values[nid] = low.compute(sec, n, coords(n.type.shape))
    stores: list[tuple[str, str, str]] = []
    for v in outs:
        store(low, sec, v, coords(low.shape(v)), stores)
    block_r, block_c = _row_blocks(n_rows, n_cols)
    source = render_cumsum(kernel.name, indexed=low.indexed(), scans=items, n_cols=n_cols,
                           block_r=block_r, block_c=block_c,
                           cuda_block_r=cuda_row_block(n_rows, block_r, block_c, 4),
                           prologue=prologue, epilogue=sec.stmts, stores=stores,
                           reverse=bool(first.attr("reverse")), dtype=dtype,
                           header_lines=header, wide=_wide(low))
    return code_of(low, "cumsum", source, indexed_args(low), (n_rows, n_cols))
