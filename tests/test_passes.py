"""Tier (b): every pass preserves what the graph computes (float64, reference interpreter),
plus the aggregate pass's structure and its refusals."""
from __future__ import annotations

import pytest
import torch

import tests.reference as R
from tests.helpers import MEMORY_BLOCKS, BLOCKS, tiny_spec, tokens
from titanc.compiler import compile_graphs
from titanc.ir import Builder, Graph, Op, interpret, verify
from titanc.passes.aggregate import aggregate
from titanc.passes.autodiff import grad_graph
from titanc.passes.canonicalize import canonicalize


def _walk(g: Graph):
    for n in g:
        yield g, n
        if n.op is Op.SCAN:
            yield from _walk(n.attr("body"))


def _run(g: Graph, inputs: dict) -> dict:
    return interpret(g, inputs)


@pytest.mark.parametrize("block", BLOCKS)
def test_every_pass_preserves_forward_and_training(block: str) -> None:
    spec = tiny_spec(**{"model.block": block})
    params = R.init_params(spec.model, seed=4)
    inputs = {"tokens": tokens(spec, seed=5), **params}
    c = compile_graphs(spec)
    fwd_dumps = [g for name, g in c.log.dumps if g.name == "forward"]
    grad_dumps = [g for name, g in c.log.dumps if g.name == "grad"]
    assert (len(fwd_dumps), len(grad_dumps)) == (11, 8)    # hoist, split_casts, constants_per_reader,
    #                                                         views_per_reader last
    want = _run(fwd_dumps[0], inputs)["loss"]
    for g in fwd_dumps[1:]:
        assert abs(float(_run(g, inputs)["loss"] - want)) < 1e-12
    ref = _run(grad_graph(fwd_dumps[0], list(params)), inputs)
    for g in grad_dumps:
        got = _run(g, inputs)
        for k, v in ref.items():
            torch.testing.assert_close(got[k], v, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("block", ["lmm", pytest.param("mac", marks=pytest.mark.slow)])
def test_chunk_groups_hoist_their_recompute_and_keep_values(block: str) -> None:
    """Eight chunks per memory scan: split into groups (role memory_group, passes/
    checkpoint_chunks.py), whose backward re-runs the group's chunks forward from the saved
    state, an xs slice, before its reverse scan. compile.hoist_groups moves that forward scan
    out of the group loop (batched over the groups: passes/hoist.py `_Batcher._scan`), and
    every pass still computes the same loss and gradients in float64."""
    spec = tiny_spec(**{**spec_overrides(block), "compile.chunk_groups": True,
                        "compile.hoist_groups": True})
    params = R.init_params(spec.model, seed=4)
    inputs = {"tokens": tokens(spec, seed=5), **params}
    c = compile_graphs(spec)
    grad_dumps = [(name, g) for name, g in c.log.dumps if g.name == "grad"]
    ref = _run(grad_graph([g for name, g in c.log.dumps if g.name == "forward"][0],
                          list(params)), inputs)
    for name, g in grad_dumps:
        got = _run(g, inputs)
        for k, v in ref.items():
            torch.testing.assert_close(got[k], v, rtol=1e-10, atol=1e-13,
                                       msg=lambda m: f"{name}, {k}: {m}")
    final = c.graph("training").graph
    groups = [(sg, n) for sg, n in _walk(final)
              if n.op is Op.SCAN and n.attr("role") == "memory_group" and n.attr("reverse")]
    assert groups
    for _, n in groups:
        body = n.attr("body")
        carries = set(body.inputs[:n.attr("n_carry")])
        inner = [m for m in body if m.op is Op.SCAN]
        # what is left inside: the reverse chunk scan, which reads the group's cotangents
        assert inner and all(m.attr("reverse") for m in inner)
        assert all(any(i in carries or body.node(i).op is not Op.INPUT for i in m.inputs)
                   for m in inner)
    # by default the recompute stays in the group loop (the groups bound what lives at once)
    default = compile_graphs(tiny_spec(**spec_overrides(block),
                                       **{"compile.chunk_groups": True})).graph("training")
    assert any(m.op is Op.SCAN and not m.attr("reverse")
               for _, n in _walk(default.graph)
               if n.op is Op.SCAN and n.attr("role") == "memory_group" and n.attr("reverse")
               for m in n.attr("body"))


def test_the_chunk_group_size_is_the_divisor_nearest_sqrt_n_in_sqrt_n_steps() -> None:
    """`_split_factor(n)`: the divisor of n closest to sqrt(n), ties to the smaller, 1 below
    8 or for a prime; found among the divisor pairs up to sqrt(n) (it looped to n before: a
    2**36-chunk scan took hours to compile)."""
    from titanc.passes.checkpoint_chunks import _split_factor

    def brute(n: int) -> int:
        ks = [k for k in range(2, n) if n % k == 0]
        return 1 if n < 8 else min(ks, key=lambda k: (abs(k - n ** 0.5), k), default=1)

    assert [_split_factor(n) for n in range(1, 600)] == [brute(n) for n in range(1, 600)]
    assert (_split_factor(8), _split_factor(12), _split_factor(13), _split_factor(36)) == \
        (2, 3, 1, 6)
    assert _split_factor(2 ** 36) == 2 ** 18                    # at once, not 2**36 steps


def test_chunk_groups_off_saves_every_chunk_state_and_keeps_values() -> None:
    """compile.chunk_groups: false leaves eight-chunk memory scans whole (no memory_group
    scan, so the backward recomputes no chunk from a group's state): the final training
    graph computes the loss and gradients of the grouped one (float64, interpreter)."""
    def final(groups: bool):
        spec = tiny_spec(**{**spec_overrides("lmm"), "compile.chunk_groups": groups})
        return spec, compile_graphs(spec).graph("training").graph

    spec, grouped = final(True)
    _, whole = final(False)
    roles = lambda g: {n.attr("role") for _, n in _walk(g) if n.op is Op.SCAN}  # noqa: E731
    assert "memory_group" in roles(grouped)
    assert "memory_group" not in roles(whole) and "memory" in roles(whole)
    inputs = {"tokens": tokens(spec, seed=5), **R.init_params(spec.model, seed=4)}
    want, got = _run(grouped, inputs), _run(whole, inputs)
    assert set(want) == set(got)
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=1e-10, atol=1e-13, msg=lambda m: f"{k}: {m}")


