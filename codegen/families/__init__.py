"""The kernel template families: one renderer per `codegen/templates/*.py.jinja`, plain Triton
in the template, the choice of dtypes, block sizes and layout in the renderer. Hooks that read
the IR and pick a family live in `codegen.lower`; the scan kernel in `codegen.scan`.

Fused families (`fused.py`, hook-made statements inside):
    render_pointwise      poi  launch(*inputs, *outputs, *scalars, shape)
    render_reduction      red  launch(*inputs, *row_outputs, *reduced_outputs, n_rows, n_cols)
    render_matmul         mm   launch(a, b, c[, scale], *epilogue_inputs, *scalars)
    render_cumsum         red  launch(*indexed, n_rows, n_cols)            (`cumsum.py`)
Fixed-structure families (`pattern_ops.py`, rendered for the pattern ops by `lower/patterns.py`):
    render_attention_fwd  tem  launch(q, *ks, *vs, o, lse, *group_lengths, sm_scale)
    render_attention_bwd  tem  launch(q, *ks, *vs, o, lse, do, dq, *dks, *dvs, delta,
                                      *group_lengths, sm_scale)   (a k, v, dk, dv per group)
    render_cross_entropy  tem  launch(h, w, target, loss, lse)
                               backward: launch(h, w, target, lse, dloss, dh, dw)
    adamw_multi.py.jinja  tem  the one-launch AdamW (rendered by `lower/patterns.py`)
Scatter families (`scatter.py`, the VJPs of the gathers, no atomics):
    render_segment_sum    tem  launch(grad [n, C], index [n], out [R, C])
    render_scatter_along  tem  launch(grad [R], index [R], out [R, size])

Each renderer returns module source; `render.load_module(source, name)` imports it.
"""

from __future__ import annotations

from titanc.codegen.meta import LAUNCH_LOCALS
from titanc.codegen.families.cumsum import CUMSUM_KERNEL_LOCALS, CumsumScan, render_cumsum
from titanc.codegen.families.pattern_ops import (
    ATTENTION_KERNEL_LOCALS,
    KeyGroup,
    render_attention_bwd,
    render_attention_fwd,
    render_cross_entropy,
)
from titanc.codegen.families.fused import (
    MATMUL_KERNEL_LOCALS,
    POINTWISE_KERNEL_LOCALS,
    REDUCTION_KERNEL_LOCALS,
    ReductionStage,
    render_matmul,
    render_pointwise,
    render_reduction,
)
from titanc.codegen.families.scatter import render_scatter_along, render_segment_sum

__all__ = [
    "TEMPLATE_LOCALS",
    "CumsumScan",
    "KeyGroup",
    "ReductionStage",
    "render_attention_bwd",
    "render_attention_fwd",
    "render_cross_entropy",
    "render_cumsum",
    "render_matmul",
    "render_pointwise",
    "render_reduction",
    "render_scatter_along",
    "render_segment_sum",
]

# Names each family's template binds itself (kernel and launcher locals, module constants):
# a user-derived name never equals one of them (`expr.Scope` prefixes it). A test renders the
# families and checks that these lists are complete.
TEMPLATE_LOCALS: dict[str, frozenset[str]] = {
    "pointwise": POINTWISE_KERNEL_LOCALS | LAUNCH_LOCALS,
    "reduction": REDUCTION_KERNEL_LOCALS | LAUNCH_LOCALS,
    "matmul": MATMUL_KERNEL_LOCALS | LAUNCH_LOCALS,
    "attention": ATTENTION_KERNEL_LOCALS | LAUNCH_LOCALS,
    "cumsum": CUMSUM_KERNEL_LOCALS | LAUNCH_LOCALS,
}
