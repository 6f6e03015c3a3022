"""One Triton kernel per scan (`codegen/scan/kernel.py`), under TRITON_INTERPRET=1 on tiny shapes.

- parity (tier e): every memory-chunk scan of a training graph (forward, checkpoint and
  reverse/backward scans), rendered as one kernel and run on random operands, equals the
  reference interpreter's scan: every block kind with a memory, memory depth 1 and 2, chunk
  sizes 1, interior and the whole sequence; float32 within 1e-5 relative (to the output's
  largest entry), float64 within 1e-10; a nested scan (MAC segment, the chunk scan inside)
  too; one whole training step on the triton target equals the cpu target in float64
  (loss and updated parameters within 1e-10);
- structure (tier c): the memory-chunk scan is one kernel whose grid is batch x memory heads;
  launches per training step are the same for seq_len 128 and 512 (lmm; chunk size fixed),
  and the executor's count equals the one computed from the plan;
- carries on chip: the memory-chunk loop holds W and S as loop-carried register tiles (no
  workspace slots), a loop that nests a scan or a carry over the budget stays in the
  workspace with the reason; a hand-built scan whose carries are read by every kind of stage
  (whole-tile einsum operands, plain and transposed, pointwise, reductions, a scalar carry,
  and a reshape that cannot read the tile) matches the interpreter with the register budget
  and without it, and says which carry stays in the workspace and why;
- the form rule (`scan_form`): chunk recurrences are kernels, layer and segment scans host
  loops; the reason is reported (executor `fallbacks`, TITANC_DEBUG=2, report.json
  `scan_forms`);
- validity: a scan kernel compiles for sm_90 without a GPU.

The float32 training step of every block kind on the triton target (which now runs these
kernels) is tests/test_codegen.py::test_training_step_matches_cpu_target.
"""

from __future__ import annotations

import os
import subprocess
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")  # read when kernels are decorated: set first

import json
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from tests.helpers import one_step_on_both_targets
from titanc.codegen.group import groupable
from titanc.codegen.lowered import lower
from titanc.codegen.meta import ROUNDS_PER_LAUNCH
from titanc.codegen.render import load_module
from titanc.codegen.scan.kernel import ScanFallback, ScanKernel, render_scan
from titanc.compiler import compile_graphs
from titanc.ir import Interpreter, Op
from titanc.ir.structural import scan_ref
from titanc.ir.tables import mask_table, rope_table
from titanc.ir.schedule import is_immediate
from titanc.runtime.targets.triton_executor import TritonExecutor, count_launches
from titanc.model.spec import load_spec
from titanc import config

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning",
                                        "ignore:invalid value encountered:RuntimeWarning",
                                        "ignore:overflow encountered:RuntimeWarning")

ROOT = Path(__file__).resolve().parent.parent
SMALL = {"model.d_model": 8, "model.n_layers": 1, "model.seq_len": 8, "model.vocab_size": 16,
         "model.ffn_hidden": 8, "train.batch_size": 1, "model.memory.heads": 2,
         "model.memory.chunk_size": 2, "model.attention.heads": 2,
         "model.attention.segment": 4, "model.attention.window": 4,
         "model.attention.persistent_tokens": 2}
TOL = {torch.float32: 1e-5, torch.float64: 1e-10}


def _spec(example: str, **extra: object):
    return load_spec(ROOT / "examples" / f"{example}.yaml", {**SMALL, **extra})


def _scans(plan, body_prefix: str = "", seen: set | None = None):
    """(graph, scan node) of every scan in a plan and its bodies whose body graph's name
    starts with `body_prefix`, one per (body name, direction, length)."""
    seen = set() if seen is None else seen
    g = plan.schedule.graph
    for k in plan.schedule.kernels:
        for nid in k.nodes:
            n = g.node(nid)
            if n.op is Op.SCAN:
                key = (n.attr("body").name, n.attr("reverse"), n.attr("length"))
                if n.attr("body").name.startswith(body_prefix) and key not in seen:
                    seen.add(key)
                    yield g, n
                yield from _scans(plan.bodies[nid], body_prefix, seen)


def _tables(sk: ScanKernel, dt: torch.dtype) -> list[torch.Tensor]:
    return [mask_table(a["n_q"], a["q_start"], a["groups"], dt) if op == "MASK" else
            rope_table(a["kind"], a["start"], a["count"], a["half"], a["base"], dt)
            for op, a in sk.tables]


def check_scan(g, n, dt: torch.dtype, seed: int = 0, carry_budget: int | None = None
               ) -> ScanKernel:
    """Render scan `n` of `g`, run it on random operands, compare every output with the
    reference interpreter's scan."""
    imm = lambda v: float(g.node(v).attr("value")) if is_immediate(g, v) else None
    sk = render_scan(g, n.id, dtype=str(dt).removeprefix("torch."), immediate=imm,
                     carry_budget=carry_budget, serial=True)
    gen = torch.Generator().manual_seed(seed)
    args = {}
    for v in n.inputs:                     # a value passed twice is one tensor
        t = g.node(v).type
        args[v] = (torch.tensor(imm(v), dtype=dt) if imm(v) is not None
                   else 0.3 * torch.randn(t.shape, generator=gen, dtype=dt))
    operands = [args[v] for v in n.inputs]
    want = scan_ref(n, operands, Interpreter(dt))
    ws = torch.full((sk.grid * sk.ws_per_program,), float("nan"), dtype=dt)
    outs = [torch.full(w.shape, float("nan"), dtype=dt) for w in want]
    load_module(sk.source, sk.name).launch(ws, *[operands[i] for i in sk.inputs],
                                           *[outs[k] for k in sk.outputs], *_tables(sk, dt))
    for k in sk.outputs:
        err = (outs[k] - want[k]).abs().max() / want[k].abs().max().clamp_min(1e-30)
        assert err <= TOL[dt], f"{g.name} scan %{n.id} output {k}: relative error {err:.2e}"
    return sk