def test_hoist_gates_moves_the_chunk_scans_gates_out_and_keeps_values() -> None:
    """compile.hoist_gates: a forward chunk scan's carry-independent work (its gates'
    cumulative decay and each token's gradient weight: cumsums, exps, sums) runs before the
    scan for every chunk at once, though it holds no einsum; the training graph computes the
    same loss and gradients (float64, interpreter)."""
    def final(hoist: bool):
        spec = tiny_spec(**{**spec_overrides("lmm"), "compile.hoist_gates": hoist})
        return spec, compile_graphs(spec).graph("training").graph

    def cumsums_in_forward_chunk_scans(g: Graph) -> int:
        return sum(m.op is Op.CUMSUM for _, n in _walk(g)
                   if n.op is Op.SCAN and n.attr("role") == "memory" and not n.attr("reverse")
                   for m in n.attr("body"))

    spec, kept = final(False)
    _, hoisted = final(True)
    assert cumsums_in_forward_chunk_scans(kept) > 0
    assert cumsums_in_forward_chunk_scans(hoisted) == 0
    inputs = {"tokens": tokens(spec, seed=5), **R.init_params(spec.model, seed=4)}
    want, got = _run(kept, inputs), _run(hoisted, inputs)
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=1e-10, atol=1e-13, msg=lambda m: f"{k}: {m}")


def spec_overrides(block: str) -> dict:
    """Eight memory chunks per scan (chunk groups of two with `compile.chunk_groups`)."""
    return {"model.block": block, "model.seq_len": 32, "model.attention.segment": 32,
            "model.attention.window": 32}


