"""The blocks of pointwise, reduction and cumsum kernels on a GPU (codegen/meta.py
`cuda_flat_block`, `cuda_row_block`): small kernels spread over the SMs.

- the rule: a block is cut until the grid has GPU_PROGRAMS programs, never below one element
  a thread, never above the interpreter's, a row never split;
- every rendered module carries both blocks, its launch takes the CUDA one on CUDA, and
  `cuda_constexprs` gives it to the ahead-of-time compile (a launch group: its members');
- the CUDA blocks compute the same: a training step of the triton target with every module's
  CUDA blocks (run by the interpreter) equals the step with the interpreter's blocks, bit for
  bit, and the cpu target in float64;
- the LM head's cross-entropy kernels cut their vocabulary block on CUDA to bound an exact
  float32 dot's FMAs a thread, and compute the same with it.
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # read when kernels are decorated: set first

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import tests.reference as R  # noqa: E402
from titanc import config  # noqa: E402
from titanc.codegen import render  # noqa: E402
from titanc.codegen.families.pattern_ops import CE_FMA_PER_THREAD, render_cross_entropy  # noqa: E402
from titanc.codegen.meta import (ACCUMULATOR_REGISTERS, GPU_PROGRAMS, cuda_flat_block,  # noqa: E402
                                 cuda_row_block, matmul_tiles)
from titanc.compiler import compile_graphs  # noqa: E402
from titanc.model.spec import load_spec  # noqa: E402
from titanc.runtime.targets.aot import (fresh_kernel_modules, launch_constexprs,  # noqa: E402
                                        record_launches)
from titanc.runtime.targets.executor import ArenaExecutor  # noqa: E402
from titanc.runtime.targets.triton_executor import TritonExecutor  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# large enough that the CUDA blocks differ from the interpreter's (1,024-element activations,
# 32-row reductions), small enough to interpret
SIZES = {"model.d_model": 32, "model.n_layers": 1, "model.seq_len": 16, "model.vocab_size": 32,
         "model.ffn_hidden": 48, "model.memory.chunk_size": 8, "model.attention.segment": 8,
         "model.attention.window": 8, "model.attention.persistent_tokens": 2,
         "train.batch_size": 2, "train.loss_chunk": 0, "train.dtype": "float64"}


def test_the_rule_spreads_small_kernels_and_leaves_large_ones() -> None:
    assert GPU_PROGRAMS == 128
    # tiny.yaml's segment activations, [8, 35, 64]: 18 programs of 1,024 -> 140 of 128
    assert cuda_flat_block(17920, 1024, 4) == 128
    assert cuda_flat_block(64, 64, 4) == 64                 # never above the interpreter's
    assert cuda_flat_block(2 ** 20, 1024, 4) == 1024        # already over the SMs
    assert cuda_flat_block(300_000, 1024, 4) == 1024
    assert cuda_flat_block(40_000, 1024, 8) == 256          # one element a thread of 8 warps
    # tiny.yaml's conv + SiLU + norm: 512 rows of 32, 64 rows a program -> 4 (128 programs)
    assert cuda_row_block(512, 64, 32, 4) == 4
    assert cuda_row_block(512, 64, 64, 4) == 4
    assert cuda_row_block(16, 16, 256, 8) == 1              # a row is never split
    assert cuda_row_block(100_000, 64, 64, 4) == 64         # already over the SMs
    assert cuda_row_block(512, 64, 8, 4) == 16              # one element a thread: 16 rows of 8
    for n in (1, 3, 100, 4096, 17920, 10 ** 6):
        for block in (16, 128, 1024):
            b = cuda_flat_block(n, block, 4)
            assert b <= block and b & (b - 1) == 0
            assert b >= min(block, 128)


def _compiled(example: str):
    return compile_graphs(load_spec(ROOT / "examples" / f"{example}.yaml", SIZES))


def _inputs(c) -> dict[str, torch.Tensor]:
    return {"tokens": torch.randint(0, 32, (2, 17), generator=torch.Generator().manual_seed(5)),
            **R.init_params(c.spec.model, seed=2)}


@pytest.mark.parametrize("example", ["tiny_lmm"])
def test_the_cuda_blocks_compute_the_same(example: str) -> None:
    """The forward plan's kernels (pointwise and row families, the memory's scans) with the
    CUDA blocks equal them with the interpreter's, bit for bit, and the cpu target."""
    c = _compiled(example)
    plan, inputs = c.plans["forward"], _inputs(c)
    want = TritonExecutor(plan).run(inputs)
    cpu = ArenaExecutor(plan).run(inputs)
    with fresh_kernel_modules(cuda_blocks=True) as changed:
        got = TritonExecutor(plan).run(inputs)
    families = {("pointwise" if "BLOCK" in m.cuda_constexprs(90) else "rows") for m in changed}
    assert families == {"pointwise", "rows"}, families      # the test reaches both kinds
    assert len(changed) >= 5                                # forward: 6 modules here
    for k, v in want.items():
        assert torch.equal(got[k], v), k                    # bit for bit: rows never split
        torch.testing.assert_close(got[k], cpu[k], rtol=1e-9, atol=1e-11,
                                   msg=lambda m: f"{k}: {m}")