# --- parity -----------------------------------------------------------------------------------------

# tiny_lmm in `make test`; every block kind's training step on both targets is in
# test_codegen, so the other examples' chunk scans against the reference are the slow tier
@pytest.mark.parametrize("example", ["tiny_lmm", *(pytest.param(e, marks=pytest.mark.slow)
                                                   for e in ("tiny_mag", "tiny_mal", "tiny"))])
def test_memory_chunk_scans_match_reference(example: str) -> None:
    """Forward, checkpoint and reverse (backward) memory-chunk scans of the training graph
    (memory chunks of 4: two per sequence; the interpreter's time is per chunk)."""
    c = compile_graphs(_spec(example, **{"model.memory.chunk_size": 4}))
    found = list(_scans(c.plans["training"], "memory_chunk"))
    assert any(n.attr("reverse") for _, n in found) and any(not n.attr("reverse")
                                                           for _, n in found)
    for g, n in found:
        sk = check_scan(g, n, torch.float32)
        assert sk.grid == 1 * 2                              # batch x memory heads
        chunk = [c for c in sk.carries if not c["why"].startswith("its loop holds a nested")]
        assert chunk and all(c["on_chip"] for c in chunk), sk.carries   # W, S (and grads)
    g, n = found[0]
    check_scan(g, n, torch.float32, carry_budget=0)          # every carry in the workspace


@pytest.mark.slow                    # an option's kernels (the graph's values: test_passes)
def test_hoisted_group_recompute_matches_reference() -> None:
    """compile.hoist_groups (passes/hoist.py): eight chunks of 2 tokens in groups of two; the
    groups' forward recompute, hoisted out of their backward, is one scan kernel over groups
    x batch x memory heads (4 x 1 x 2 programs), and it and the group backward left behind
    match the reference interpreter."""
    c = compile_graphs(_spec("tiny_lmm", **{"model.seq_len": 16, "compile.chunk_groups": True,
                                             "compile.hoist_groups": True}))

    def every_scan(plan):
        g = plan.schedule.graph
        for k in plan.schedule.kernels:
            for nid in (i for i in k.nodes if g.node(i).op is Op.SCAN):
                if g.node(nid).attr("role") in ("memory", "memory_group"):
                    yield g, g.node(nid)
                yield from every_scan(plan.bodies[nid])

    grids = [check_scan(g, n, torch.float32).grid for g, n in every_scan(c.plans["training"])]
    assert 4 * 2 in grids and set(grids) <= {2, 8}, grids


@pytest.mark.slow
@pytest.mark.parametrize("depth, chunk", [(1, 1), (2, 4), (2, 8)])   # token by token,
def test_depth_and_chunk_sizes_float64(depth: int, chunk: int) -> None:  # interior, whole
    c = compile_graphs(_spec("tiny_lmm", **{"model.memory.depth": depth,
                                            "model.memory.chunk_size": chunk,
                                            "train.dtype": "float64"}))
    found = list(_scans(c.plans["training"], "memory_chunk"))
    assert found
    for k, (g, n) in enumerate(found):
        sk = check_scan(g, n, torch.float64, seed=k)
        assert any(c["on_chip"] for c in sk.carries)


@pytest.mark.slow
def test_nested_scan_float64() -> None:
    """The MAC segment scan holds the memory-chunk scan: one kernel, loops nested."""
    c = compile_graphs(_spec("tiny", **{"train.dtype": "float64"}))
    g, n = next(iter(_scans(c.plans["training"], "mac_segment")))
    assert any(m.op is Op.SCAN for m in n.attr("body"))
    sk = check_scan(g, n, torch.float64)
    assert sk.source.count("@triton.jit") == 1 and "for it2 in range(" in sk.source


@pytest.mark.slow
def test_training_step_float64_matches_cpu_target() -> None:
    over = {**SMALL, "model.memory.heads": 1, "train.dtype": "float64"}
    progs = one_step_on_both_targets(ROOT / "examples" / "tiny_lmm.yaml", over, batch=1)
    tri = [ex for ex in progs["triton"].executors.by_graph.values()
           if isinstance(ex, TritonExecutor)]
    assert tri and not any(f["scan"].find("memory_chunk") >= 0 for ex in tri
                           for f in ex.fallbacks)


@pytest.mark.parametrize("loops", [pytest.param(False, marks=pytest.mark.slow), True])
def test_sunk_reads_match_the_cpu_target(loops: bool, monkeypatch) -> None:
    """`compile.sink_reads: always`: the forward chunk scans' reads run after them over the
    stacked start states (passes/hoist.py); one float64 training step of tiny_lmm on the
    triton target equals the cpu target's, with the memory scans as scan kernels and (a
    launch worth no rounds) as host loops."""
    from titanc.codegen.scan import kernel

    if loops:
        monkeypatch.setattr(kernel, "ROUNDS_PER_LAUNCH", 0)
    over = {**SMALL, "model.memory.heads": 1, "train.dtype": "float64",
            "compile.sink_reads": "always"}
    with config.override(compile_cache=False):      # keep these decisions off the disk
        progs = one_step_on_both_targets(ROOT / "examples" / "tiny_lmm.yaml", over, batch=1)
    tri = [ex for ex in progs["triton"].executors.by_graph.values()
           if isinstance(ex, TritonExecutor)]
    loops_run = [f for ex in tri for f in ex.fallbacks if "memory_chunk" in f["scan"]]
    assert bool(loops_run) == loops