def _has_per_token_update(g: Graph) -> list[str]:
    """Values with a chunk-position axis together with both axes of a memory weight matrix."""
    bad = []
    for gr, n in _walk(g):
        t = n.type
        if gr.name.startswith("memory_chunk") and not isinstance(t, tuple) and t.rank >= 5:
            bad.append(f"{gr.name} %{n.id} {n.op.name} {t}")
    return bad


@pytest.mark.parametrize("block", MEMORY_BLOCKS)
def test_no_per_token_outer_products_after_pipeline(block: str) -> None:
    spec = tiny_spec(**{"model.block": block})
    c = compile_graphs(spec)
    direct = [g for name, g in c.log.dumps if name == "frontend_forward"][0]
    assert _has_per_token_update(direct)            # the frontend emits the direct form
    assert _has_per_token_update(c.forward) == []
    assert _has_per_token_update(c.grad) == []


def test_aggregate_folds_weights_into_a_contraction() -> None:
    b = Builder("agg")
    a = b.input("a", (2, 5, 3), "f64")
    x = b.input("x", (2, 5, 4), "f64")
    w = b.input("w", (2, 5), "f64")
    outer = b.einsum("buo,bui->buoi", a, x)
    s = (outer * w.reshape(2, 5, 1, 1)).sum((1,))
    b.graph.set_outputs([("s", s.id)])
    g = aggregate(verify(b.graph))
    ops = [n.op for n in g]
    assert Op.EINSUM in ops and max(n.type.rank for n in g) == 3
    einsums = [n.attr("spec") for n in g if n.op is Op.EINSUM]
    assert einsums == ["buo,bui->boi"]
    vals = {k: torch.randn(*t, dtype=torch.float64) for k, t in
            {"a": (2, 5, 3), "x": (2, 5, 4), "w": (2, 5)}.items()}
    torch.testing.assert_close(interpret(g, vals)["s"], interpret(b.graph, vals)["s"])


def test_aggregate_refuses_when_outer_product_is_used_unsummed() -> None:
    b = Builder("agg")
    a, x, w = b.input("a", (2, 5, 3), "f64"), b.input("x", (2, 5, 4), "f64"), b.input("w", (2, 5), "f64")
    outer = b.einsum("buo,bui->buoi", a, x)
    s = (outer * w.reshape(2, 5, 1, 1)).sum((1,))
    b.graph.set_outputs([("s", s.id), ("outer", outer.id)])
    g = aggregate(b.graph)
    assert [n.attr("spec") for n in g if n.op is Op.EINSUM] == ["buo,bui->buoi"]


def test_aggregate_refuses_weights_that_are_not_per_position() -> None:
    b = Builder("agg")
    a, x = b.input("a", (2, 5, 3), "f64"), b.input("x", (2, 5, 4), "f64")
    w = b.input("w", (2, 5, 3), "f64")             # varies along o: not a per-position scalar
    outer = b.einsum("buo,bui->buoi", a, x)
    s = (outer * w.reshape(2, 5, 3, 1)).sum((1,))
    b.graph.set_outputs([("s", s.id)])
    g = aggregate(b.graph)
    assert any(n.op is Op.EINSUM and n.attr("spec") == "buo,bui->buoi" for n in g)


def test_canonicalize_rules() -> None:
    b = Builder("c")
    x = b.input("x", (3, 3), "f64")
    y = ((x * 1.0 + 0.0) * (b.full(2.0, (), "f64") * 3.0)).permute(1, 0).permute(1, 0)
    z = -(-y) + x.permute(1, 0)                    # a transpose of equal axes must survive
    dup = (x * 1.0 + 0.0) * (b.full(2.0, (), "f64") * 3.0)
    b.graph.set_outputs([("z", z.id), ("dup", dup.id)])
    g = canonicalize(b.graph)
    ops = sorted(n.op.name for n in g)
    assert ops == ["ADD", "FULL", "INPUT", "MUL", "PERMUTE"]
    x_val = torch.randn(3, 3, dtype=torch.float64)
    out = interpret(g, {"x": x_val})
    torch.testing.assert_close(out["z"], 6 * x_val + x_val.T)


