"""The triton target's lowering tables (`ir/lowering.py`), one rule per op each:

    TRITON_INDEX   rule(low, sec, node, coords, valid) -> Val: the value of a free node (a
                   generator, or an `OpGroup.INDEXING` op, a gather or a float cast read
                   through) at `coords` of its own shape, 0 where a condition of `valid`
                   fails; the rule reads its operands with `low.read` at the coordinates it
                   maps `coords` to (`nodes.py` holds the built-in rules)
    TRITON_KERNEL  rule(g, node, kernel, header, dtype, allow_tf32) -> KernelCode: the whole
                   template kernel of the node (a pattern op: `patterns.py` renders its
                   template; the scatter-adds INDEX_ADD, SCATTER_ALONG: `dispatch.py`)

Arithmetic elementwise ops need no rule (their registry entry's `triton` expression); the
pointwise, reduction and contraction kernels are families of their own (`dispatch.py`).
"""
from __future__ import annotations

from titanc.ir.lowering import Lowerings

__all__ = ["TRITON_INDEX", "TRITON_KERNEL"]

TRITON_INDEX = Lowerings("triton (index rule)")
TRITON_KERNEL = Lowerings("triton (template kernel)")