# --- bf16 dots --------------------------------------------------------------------------------------

_TORCH = {"bf16": torch.bfloat16, "f32": torch.float32, "f64": torch.float64}


def _run_low(g, n, seed: int = 0) -> tuple[ScanKernel, list[torch.Tensor], tuple]:
    """Render scan `n` of a bf16 program's graph `g` and run it on random operands in each
    operand's own dtype; the kernel's outputs and the reference interpreter's."""
    imm = lambda v: float(g.node(v).attr("value")) if is_immediate(g, v) else None
    sk = render_scan(g, n.id, immediate=imm)
    gen = torch.Generator().manual_seed(seed)
    args = {v: (torch.tensor(imm(v)) if imm(v) is not None else
                (0.3 * torch.randn(g.node(v).type.shape, generator=gen)
                 ).to(_TORCH[g.node(v).type.dtype])) for v in n.inputs}
    operands = [args[v] for v in n.inputs]
    want = scan_ref(n, operands, Interpreter(torch.float32))
    ws = torch.full((sk.grid * sk.ws_per_program,), float("nan"))
    outs = [torch.full(w.shape, float("nan"), dtype=w.dtype) for w in want]
    load_module(sk.source, sk.name).launch(ws, *[operands[i] for i in sk.inputs],
                                           *[outs[k] for k in sk.outputs],
                                           *_tables(sk, torch.float32))
    return sk, outs, want


# in `make test-all`: interpreted bf16 training scans (tests/test_aot.py checks in `make test`
# that the bf16 scan kernel multiplies on bf16 tensor cores)
@pytest.mark.slow
@pytest.mark.parametrize("example, body", [("tiny_lmm", "memory_chunk"), ("tiny", "mac_segment")])
def test_bf16_dots_take_bf16_operands_exactly(example: str, body: str, monkeypatch) -> None:
    """Under `train.dtype: bfloat16` a scan kernel holds bf16 values in float32; a dot whose
    operands hold bf16 values (`codegen.meta.value_dtype`: bf16 nodes, and float32 widenings
    of them such as an expanded attention's q and k) converts its tiles to bf16 for the 16-bit
    MMA (float32 accumulation, constexpr DOT_F32 off on a GPU). Under the interpreter the
    DOT_F32 branch multiplies the converted tiles widened back, and the interpreter's
    conversion truncates: outputs bit-equal to the same kernel with float32 dots of the
    unconverted tiles (`mma16` refused) show the conversion never changed a value. The forward
    and backward memory-chunk scans (every dot bf16), and the MAC segment's forward with its
    attention (q k^T over the widened bf16 q and the key groups' concat; the softmax-weighted
    dots stay float32); its serial backward takes 10 s a run interpreted."""
    # memory chunks of 4: two per sequence (the interpreter's time is per chunk, and a chunk
    # of 2 tokens runs the same dots)
    c = compile_graphs(_spec(example, **{"train.dtype": "bfloat16", "model.memory.chunk_size": 4}))
    found = list(_scans(c.plans["training"], body))
    assert any(n.attr("reverse") for _, n in found) and any(not n.attr("reverse")
                                                           for _, n in found)
    if body == "mac_segment":
        found = [(g, n) for g, n in found if not n.attr("reverse")]
    for k, (g, n) in enumerate(found):
        sk, got, want = _run_low(g, n, seed=k)
        dots = sk.source.count("tl.dot(")
        low = len(re.findall(r"\+= tl\.dot\(h\d+, h\d+\)$", sk.source, re.M))  # bf16 tiles
        assert low >= 2 and "DOT_F32: tl.constexpr" in sk.source, (g.name, n.id)
        assert ".to(tl.bfloat16)" in sk.source
        if body == "memory_chunk":
            assert dots == 2 * low                      # each dot: DOT_F32 or the MMA
        else:                                           # p @ v, ds @ k, ...: float32
            assert low < dots - low
        for i in sk.outputs:   # the bf16 rounding places are the reference's
            err = (got[i].float() - want[i].float()).abs().max() / \
                want[i].float().abs().max().clamp_min(1e-30)
            assert err <= 2e-2, f"{g.name} scan %{n.id} output {i}: relative error {err:.2e}"
        with monkeypatch.context() as m:
            m.setattr("titanc.codegen.scan.einsum.mma16", lambda *a: None)
            sk32, got32, _ = _run_low(g, n, seed=k)
        assert "DOT_F32=" not in sk32.source and not re.search(r"tl\.dot\(h\d+, h\d+\)",
                                                                sk32.source)
        for i in sk.outputs:
            assert torch.equal(got[i], got32[i]), (g.name, n.id, i)


# --- carries on chip ----------------------------------------------------------------------------------

def _carry_graph():
    """A scan whose carries are read by every kind of stage: h (read through a reshape to
    32, which no tile of h's axes can give: the workspace), g (pointwise, einsum operand
    plain and transposed, a row reduction: on chip) and a scalar s (on chip)."""
    from titanc.ir import Builder

    b = Builder("forward")
    x = b.input("x", (3, 4, 8), "f64")
    w = b.input("w", (8, 5), "f64")

    def body(bb, c, xs, k):
        h, g, s = c
        (xt,) = xs
        (wt,) = k
        g2 = g * 0.5 + xt + h * bb.einsum("ij,ik->jk", g, xt).sum([0])   # transposed read
        s2 = s + g.sum([0, 1]) * 0.1
        return [h * 0.9 + xt, g2, s2], [h.reshape(32), bb.einsum("ij,jk->ik", g, wt),
                                        g.amax([1])]

    (h, g, s), ys = b.scan(body, [b.full(0.0, (4, 8), "f64") + 1.0,
                                  b.full(0.0, (4, 8), "f64") + 0.5, b.full(0.0, (), "f64") + 0.0],
                           [x], [w], name="carried")
    b.graph.set_outputs([("h", h.id), ("g", g.id), ("s", s.id)]
                        + [(f"y{i}", y.id) for i, y in enumerate(ys)])
    return b.graph


