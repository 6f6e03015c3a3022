"""Kernel families: one frozen record per kind of generated kernel, read by every stage.

A `KernelFamily` says everything the compiler keys on a kind of kernel:

    name        the family (`KernelCode.family`, report.json `step.families`, the cost model)
    category    the schedule category fusion gives its kernels (`Kernel.category`):
                pointwise | reduction | matmul | template (`passes/fusion.py` decides which
                nodes fuse into which category; `ops` picks a family inside one)
    prefix      its kernels' names: titanc_<prefix>_fused_<ops>_<n> (one prefix a category)
    ops         the ops that pick it inside its category (CUMSUM: the cumsum family of the
                reduction kernels); a category's family without `ops` is its default. A
                template kernel's family is its op's `Structural.family` instead
    renderer    "module:function" of its hook, `hook(low, outs, header, dtype, allow_tf32)
                -> KernelCode` (`codegen.lower.dispatch.render_kernel` calls it); "" for a
                family that is no Triton kernel of its own (a scan runs as a scan kernel or
                a host loop, `codegen.scan`)
    template    its file in `codegen/templates` ("" when the op's rule picks it)
    locals      "module:NAME" of the names its template binds (`codegen.families.
                TEMPLATE_LOCALS`: a user-derived name never takes one), "" for none listed
    groupable   may one of its launches join a launch group (`codegen.group`): its module
                is one kernel and one pure `launch`
    profile     the profiler's category for its kernels (`runtime.targets.executor.
                kernel_label`; the optimizer graph and a memory scan's body override it)
    cost        the cost model's class (`titanc.tools.cost_model`): which attainable rate
                its FLOPs run at (`UNIT` there)

`FAMILIES` is the registry in a fixed order (the order tables print families in);
`register_family` adds one (a test's toy family, a new kernel kind), `unregister_family`
removes it. Adding a kernel family is this record plus its template and its renderer
(docs/architecture.md, "Adding a kernel family"; tests/test_kernel_family.py follows it).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

from titanc.ir.graph import Graph
from titanc.ir.ops import Op
from titanc.ir.structural import STRUCTURAL

__all__ = ["FAMILIES", "KernelFamily", "PROFILE_LABELS", "categories", "family", "family_of",
           "prefix", "register_family", "resolve", "unregister_family"]


@dataclass(frozen=True, slots=True)
class KernelFamily:
    name: str
    category: str
    prefix: str
    renderer: str = ""
    template: str = ""
    locals: str = ""
    ops: frozenset[Op] = field(default_factory=frozenset)
    groupable: bool = False
    profile: str = "other"
    cost: str = "elementwise"


# the profiler's categories, in the order its tables print them; "memory update" (a memory
# scan's body) and "optimizer" (the optimizer graph) are where a kernel runs, not its family
PROFILE_LABELS = ("pointwise", "reduction", "matmul", "attention", "memory update",
                  "optimizer", "scan", "other")

_HOOKS = "titanc.codegen.lower"
FAMILIES: dict[str, KernelFamily] = {}


def register_family(f: KernelFamily) -> KernelFamily:
    """Add `f` to the registry; a name taken, a second prefix for a category, a second default
    family of a category or an unknown profile label is an error naming the record."""
    if f.name in FAMILIES:
        raise ValueError(f"kernel family {f.name!r} is registered already")
    same = [o for o in FAMILIES.values() if o.category == f.category]
    if same and same[0].prefix != f.prefix:
        raise ValueError(f"kernel family {f.name!r}: category {f.category!r} names its kernels "
                         f"titanc_{same[0].prefix}_..., not titanc_{f.prefix}_...")
    if f.category != "template" and not f.ops and any(not o.ops for o in same):
        raise ValueError(f"kernel family {f.name!r}: category {f.category!r} has a default "
                         f"family already; give the record the `ops` that pick it")
    if f.profile not in PROFILE_LABELS:
        raise ValueError(f"kernel family {f.name!r}: profile {f.profile!r} is none of "
                         f"{PROFILE_LABELS}")
    FAMILIES[f.name] = f
    return f


def unregister_family(name: str) -> None:
    del FAMILIES[name]


def family(name: str) -> KernelFamily:
    if name not in FAMILIES:
        raise KeyError(f"no kernel family {name!r} (registered: {', '.join(FAMILIES)}); "
                       f"an op's Structural.family names a KernelFamily record "
                       f"(ir/kernel_family.py)")
    return FAMILIES[name]


def categories() -> tuple[str, ...]:
    """The schedule's kernel categories, in registry order."""
    return tuple(dict.fromkeys(f.category for f in FAMILIES.values()))


