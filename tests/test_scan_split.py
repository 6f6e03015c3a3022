"""Split scan kernels (`codegen/scan/kernel.py`, "Split kernels"): a slice of the independent
axes shared by P programs, under TRITON_INTERPRET=1 on tiny shapes.

Under the interpreter one program per slice runs its P sub-programs' shares of every stage in
turn (SPLIT_SERIAL), the same stage code a GPU runs on P programs meeting at group barriers;
so what is tested here is the split's math (which blocks each sub-program computes, and the
workspace they exchange), not the barrier.

- parity (tier e, `make test-all`: split kernels are opt-in, `TITANC_SCAN_SPLIT`): the
  memory-chunk scans of a training graph (forward and backward), with tile caps far below
  the shapes so that every stage kind loops over blocks, split over P = 2 and 3 (3 divides
  none of the block counts of some stages) equal the unsplit kernel with its
  carries in the workspace (bit for bit where no reduction combines partial results, else
  within 1e-13) and the reference interpreter within 1e-10 (float64);
  one float64 training step of tiny_lmm with split kernels equals the cpu target;
- structure (tier c): the grid is slices x P, at most `MAX_SPLIT_GRID` programs (no split
  where the slices leave no room), carries stay in the workspace with the reason, the serial
  rounds count sub-program 0's blocks; TITANC_SCAN_SPLIT sets `config.scan_split`;
- validity (`make test-all`: a cold ptxas compile of half a minute): a split kernel compiles
  for sm_90 without a GPU, within the spill budget.
"""
from __future__ import annotations

import os
import re

os.environ.setdefault("TRITON_INTERPRET", "1")  # read when kernels are decorated: set first

import pytest
import torch

pytest.importorskip("triton")

from tests.helpers import one_step_on_both_targets
from tests.test_scan_kernel import ROOT, SMALL, _caps, _scans, _spec, _tables
from titanc import config
from titanc.codegen.render import load_module
from titanc.codegen.scan.kernel import MAX_SPLIT_GRID, ScanKernel, render_scan
from titanc.codegen.scan.rounds import serial_rounds
from titanc.compiler import compile_graphs
from titanc.ir import Interpreter
from titanc.ir.schedule import is_immediate
from titanc.ir.structural import scan_ref
from titanc.runtime.targets.triton_executor import TritonExecutor

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning",
                                        "ignore:invalid value encountered:RuntimeWarning",
                                        "ignore:overflow encountered:RuntimeWarning")


def _run(g, n, split: int, seed: int = 0) -> tuple[ScanKernel, list, tuple]:
    """Scan `n` of `g` rendered with `split` (carries in the workspace) and run in float64 on
    random operands: the kernel, its outputs and the reference interpreter's."""
    dt = torch.float64
    imm = lambda v: float(g.node(v).attr("value")) if is_immediate(g, v) else None
    sk = render_scan(g, n.id, dtype="float64", immediate=imm, carry_budget=0, split=split)
    gen = torch.Generator().manual_seed(seed)
    args = {v: (torch.tensor(imm(v), dtype=dt) if imm(v) is not None else
                0.3 * torch.randn(g.node(v).type.shape, generator=gen, dtype=dt))
            for v in n.inputs}
    operands = [args[v] for v in n.inputs]
    want = scan_ref(n, operands, Interpreter(dt))
    ws = torch.full((sk.grid * sk.ws_per_program,), float("nan"), dtype=dt)
    outs = [torch.full(w.shape, float("nan"), dtype=dt) for w in want]
    load_module(sk.source, sk.name).launch(ws, *[operands[i] for i in sk.inputs],
                                           *[outs[k] for k in sk.outputs], *_tables(sk, dt))
    return sk, outs, want