@pytest.mark.parametrize("dt", [torch.float64, torch.float32])
def test_carries_on_chip_match_reference_and_say_why_not(dt) -> None:
    g = _carry_graph()
    n = next(m for m in g if m.op is Op.SCAN)
    sk = check_scan(g, n, dt)
    where = {c["carry"]: c for c in sk.carries}
    assert not where[0]["on_chip"] and "read at coordinates other than its tile" in where[0]["why"]
    assert where[1]["on_chip"] and where[2]["on_chip"]
    assert where[1]["shape"] == [4, 8] and where[2]["shape"] == []
    assert "tl.trans(" in sk.source and "held on chip" in sk.source
    off = check_scan(g, n, dt, carry_budget=0)
    assert not any(c["on_chip"] for c in off.carries)
    assert all("budget of 0 B" in c["why"] for c in off.carries[1:])
    assert off.ws_per_program > sk.ws_per_program


def _chain_graph():
    """A body with a chain of stored elementwise nodes of one shape (each read twice), one of
    which reads an earlier one through a transpose (other coordinates than the stage's tile),
    and values only the chain itself reads."""
    from titanc.ir import Builder

    b = Builder("forward")
    x = b.input("x", (3, 2, 4, 8), "f64")

    def body(bb, c, xs, k):
        (h,) = c
        (xt,) = xs
        a = (xt * h).sigmoid()                   # reads the carry on chip: a stage alone
        b1 = (1.0 - a) * xt                      # read by d and e
        p = b1 * 2.0                             # read by d and q only: never stored
        d = a * b1 + p                           # read by f, twice, q and e
        q = d * p
        f = d + d.permute(0, 2, 1).reshape(2, 4, 8)    # d at other coordinates: a new stage
        e = f * b1 + a * q
        t = bb.einsum("bij,bjk->bik", d.permute(0, 2, 1), e)       # another stage reads them
        return [h * 0.5 + e], [t.sum([2]), f + e + q]

    (h,), ys = b.scan(body, [b.full(0.0, (2, 4, 8), "f64") + 1.0], [x], role="memory",
                      name="chain")
    b.graph.set_outputs([("h", h.id)] + [(f"y{i}", y.id) for i, y in enumerate(ys)])
    return b.graph


def _reductions_graph():
    """A body with reductions alike (two sums of one shape over one axis, two cumsums, the
    second reversed) and one sum that reads another's result through an elementwise node."""
    from titanc.ir import Builder

    b = Builder("forward")
    x = b.input("x", (3, 2, 4, 8), "f64")
    y = b.input("y", (3, 2, 4, 8), "f64")

    def body(bb, c, xs, k):
        (h,) = c
        xt, yt = xs
        s1 = (xt * 2.0).sum([2], keepdim=True)   # [2, 4, 1]
        s2 = (yt - 1.0).sum([2], keepdim=True)   # alike, independent: the same stage
        s3 = (s1 * yt).sum([2], keepdim=True)    # alike, reads s1: a stage after theirs
        c1 = xt.cumsum(2)
        c3 = (yt * 3.0).cumsum(2)                # alike c1, independent, next: shares it
        c2 = yt.cumsum(2, reverse=True)          # reversed: another key
        return [h * 0.5 + s1 + s2 + s3], [c1 + c2 + c3]

    (h,), ys = b.scan(body, [b.full(0.0, (2, 4, 1), "f64") + 1.0], [x, y], role="memory",
                      name="reductions")
    b.graph.set_outputs([("h", h.id)] + [(f"y{i}", y.id) for i, y in enumerate(ys)])
    return b.graph


@pytest.mark.parametrize("dt", [torch.float64, torch.float32])
def test_reductions_alike_share_a_stage(dt) -> None:
    """Consecutive reductions alike that read none of each other's results are one stage
    (their loads in one round, one barrier); one that reads another's result, or runs the
    other way, takes a stage of its own; the kernel equals the interpreter."""
    g = _reductions_graph()
    n = next(m for m in g if m.op is Op.SCAN)
    sk = check_scan(g, n, dt)
    stages = [line.strip() for line in sk.source.splitlines()
              if re.match(r"\s+# %\d+ = (sum|cumsum)", line)]
    shared = [st for st in stages if st.count("%") == 2]
    assert any("sum, %" in st and "cumsum" not in st for st in shared), stages
    assert any(st.count("cumsum") == 2 for st in shared), stages
    assert len(stages) == 4, stages            # s1 s2 | s3 | c1 c3 | c2 (in body order)


def test_reductions_alike_of_a_carry_on_chip_take_a_stage_each() -> None:
    """Two sums alike of a carry held on chip: their shared row loop cannot read the carry's
    tile (`_RegMiss`), so each becomes a stage of its own over one tile of the carry, which
    stays on chip; the kernel equals the interpreter."""
    from titanc.ir import Builder

    b = Builder("forward")
    x = b.input("x", (3, 4, 8), "f64")

    def body(bb, c, xs, k):
        (g,) = c
        (xt,) = xs
        s1 = g.sum([1], keepdim=True)
        s2 = (g * 2.0).sum([1], keepdim=True)
        return [g * 0.5 + xt + s1 * s2 * 0.01], [s1 + s2]

    (g,), ys = b.scan(body, [b.full(0.0, (4, 8), "f64") + 0.5], [x], name="sums")
    b.graph.set_outputs([("g", g.id)] + [(f"y{i}", y.id) for i, y in enumerate(ys)])
    n = next(m for m in b.graph if m.op is Op.SCAN)
    sk = check_scan(b.graph, n, torch.float64)
    assert all(c["on_chip"] for c in sk.carries), sk.carries
    assert sk.source.count("of one tile") == 2, sk.source


