"""The cpu target's lowering table (`ir/lowering.py`): for each op that computes, a rule

    rule(builder, node, operands, out) -> steps

returning the closures (out= ATen calls) that write the node's result into `out`, its planned
tensor (for a tuple-valued pattern op: the list of its elements' tensors, scratch where no
later kernel reads one). Operands are tensors or, for an inlined scalar constant, floats. The
structural ops' rules are in `cpu_rules.py`, the pattern ops' in `pattern_kernels.py` and
`attention_kernels.py`; an arithmetic elementwise op runs its registry entry's `out`.
"""
from __future__ import annotations

from titanc.ir.lowering import Lowerings

__all__ = ["CPU"]

CPU = Lowerings("cpu")
