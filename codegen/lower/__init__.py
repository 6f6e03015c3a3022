"""Lowering schedule kernels to Triton: the code that reads the IR.

    dispatch.py   the one dispatch from a schedule kernel to its family (`plan_kernels`,
                  `render_kernel`): pointwise, matmul and the scatters here, rows and pattern
                  ops through `rows.py` / `patterns.py`, a scan through `codegen.scan`
    nodes.py      `KernelLowering`: one kernel's computed and free nodes as Triton values
    indexing.py   index arithmetic: coordinates as Triton expressions
    expr.py       statements inside fused kernels: expression DAGs, the statement checker, naming
    code.py       `KernelCode` (what a hook hands back) and the helpers every hook shares
    rows.py       SUM/AMAX reductions and CUMSUM over a [rows, cols] index space
    patterns.py   pattern ops (flash attention, fused linear cross-entropy, AdamW) onto their
                  fixed-structure families

The families themselves (renderers over plain-Triton templates) are `codegen.families`.
"""