def test_one_block_einsums_share_a_stage(monkeypatch) -> None:
    """Consecutive einsums of one block each, reading none of each other's results, are one
    stage: every member's operand loads, then the dots and the stores, one barrier. On a GPU
    only bf16 dots share (float32 ones spilled: `SHARED_EXACT_DOTS`); forced here for
    float64, the memory-chunk scans (MAC, training graph) still equal the interpreter, and
    the bf16 kernels do share."""
    from titanc.codegen.scan import einsum

    def shared(src: str) -> int:
        """Stages with two einsums or more (their comments with no barrier between)."""
        body = src.split("for it1 in range", 1)[1]
        return sum(part.count("= einsum[") >= 2 for part in body.split("tl.debug_barrier()"))

    c = compile_graphs(_spec("tiny", **{"model.memory.chunk_size": 4}))
    found = list(_scans(c.plans["training"], "memory_chunk"))
    assert all(shared(render_scan(g, n.id).source) == 0 for g, n in found)
    monkeypatch.setattr(einsum, "SHARED_EXACT_DOTS", True)
    together = 0
    for g, n in found:
        together += shared(check_scan(g, n, torch.float64).source)
    assert together >= 3, together
    monkeypatch.setattr(einsum, "SHARED_EXACT_DOTS", False)
    low = compile_graphs(_spec("tiny", **{"model.memory.chunk_size": 4,
                                          "train.dtype": "bfloat16"}))
    assert sum(shared(render_scan(g, n.id).source)
               for g, n in _scans(low.plans["training"], "memory_chunk")) >= 3


@pytest.mark.parametrize("dt", [torch.float64, torch.float32])
def test_pointwise_chain_is_one_stage(dt, monkeypatch) -> None:
    """Stored elementwise nodes of one shape share a stage, reading each other from
    registers; a value only that stage reads is never stored."""
    g = _chain_graph()
    n = next(m for m in g if m.op is Op.SCAN)
    sk = check_scan(g, n, dt)
    stages = [line.strip() for line in sk.source.splitlines()
              if re.match(r"\s+# %\d+ = \w+, %\d+ = ", line)]
    assert len(stages) == 2, stages            # b1, p, d, q | f, e: split at the transpose
    assert stages[0].count("%") == 4 and stages[1].count("%") == 2, stages
    with monkeypatch.context() as m:
        m.setattr("titanc.codegen.scan.kernel.drop_dead_stores", lambda lines: lines)
        kept = check_scan(g, n, dt)
    assert sk.source.count("tl.store(ws_ptr") == kept.source.count("tl.store(ws_ptr") - 1


def test_memory_chunk_carries_held_on_chip() -> None:
    """tiny_lmm at its own sizes: W1, W2, S1, S2 of a 32-wide, expansion-2 memory are
    [64, 32] / [32, 64] (8 KiB each, 32 KiB together: the budget) per (batch, head) program.
    The chunk loop holds them as register tiles; the chunk-group loop around it (which nests
    it) and the chunked loss scan's [256, 64] carry (64 KiB; `compile.fused_loss: false`) stay in
    the workspace, with the reason; the chunked loss scan (`compile.fused_loss: false`) is no
    kernel at all: it has no independent axis."""
    c = compile_graphs(load_spec(ROOT / "examples" / "tiny_lmm.yaml"))
    for g, n in _scans(c.plans["training"], "memory_chunk"):
        on = render_scan(g, n.id)
        off = render_scan(g, n.id, carry_budget=0)
        inner = [r for r in on.carries if not r["why"]]
        assert [r["shape"] for r in inner][:4] == [[64, 32], [32, 64], [64, 32], [32, 64]]
        assert all(r["on_chip"] for r in inner)
        nested = n.attr("body").name.startswith("memory_chunk_group")
        assert all(("nested scan" in r["why"]) == (nested and r["scan"] == f"%{n.id}")
                   for r in on.carries if not r["on_chip"])
        assert "held on chip" in on.source and "held on chip" not in off.source
        # the slots (2 x 4 x 2048 elements) are gone from the workspace, and more with them
        assert off.ws_per_program - on.ws_per_program >= 2 * 4 * 2048, (off.ws_per_program,
                                                                          on.ws_per_program)
    chunked = compile_graphs(load_spec(ROOT / "examples" / "tiny_lmm.yaml",
                                       {"compile.fused_loss": False}))
    g, n = next(iter(_scans(chunked.plans["training"], "loss_chunk_bwd")))
    # the chunked loss has no independent axis: not a kernel but a host loop, with the reason
    with pytest.raises(ScanFallback, match="one program would run the whole scan on one SM"):
        render_scan(g, n.id)


# --- structure ---------------------------------------------------------------------------------------

