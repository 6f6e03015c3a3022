"""The walk-through of docs/architecture.md ("Adding a kernel family"), followed in a fixture:
a toy family (`toy_sum`: the reduction kernels that hold a SUM, with a hook of its own) is
one `KernelFamily` record plus its renderer, removed again after the test; every consumer of
the records sees it: fusion's kernel names, dispatch, launch groups, the profiler, the cost
model, inspect. And the lists the records replaced are gone."""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")

from titanc.ir.kernel_family import (  # noqa: E402
    FAMILIES, KernelFamily, categories, family, family_of, prefix, register_family,
    unregister_family)

ROOT = Path(__file__).resolve().parents[1]
CALLS: list[str] = []


def toy_hook(low: Any, outs: list[int], header: list[str], dtype: str,
             allow_tf32: bool = False) -> Any:
    """The toy family's renderer: the reduction family's kernel, a comment line on top."""
    from titanc.codegen.lower.rows import lower_reduction
    CALLS.append(low.kernel.name)
    code = lower_reduction(low, outs, header, dtype, allow_tf32)
    return code.__class__(code.name, code.category, "toy_sum", code.graph,
                          "# toy_sum\n" + code.source, code.args, code.sizes)


@pytest.fixture
def toy_sum():
    from titanc.ir import Op
    # 1. ir/kernel_family.py: the record (its category and the ops that pick it there, its
    #    hook, its profile label, its cost class; not groupable, so it launches alone)
    fam = register_family(KernelFamily(
        "toy_sum", "reduction", "red", f"{__name__}:toy_hook", "reduction.py.jinja",
        ops=frozenset({Op.SUM}), groupable=False, profile="other", cost="reduction"))
    CALLS.clear()
    yield fam
    unregister_family("toy_sum")


def _mal():
    from titanc.compiler import compile_graphs
    from titanc.model.spec import load_spec
    return compile_graphs(load_spec(ROOT / "examples" / "tiny_mal.yaml", {
        "model.d_model": 16, "model.n_layers": 1, "model.seq_len": 16, "model.vocab_size": 32,
        "model.ffn_hidden": 32, "train.batch_size": 1, "model.memory.chunk_size": 4,
        "model.attention.segment": 8, "model.attention.window": 8}))


def test_the_registry_is_consistent() -> None:
    """One prefix a category, one default family a category, every template op names a
    record, and the records' hooks and locals resolve."""
    from titanc.ir.kernel_family import resolve
    from titanc.ir.structural import STRUCTURAL
    assert categories() == ("pointwise", "reduction", "matmul", "template")
    assert [prefix(c) for c in categories()] == ["poi", "red", "mm", "tem"]
    for op, entry in STRUCTURAL.items():
        if entry.family:
            assert family(entry.family).category == "template", op
    for f in FAMILIES.values():
        if f.renderer:
            assert callable(resolve(f.renderer)), f.name
        if f.locals:
            assert isinstance(resolve(f.locals), frozenset), f.name
        if f.template:
            assert (ROOT / "codegen" / "templates" / f.template).exists(), f.name
    with pytest.raises(ValueError, match="names its kernels titanc_red_"):
        register_family(KernelFamily("bad", "reduction", "xx", ops=frozenset({"x"})))
    with pytest.raises(KeyError, match="no kernel family 'nope'"):
        family("nope")


def test_every_consumer_sees_a_toy_family(toy_sum: KernelFamily) -> None:
    from titanc.codegen.group import groupable
    from titanc.codegen.lower.dispatch import plan_kernels
    from titanc.codegen.lowered import LaunchGroup, lower
    from titanc.runtime.targets.profiler import kernel_label
    from titanc.tools.cost_model import compiled_cost
    from titanc.tools.inspect import category_totals

    c = _mal()
    plan = c.plans["training"]
    mine = [(p, k) for p, k, _ in plan_kernels(plan) if family_of(p.schedule.graph, k) is toy_sum]
    assert mine, "no reduction kernel holds a SUM"
    # fusion: its kernels are reduction kernels, named with its category's prefix
    assert all(k.category == "reduction" and k.name.startswith("titanc_red_fused_")
               for _, k in mine)
    # dispatch: its hook renders them, and the code carries its name
    codes = [code for _, k, code in plan_kernels(plan) if k.name in {k.name for _, k in mine}]
    assert CALLS and all(code.family == "toy_sum" and code.source.startswith("# toy_sum")
                         for code in codes)
    # launch groups: not groupable, so never a member
    assert not any(groupable(p.schedule.graph, k) for p, k in mine)
    for low in lower(plan, None, groupable).walk():
        for s in low.steps:
            if isinstance(s, LaunchGroup):
                assert all(family_of(low.graph, m.kernel) is not toy_sum for m in s.members)
    # the profiler: its label ("other"; a memory scan's body says "memory update")
    p, k = mine[0]
    assert kernel_label(p.schedule.graph, k) == "other"
    # the cost model: a family of its own in report.json's step, in the registry's order
    fams = compiled_cost(c)["families"]
    assert "toy_sum" in fams and list(fams).index("toy_sum") > list(fams).index("matmul")
    # inspect: its kernels total under their category
    assert "reduction" in category_totals([{"name": k.name, "category": k.category, "flops": 1,
                                            "bytes": 1} for _, k in mine])


def test_without_the_toy_the_same_kernels_are_the_reduction_family() -> None:
    from titanc.codegen.lower.dispatch import plan_kernels
    c = _mal()
    fams = {code.family for _, _, code in plan_kernels(c.plans["training"])}
    assert "toy_sum" not in fams and {"pointwise", "reduction", "matmul"} <= fams


def test_the_lists_the_records_replaced_are_gone() -> None:
    """No module keeps its own list of kernel families or categories."""
    gone = re.compile(r"^(GROUP_FAMILIES|GROUP_CATEGORIES|PROFILE_CATEGORIES|FAMILY_ORDER|"
                      r"CATEGORY_ORDER|CATEGORIES|PREFIX)\s*=", re.M)
    hits = [str(p.relative_to(ROOT)) for d in ("ir", "passes", "codegen", "runtime", "titanc")
            for p in (ROOT / d).rglob("*.py") if gone.search(p.read_text())]
    assert hits == []
