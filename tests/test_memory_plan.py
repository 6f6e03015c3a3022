"""Tier (c) for the static buffer plan: the placement unit on synthetic buffer lists (greedy's
worst case included), the plan's invariants and ratios on every example graph, a golden map,
and an executor that runs a schedule inside its planned arena (filled with NaN garbage) and
must reproduce the reference interpreter."""
from __future__ import annotations

import random
import time
from typing import Callable

import pytest
import torch

from tests.helpers import tiny_spec, tokens
from tests.test_fusion import EXAMPLES, TINY_EXAMPLES, example_graphs, example_schedules
from titanc.compiler import compile_graphs
from titanc.ir import Builder, Graph, Interpreter, Op, verify
from titanc.ir.types import DTYPES, TensorType
from titanc.model.params import init_params
from titanc.passes.fusion import fuse
from titanc.ir.tables import mask_table, rope_table
from titanc.ir.buffer_plan import view_of, OUTPUT_PREFIX, BufferPlan, ScanHomes
from titanc.passes.buffer_plan import (ORDERS, lower_bound, buffer_report, overlaps, place, place_in_order,
                                       plan_buffers)
from titanc.model.spec import load_spec

Tensor = torch.Tensor


# -- synthetic buffer lists ----------------------------------------------------------------------

def test_disjoint_lifetimes_share_one_address() -> None:
    bufs = [(64, 0, 0), (128, 1, 1), (64, 2, 3)]
    offsets, arena = place(bufs, "size")
    assert offsets == [0, 0, 0] and arena == 128 == lower_bound(bufs)


def test_overlapping_lifetimes_stack_largest_first() -> None:
    bufs = [(64, 0, 3), (256, 1, 2), (128, 2, 5)]
    offsets, arena = place(bufs, "size")
    assert offsets == [384, 0, 256] and arena == 448 == lower_bound(bufs)


def test_smallest_fitting_gap_wins() -> None:
    bufs = [(4, 0, 9), (3, 0, 0), (2, 0, 9), (2, 0, 0), (2, 0, 9),   # leave gaps of 3 and 2
            (2, 1, 9), (3, 1, 9)]
    offsets, arena = place_in_order(bufs, range(len(bufs)))
    assert offsets[:5] == [0, 4, 7, 9, 11]
    assert offsets[5] == 9           # the 2-byte gap at 9, not the 3-byte gap at 4
    assert offsets[6] == 4           # the 3-byte gap is left for the 3-byte buffer
    assert arena == 13


def test_greedy_by_size_worst_case() -> None:
    # Two big short-lived buffers A (t=0) and C (t=3) and two small long-lived ones B (t=0..2)
    # and D (t=2..3) that overlap each other at t=2. Largest first puts A and C both at 0;
    # then B must sit above A and D above both C and B: 3 + 2 + 2 = 7. Optimal: B at 0, A at
    # 2, C at 0, D at 3 (B is dead by t=3): 5, the lower bound. Ratio 7/5.
    bufs = [(3, 0, 0), (2, 0, 2), (3, 3, 3), (2, 2, 3)]
    assert lower_bound(bufs) == 5
    offsets, arena = place(bufs, "size")
    assert (offsets, arena) == ([0, 3, 0, 5], 7)
    assert arena / lower_bound(bufs) == pytest.approx(1.4)
    offsets, arena = place(bufs)             # trying other orders recovers the optimum
    assert arena == 5 and not overlaps(bufs, offsets)


def test_random_lists_never_overlap() -> None:
    rng = random.Random(0)
    for _ in range(200):
        bufs = []
        for _ in range(rng.randint(1, 25)):
            a = rng.randint(0, 12)
            bufs.append((rng.choice([0, 64, 128, 192, 1024]), a, rng.randint(a, 12)))
        for strategy in list(ORDERS) + ["best"]:
            offsets, arena = place(bufs, strategy)
            assert not overlaps(bufs, offsets)
            assert arena >= lower_bound(bufs)
            assert arena >= max((o + s for o, (s, _, _) in zip(offsets, bufs)), default=0)


# -- a small graph: golden map -------------------------------------------------------------------