@pytest.mark.slow
@pytest.mark.parametrize("split", [2, 3])
def test_split_memory_scans_match_unsplit_and_reference(monkeypatch, split: int) -> None:
    """tiny_lmm, d_model 32 (one memory head of 32, a hidden layer of 64), chunks of 4 tokens,
    64-element tiles and 16^3 dots: forward and backward memory-chunk scans split over 2 or
    3 programs a slice. Every way a stage hands out work shows: a flat tile loop, a dot's
    M x N blocks in one loop, a reduction's rows, a sum over a whole weight by parts, and
    a stage of one block on sub-program 0."""
    _caps(monkeypatch, 64, 16)
    c = compile_graphs(_spec("tiny_lmm", **{"model.d_model": 32, "model.memory.chunk_size": 4,
                                            "model.memory.heads": 1,
                                            "train.dtype": "float64"}))
    found = list(_scans(c.plans["training"], "memory_chunk"))
    assert any(n.attr("reverse") for _, n in found) and any(not n.attr("reverse")
                                                           for _, n in found)
    for g, n in found:
        base, ref, want = _run(g, n, 1)
        assert base.split == 1 and base.barriers == 0
        sk, outs, _ = _run(g, n, split)
        assert (sk.split, sk.grid) == (split, split * base.grid)
        assert "for mn" in sk.source              # a dot's M x N blocks, handed out
        for k in sk.outputs:
            for other, tol in ((ref[k], 1e-13), (want[k], 1e-10)):
                err = (outs[k] - other).abs().max() / other.abs().max()
                assert err <= tol, f"{g.name} %{n.id} P={split} output {k}: {err:.2e}"
            if "partial results combined" not in sk.source:   # the same sums, in order
                assert torch.equal(outs[k], ref[k]), f"{g.name} %{n.id} P={split} {k}"
        handed = re.findall(r"range\(sub \* (\d+), (\d+), (\d+)\)", sk.source)
        assert handed and all(int(s) == split * int(b) for b, _, s in handed)
        if split == 3:       # some stage's blocks are not a multiple of the split
            assert any((int(t) // int(b)) % 3 for b, t, _ in handed), handed
        assert "if sub_lo == 0:" in sk.source             # a stage of one block
        if n.attr("reverse"):     # the backward's sums over a whole weight: by parts
            assert "partial results combined" in sk.source
        assert sk.rounds < base.rounds and sk.barriers == _loop_barriers(sk.source)
        assert all(not c["on_chip"] and "split kernel" in c["why"] for c in sk.carries)


def _loop_barriers(source: str) -> int:
    """Group barriers inside a kernel's scan loop (`it1`; no loop around any of them)."""
    lines = source.splitlines()
    start = next(i for i, line in enumerate(lines) if "for it1 in range(" in line)
    ind = len(lines[start]) - len(lines[start].lstrip())
    end = next((i for i in range(start + 1, len(lines))
                if lines[i].strip() and not lines[i].lstrip().startswith("#")
                and len(lines[i]) - len(lines[i].lstrip()) <= ind), len(lines))
    return sum("_group_barrier(bar_ptr" in line for line in lines[start:end])


def test_split_is_capped_by_the_programs_resident_at_once() -> None:
    """A split kernel's programs all spin on each other: at most `MAX_SPLIT_GRID` of them
    (132, an H100's or H200's SMs); where the slices leave room for no second program a slice
    the kernel is the unsplit one."""
    c = compile_graphs(_spec("tiny_lmm"))
    g, n = next(iter(_scans(c.plans["training"], "memory_chunk")))
    sk = render_scan(g, n.id, split=1000)
    assert sk.grid == 2 * (MAX_SPLIT_GRID // 2) and sk.split == MAX_SPLIT_GRID // 2
    big = compile_graphs(_spec("tiny_lmm", **{"train.batch_size": 67}))
    g, n = next(iter(_scans(big.plans["training"], "memory_chunk")))
    one = render_scan(g, n.id, split=2)
    assert (one.split, one.grid) == (1, 134) and "SPLIT" not in one.source


def test_serial_rounds_of_a_split_stage_are_sub_program_0s() -> None:
    """A split stage's loop `range(sub * B, N, P * B)`: sub-program 0 runs the most blocks,
    ceil(N / (P * B))."""
    lines = """
    for it1 in range(0, 2):
        for sub in range(sub_lo, sub_hi):
            for o2 in range(sub * 64, 640, 192):
                x3 = tl.load(ws_ptr)
        tl.debug_barrier()
""".splitlines()
    assert serial_rounds(lines) == 4


def test_config_reads_the_split() -> None:
    assert config.Config.from_env({"TITANC_SCAN_SPLIT": "4"}).scan_split == 4
    assert config.Config.from_env({"TITANC_SCAN_SPLIT": "x"}).scan_split == 1
    assert config.Config.from_env({}).scan_split == 1


@pytest.mark.slow
def test_training_step_with_split_kernels_matches_cpu_target(monkeypatch) -> None:
    """One float64 training step of tiny_lmm (d_model 32, 16-element tiles and 16^3 dots)
    with every memory scan a split kernel of 3 programs a slice (`TITANC_SCAN_SPLIT=3`, the
    cost rule off) equals the cpu target's."""
    _caps(monkeypatch, 16, 16)
    over = {**SMALL, "model.d_model": 32, "model.memory.heads": 2, "train.dtype": "float64"}
    with config.override(compile_cache=False, scan_split=3, scan_cost=False):
        progs = one_step_on_both_targets(ROOT / "examples" / "tiny_lmm.yaml", over, batch=1)
    tri = [ex for ex in progs["triton"].executors.by_graph.values()
           if isinstance(ex, TritonExecutor)]
    splits = [sk.split for ex in tri for sk in ex._scans.values() if isinstance(sk, ScanKernel)]
    assert splits and set(splits) == {3}, splits


@pytest.mark.slow
def test_split_scan_kernel_compiles_for_sm90() -> None:
    """tiny_lmm's memory-chunk kernels split over 4 programs a slice (`TITANC_SCAN_SPLIT=4`,
    the cost rule off) compile for sm_90 through the AOT path (SPLIT_SERIAL off: the group
    barrier's gpu-scope atomics and spin), within shared memory and the spill budget."""
    from tests.test_aot import SPILL_BUDGET, _compile, _record
    from titanc.runtime.targets import aot

    with config.override(scan_split=4, scan_cost=False):
        launches = _record(ROOT / "examples" / "tiny_lmm.yaml", {}, ("training",))
    split = [l for l in launches if l.is_scan and "SPLIT_SERIAL" in dict(l.constexprs)]
    assert split, [l.name for l in launches if l.is_scan]
    results = _compile(None, {}, launches=split, archs=(90,))
    assert all(r["ok"] for r in results), [r.get("error") for r in results][:2]
    for r in results:
        assert r["spill_bytes"] <= SPILL_BUDGET and r["shared"] <= aot.SHARED_LIMIT[90], r