def test_the_end_of_a_cumsum_is_its_total() -> None:
    """slice(cumsum(x, a), the last position along a) -> sum(x, a, keepdim) (a reverse
    cumsum: its first position); another position, or another axis, stays a slice."""
    b = Builder("c")
    x = b.input("x", (2, 5), "f64")
    last = x.cumsum(1).slice(1, 4, 5)
    first_rev = x.cumsum(1, reverse=True).slice(1, 0, 1)
    middle = x.cumsum(1).slice(1, 2, 3)
    b.graph.set_outputs([("last", last.id), ("first_rev", first_rev.id), ("middle", middle.id)])
    g = canonicalize(b.graph)
    ops = [g.node(v).op.name for _, v in g.outputs]
    assert ops[:2] == ["SUM", "SUM"] and ops[2] == "SLICE"
    x_val = torch.randn(2, 5, dtype=torch.float64)
    out = interpret(g, {"x": x_val})
    torch.testing.assert_close(out["last"], x_val.sum(1, keepdim=True))
    torch.testing.assert_close(out["first_rev"], x_val.sum(1, keepdim=True))
    torch.testing.assert_close(out["middle"], x_val.cumsum(1)[:, 2:3])


def test_chunked_loss_keeps_outputs_that_follow_the_loss() -> None:
    """An output computed from the loss survives the rewrite with the same value."""
    from titanc.passes.chunked_loss import ChunkedLoss

    b = Builder("forward")
    h = b.input("h", (2, 4, 3), "f64")
    head = b.input("head", (5, 3), "f64")
    t = b.input("t", (2, 4), "i64")
    logits = b.einsum("btd,vd->btv", h, head)
    mx = logits.amax((-1,), keepdim=True)
    lse = (logits - mx).exp().sum((-1,)).log() + mx.reshape(2, 4)
    loss = (lse - b.take_along(logits, t)).sum((0, 1)) * (1.0 / 8)
    b.graph.set_outputs([("loss", loss.id), ("twice", (loss * 2.0).id)])
    g = ChunkedLoss(2)(b.graph)
    assert [n for n, _ in g.outputs] == ["loss", "twice"]
    assert any(n.op is Op.SCAN for n in g)
    gen = torch.Generator().manual_seed(0)
    ins = {"h": torch.randn(2, 4, 3, generator=gen, dtype=torch.float64),
           "head": torch.randn(5, 3, generator=gen, dtype=torch.float64),
           "t": torch.randint(0, 5, (2, 4), generator=gen)}
    want, got = _run(b.graph, ins), _run(g, ins)
    for k in ("loss", "twice"):
        assert abs(float(got[k] - want[k])) < 1e-12


def _reads_in_forward_chunk_scans(g: Graph) -> int:
    """Einsums in the bodies of the forward memory-chunk scans of `g`."""
    return sum(m.op is Op.EINSUM for _, n in _walk(g)
               if n.op is Op.SCAN and n.attr("role") == "memory" and not n.attr("reverse")
               for m in n.attr("body"))


@pytest.mark.parametrize("block", ["lmm", "mac", pytest.param("mal", marks=pytest.mark.slow),
                                   pytest.param("mag", marks=pytest.mark.slow)])