def test_the_ahead_of_time_compile_takes_the_cuda_blocks() -> None:
    """`launch_constexprs` (the precompile's and `titanc.tools.aot`'s) gives every launch,
    alone or in a group, its module's CUDA blocks (`cuda_constexprs`)."""
    c = _compiled("tiny")
    seen = {"alone": 0, "group": 0}
    for launch in record_launches(c.plans["training"]):
        module = render.load_module(launch.source, launch.name, interpret=False)
        constexprs, _, _ = launch_constexprs(launch, module, 90)
        members = getattr(module, "MEMBERS", None)
        for i, m in enumerate(members if members is not None else [module]):
            prefix = f"m{i}_" if members is not None else ""
            for k, v in (m.cuda_constexprs(90) if hasattr(m, "cuda_constexprs") else {}).items():
                assert constexprs[prefix + k] == v, (launch.name, k)
            blocks = getattr(m, "BLOCKS", None)
            if isinstance(blocks, dict) and blocks[True] != blocks[False]:
                seen["group" if members is not None else "alone"] += 1
    assert seen["alone"] and seen["group"], seen


def test_recorded_cuda_grids_spread_the_programs() -> None:
    """`record_launches(cuda_blocks=True)` records the grids a GPU runs: never fewer programs
    than the interpreter's, more where a block was cut; benchmarks/launches.py `--grids`
    reports them (its `program_grids`)."""
    plan = _compiled("tiny_lmm").plans["training"]
    interp, cuda = {}, {}
    with fresh_kernel_modules():
        record_launches(plan, grids=interp)
    record_launches(plan, grids=cuda, cuda_blocks=True)
    assert interp.keys() == cuda.keys()
    assert all(cuda[k] >= interp[k] for k in interp)
    assert sum(cuda[k] > interp[k] for k in interp) >= 5
    from tests.test_bench import _load_benchmark
    table = _load_benchmark("launches").program_grids(_compiled("tiny_lmm"))
    assert table["cuda"]["kernels"] == table["interpreter"]["kernels"] > 0
    assert table["cuda"]["median_programs"] > table["interpreter"]["median_programs"]
    # the FLOPs share on fewer programs than an H100's SMs (report.json `occupancy`'s rows):
    # every launch of this toy size is small, its chunk scans among the kernels over 1%
    flops = table["flops"]
    assert 0.9 < flops["under_sms_share"] <= 1.0
    assert any("scan_memory_chunk" in n for n in flops["under_sms_kernels"])
    assert all(p < 132 and share > 0.01 for p, share in flops["under_sms_kernels"].values())


