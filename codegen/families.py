"""The kernel template families: one `render_<family>` hook per `codegen/templates/*.py.jinja`.

Fused families (`fused_families.py`, hook-made statements inside):
    render_pointwise      poi  launch(*inputs, *outputs, *scalars, shape)
    render_reduction      red  launch(*inputs, *row_outputs, *reduced_outputs, n_rows, n_cols)
    render_matmul         mm   launch(a, b, c[, scale], *epilogue_inputs, *scalars)
Fixed-structure families (`fixed_families.py`, rendered for the pattern ops):
    render_attention_fwd  tem  launch(q, k, v, o, lse, *group_lengths, sm_scale)
    render_attention_bwd  tem  launch(q, k, v, o, lse, do, dq, dk, dv, delta, *group_lengths,
                                      sm_scale)
    render_cross_entropy  tem  launch(h, w, target, loss, lse)
                               backward: launch(h, w, target, lse, dloss, dh, dw)
The one-launch AdamW (`adamw_multi.py.jinja`) is rendered by `pattern_kernels.py` and the
embedding gradient (`segment_sum.py.jinja`) by `segment_sum.py`.

Families added for the IR hooks (`extra_families.py`; `hooks.py` maps schedule kernels onto
all of these):
    render_cumsum         red  launch(*indexed, n_rows, n_cols)
    render_scatter_along  tem  launch(grad [R], index [R], out [R, size])

Each hook returns module source; `render.load_module(source, name)` imports it.
"""

from __future__ import annotations

from .fixed_families import (
    ATTENTION_KERNEL_LOCALS,
    KeyGroup,
    render_attention_bwd,
    render_attention_fwd,
    render_cross_entropy,
)
from .extra_families import (
    CUMSUM_KERNEL_LOCALS,
    CumsumScan,
    render_cumsum,
    render_scatter_along,
)
from .fused_families import (
    MATMUL_KERNEL_LOCALS,
    POINTWISE_KERNEL_LOCALS,
    REDUCTION_KERNEL_LOCALS,
    ReductionStage,
    render_matmul,
    render_pointwise,
    render_reduction,
)
from .meta import LAUNCH_LOCALS

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