def test_sunk_reads_run_after_the_chunk_scan_and_keep_values(block: str) -> None:
    """compile.sink_reads: a forward chunk scan's reads (the queries through the memory at each
    chunk's start state) run after it, for every chunk at once from the stacked start states;
    the scans keep only the write's einsums, and the training graph computes the same loss
    and gradients (float64, interpreter). `auto` leaves tiny states in the loop. A start
    state the backward's checkpoint also stacks is one output, read by one ITEM (two ITEMs of
    one element: the buffer plan fills one of them, the other read stale memory), in every
    scan: a MAC segment stacks the memory state for its backward and for its chunks' reads."""
    def final(sink: str):
        spec = tiny_spec(**{**spec_overrides(block), "compile.sink_reads": sink})
        return spec, compile_graphs(spec).graph("training").graph

    spec, kept = final("never")
    _, sunk = final("always")
    _, auto = final("auto")
    assert _reads_in_forward_chunk_scans(sunk) < _reads_in_forward_chunk_scans(kept)
    assert _reads_in_forward_chunk_scans(auto) == _reads_in_forward_chunk_scans(kept)
    def repeated(g: Graph) -> list[str]:
        """The scans of `g` that stack one value (or one cast of it) twice."""
        out = []
        for _, n in _walk(g):
            if n.op is Op.SCAN:
                body = n.attr("body")
                ys = [v for _, v in body.outputs[n.attr("n_carry"):]]
                keys = [(body.node(v).op, body.node(v).inputs) if body.node(v).op is Op.CAST
                        else v for v in ys]
                if len(set(keys)) < len(keys):
                    out.append(n.attr("role"))
        return out

    assert repeated(sunk) == []    # a start state the backward also saves is stacked once
    inputs = {"tokens": tokens(spec, seed=5), **R.init_params(spec.model, seed=4)}
    want, got = _run(kept, inputs), _run(sunk, inputs)
    graphs = {"sunk": got}
    if block == "mac":             # compile.stack_once: false, a segment stacks it per user
        twice = compile_graphs(tiny_spec(**{**spec_overrides(block), "compile.sink_reads":
                                            "always", "compile.stack_once": False}))
        assert repeated(twice.graph("training").graph) == ["segment"]
        graphs["stacked per user"] = _run(twice.graph("training").graph, inputs)
    for name, got in graphs.items():
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, rtol=1e-10, atol=1e-13,
                                       msg=lambda m: f"{name} {k}: {m}")


def test_a_widened_checkpoint_is_read_narrow_by_the_chunk_backward() -> None:
    """Mixed precision stores the memory's chunk checkpoints in bf16 and the chunk backward
    widens them: the widening stays in the backward's body (a conversion on load), so no
    kernel writes a float32 copy of every chunk's checkpoint (large_125m: 43.5 GB a step)."""
    spec = tiny_spec(**{**spec_overrides("lmm"), "train.dtype": "bfloat16"})
    g = compile_graphs(spec).graph("training").graph
    widened = [n for gg, n in _walk(g) if n.op is Op.CAST and n.type.dtype == "f32"
               and gg.node(n.inputs[0]).op is Op.ITEM
               and gg.node(gg.node(n.inputs[0]).inputs[0]).attr("role", "") == "memory"]
    assert not widened


@pytest.mark.parametrize("block", ["lmm", "mac"])
def test_views_one_kernel_would_write_for_another_are_copied_into_their_readers(
        block: str) -> None:
    """views_per_reader: fused without it, the training graph has kernels writing views of
    stored values (the depthwise conv's shifted slices, head layouts) for readers in other
    kernels; with it nearly none do (the second fusion may pair a copy otherwise), and the
    kernels move fewer bytes. Its values: `test_every_pass_preserves_forward_and_training`."""
    from titanc.passes.fusion import fuse
    from titanc.passes.views_per_reader import KEPT_BODIES, written_views

    def schedules(s):
        yield s
        for k in s.kernels:
            for nid in k.nodes:
                if nid in s.bodies and s.graph.node(nid).attr("role", "loop") not in KEPT_BODIES:
                    yield from schedules(s.bodies[nid])

    c = compile_graphs(tiny_spec(**{"model.block": block}))
    dumps = [(name, g) for name, g in c.log.dumps if g.name == "grad"]
    assert dumps[-1][0] == "views_per_reader_grad"
    trial, final = fuse(dumps[-2][1]), c.graph("training").schedule
    before = sum(len(written_views(s)) for s in schedules(trial))
    after = sum(len(written_views(s)) for s in schedules(final))
    assert before >= 20 and after * 10 < before, (before, after)
    assert sum(k.bytes for k in final.all_kernels()) < sum(k.bytes for k in trial.all_kernels())