def test_gpu_blocks_off_keeps_the_interpreters_blocks_on_cuda() -> None:
    """TITANC_GPU_BLOCKS=0 (`config.gpu_blocks`, the GPU check's `*_interp_blocks` rows): every
    module's CUDA block is the interpreter's."""
    assert config.Config.from_env({"TITANC_GPU_BLOCKS": "0"}).gpu_blocks is False
    assert config.Config.from_env({}).gpu_blocks is True
    plan = _compiled("tiny_lmm").plans["training"]
    for on in (True, False):
        with config.override(gpu_blocks=on):
            launches = record_launches(plan)
        differ = 0
        for launch in launches:
            module = render.load_module(launch.source, launch.name, interpret=False)
            for m in getattr(module, "MEMBERS", None) or [module]:
                blocks = getattr(m, "BLOCKS", None)
                if isinstance(blocks, dict) and not isinstance(blocks[True], tuple):
                    differ += blocks[True] != blocks[False]
        assert (differ > 0) == on, (on, differ)


def _ce_blocks(**kw) -> dict[bool, int]:
    src = render_cross_entropy("titanc_tem_fused_ce_0", **kw)
    return render.load_module(src, "ce_blocks", interpret=False).BLOCKS


def test_the_cross_entropy_vocabulary_block_on_cuda_bounds_its_fmas() -> None:
    """An exact float32 dot is FMAs on a GPU: the LM head's kernels cut BLOCK_V on CUDA to
    `CE_FMA_PER_THREAD` a thread a step (d_model 128: 64 -> 16, which took the dW kernel's
    sm_90 spill from 8,784 B a thread to none); tf32 and float64 keep theirs."""
    assert _ce_blocks(d_model=128) == {False: 64, True: 16}
    assert _ce_blocks(d_model=64) == {False: 64, True: 32}
    assert _ce_blocks(d_model=768) == {False: 64, True: 16}      # BLOCK_D 256 (CE_MAX_BLOCK_D)
    assert _ce_blocks(d_model=128, allow_tf32=True) == {False: 64, True: 64}
    assert _ce_blocks(d_model=128, dtype="float64") == {False: 64, True: 64}
    assert CE_FMA_PER_THREAD == 256


def test_the_cross_entropy_cuda_block_computes_the_same() -> None:
    """The forward and backward kernels at d_model 128 with their CUDA vocabulary block (16,
    run by the interpreter) against torch."""
    N, D, V = 20, 128, 75
    fwd_src = render_cross_entropy("titanc_tem_fused_ce_0", d_model=D)
    bwd_src = render_cross_entropy("titanc_tem_fused_ce_bwd_0", d_model=D, backward=True)
    with fresh_kernel_modules(cuda_blocks=True) as changed:
        fwd, bwd = render.load_module(fwd_src, "ce_cuda"), render.load_module(bwd_src, "ceb_cuda")
    assert len(changed) == 2 and fwd.BLOCKS[False] == 16
    g = torch.Generator().manual_seed(11)
    h = torch.randn(N, D, generator=g).requires_grad_()
    W = torch.randn(V, D, generator=g).requires_grad_()
    target = torch.randint(0, V, (N,), generator=g)
    loss, lse = torch.empty(N), torch.empty(N)
    fwd.launch(h.detach(), W.detach(), target, loss, lse)
    ref = F.cross_entropy(h @ W.t(), target, reduction="none")
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-5)
    ref.mean().backward()
    dh, dW = torch.empty_like(h), torch.empty_like(W)
    bwd.launch(h.detach(), W.detach(), target, lse, torch.tensor(1.0 / N).expand(N), dh, dW)
    torch.testing.assert_close(dh, h.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dW, W.grad, rtol=1e-5, atol=1e-6)