def test_memory_chunk_scan_is_one_kernel() -> None:
    """tiny_lmm at its own sizes: batch 8 x 2 memory heads, 8 chunks of 16 tokens."""
    c = compile_graphs(load_spec(ROOT / "examples" / "tiny_lmm.yaml"))
    for g, n in _scans(c.plans["training"], "memory_chunk"):
        sk = render_scan(g, n.id)
        assert (sk.grid, sk.prefix) == (16, (8, 2))
        assert sk.source.count("@triton.jit") == 1
        assert f"for it1 in range(0, {n.attr('length')}):" in sk.source
        assert "tl.dot(" in sk.source and "tl.cumsum(" in sk.source
        # every name the body assigns is read (the emitter drops index and zero tiles a
        # stage made but did not use: the interpreter ran each one every iteration), and
        # int32 index ranges take no cast
        body = sk.source.split("pbase = pid * WS", 1)[1].split("def launch", 1)[0]
        names = re.findall(r"^\s*([a-z]+\d+) = ", body, re.M)
        assert names and all(len(re.findall(rf"\b{v}\b", body)) > 1 for v in names)
        assert ".to(tl.int32)" not in body.replace("tl.int32, bitcast", "")
        # a mask tests only what can fail: never a whole block (`arange(0, B)` against B)
        whole = dict(re.findall(r"^\s*([a-z]+\d+) = (?:\(0 \+ )?tl\.arange\(0, (\d+)\)",
                                body, re.M))
        bounds = re.findall(r"\(([a-z]+\d+) < (\d+)\)", body)
        assert whole
        assert not [(v, n) for v, n in bounds if whole.get(v) == n], "statically true masks"


