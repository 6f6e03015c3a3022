"""The two walk-throughs of docs/architecture.md ("Adding an op"), followed in fixtures: a toy
structural op (TRIL, an indexing op) and a toy pattern op (ADD_SUB, a tuple-valued template
kernel), each an `Op`, one `Structural` record and a lowering rule per target, removed again
after the test. Each runs on the interpreter, through autodiff, on the cpu target and on the
interpreted triton target, and its gradients match torch autograd. Each also says whether a
scan kernel holds it (its TRITON_SCAN entry): TRIL inside one matches the interpreter, ADD_SUB
keeps its scan a host loop with the reason, and so does TRIL without its rule."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from titanc.ir import Builder, Graph, Op, interpret
from titanc.ir.kernel_family import KernelFamily, register_family, unregister_family
from titanc.ir.lowering import LoweringError, register_lowering
from titanc.ir.structural import Structural, register, unregister
from titanc.ir.types import TensorType


def _same_type(ts: list, a: dict) -> TensorType:
    return ts[0]


def _remove(op: Op, *tables: Any) -> None:
    """Undo a fixture's op: its rules, its record, its name."""
    for table in tables:
        table.remove(op)
    unregister(op)
    delattr(Op, op.name)


# -- the structural op: TRIL (walk-through 1) ------------------------------------------------------

@pytest.fixture
def tril():
    """x[..., i, j] where j <= i + diagonal, else 0 (over the last two axes)."""
    from titanc.codegen.lower.lowerings import TRITON_INDEX, TRITON_SCAN
    from titanc.codegen.scan.rules import ScanRule
    from titanc.runtime.targets.lowerings import CPU

    op = Op.define("TRIL")
    # 1. ir/tril.py: the record (shape, reference, VJP, zero folding, its group)
    register(Structural(
        op, _same_type,
        ref=lambda n, xs, it: torch.tril(xs[0], n.attr("diagonal")),
        vjp=lambda b, a, xs, y, ct: [b.op(op, ct, diagonal=a["diagonal"])],
        zero="all", groups=("INDEXING",)))

    # 2. runtime/targets/cpu_rules.py: the cpu rule, an out= call into the planned tensor
    @register_lowering(op, CPU)
    def _cpu(b: Any, n: Any, xs: list, o: torch.Tensor) -> list:
        x, k = xs[0], n.attr("diagonal")
        return [lambda: torch.tril(x, k, out=o)]

    # 3. codegen/lower/nodes.py: the triton index rule, the operand where visible, else 0
    @register_lowering(op, TRITON_INDEX)
    def _triton(low: Any, sec: Any, n: Any, c: list, valid: tuple) -> Any:
        from titanc.codegen.lower.nodes import literal
        i, j, k = c[-2], c[-1], n.attr("diagonal")
        if i.value is not None and j.value is not None:
            return low.read(sec, n.inputs[0], c, valid) if j.value <= i.value + k \
                else literal(0.0)
        return low.read(sec, n.inputs[0], c, valid + (f"{j.expr} <= {i.expr} + ({k})",))

    # 4. codegen/scan/rules.py: the scan-kernel rule, a view (as PAD): index arithmetic on
    # its reader's loads inside a scan kernel, the independent axes passed through
    def _scan_pax(n: Any, ins: list, sc: Any, bad: Any) -> Any:
        q, r = ins[0], n.type.rank
        if q is not None and {r - 2, r - 1} & set(q):
            raise bad("runs along")
        return q

    def _scan_value(em: Any, sec: Any, sc: Any, n: Any, c: list, conds: tuple) -> str:
        k = n.attr("diagonal")
        return em.read(sec, sc, n.inputs[0], c, conds + (f"{c[-1]} <= {c[-2]} + ({k})",))

    register_lowering(op, TRITON_SCAN, ScanRule("view", _scan_pax, _scan_value))

    yield op
    _remove(op, CPU, TRITON_INDEX, TRITON_SCAN)


def _tril_graph(op: Op) -> Graph:
    """loss = sum(tril(x·x, -1) · w + tril(x, 1))."""
    b = Builder("forward")
    x = b.input("x", (2, 5, 4), "f64")
    w = b.input("w", (5, 4), "f64")
    loss = (b.op(op, x * x, diagonal=-1) * w + b.op(op, x, diagonal=1)).sum((0, 1, 2))
    b.graph.set_outputs([("loss", loss.id)])
    return b.graph