def small_scan_graph() -> Graph:
    b = Builder("small")
    tok = b.input("tokens", (2, 5), "i64")
    emb, w = b.input("embed", (10, 8), "f32"), b.input("w", (8, 8), "f32")
    x = b.take(emb, tok.slice(1, 0, 4))                          # (2, 4, 8)

    def body(bb, c, xt, k):
        h = (bb.matmul(c[0], k[0]) + xt[0]).silu()                # (2, 8)
        return [h], [h.sum((1,))]

    (c,), (ys,) = b.scan(body, [b.full(0.0, (2, 8), "f32")], [x.permute(1, 0, 2)], [w],
                         name="rnn")
    flat = b.einsum("bd,vd->bv", c, emb).reshape(20)             # logits (2, 10), flattened
    loss = flat.exp().sum((0,)) + ys.sum((0, 1))
    b.graph.set_outputs([("loss", loss.id), ("flat", flat.id), ("state", c.reshape(16).id)])
    return verify(b.graph)


GOLDEN = """\
buffer plan small: 8 kernels, arena 448 B, lower bound 448 B (ratio 1.000)
  peak activation 448 B, persistent 576 B, alignment 64
  persistent region:
          offset         size  name
               0          320  embed
             320          256  w
  activation arena:
    buffer           offset         size  live        kernel
    %4                    0          256  [0,3]       titanc_poi_fused_take_0  f32[2,4,8]
    %0                  256          128  [0,0]       input:tokens  i64[2,5]
    ws %7               256           64  [3,3]       titanc_tem_fused_scan_rnn_3
      carry state: +0:64, +64:0
      buffer plan rnn: 2 kernels, arena 0 B, lower bound 0 B (ratio 1.000)
        peak activation 0 B, persistent 0 B, alignment 64
        bound by the scan (inputs; outputs as out:NAME): %0=c0, %1=x1, %2=k2, %5=out:carry0, %6=out:y0
        activation arena:
          buffer           offset         size  live        kernel
    %9                  320           64  [3,5]       titanc_tem_fused_scan_rnn_3  f32[4,2]
    %8                  384           64  [3,7]       titanc_tem_fused_scan_rnn_3  f32[2,8]
    %11                   0          128  [4,7]       titanc_mm_fused_einsum_6  f32[20]
    %14                 128           64  [5,6]       titanc_red_fused_sum_7  f32[]
    %15                 192           64  [6,7]       titanc_red_fused_exp_sum_add_8  f32[]
  aliases (reshapes sharing their source's storage; views of a stored value or a constant):
    %5 -> constant full
    %6 -> %4 via permute
    %16 -> %8
"""


def test_memory_map_golden() -> None:
    plan = plan_buffers(fuse(small_scan_graph()), {"embed", "w"})
    assert plan.to_text() == GOLDEN
    assert plan.is_noop(7) and not plan.is_noop(6)        # the lone reshape writes nothing
    # the constant fill (a scan carry) and the permute (its xs) are views: no kernel runs
    assert plan.is_noop(1) and plan.is_noop(2)
    assert plan.views == {5: (5, ()), 6: (4, (6,))} and plan.constants == {5}
    assert plan.location(16) == plan.location(8) == ("arena", 384)
    # the carry's ITEM %8 is one of its two slots (the last iteration's parity): one slot left
    assert [size for _, size in plan.carry_state[7]] == [64, 0]
    assert plan.location(2) == ("persistent", 320)
    assert buffer_report(plan, 10) == {
        "arena_bytes": 448, "lower_bound_bytes": 448, "persistent_bytes": 576,
        "peak_activation_bytes": 448, "logits_bytes": 80}   # the flattened [2, 10] logits


# -- an executor over the planned arena ----------------------------------------------------------

def _view(mem: Tensor, offset: int, t: TensorType) -> Tensor:
    return mem[offset:offset + t.nbytes].view(DTYPES[t.dtype]).view(t.shape)


