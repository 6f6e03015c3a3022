"""The kernel template families: one renderer per `codegen/templates/*.py.jinja`, plain Triton
in the template, the choice of dtypes, block sizes and layout in the renderer. Each family's
record (name, prefix, template, hook, whether it joins launch groups, profile label, cost
class) is in `ir/kernel_family.py`. Hooks that read
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

from titanc.ir.kernel_family import FAMILIES, resolve
from titanc.codegen.meta import LAUNCH_LOCALS
from titanc.codegen.families.cumsum import CumsumScan, render_cumsum
from titanc.codegen.families.pattern_ops import (
    KeyGroup,
    render_attention_bwd,
    render_attention_fwd,
    render_cross_entropy,
)
from titanc.codegen.families.fused import (
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

# Names each family's template binds itself (kernel and launcher locals, module constants),
# from the records (`KernelFamily.locals`, `ir/kernel_family.py`): a user-derived name never
# equals one of them (`expr.Scope` prefixes it). A test renders the families and checks that
# these lists are complete.
TEMPLATE_LOCALS: dict[str, frozenset[str]] = {
    f.name: resolve(f.locals) | LAUNCH_LOCALS for f in FAMILIES.values() if f.locals}
