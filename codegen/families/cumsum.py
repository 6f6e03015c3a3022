"""The cumulative-sum family (`red`): a cumsum along the columns of a [rows, cols] index
space with a prologue and an epilogue.

    render_cumsum         red  launch(*indexed, n_rows, n_cols)

Like the fused families, `render_cumsum` carries hook-made statements through one `expr.Scope`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from titanc.codegen.lower.expr import Scope
from titanc.codegen.families.fused import indexed_tensors
from titanc.codegen.meta import LAUNCH_LOCALS, check_block, compute_dtype, pow2
from titanc.codegen.render import render

__all__ = ["CUMSUM_KERNEL_LOCALS", "CumsumScan", "render_cumsum"]

CUMSUM_KERNEL_LOCALS = frozenset("""
    BLOCK_R BLOCK_C pid rows row_mask cols mask block col_start n_rows n_cols
""".split())


@dataclass(frozen=True)
class CumsumScan:
    """`result = cumsum(operand)` along the columns; `operand` is a prologue variable."""

    operand: str
    result: str


def render_cumsum(
    name: str,
    *,
    indexed: Sequence[tuple[str, int]],
    scans: Sequence[CumsumScan],
    n_cols: int,
    prologue: Sequence[str] = (),
    epilogue: Sequence[str] = (),
    stores: Sequence[tuple[str, str, str]] = (),
    reverse: bool = False,
    dtype: str = "float32",
    header_lines: Sequence[str] = (),
    block_r: int | None = None,
    block_c: int | None = None,
    max_single_block: int = 4096,
    num_warps: int = 4,
    wide: bool = False,
    cuda_block_r: int | None = None,
) -> str:
    """Inclusive cumulative sums along the columns of [rows, cols] tiles.

    prologue: statements on the tile (they read `rows`, `cols`, `mask`) computing each scan's
        operand; epilogue: statements on the scanned tile (they may read the results);
    stores: `(indexed tensor, offset var, value var)` written under `mask`.
    reverse: sums from the last column (`x[j] + x[j + 1] + ...`).
    Rows wider than one block (`n_cols > block_c`) loop over column blocks, each scan carrying
    the sum of the blocks already done.
    wide: row and column indices in int64 (a tensor of >= 2**31 elements, `meta.needs_int64`).
    cuda_block_r: rows a program on CUDA (`meta.cuda_row_block`; default `block_r`), also the
        module's `cuda_constexprs` for an ahead-of-time compile.
    """
    if not scans:
        raise ValueError("a cumsum kernel needs at least one scan")
    if block_c is None:
        block_c = pow2(n_cols, 16) if n_cols <= max_single_block else 1024
    check_block("block_c", block_c, 16)
    if block_r is None:
        block_r = max(1, min(16, 4096 // block_c))
    check_block("block_r", block_r)
    cuda_block_r = check_block("cuda_block_r", block_r if cuda_block_r is None else cuda_block_r)
    scope = Scope(CUMSUM_KERNEL_LOCALS | LAUNCH_LOCALS)
    idx_tensors = indexed_tensors(scope, indexed)
    pro = scope.statements(prologue)
    scan_ctx = []
    for s in scans:
        result = scope.assign(s.result)
        scan_ctx.append({"operand": scope.ref(s.operand), "result": result,
                         "part": scope.assign(f"{result}_part"),
                         "carry": scope.assign(f"{result}_carry")})
    epi = scope.statements(epilogue)
    store_ctx = [{"ptr": f"{scope.ref(t)}_ptr", "offset": scope.ref(o), "var": scope.ref(v)}
                 for t, o, v in stores]
    return render(
        "scan_cumsum.py.jinja",
        name=name,
        header_lines=header_lines,
        block_r=block_r,
        cuda_block_r=cuda_block_r,
        block_c=block_c,
        num_warps=num_warps,
        compute_dtype=compute_dtype(dtype),
        single_pass=block_c >= n_cols,
        reverse=reverse,
        indexed=idx_tensors,
        prologue=pro,
        scans=scan_ctx,
        epilogue=epi,
        stores=store_ctx,
        launch_params=[t["arg"] for t in idx_tensors],
        wide=wide,
    )