def _tril_want(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (torch.tril(x * x, -1) * w + torch.tril(x, 1)).sum()


def _scan_graph(apply: Any, role: str = "loop") -> Graph:
    """A scan over x [3, 2, 4, 4] whose body applies `apply(b, value)` (a new op) to a carry
    and to each slice."""
    b = Builder("forward")
    x = b.input("x", (3, 2, 4, 4), "f64")
    h0 = b.input("h0", (2, 4, 4), "f64")

    def body(bb: Builder, c: list, xs: list, k: list) -> tuple[list, list]:
        (h,), (xt,) = c, xs
        return [apply(bb, h * 0.5 + xt)], [apply(bb, xt) * h]

    (h,), (y,) = b.scan(body, [h0], [x], name="with_op", role=role)
    b.graph.set_outputs([("h", h.id), ("y", y.id)])
    return b.graph


def _render_and_run(g: Graph) -> Any:
    """The scan of `g` as one scan kernel, run on random operands: equal to the reference
    interpreter's scan (float64)."""
    from titanc.codegen.render import load_module
    from titanc.codegen.scan.kernel import render_scan
    from titanc.config import triton_interpret_mode
    from titanc.ir import Interpreter
    from titanc.ir.structural import scan_ref
    from titanc.runtime.targets.triton_executor import interpreting

    n = next(m for m in g if m.op is Op.SCAN)
    sk = render_scan(g, n.id, dtype="float64")
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(g.node(v).type.shape, generator=gen, dtype=torch.float64)
          for v in n.inputs]
    want = scan_ref(n, xs, Interpreter(torch.float64))
    outs = [torch.full(w.shape, float("nan"), dtype=torch.float64) for w in want]
    ws = torch.zeros(sk.grid * sk.ws_per_program, dtype=torch.float64)
    with triton_interpret_mode(interpreting()):     # (on CPU tensors; a GPU runs them too)
        dev = "cpu" if interpreting() else "cuda"
        args = [t.to(dev) for t in [ws, *[xs[i] for i in sk.inputs], *[outs[k] for k in sk.outputs]]]
        load_module(sk.source, sk.name, interpreting()).launch(*args)
    outs = dict(zip(sk.outputs, args[1 + len(sk.inputs):]))
    for k in sk.outputs:
        torch.testing.assert_close(outs[k].cpu(), want[k], rtol=1e-12, atol=1e-12)
    return sk


# -- the pattern op: ADD_SUB (walk-through 2) ------------------------------------------------------

_ADD_SUB_SOURCE = '''{header}
import triton
import triton.language as tl


@triton.jit
def {name}(x_ptr, y_ptr, s_ptr, d_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0)
    y = tl.load(y_ptr + offs, mask=mask, other=0)
    tl.store(s_ptr + offs, x + y, mask=mask)
    tl.store(d_ptr + offs, x - y, mask=mask)


def launch(x, y, s, d, n):
    {name}[(triton.cdiv(n, 64),)](x, y, s, d, n, BLOCK=64)
'''


def _add_sub_vjp(b: Any, a: dict, xs: list, y: Any, cts: list) -> list:
    """(s, d) = (x + y, x − y): dx = ct_s + ct_d, dy = ct_s − ct_d."""
    cs, cd = cts
    if cs is None:
        return [cd, -cd]
    if cd is None:
        return [cs, cs]
    return [cs + cd, cs - cd]


@pytest.fixture
def add_sub():
    """(x, y) -> (x + y, x − y), one template kernel with its two ITEMs."""
    from titanc.codegen.lower.code import KernelCode, TensorArg
    from titanc.codegen.lower.lowerings import TRITON_KERNEL, TRITON_SCAN
    from titanc.codegen.lower.patterns import element_args
    from titanc.codegen.scan.rules import ScanRule
    from titanc.runtime.targets.lowerings import CPU

    op = Op.define("ADD_SUB")
    # 1. ir/add_sub.py: the record (shape, reference, VJP, and the kernel's facts)
    register(Structural(
        op, lambda ts, a: (ts[0], ts[0]),
        ref=lambda n, xs, it: (xs[0] + xs[1], xs[0] - xs[1]),
        vjp=_add_sub_vjp, groups=("PATTERN",),
        flops=lambda n, g: 2 * g.node(n.inputs[0]).type.numel,
        precision="high", family="add_sub"))
    # ... and its kernel family (ir/kernel_family.py): a template kernel of its op's rule
    register_family(KernelFamily("add_sub", "template", "tem",
                                 "titanc.codegen.lower.patterns:lower_template"))

    # 2. runtime/targets/pattern_kernels.py: the cpu rule, out= calls into its elements
    @register_lowering(op, CPU)
    def _cpu(b: Any, n: Any, xs: list, outs: list) -> list:
        (x, y), (s, d) = xs, outs
        return [lambda: torch.add(x, y, out=s), lambda: torch.sub(x, y, out=d)]

    # 3. codegen/lower/patterns.py: the triton rule, rendering 4. its template
    @register_lowering(op, TRITON_KERNEL)
    def _triton(g: Any, n: Any, kernel: Any, header: list, dtype: str,
                allow_tf32: bool) -> KernelCode:
        numel = g.node(n.inputs[0]).type.numel
        source = _ADD_SUB_SOURCE.format(name=kernel.name,
                                        header="\n".join(f"# {h}" for h in header))
        args = [TensorArg(i, (numel,)) for i in n.inputs]
        args += [TensorArg(a.value, (numel,)) for a in element_args(g, n, kernel)]
        return KernelCode(kernel.name, kernel.category, "add_sub", g.name, source,
                          tuple(args), (numel,))

    # 5. codegen/scan/rules.py: not in scan kernels (a scan whose body holds one stays a host
    # loop over its body's kernels, and says why)
    register_lowering(op, TRITON_SCAN, ScanRule("none", why_not="ADD_SUB is a template "
                                                "kernel of its own, not in scan kernels"))

    yield op
    _remove(op, CPU, TRITON_KERNEL, TRITON_SCAN)
    unregister_family("add_sub")


