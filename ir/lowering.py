"""Per-target lowering tables: how a target runs an op, one rule per (op, target).

As JAX registers a primitive's lowering per platform (`mlir.register_lowering(prim, rule,
platform="cuda")`), each target owns a `Lowerings` table and fills it next to its code:

    runtime/targets/lowerings.py   CPU              (builder, node, operands, out) -> steps
    codegen/lower/lowerings.py     TRITON_INDEX     (lowering, section, node, coords, valid)
                                                    -> the value of a free node at coords
                                   TRITON_KERNEL    (graph, node, kernel, header, dtype,
                                                    allow_tf32) -> the KernelCode of the
                                                    template kernel holding the node
                                   TRITON_SCAN      a `ScanRule` record (codegen/scan/
                                                    rules.py): whether the op stays inside
                                                    a scan kernel, and how it is emitted

The table class holds no target's facts (the IR imports no target); a rule's signature is
its table's (a function, or a record where a target needs several facts per op).
`register_lowering(op, table, rule)` adds one (or decorates the rule); looking up an op with
no rule raises `LoweringError` naming the op and the target.
"""
from __future__ import annotations

from typing import Any, TypeVar

from titanc.ir.ops import Op

__all__ = ["LoweringError", "Lowerings", "register_lowering"]

Rule = TypeVar("Rule")


class LoweringError(NotImplementedError):
    """An op the target has no rule for."""


class Lowerings:
    """The lowering rules of one target (`target` names it in errors)."""

    def __init__(self, target: str):
        self.target = target
        self.rules: dict[Op, Any] = {}

    def __contains__(self, op: Op) -> bool:
        return op in self.rules

    def __getitem__(self, op: Op) -> Any:
        rule = self.rules.get(op)
        if rule is None:
            raise LoweringError(f"the {self.target} target has no lowering rule for "
                                f"{op.name}: register_lowering(Op.{op.name}, <its table>, rule)")
        return rule

    def remove(self, op: Op) -> None:
        """Drop `op`'s rule (a test's toy op)."""
        self.rules.pop(op, None)

    def __repr__(self) -> str:
        return f"Lowerings({self.target!r}, {len(self.rules)} ops)"


def register_lowering(op: Op, target: Lowerings, rule: Rule | None = None) -> Any:
    """Make `rule` how `target` lowers `op`; without `rule`, a decorator doing so."""
    def add(r: Rule) -> Rule:
        target.rules[op] = r
        return r
    return add if rule is None else add(rule)