def _constant(n) -> Tensor:  # type: ignore[no-untyped-def]
    """A generator root's value (FULL, ROPE or MASK), as the executors make it at bind time."""
    a, dt = n.attr_dict, DTYPES[n.type.dtype]
    if n.op is Op.FULL:
        return torch.tensor(a["value"], dtype=dt).expand(n.type.shape)
    if n.op is Op.ROPE:
        return rope_table(a["kind"], a["start"], a["count"], a["half"], a["base"], dt)
    return mask_table(a["n_q"], a["q_start"], a["groups"], dt)


def _locator(plan: BufferPlan, mem: Tensor, pers: Tensor,
             ext: dict[str, Tensor]) -> Callable[[int], Tensor]:
    g = plan.schedule.graph

    def where(v: int) -> Tensor:
        if v in plan.views:                  # a strided view of its root, or of a constant
            root, chain = plan.views[v]
            n = g.node(root)
            t = (_constant(n) if plan.is_constant_root(root) else where(root))
            for c in chain:
                t = view_of(t, g.node(c))
            return t
        kind, loc = plan.location(v)
        t = g.node(v).type
        if kind == "arena":
            return _view(mem, loc, t)
        if kind == "persistent":
            return _view(pers, loc, t)
        return ext[loc].reshape(t.shape)
    return where


def _execute(plan: BufferPlan, mem: Tensor, pers: Tensor, ext: dict[str, Tensor],
             interp: Interpreter) -> Callable[[int], Tensor]:
    """Run the schedule kernel by kernel: each reads only its inputs' storage (or inlines an
    immediate) and writes only its outputs'; scans loop over their body's plan inside their
    workspace."""
    g = plan.schedule.graph
    where = _locator(plan, mem, pers, ext)
    ws = {b.value: b for b in plan.buffers if b.kind == "workspace"}
    for k, kern in enumerate(plan.schedule.kernels):
        if plan.is_noop(k):
            continue
        env = {v: where(v) for v in kern.inputs}
        for nid in kern.nodes:
            node = g.node(nid)
            if node.op is Op.ITEM and g.node(node.inputs[0]).op is Op.SCAN:
                continue                  # the scan writes its ITEMs' buffers itself
            args = [env[i] if i in env else
                    torch.tensor(g.node(i).attr("value"), dtype=DTYPES[g.node(i).type.dtype])
                    for i in node.inputs]
            if node.op is Op.SCAN:
                items = {g.node(i).attr("index"): where(i) for i in kern.outputs}
                _scan(plan, node, args, mem[ws[nid].offset:ws[nid].offset + ws[nid].size],
                      items, interp)
            else:
                env[nid] = interp._eval(node, args)
        for v in kern.outputs:
            if v in env and v not in plan.aliases:
                where(v).copy_(env[v])
    return where


def _scan(plan: BufferPlan, node, args: list[Tensor], region: Tensor,
          items: dict[int, Tensor], interp: Interpreter) -> None:
    """Two carry slot sets at the start of the workspace, the body's arena after them.
    Iteration i reads the operands (i = 0) or the set iteration i-1 wrote, and writes its
    carries into set i % 2 (the last iteration into the carries' ITEM buffers, and so do the
    iterations of its parity where the ITEM is read; a carry saved for the backward into its
    stacked buffer: `ScanHomes`) and its ys straight into their stacked ITEM buffers; outputs
    the body cannot write in place are copied there."""
    a = node.attr_dict
    body, nc, nx_, length = a["body"], a["n_carry"], a["n_xs"], a["length"]
    sub = plan.bodies[node.id]
    state = plan.carry_state[node.id]
    sets = [[_view(region, off, t) if size else None
             for (off, size), t in zip(state[s * nc:(s + 1) * nc], node.type)] for s in (0, 1)]
    names = body.input_names()
    body_mem = region[plan.workspace_body_offset(node.id):]
    steps = range(length - 1, -1, -1) if a["reverse"] else range(length)
    carry = args[:nc]
    layout = plan.scan_homes(node.id, items)
    for i, t in enumerate(steps):
        homes = [ScanHomes.resolve(h, args, sets, items, lambda k: torch.empty(
                 body.node(body.outputs[k][1]).type.shape,
                 dtype=DTYPES[body.node(body.outputs[k][1]).type.dtype]))
                 for h in layout.homes(i)]
        ext = dict(zip(names, carry + [x[t] for x in args[nc:nc + nx_]] + args[nc + nx_:]))
        ext.update({OUTPUT_PREFIX + name: h for (name, _), h in zip(body.outputs, homes)})
        where = _execute(sub, body_mem, torch.empty(0), ext, interp)
        for k, ((_, v), home) in enumerate(zip(body.outputs, homes)):
            if not sub.direct_output(k):
                home.copy_(where(v))
        carry = homes[:nc]