def _add_sub_graph(op: Op) -> Graph:
    """loss = sum((x + y) · w + (x − y)²), the pair from one ADD_SUB node."""
    b = Builder("forward")
    x = b.input("x", (3, 4), "f64")
    y = b.input("y", (3, 4), "f64")
    w = b.input("w", (3, 4), "f64")
    pair = b.op(op, x, y)
    s, d = b.item(pair, 0), b.item(pair, 1)
    loss = (s * w + d * d).sum((0, 1))
    b.graph.set_outputs([("loss", loss.id)])
    return b.graph


def _add_sub_want(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return ((x + y) * w + (x - y) ** 2).sum()


# -- the check both walk-throughs end with ---------------------------------------------------------

def _runs_everywhere(g: Graph, inputs: dict[str, torch.Tensor], want: Any) -> Graph:
    """Loss and gradients of `g` on the interpreter, the cpu target and the interpreted
    triton target equal torch autograd's `want(**inputs)`; returns the gradient graph."""
    from titanc.passes.autodiff import grad_graph
    from titanc.passes.canonicalize import canonicalize
    from titanc.passes.fusion import fuse
    from titanc.passes.buffer_plan import plan_buffers
    from titanc.runtime.targets.executor import ArenaExecutor
    from titanc.runtime.targets.triton_executor import TritonExecutor

    leaves = {k: v.clone().requires_grad_(True) for k, v in inputs.items()}
    loss = want(**leaves)
    loss.backward()
    gg = canonicalize(grad_graph(g, list(inputs)))
    plan = plan_buffers(fuse(gg), set())
    for name, run in (("interpreter", lambda: interpret(gg, inputs)),
                      ("cpu", lambda: ArenaExecutor(plan).run(inputs)),
                      ("triton", lambda: TritonExecutor(plan).run(inputs))):
        got = run()
        torch.testing.assert_close(got["loss"], loss.detach(), rtol=1e-12, atol=1e-12,
                                   msg=name)
        for k, leaf in leaves.items():
            torch.testing.assert_close(got[f"grad.{k}"], leaf.grad, rtol=1e-12, atol=1e-12,
                                       msg=f"{name}: grad.{k}")
    return gg


def _inputs(**shapes: tuple[int, ...]) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {k: torch.randn(*s, generator=gen, dtype=torch.float64) for k, s in shapes.items()}


def test_a_new_structural_op_runs_everywhere(tril) -> None:
    """TRIL, from its record and a rule per target: a free indexing node in the fused kernels
    (its own VJP is a TRIL of the cotangent)."""
    gg = _runs_everywhere(_tril_graph(tril), _inputs(x=(2, 5, 4), w=(5, 4)), _tril_want)
    assert sum(n.op is tril for n in gg) >= 3               # forward twice, backward once


def test_a_new_op_says_whether_it_stays_inside_a_scan_kernel(tril, add_sub) -> None:
    """TRIL's TRITON_SCAN rule keeps a scan holding it one kernel (a grid over the carry's
    leading axis, the values the interpreter's); without the rule, and with ADD_SUB's "not
    in scan kernels" entry, the scan falls back to its host loop with the reason."""
    from titanc.codegen.lower.lowerings import TRITON_SCAN
    from titanc.codegen.scan.kernel import ScanFallback, render_scan

    with_tril = lambda b, v: b.op(tril, v, diagonal=-1)
    sk = _render_and_run(_scan_graph(with_tril))
    assert sk.grid == 2 and sk.source.count("@triton.jit") == 1
    g = _scan_graph(lambda b, v: b.item(b.op(add_sub, v, v), 1))
    with pytest.raises(ScanFallback, match="ADD_SUB is a template kernel of its own"):
        render_scan(g, next(m for m in g if m.op is Op.SCAN).id)
    TRITON_SCAN.remove(tril)
    g = _scan_graph(with_tril)
    with pytest.raises(ScanFallback, match=r"no scan-kernel rule for TRIL \(TRITON_SCAN: "
                                           r"register_lowering\(Op.TRIL, TRITON_SCAN"):
        render_scan(g, next(m for m in g if m.op is Op.SCAN).id)
    # ... and a program says so: a memory scan holding it is a host loop, with the reason
    # (report.json `scan_forms`, the executor's `fallbacks`)
    from titanc.codegen.scan.kernel import count_launches
    from titanc.passes.buffer_plan import plan_buffers
    from titanc.passes.fusion import fuse

    forms: list = []
    count_launches(plan_buffers(fuse(_scan_graph(with_tril, "memory")), set()), forms=forms)
    assert [f["form"] for f in forms] == ["host_loop"]
    assert "no scan-kernel rule for TRIL" in forms[0]["why"]


def test_a_new_pattern_op_runs_everywhere(add_sub) -> None:
    """ADD_SUB, from its record and a rule per target: a template kernel of its own, whose
    cost the fusion pass reads from the record."""
    from titanc.passes.fusion import fuse, node_flops

    g = _add_sub_graph(add_sub)
    _runs_everywhere(g, _inputs(x=(3, 4), y=(3, 4), w=(3, 4)), _add_sub_want)
    sched = fuse(g)
    kern = next(k for k in sched.kernels if any(g.node(n).op is add_sub for n in k.nodes))
    assert kern.category == "template"
    assert node_flops(next(n for n in g if n.op is add_sub), g) == 24


def test_a_missing_lowering_names_the_op_and_the_target(add_sub) -> None:
    from titanc.codegen.lower.lowerings import TRITON_INDEX
    from titanc.runtime.targets.lowerings import CPU

    with pytest.raises(LoweringError, match="the triton \\(index rule\\) target has no "
                                            "lowering rule for ADD_SUB"):
        TRITON_INDEX[add_sub]
    CPU.remove(add_sub)
    from titanc.passes.fusion import fuse
    from titanc.passes.buffer_plan import plan_buffers
    from titanc.runtime.targets.executor import ArenaExecutor

    g = _add_sub_graph(add_sub)
    with pytest.raises(LoweringError, match="the cpu target has no lowering rule for ADD_SUB"):
        ArenaExecutor(plan_buffers(fuse(g), set()))


def test_each_target_has_a_rule_for_every_op_it_lowers_by_rule() -> None:
    """The cpu table covers every structural op that computes (the executor itself binds
    INPUT, ITEM, generators, scans and torch-expressible views); the triton index table every
    free op (generators, indexing ops, gathers, casts); the template table every pattern op."""
    import titanc.codegen.lower.dispatch  # noqa: F401  (fills the triton tables)
    import titanc.runtime.targets.executor  # noqa: F401  (fills the cpu table)
    from titanc.codegen.lower.lowerings import TRITON_INDEX, TRITON_KERNEL
    from titanc.ir import OpGroup
    from titanc.ir.structural import STRUCTURAL
    from titanc.runtime.targets.lowerings import CPU

    bound = {Op.INPUT, Op.ITEM, Op.SCAN, Op.PERMUTE, Op.EXPAND, Op.SLICE} | OpGroup.GENERATOR
    assert [op.name for op in STRUCTURAL if op not in bound and op not in CPU] == []
    free = OpGroup.GENERATOR | OpGroup.INDEXING | {Op.TAKE, Op.TAKE_ALONG, Op.CAST}
    assert [op.name for op in free if op not in TRITON_INDEX] == []
    assert [op.name for op in OpGroup.PATTERN if op not in TRITON_KERNEL] == []
    # every op says whether a scan kernel holds it: a rule, or an explicit "none" entry
    import titanc.codegen.scan.rules  # noqa: F401  (fills the scan-kernel table)
    from titanc.codegen.lower.lowerings import TRITON_SCAN
    from titanc.ir.elementwise import ELEMENTWISE

    every = set(STRUCTURAL) | set(ELEMENTWISE) | OpGroup.ELEMENTWISE
    assert [op.name for op in every if op not in TRITON_SCAN] == []
