"""The triton target's lowering tables (`ir/lowering.py`), one rule per op each:

    TRITON_INDEX   rule(low, sec, node, coords, valid) -> Val: the value of a free node (a
                   generator, or an `OpGroup.INDEXING` op, a gather or a float cast read
                   through) at `coords` of its own shape, 0 where a condition of `valid`
                   fails; the rule reads its operands with `low.read` at the coordinates it
                   maps `coords` to (`nodes.py` holds the built-in rules)
    TRITON_KERNEL  rule(g, node, kernel, header, dtype, allow_tf32) -> KernelCode: the whole
                   template kernel of the node (a pattern op: `patterns.py` renders its
                   template; the scatter-adds INDEX_ADD, SCATTER_ALONG: `dispatch.py`)
    TRITON_SCAN    a `codegen.scan.rules.ScanRule` record: whether a node of the op stays
                   inside a scan kernel (else the reason its scan runs as a host loop) and
                   how the kernel holds it: its stage, where the independent axes sit in its
                   value, its value at coordinates (`codegen/scan/rules.py` holds the
                   built-in rules)

Arithmetic elementwise ops need no TRITON_INDEX rule (their registry entry's `triton`
expression; `codegen/scan/rules.py` gives each the pointwise TRITON_SCAN rule); the
pointwise, reduction and contraction kernels are families of their own (`dispatch.py`).
"""
from __future__ import annotations

from titanc.ir.lowering import Lowerings

__all__ = ["TRITON_INDEX", "TRITON_KERNEL", "TRITON_SCAN"]

TRITON_INDEX = Lowerings("triton (index rule)")
TRITON_KERNEL = Lowerings("triton (template kernel)")
TRITON_SCAN = Lowerings("triton (scan kernel)")