@pytest.mark.parametrize("groups", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_large_memory_scans_take_one_program_per_batch_row_and_head(groups) -> None:
    """large_125m (one layer, 1,024 tokens): every memory-chunk scan launches at least
    batch 8 x 4 memory heads = 32 programs, a chunk groups' backward included (its
    per-program workspace was 4.8M elements: under a total cap of 2**27 it fell back to 8
    programs running the four heads in turn, on an H100 301 ms a launch, 76% of the step;
    `MAX_WORKSPACE_TOTAL` is 2**28, int32 indices). With compile.chunk_groups and
    compile.hoist_groups the groups' forward recompute, hoisted out of that backward
    (passes/hoist.py), runs every group at once: 4 x 8 x 4 programs. (By default these scans
    run as host loops at this size, `test_scan_cost_picks_the_loop_where_the_state_outgrows_a_program`:
    the kernels are forced here, `TITANC_SCAN_COST=0`.)"""
    from titanc.runtime.targets.aot import record_launches

    c = compile_graphs(load_spec(ROOT / "examples" / "large_125m.yaml", {
        "model.n_layers": 1, "model.seq_len": 1024, "model.vocab_size": 64,
        "compile.chunk_groups": groups, "compile.hoist_groups": groups}))
    grids: dict[str, int] = {}
    with config.override(scan_cost=False):
        record_launches(c.plans["training"], grids=grids)
    chunk = {k: v for k, v in grids.items() if "memory_chunk" in k}
    assert any("group_bwd" in k for k in chunk) == groups, chunk
    assert sorted(chunk.values()) == [32, 32, 32] + [128] * groups, chunk


def test_scan_cost_picks_the_loop_where_the_state_outgrows_a_program() -> None:
    """large_125m (one layer, 1,024 tokens, bf16): a memory head's MLP and momentum do not fit
    one program's chip, and its one kernel would run 257-2,873 serial tile rounds an
    iteration on 32 programs (3.4 µs a round on an H200: 6.7 of the full model's 8.6 s of
    kernels). Every memory scan runs as its host loop, says why, and the loop's kernels spread
    over the chip (most of them 96 programs or more); with `TITANC_SCAN_COST=0` they are
    kernels again. tiny.yaml's scans (14-30 rounds on tiles that fit) stay kernels."""
    from titanc.codegen.scan.kernel import serial_cost
    from titanc.runtime.targets.aot import record_launches

    def forms(c) -> list[dict]:
        out: list[dict] = []
        count_launches(c.plans["training"], forms=out)
        return [f for f in out if f["role"] in ("memory", "memory_group")]

    large = compile_graphs(load_spec(ROOT / "examples" / "large_125m.yaml", {
        "model.n_layers": 1, "model.seq_len": 1024, "model.vocab_size": 64,
        "train.dtype": "bfloat16"}))
    got = forms(large)
    assert got and all(f["form"] == "host_loop" for f in got), got
    assert all("serial tile rounds an iteration on 32 programs" in f["why"]
               and "a loop of kernels over the whole chip is faster" in f["why"] for f in got)
    assert count_launches(large.plans["training"]) == \
        count_launches(large.plans["training"], scan_kernels=False)
    grids: dict[str, int] = {}
    record_launches(large.plans["training"], grids=grids, cuda_blocks=True)
    assert not any(k.startswith("titanc_tem_fused_scan_memory") for k in grids)
    assert sorted(grids.values())[len(grids) // 4] >= 96, sorted(grids.values())
    with config.override(scan_cost=False):
        assert {f["form"] for f in forms(large)} == {"kernel"}
    tiny = compile_graphs(load_spec(ROOT / "examples" / "tiny.yaml", {"train.dtype": "bfloat16"}))
    assert {f["form"] for f in forms(tiny)} == {"kernel"}
    plan = tiny.plans["training"]                  # every step a launch: 8 rounds each
    loops = lower(plan, None, groupable)
    assert serial_cost(loops) == ROUNDS_PER_LAUNCH * loops.launches() > 0


@pytest.mark.slow
def test_memory_scans_the_cost_rule_loops_match_the_cpu_target(monkeypatch) -> None:
    """With a launch worth no rounds the rule runs every memory scan as its host loop; one
    float64 training step of tiny_lmm on the triton target still equals the cpu target's."""
    from titanc.codegen.scan import kernel

    monkeypatch.setattr(kernel, "ROUNDS_PER_LAUNCH", 0)
    over = {**SMALL, "model.memory.heads": 1, "train.dtype": "float64"}
    with config.override(compile_cache=False):      # keep these decisions off the disk
        progs = one_step_on_both_targets(ROOT / "examples" / "tiny_lmm.yaml", over, batch=1)
    tri = [ex for ex in progs["triton"].executors.by_graph.values()
           if isinstance(ex, TritonExecutor)]
    why = [f["reason"] for ex in tri for f in ex.fallbacks if "memory_chunk" in f["scan"]]
    assert why and all("serial tile rounds" in w for w in why)


def _step_launches(example: str, seq_len: int) -> tuple[int, int]:
    """Launches per training step (training graph + optimizer): with scan kernels, and with
    every scan a host loop."""
    c = compile_graphs(load_spec(ROOT / "examples" / f"{example}.yaml", {
        "model.seq_len": seq_len, "model.memory.chunk_size": 16}))
    return tuple(sum(count_launches(c.plans[g], scan_kernels=on)    # type: ignore[return-value]
                     for g in ("training", "optimizer")) for on in (True, False))


def test_launches_per_step_independent_of_seq_len() -> None:
    """tiny_lmm at its own sizes (batch 8): the only loop over the sequence is the memory's
    chunk recurrence, one kernel at every length; the layer scans are host loops of n_layers
    iterations either way."""
    (k128, loops128), (k512, loops512) = _step_launches("tiny_lmm", 128), \
        _step_launches("tiny_lmm", 512)
    assert k128 == k512
    assert loops128 < loops512                                   # host loops grow
    assert 5 * k128 <= loops128


def test_executor_counts_launches_like_the_plan() -> None:
    c = compile_graphs(_spec("tiny"))
    for name in ("training", "optimizer"):
        ex = TritonExecutor(c.plans[name])
        assert ex.launches_per_run() == count_launches(c.plans[name])
    assert count_launches(c.plans["training"]) < count_launches(c.plans["training"],
                                                                scan_kernels=False)


# --- tiles: serial rounds -----------------------------------------------------------------------------

def test_serial_rounds_counts_dependent_tile_trips() -> None:
    """A block of loads or dots between two barriers is one round per execution: the
    product of the loops around it inside the scan loop (`it1`), nested scans included;
    what lies outside the scan loop is not counted."""
    from titanc.codegen.scan.rounds import serial_rounds
    lines = """
    x1 = tl.load(a0_ptr)
    for it1 in range(0, 4):
        x2 = tl.load(a1_ptr)
        x3 = tl.load(a2_ptr)
        tl.debug_barrier()
        for m4 in range(0, 128, 64):
            for k5 in range(0, 256, 64):
                acc6 += tl.dot(x2, x3)
            tl.store(ws_ptr, acc6)
        for o7 in range(0, 8192, 4096):
            x8 = tl.load(ws_ptr)
        tl.debug_barrier()
        for it2 in range(0, 3):
            x9 = tl.load(ws_ptr)
            tl.debug_barrier()
            x10 = tl.load(ws_ptr)
    x11 = tl.load(o0_ptr)
""".splitlines()
    # 1 (two loads, one block) + 2 x 4 (dots) + 2 (a second loop in the same stage)
    # + 3 x (1 + 1) (the nested scan's two stages)
    assert serial_rounds(lines) == 1 + 8 + 2 + 6


def _caps(monkeypatch, tile: int, block: int) -> None:
    """Set the scan kernel's tile caps (`codegen.scan.index`) where its stages read them."""
    from titanc.codegen.scan import einsum, reduce, stages

    for module in (stages, reduce):
        monkeypatch.setattr(module, "MAX_TILE", tile)
    monkeypatch.setattr(einsum, "DOT_BLOCK", block)


def test_scan_tiles_cut_the_serial_rounds(monkeypatch) -> None:
    """The benchmark's medium memory (d_model 128: heads of 64, a hidden layer of 128), one
    layer: every memory-chunk scan of the training graph takes at most half the serial tile
    rounds an iteration at the caps (4096-element tiles, 64^3 dots) that it took at 1024 /
    32^3 (on an H100 the medium step's scans were 61% of it, 2026-11-27)."""
    c = compile_graphs(load_spec(ROOT / "examples" / "tiny_lmm.yaml", {
        "model.d_model": 128, "model.n_layers": 1, "model.seq_len": 64, "train.batch_size": 2}))
    found = list(_scans(c.plans["training"], "memory_chunk"))
    assert len(found) >= 2
    now = [render_scan(g, n.id).rounds for g, n in found]
    _caps(monkeypatch, 1024, 32)
    before = [render_scan(g, n.id).rounds for g, n in found]
    assert all(r > 0 and 2 * r <= b for r, b in zip(now, before)), (now, before)


@pytest.mark.parametrize("budget", [pytest.param(None, marks=pytest.mark.slow), 0])
def test_looped_tiles_match_reference(budget, monkeypatch) -> None:
    """Caps far below the shapes (16-element tiles along a row loop, 16^3 dots) put every
    stage kind in loops over blocks, with the carries on chip and in the workspace: the
    memory-chunk scans (MAC, d_model 32) still equal the interpreter in float64."""
    _caps(monkeypatch, 16, 16)
    c = compile_graphs(_spec("tiny", **{"model.d_model": 32, "model.memory.chunk_size": 4}))
    for g, n in _scans(c.plans["training"], "memory_chunk"):
        sk = check_scan(g, n, torch.float64, carry_budget=budget)
        assert re.search(r"for [a-z]+\d+ in range\(0, \d+, 16\):", sk.source)


# --- fallback ---------------------------------------------------------------------------------------

def test_scan_form_rule_and_reasons(monkeypatch, capsys) -> None:
    """`scan_form` (tiny_lmm at its own sizes): the memory's chunk recurrences (forward,
    backward) are kernels with a batch x memory heads
    grid; the layer scan and its backward are host loops of ordinary kernels, and say why
    (executor `fallbacks`, TITANC_DEBUG=2); the generator refuses a scan with no independent
    axes (the layer backward sums weight gradients over the batch) instead of running it on
    one program."""
    c = compile_graphs(load_spec(ROOT / "examples" / "tiny_lmm.yaml"))
    forms: list[dict] = []
    assert count_launches(c.plans["training"], forms=forms) > 0
    by_role = {}
    for f in forms:
        by_role.setdefault(f["role"], set()).add(f["form"])
    assert by_role == {"layer": {"host_loop"}, "memory": {"kernel"}}, forms
    assert all(f["grid"] == 16 for f in forms if f["form"] == "kernel")
    assert all("big parallel work" in f["why"] for f in forms if f["form"] == "host_loop")
    g, n = next(iter(_scans(c.plans["training"], "layer_bwd")))
    with pytest.raises(ScanFallback, match=r"no independent leading axes \(%\d+ \(einsum\) "
                                           r"contracts the independent axes \[8\]\)"):
        render_scan(g, n.id)
    with config.override(debug=2):
        ex = TritonExecutor(c.plans["training"])
        reasons = [f["reason"] for f in ex.fallbacks if "layer_bwd" in f["scan"]]
        assert len(reasons) == 1 and "big parallel work" in reasons[0]
        assert f"runs as a host loop: {reasons[0]}" in capsys.readouterr().err
        assert ex.launches_per_run() == count_launches(c.plans["training"])
        assert not any("memory_chunk" in f["scan"] for f in ex.fallbacks)


# --- validity on a GPU target -------------------------------------------------------------------------

_COMPILE_SM90 = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from titanc.codegen.render import load_module
from titanc.codegen.scan.kernel import render_scan
from titanc.compiler import compile_graphs
from titanc.model.spec import load_spec

from titanc.ir import Op

def find(plan):
    for n in plan.schedule.graph:
        if n.op is Op.SCAN:
            if n.attr("body").name == "memory_chunk":
                return plan.schedule.graph, n
            found = find(plan.bodies[n.id])
            if found:
                return found

g, n = find(compile_graphs(load_spec(sys.argv[1])).plans["training"])
sk = render_scan(g, n.id)
fn = getattr(load_module(sk.source, sk.name), sk.name)
sig = {a: "*fp32" if a.endswith("_ptr") else "constexpr" if a == "WS" else "i64"
       for a in fn.arg_names}
k = triton.compile(ASTSource(fn, sig, {"WS": sk.ws_per_program}), target=GPUTarget("cuda", 90, 32))
ptx = k.asm["ptx"]
print(".target sm_90" in ptx, ptx.count("bar.sync"), k.metadata.shared)
"""


@pytest.mark.slow
def test_scan_kernel_compiles_for_sm90() -> None:
    """The forward memory-chunk kernel of tiny_lmm compiles to PTX for sm_90 (in a fresh
    process: this one imported Triton in interpreter mode). Slow tier: `make test` compiles
    the same template for sm_90 through the AOT path, forward and backward, with its budgets
    (`tests/test_aot.py::test_every_tiny_scan_kernel_compiles_for_sm90`)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _COMPILE_SM90,
                        str(ROOT / "examples" / "tiny_lmm.yaml")],
                       capture_output=True, text=True, env=env, timeout=600)
    if r.returncode != 0 and "ptxas" in r.stderr:
        pytest.skip(f"no CUDA toolchain for sm_90 in this triton build: {r.stderr[-200:]}")
    assert r.returncode == 0, r.stderr[-2000:]
    target, barriers, shared = r.stdout.split()
    assert target == "True" and int(barriers) > 10