def run_planned(plan: BufferPlan, inputs: dict[str, Tensor]) -> dict[str, Tensor]:
    g = plan.schedule.graph
    mem = torch.full((plan.arena_bytes,), 0xFF, dtype=torch.uint8)     # f32/f64 NaN garbage
    pers = torch.full((plan.persistent_bytes,), 0xFF, dtype=torch.uint8)
    where = _locator(plan, mem, pers, {})
    for i in g.inputs:
        where(i).copy_(inputs[g.node(i).attr("name")])
    where = _execute(plan, mem, pers, {}, Interpreter())
    return {name: where(v).clone() for name, v in g.outputs}


def test_executor_in_the_arena_matches_the_interpreter_small() -> None:
    g = small_scan_graph()
    gen = torch.Generator().manual_seed(0)
    inputs = {"tokens": torch.randint(0, 10, (2, 5), generator=gen),
              "embed": torch.randn(10, 8, generator=gen), "w": torch.randn(8, 8, generator=gen)}
    got = run_planned(plan_buffers(fuse(g), {"embed", "w"}), inputs)
    want = Interpreter()(g, inputs)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-6)


def test_executor_in_the_arena_matches_the_interpreter() -> None:
    # the pipeline's training graph of a tiny float64 MAC model: layer scan (2 iterations)
    # around a segment scan around a memory-chunk scan (2 iterations), chunked loss
    spec = tiny_spec(**{"model.block": "mac", "model.seq_len": 8})
    c = compile_graphs(spec, verify_each=False)
    names = [p.name for p in c.params]
    inputs = {"tokens": tokens(spec), **init_params(spec.model, 0, torch.float64)}
    plan = plan_buffers(fuse(c.grad), set(names) | {f"grad.{n}" for n in names})
    got = run_planned(plan, inputs)
    want = Interpreter()(c.grad, inputs)
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-12)


# -- the example graphs --------------------------------------------------------------------------

def _check_plan(plan: BufferPlan) -> None:
    bufs = [(b.size, b.first, b.last) for b in plan.buffers]
    assert not overlaps(bufs, [b.offset for b in plan.buffers])        # all pairs
    assert all(b.offset % plan.alignment == 0 == b.size % plan.alignment for b in plan.buffers)
    assert all(b.offset + b.size <= plan.arena_bytes for b in plan.buffers)
    assert plan.lower_bound_bytes <= plan.peak_activation_bytes <= plan.arena_bytes
    for sub in plan.bodies.values():
        _check_plan(sub)


@pytest.mark.parametrize("name", TINY_EXAMPLES)
def test_example_plans_are_valid_and_tight(name: str) -> None:
    spec = load_spec(EXAMPLES / name)
    for g, s in zip(example_graphs(name), example_schedules(name)):
        params = [n for n in g.input_names() if n != "tokens"]
        plan = plan_buffers(s, set(params) | {f"grad.{p}" for p in params})
        _check_plan(plan)
        report = buffer_report(plan, spec.model.vocab_size)
        ratio = report["arena_bytes"] / report["lower_bound_bytes"]
        print(f"{name} {g.name}: kernels {len(s.all_kernels())} arena/lower_bound {ratio:.4f} "
              f"{report}")
        assert ratio < 1.10
        B, T, V = spec.train.batch_size, spec.model.seq_len, spec.model.vocab_size
        assert report["logits_bytes"] == 0      # the fused loss: logits tiles stay in its kernel
        assert report["persistent_bytes"] >= sum(
            g.node(i).type.nbytes for i in g.inputs if g.node(i).attr("name") in params)


