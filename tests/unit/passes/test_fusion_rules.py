"""The fusion rules that cut tiny.yaml's training step from 290 to ~210 kernels (issue 12):

- a reduction's row epilogue: input-domain work that reads the reduced value of its own row
  (`x * rsqrt(mean(x²))`, the RMSNorm backward's `expand(r) * x`) is the reduction kernel's;
- several einsums over one output tile in one matmul kernel, each its own K loop (siblings
  reading one operand, a sum of products such as a backward's `dy W1ᵀ + dz W2ᵀ`);
- a matmul's prologue: pointwise work only its einsums read is evaluated as each operand
  tile is loaded (`silu(x) * g` before the FFN's down projection), never stored;
- cousins: pointwise kernels of one domain that read outputs of the same kernel merge, one
  launch instead of several;
- neighbours: independent kernels of one kind close in the order merge (pointwise of one
  domain, reductions of one shape and axes, contractions of one tile), not across kinds or
  reduction axes.

Each rule: the structure (kernel count and category of a small graph, the refusal where it
must not apply) and float64 parity of the fused schedule against the reference interpreter
on the cpu target and on the interpreted triton target (a row loop forced too)."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # read when kernels are decorated: set first

import pytest
import torch

from titanc.codegen.lower import rows as hooks_rows
from titanc.ir import Builder, Graph, Op, interpret, verify
from titanc.passes.fusion import fuse
from titanc.passes.buffer_plan import plan_buffers
from titanc.ir.schedule import Schedule, verify_schedule
from titanc.runtime.targets.executor import ArenaExecutor

pytest.importorskip("triton")

from titanc.runtime.targets.triton_executor import TritonExecutor  # noqa: E402

DT = "f64"                                        # graphs in float64: parity to 1e-12


def ops(s: Schedule) -> list[list[str]]:
    return [[s.graph.node(n).op.name.lower() for n in k.nodes] for k in s.kernels]


def categories(s: Schedule) -> list[str]:
    return [k.category for k in s.kernels]


def check_parity(g: Graph, seed: int = 0) -> Schedule:
    """Fuse `g` (a float64 graph), run it on both targets, compare with the interpreter."""
    s = verify_schedule(fuse(verify(g)))
    gen = torch.Generator().manual_seed(seed)
    inputs = {g.node(i).attr("name"): torch.rand(g.node(i).type.shape, generator=gen,
                                                  dtype=torch.float64) + 0.5
              for i in g.inputs}
    want = interpret(g, inputs)
    for cls in (ArenaExecutor, TritonExecutor):
        got = cls(plan_buffers(s)).run(inputs)
        for name, v in want.items():
            torch.testing.assert_close(got[name], v, rtol=1e-12, atol=1e-12,
                                       msg=lambda m: f"{cls.__name__} {name}: {m}")
    return s


# -- a reduction's row epilogue --------------------------------------------------------------------

def rmsnorm(d: int) -> Graph:
    b = Builder("rmsnorm")
    x, w = b.input("x", (4, 6, d), DT), b.input("w", (d,), DT)
    inv = ((x * x).sum((2,), keepdim=True) * (1.0 / d) + 1e-6).rsqrt()     # (4, 6, 1)
    b.graph.set_outputs([("y", (x * inv * w).id)])
    return b.graph


@pytest.mark.parametrize("row_block", [None, 16], ids=["one-block", "row-loop"])
def test_rmsnorm_is_one_reduction_kernel(row_block, monkeypatch) -> None:
    if row_block:
        monkeypatch.setattr(hooks_rows, "MAX_ROW_BLOCK", row_block)
    s = check_parity(rmsnorm(40))
    assert categories(s) == ["reduction"]
    assert [o for o in ops(s)[0] if o != "full"] == ["mul", "sum", "mul", "add", "rsqrt",
                                                     "mul", "mul"]


def test_row_epilogue_reads_a_weight_as_long_as_the_rows() -> None:
    # 2 x 8 rows of 16: the [16] weight (a view of an input, free in the kernel) has as many
    # elements as there are reduced values, but it is read at its own coordinates
    b = Builder("rmsnorm16")
    x, w = b.input("x", (2, 8, 16), DT), b.input("w", (1, 16), DT)
    inv = ((x * x).sum((2,), keepdim=True) * (1.0 / 16) + 1e-6).rsqrt()
    b.graph.set_outputs([("y", (x * inv * b.op(Op.RESHAPE, w, shape=[16])).id)])
    assert categories(check_parity(b.graph)) == ["reduction"]


def test_expanded_row_value_is_the_row_epilogue() -> None:
    # the RMSNorm backward: dx = g * inv + expand(sum(g * x) * inv³ * c) * x
    b = Builder("rmsnorm_bwd")
    x, gr = b.input("x", (4, 6, 24), DT), b.input("g", (4, 6, 24), DT)
    inv = b.input("inv", (4, 6, 1), DT)
    r = (gr * x).sum((2,), keepdim=True) * inv * inv * inv * -0.5
    dx = gr * inv + b.op(Op.EXPAND, r, shape=[4, 6, 24]) * x
    b.graph.set_outputs([("dx", dx.id)])
    s = check_parity(b.graph)
    assert categories(s) == ["reduction"]


def test_reduced_value_read_across_rows_is_refused() -> None:
    # s[i] is row i's sum; reshaped to (1, 8) it broadcasts along the rows of x2: element
    # (i, j) would read row j's value, not its own, so the product is a kernel of its own
    b = Builder("cross")
    x, x2 = b.input("x", (8, 8), DT), b.input("x2", (8, 8), DT)
    s = x.sum((1,), keepdim=True).exp()
    y = x2 * b.op(Op.RESHAPE, s, shape=[1, 8])
    b.graph.set_outputs([("y", y.id)])
    fused = check_parity(b.graph)
    assert categories(fused) == ["reduction", "pointwise"]


# -- several einsums over one output tile ----------------------------------------------------------

def test_sum_of_products_is_one_matmul_kernel() -> None:
    # dx = dy W1ᵀ + dz W2ᵀ (two K sizes), then an epilogue
    b = Builder("dx")
    dy, dz = b.input("dy", (2, 9, 20), DT), b.input("dz", (2, 9, 12), DT)
    w1, w2 = b.input("w1", (16, 20), DT), b.input("w2", (16, 12), DT)
    dx = (b.einsum("btf,df->btd", dy, w1) + b.einsum("btg,dg->btd", dz, w2)).silu()
    b.graph.set_outputs([("dx", dx.id)])
    s = check_parity(b.graph)
    assert categories(s) == ["matmul"]
    assert sorted(ops(s)[0]) == ["add", "einsum", "einsum", "silu"]


def test_sibling_projections_share_one_kernel() -> None:
    # q, k, v = x Wq, x Wk, x Wv: one kernel reading x once, three outputs
    b = Builder("qkv")
    x = b.input("x", (3, 10, 16), DT)
    ws = [b.input(f"w{k}", (16, 24), DT) for k in "qkv"]
    outs = [b.einsum("btd,de->bte", x, w) for w in ws]
    b.graph.set_outputs([(f"y{k}", o.id) for k, o in zip("qkv", outs)])
    s = check_parity(b.graph)
    assert categories(s) == ["matmul"]
    assert s.kernels[0].outputs == tuple(o.id for o in outs)


def test_contractions_over_different_tiles_stay_apart() -> None:
    # same output shape, but the first operand gives the rows of one and the columns of the
    # other: no common (batch, M, N) grid
    b = Builder("tiles")
    x, w = b.input("x", (16, 16), DT), b.input("w", (16, 16), DT)
    y = b.einsum("mk,kn->mn", x, w) + b.einsum("nk,mk->mn", x, w)
    b.graph.set_outputs([("y", y.id)])
    s = check_parity(b.graph)
    assert categories(s) == ["matmul", "matmul"]


# -- a matmul's prologue ---------------------------------------------------------------------------

def test_pointwise_operand_is_computed_as_the_matmul_loads_it() -> None:
    # y = sigmoid((silu(x) * g) W): the gate is the first operand's prologue, evaluated tile by
    # tile in the K loop, never stored; the sigmoid is the epilogue: one kernel
    b = Builder("prologue")
    x, g, w = b.input("x", (2, 9, 20), DT), b.input("g", (2, 9, 20), DT), b.input("w", (20, 16), DT)
    y = b.einsum("btf,fd->btd", x.silu() * g, w).sigmoid()
    b.graph.set_outputs([("y", y.id)])
    s = check_parity(b.graph)
    assert categories(s) == ["matmul"]
    assert ops(s)[0] == ["silu", "mul", "einsum", "sigmoid"]


def test_prologues_of_both_operands_through_reshapes() -> None:
    # the second operand is read transposed ("df": its rows are N) and computed from a
    # reshaped input times a broadcast row; the first is a reshape of a computed value, and
    # one prologue value feeds two einsums of the tile
    b = Builder("prologues")
    x, s_ = b.input("x", (2, 3, 3, 20), DT), b.input("s", (20,), DT)
    w1, w2 = b.input("w1", (8, 2, 20), DT), b.input("w2", (16, 20), DT)
    h = b.op(Op.RESHAPE, x.exp(), shape=[2, 9, 20])
    wt = b.op(Op.RESHAPE, w1, shape=[16, 20]) * s_
    y = b.einsum("btf,df->btd", h, wt) + b.einsum("btf,df->btd", h, w2)
    b.graph.set_outputs([("y", y.id)])
    s = check_parity(b.graph)
    assert categories(s) == ["matmul"]


def test_a_gram_matrix_of_a_computed_value() -> None:
    # both operands are the same prologue value, read as rows and as columns
    b = Builder("gram")
    x = b.input("x", (3, 12, 10), DT)
    h = x.sigmoid()
    y = b.einsum("bik,bjk->bij", h, h)
    b.graph.set_outputs([("y", y.id)])
    assert categories(check_parity(b.graph)) == ["matmul"]


def test_an_operand_read_elsewhere_is_stored_by_its_own_kernel() -> None:
    # h is also read by the epilogue (the residual) and by another kernel's reader (an
    # output): neither can read a value that exists only tile by tile in the K loop
    for name, extra in (("residual", True), ("output", False)):
        b = Builder(name)
        x, w = b.input("x", (2, 9, 16), DT), b.input("w", (16, 16), DT)
        h = x.silu()
        y = b.einsum("btf,fd->btd", h, w)
        outs = [("y", (y + h).id)] if extra else [("y", y.id), ("h", h.id)]
        b.graph.set_outputs(outs)
        s = check_parity(b.graph)
        assert categories(s) == ["pointwise", "matmul"], name


# -- cousins -------------------------------------------------------------------------------------

def test_cousin_pointwise_kernels_merge() -> None:
    # one matmul kernel makes p and q; exp(pᵀ) and sigmoid(qᵀ) read them transposed (a view
    # of a computed value, so not in its epilogue) and share no input: one pointwise kernel.
    # (h, which the row sums read too, is stored rather than the matmul's prologue; live with
    # p and q during the matmul, it keeps the merge from raising the peak.)
    b = Builder("cousins")
    x, w1, w2 = b.input("x", (16, 64), DT), b.input("w1", (64, 16), DT), b.input("w2", (64, 16), DT)
    h = x.exp()
    p, q = b.einsum("mk,kn->mn", h, w1), b.einsum("mk,kn->mn", h, w2)
    u = b.op(Op.PERMUTE, p, perm=[1, 0]).exp()
    v = b.op(Op.PERMUTE, q, perm=[1, 0]).sigmoid()
    b.graph.set_outputs([("u", u.id), ("v", v.id), ("hs", h.sum((1,)).id)])
    s = check_parity(b.graph)
    assert categories(s) == ["reduction", "matmul", "pointwise"]
    assert sorted(ops(s)[2]) == ["exp", "permute", "permute", "sigmoid"]


# -- neighbours ------------------------------------------------------------------------------------

def test_neighbouring_kernels_of_one_kind_merge() -> None:
    # three independent pieces of work on separate inputs: two pointwise ones of one domain
    # (shapes differ, the element count is the same), two sums over one shape and axes, two
    # contractions of one tile: a launch saved each, nothing shared to save bytes on
    b = Builder("neighbours")
    a, c = b.input("a", (8, 6), DT), b.input("c", (6, 8), DT)
    r1, r2 = b.input("r1", (5, 7), DT), b.input("r2", (5, 7), DT)
    x1, x2, w = b.input("x1", (4, 16), DT), b.input("x2", (4, 16), DT), b.input("w", (16, 8), DT)
    outs = [a.exp(), c.sigmoid(), r1.sum((1,)), (r2 * r2).sum((1,)),
            b.einsum("mk,kn->mn", x1, w), b.einsum("mk,kn->mn", x2, w).silu()]
    b.graph.set_outputs([(f"y{k}", o.id) for k, o in enumerate(outs)])
    s = check_parity(b.graph)
    assert sorted(categories(s)) == ["matmul", "pointwise", "reduction"]


def test_neighbouring_reductions_over_other_axes_stay_apart() -> None:
    b = Builder("apart")
    r1, r2 = b.input("r1", (5, 7), DT), b.input("r2", (5, 7), DT)
    b.graph.set_outputs([("s1", r1.sum((1,)).id), ("s2", r2.sum((0,)).id)])
    s = check_parity(b.graph)
    assert categories(s) == ["reduction", "reduction"]