def test_report_counts_launches_per_target_and_says_why_a_scan_stays_a_loop(tmp_path) -> None:
    from titanc.tools.cli import main

    assert main(["compile", str(ROOT / "examples" / "tiny.yaml"), "-o", str(tmp_path / "b")]) == 0
    report = json.loads((tmp_path / "b" / "report.json").read_text())
    cpu, tri = report["launches_per_step"]["cpu"], report["launches_per_step"]["triton"]
    # AdamW: 1 kernel; views and constant fills launch nothing, a view one kernel would
    # write for another is copied into its readers (passes/views_per_reader.py); on triton
    # launch groups (390)
    assert cpu["training"] == 1326 and tri["training"] < cpu["training"]
    assert tri["decode"] <= cpu["decode"]
    # the layer, segment and decode-write scans are host loops, the memory chunks kernels
    forms = report["scan_forms"]["triton"]
    assert {(f["role"], f["form"]) for f in forms} == {
        ("layer", "host_loop"), ("segment", "host_loop"), ("memory", "kernel"),
        ("memory", "host_loop")}
    assert all(f["grid"] == 8 * 2 for f in forms if f["form"] == "kernel")  # batch x heads
    (loop,) = [f for f in forms if f["role"] == "memory" and f["form"] == "host_loop"]
    assert loop["graph"] == "write" and "no independent leading axes" in loop["why"]
    # scan_forms covers the forward graph too; scan_fallbacks the step's and decoding's
    assert {(f["graph"], f["scan"]) for f in report["scan_fallbacks"]["triton"]} <= {
        (f["graph"], f["scan"]) for f in forms if f["form"] == "host_loop"}
    rows = report["scan_carries"]["triton"]
    assert rows and all({"graph", "kernel", "scan", "carry", "shape", "on_chip", "why"} <= set(r)
                        for r in rows)
    assert all(r["on_chip"] == (r["why"] == "") for r in rows)
    # the memory chunk loop holds W1, W2 and their momenta on chip
    assert any(r["on_chip"] and "memory_chunk" in r["kernel"] and r["shape"] == [64, 32]
               for r in rows)
