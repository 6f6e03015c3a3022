"""Issue 12: no kernel without a computing node, in the plans of every example.

A *computing node* computes values (`titanc.tools.cost_model.is_computing`): an elementwise op or
CAST, a reduction (SUM, AMAX, CUMSUM), a contraction (EINSUM), a scatter-add (INDEX_ADD,
SCATTER_ALONG), a SCAN or a pattern op (ATTENTION, LINEAR_CROSS_ENTROPY, ADAMW, ...). A view
(RESHAPE, PERMUTE, EXPAND, SLICE), a PAD or CONCAT, a gather (TAKE, TAKE_ALONG), a constant
(FULL, ROPE, MASK), an ITEM or an INPUT only moves or makes values. A kernel that launches
(not `BufferPlan.is_noop`) and holds no computing node is a pure copy.

None stays, in any graph of any example: no concat of RoPE halves or of attention key groups
in any scan body, no copy of the token slices (the fused loss and the segment sum read them
through their strides), and no embedding gather of its own: its one reader is the layer scan,
whose kernel computes it as its prologue (`ir.schedule.scan_prologue`; a scan kernel
reads its carry's initial value through the gather, a host loop gathers the rows into the
carry's storage first).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from titanc.compiler import compile_graphs
from titanc.ir import Builder, Op, interpret
from titanc.passes.constants import constants_per_reader
from titanc.model.spec import load_spec
from titanc.tools.cost_model import is_computing
from titanc import config

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.yaml"))


def _copies(plan, depth=0, out=None) -> list[tuple[int, str, str, set]]:
    """(depth, graph, kernel, ops) of every launched kernel without a computing node."""
    out = [] if out is None else out
    g = plan.schedule.graph
    for i, k in enumerate(plan.schedule.kernels):
        if plan.is_noop(i):
            continue
        ops = {g.node(n).op for n in k.nodes}
        if not any(is_computing(op) for op in ops):
            out.append((depth, g.name, k.name, ops))
        for n in k.nodes:
            if n in plan.bodies:
                _copies(plan.bodies[n], depth + 1, out)
    return out


# (with `compile.chunk_groups: true` the exact chunked (WY) write's backward still copies a
# chunk group's gate xs reshaped with a trailing 1, read by a MUL and, as xs, by the nested
# chunk scan: a view of a body input handed to a nested scan is not a view the plan binds)
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_every_launched_kernel_computes(path: Path) -> None:
    c = compile_graphs(load_spec(path), verify_each=False)
    for kind in ("forward", "training", "optimizer"):
        copies = _copies(c.plans[kind])
        assert not copies, (kind, copies)


def test_the_embedding_gather_is_the_layer_scans_prologue() -> None:
    """The gather is in the layer scan's kernel and keeps its buffer (the carry's operand, so
    the plan is what it was: lent and updated in place in the forward); every way to run it
    agrees with the interpreter: the cpu target gathers into that buffer, the triton target's
    host loop (a layer scan is never one kernel, `scan_form`) launches the gather first; the
    scan-kernel generator can read the initial value through the gather instead."""
    from tests.test_codegen import ROOT, small
    import tests.reference as R
    from titanc.codegen.scan.kernel import count_launches, render_scan, scan_form
    from titanc.ir.schedule import scan_prologue
    from titanc.runtime.targets.executor import ArenaExecutor
    from titanc.runtime.targets.triton_executor import TritonExecutor

    spec = load_spec(ROOT / "examples" / "tiny_attn.yaml", small("tiny_attn"))
    plan = compile_graphs(spec).plans["forward"]
    g = plan.schedule.graph
    [(k, kern)] = [(k, kern) for k, kern in enumerate(plan.schedule.kernels)
                   if scan_prologue(g, kern)]
    [take] = scan_prologue(g, kern)
    sid = next(n for n in kern.nodes if g.node(n).op is Op.SCAN)
    assert g.node(take).op is Op.TAKE and g.node(sid).inputs[0] == take
    assert plan.location(take)[0] == "arena" and 0 in plan.in_place[sid]
    assert "big parallel work" in scan_form(g, sid)
    sk = render_scan(g, sid, prologue=scan_prologue(g, kern))
    assert 0 not in sk.inputs and set(sk.extra) == set(g.node(take).inputs)
    inputs = {"tokens": torch.randint(0, 16, (1, 9), generator=torch.Generator().manual_seed(3)),
              **{n: v.float() for n, v in R.init_params(spec.model, seed=1).items()}}
    want = interpret(g, {n: inputs[n] for n in g.input_names()})
    loop = TritonExecutor(plan)
    assert loop.launches_per_run() == count_launches(plan, scan_kernels=False)
    runs = {"cpu": ArenaExecutor(plan).run(inputs), "host loop": loop.run(inputs)}
    for how, got in runs.items():
        for name in want:
            torch.testing.assert_close(got[name], want[name].float(), rtol=1e-5, atol=1e-5,
                                       msg=lambda m, how=how: f"{how}: {m}")


def test_constants_per_reader_copies_a_concatenated_table_into_each_reader() -> None:
    """[cos ‖ cos] read by two multiplies: one copy each (so fusion computes it in both
    kernels), the same values; a plain generator stays shared."""
    b = Builder("t")
    x = b.input("x", (4, 6), "f64")
    cos = b.rope("cos", 0, 4, 3, "f64")
    full = b.concat([cos, cos], -1)
    y, z = x * full, (x + 1.0) * full
    b.graph.set_outputs([("y", y.id), ("z", z.id), ("c", cos.id)])
    g = b.graph
    got = constants_per_reader(g)
    assert [n.op for n in got].count(Op.CONCAT) == 2
    assert [n.op for n in got].count(Op.ROPE) == 1
    for n in got:
        if n.op is Op.CONCAT:
            assert len(got.users(n.id)) == 1
    xs = {"x": torch.randn(4, 6, dtype=torch.float64)}
    want, have = interpret(g, xs), interpret(got, xs)
    for name in want:
        torch.testing.assert_close(have[name], want[name], rtol=0, atol=0)


def test_a_cast_constant_is_copied_into_each_reader_too() -> None:
    """Under mixed precision RoPE's [cos ‖ cos] is read through a cast: the cast of a
    constant is a constant, copied with its operands into each reader (before, the shared
    cast(concat) was a kernel of its own in tiny_mag's and tiny_mal's bf16 layer backward)."""
    b = Builder("t")
    x = b.input("x", (4, 6), "f32")
    cos = b.rope("cos", 0, 4, 3, "bf16")
    full = b.op(Op.CAST, b.concat([cos, cos], -1), dtype="f32")
    y, z = x * full, (x + 1.0) * full
    b.graph.set_outputs([("y", y.id), ("z", z.id)])
    g = b.graph
    got = constants_per_reader(g)
    assert [n.op for n in got].count(Op.CAST) == 2
    assert [n.op for n in got].count(Op.CONCAT) == 2
    for n in got:
        if n.op in (Op.CAST, Op.CONCAT):
            assert len(got.users(n.id)) == 1
    xs = {"x": torch.randn(4, 6)}
    want, have = interpret(g, xs), interpret(got, xs)
    for name in want:
        torch.testing.assert_close(have[name], want[name], rtol=0, atol=0)