@pytest.mark.slow
def test_large_example_plans_in_seconds() -> None:
    c = compile_graphs(load_spec(EXAMPLES / "large_125m.yaml"), verify_each=False)
    t0 = time.perf_counter()
    s = fuse(c.grad)
    t1 = time.perf_counter()
    plan = plan_buffers(s, {p.name for p in c.params} | {f"grad.{p.name}" for p in c.params})
    t2 = time.perf_counter()
    print(f"large_125m grad: fuse {t1 - t0:.2f}s plan {t2 - t1:.3f}s ratio {plan.ratio:.4f} "
          f"{buffer_report(plan, 256)}")
    assert t2 - t1 < 5.0 and t1 - t0 < 30.0
    _check_plan(plan)


# -- carries written over their operand --------------------------------------------------------

def _carry_scan(body_fn: Callable, length: int = 3) -> tuple[Graph, int]:
    """x0 = exp(x) (a plain arena value read only by the scan) carried through `length`
    iterations of `body_fn`; the result's sum is the output."""
    b = Builder("carry")
    x, w = b.input("x", (4, 8), "f64"), b.input("w", (8, 8), "f64")
    x0 = x.exp()
    (c,), _ = b.scan(body_fn, [x0], [b.full(1.0, (length, 4, 8), "f64")], [w], name="step")
    b.graph.set_outputs([("out", c.sum((0, 1)).id)])
    g = verify(b.graph)
    return g, next(n.id for n in g if n.op is Op.SCAN)


def test_a_carry_read_before_its_next_value_is_written_is_updated_in_place() -> None:
    """Every kernel reading the carry runs before the kernel writing the next value (a matmul
    reads c, a second matmul reads only the first's result): every iteration writes the
    operand's storage, no carry slot; executing the plan in its arena gives the interpreter's
    result. Where the kernel writing the next value reads the carry too (c * x), the carry is
    lent (slot B) but not updated in place."""
    def late(bb, c, xt, k):
        return [bb.matmul(bb.matmul(c[0], k[0]).silu(), k[0]) + xt[0]], []

    def same(bb, c, xt, k):
        return [c[0] * xt[0] + 1.0], []

    gen = torch.Generator().manual_seed(3)
    inputs = {"x": torch.randn(4, 8, generator=gen, dtype=torch.float64),
              "w": torch.randn(8, 8, generator=gen, dtype=torch.float64) / 3}
    for fn, in_place in ((late, True), (same, False)):
        g, sid = _carry_scan(fn)
        plan = plan_buffers(fuse(g), {"w"})
        assert 0 in plan.lent[sid]
        assert (0 in plan.in_place[sid]) is in_place, fn.__name__
        if in_place:
            assert all(size == 0 for _, size in plan.carry_state[sid])
        got, want = run_planned(plan, inputs), Interpreter()(g, inputs)
        torch.testing.assert_close(got["out"], want["out"], rtol=1e-12, atol=1e-12)


def test_a_scan_whose_only_result_takes_its_operand_buffer_still_runs() -> None:
    """2 layers (an even scan): the forward plan's layer result shares the embedding gather's
    buffer (`_carry_in_place`); the scan's kernel, all of whose outputs are then aliased, is
    not a no-op (it was skipped once: the loss was the unembedded gather's)."""
    from titanc.runtime.targets.executor import ArenaExecutor
    import tests.reference as R
    spec = tiny_spec(**{"model.block": "attn", "model.n_layers": 2})
    c = compile_graphs(spec)
    plan = c.plans["forward"]
    g = plan.schedule.graph
    (scan,) = [n for n in g if n.op is Op.SCAN and n.attr("role") == "layer"]
    k = next(i for i, kern in enumerate(plan.schedule.kernels) if scan.id in kern.nodes)
    items = [u for u in g.users(scan.id) if u in plan.aliases]
    assert items and not plan.is_noop(k)
    inputs = {"tokens": tokens(spec), **R.init_params(spec.model, seed=0)}
    want = Interpreter()(c.graphs["forward"].graph, inputs)["loss"]
    got = ArenaExecutor(plan).run(inputs)["loss"]
    assert abs(float(got) - float(want)) < 1e-10