def test_a_matmul_tile_keeps_its_accumulators_within_the_registers_on_a_gpu() -> None:
    """`matmul_tiles(..., accumulators=k)`: on a GPU BLOCK_M halves (to 64), then BLOCK_N,
    until k float32 accumulator tiles fit ACCUMULATOR_REGISTERS a thread; the interpreter's
    tile is unchanged."""
    one = matmul_tiles(2, 1024, 341, 128)
    three = matmul_tiles(2, 1024, 341, 128, accumulators=3)
    assert one[90].block_m == 128 and three[90].block_m == 64      # the FFN kernel's sm_90 tile
    assert three[0] == one[0]
    for arch, t in three.items():
        if arch:
            assert 3 * t.block_m * t.block_n <= ACCUMULATOR_REGISTERS * 32 * t.num_warps
            assert t.block_m >= 64 or t.block_m == one[arch].block_m


def test_a_column_reduction_takes_adjacent_rows_and_column_blocks_on_cuda() -> None:
    """A reduction whose rows are contiguous in memory (its input's last axis kept: a sum
    over tokens) with at least COLUMN_ELEMENTS elements takes COLUMN_ROWS rows a program on
    CUDA and loops over column blocks (`meta.cuda_column_blocks`); smaller ones, and every
    one with TITANC_GPU_BLOCKS=0, keep the interpreter's. large_125m's layer backward
    (768 channels x 32,768 tokens): 16 rows of 128-column blocks, no spill on sm_90."""
    from titanc.codegen.meta import COLUMN_ELEMENTS, COLUMN_ROWS, cuda_column_blocks

    assert cuda_column_blocks(768, 32768) == (COLUMN_ROWS, 128)
    assert cuda_column_blocks(64, 256) is None                  # tiny.yaml's: latency-bound
    assert cuda_column_blocks(8, COLUMN_ELEMENTS) == (8, 128)   # fewer rows than COLUMN_ROWS
    assert cuda_column_blocks(COLUMN_ELEMENTS, 64) is None      # a row is one column block
    with config.override(gpu_blocks=False):
        assert cuda_column_blocks(768, 32768) is None
    c = compile_graphs(load_spec(ROOT / "examples" / "large_125m.yaml", {
        "model.n_layers": 1, "model.seq_len": 1024, "model.vocab_size": 64,
        "train.dtype": "bfloat16"}))
    seen = []
    with fresh_kernel_modules():
        for launch in record_launches(c.plans["training"]):
            module = render.load_module(launch.source, launch.name, interpret=False)
            for m in getattr(module, "MEMBERS", None) or [module]:
                cols = getattr(m, "COLS", None)
                if cols and cols[True] != cols[False]:
                    seen.append((launch.name, m.BLOCKS[True], cols[True]))
    assert seen and all(r == COLUMN_ROWS and c == 128 for _, r, c in seen), seen


def test_column_blocks_compute_the_same(monkeypatch) -> None:
    """Every column reduction of tiny_lmm at the test sizes with the CUDA column layout
    (COLUMN_ELEMENTS lowered so that they qualify), run by the interpreter: the cpu target's
    results in float64 (the columns are summed block by block, another order)."""
    from titanc.codegen import meta

    monkeypatch.setattr(meta, "COLUMN_ELEMENTS", 1)
    monkeypatch.setattr(meta, "COLUMN_TILE", 16 * meta.COLUMN_ROWS)   # 16-column blocks
    c = _compiled("tiny_lmm")
    plan, inputs = c.plans["training"], _inputs(c)
    cpu = ArenaExecutor(plan).run(inputs)
    with fresh_kernel_modules(cuda_blocks=True) as changed:
        got = TritonExecutor(plan).run(inputs)
    looped = [m for m in changed if getattr(m, "COLS", {False: 0, True: 0})[True] == 16]
    assert looped, "no column reduction took the column layout"
    for k, v in cpu.items():
        torch.testing.assert_close(got[k], v, rtol=1e-9, atol=1e-11, msg=lambda m: f"{k}: {m}")