def prefix(category: str) -> str:
    """The name prefix of a category's kernels (poi, red, mm, tem)."""
    for f in FAMILIES.values():
        if f.category == category:
            return f.prefix
    raise KeyError(f"no kernel family of category {category!r}")


def family_of(g: Graph, kernel: Any) -> KernelFamily:
    """The family that renders schedule kernel `kernel` of graph `g`: a template kernel's
    op names it (`Structural.family`); another kernel's is the family of its category whose
    `ops` it holds, else the category's default."""
    ops = [g.node(n).op for n in kernel.nodes]
    if kernel.category == "template":         # its op names it (a scan's prologue: none)
        named = [STRUCTURAL[op].family for op in ops if op in STRUCTURAL and STRUCTURAL[op].family]
        if not named:
            raise KeyError(f"{kernel.name}: a template kernel without an op that names its "
                           f"kernel family (Structural.family)")
        return family(named[0])
    held = set(ops)
    default = None
    for f in FAMILIES.values():
        if f.category != kernel.category:
            continue
        if f.ops & held:
            return f
        if not f.ops:
            default = default or f
    if default is None:
        raise KeyError(f"{kernel.name}: no kernel family of category {kernel.category!r}")
    return default


def resolve(ref: str) -> Any:
    """The object "module:name" names (a record's renderer or locals), imported on use."""
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


_FUSED = "titanc.codegen.families.fused"
for _f in (
    KernelFamily("pointwise", "pointwise", "poi", f"{_HOOKS}.dispatch:lower_pointwise",
                 "pointwise.py.jinja", f"{_FUSED}:POINTWISE_KERNEL_LOCALS", groupable=True,
                 profile="pointwise", cost="elementwise"),
    KernelFamily("reduction", "reduction", "red", f"{_HOOKS}.rows:lower_reduction",
                 "reduction.py.jinja", f"{_FUSED}:REDUCTION_KERNEL_LOCALS", groupable=True,
                 profile="reduction", cost="reduction"),
    KernelFamily("cumsum", "reduction", "red", f"{_HOOKS}.rows:lower_cumsum",
                 "scan_cumsum.py.jinja", "titanc.codegen.families.cumsum:CUMSUM_KERNEL_LOCALS",
                 ops=frozenset({Op.CUMSUM}), groupable=True, profile="reduction",
                 cost="reduction"),
    KernelFamily("matmul", "matmul", "mm", f"{_HOOKS}.dispatch:lower_matmul",
                 "matmul.py.jinja", f"{_FUSED}:MATMUL_KERNEL_LOCALS", groupable=True,
                 profile="matmul", cost="matmul"),
    KernelFamily("attention_fwd", "template", "tem", f"{_HOOKS}.patterns:lower_template",
                 "attention_fwd.py.jinja",
                 "titanc.codegen.families.pattern_ops:ATTENTION_KERNEL_LOCALS",
                 profile="attention", cost="attention"),
    KernelFamily("attention_bwd", "template", "tem", f"{_HOOKS}.patterns:lower_template",
                 "attention_bwd.py.jinja",
                 "titanc.codegen.families.pattern_ops:ATTENTION_KERNEL_LOCALS",
                 profile="attention", cost="attention"),
    KernelFamily("cross_entropy", "template", "tem", f"{_HOOKS}.patterns:lower_template",
                 "cross_entropy.py.jinja", profile="other", cost="matmul"),
    KernelFamily("cross_entropy_bwd", "template", "tem", f"{_HOOKS}.patterns:lower_template",
                 "cross_entropy.py.jinja", profile="other", cost="matmul"),
    KernelFamily("adamw_multi", "template", "tem", f"{_HOOKS}.patterns:lower_template",
                 "adamw_multi.py.jinja", profile="optimizer", cost="elementwise"),
    KernelFamily("segment_sum", "template", "tem", f"{_HOOKS}.patterns:lower_template",
                 "segment_sum.py.jinja", profile="other", cost="elementwise"),
    KernelFamily("scatter_along", "template", "tem", f"{_HOOKS}.patterns:lower_template",
                 "scatter_along.py.jinja", profile="other", cost="elementwise"),
    KernelFamily("scan", "template", "tem", "", "scan.py.jinja", profile="scan", cost="scan"),
):
    register_family(_f)
