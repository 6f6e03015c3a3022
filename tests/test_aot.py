"""GPU-readiness without a GPU: every kernel the program launches compiles for sm_80 and sm_90
(`runtime.targets.aot`: launches recorded under the interpreter, compiled by Triton with the ptxas in
its wheel), and offsets turn int64 where a tensor reaches 2**31 elements.

Budgets asserted on every compiled kernel: shared memory within the architecture's
per-block limit (`aot.SHARED_LIMIT`), at most SPILL_BUDGET bytes of register spill stores per
thread (scan kernels included: DESIGN.md §7), and
tensor-core instructions (`mma` on sm_80, `wgmma` on sm_90) in the PTX of every
matmul-family kernel when tf32 is allowed, and bf16 MMA (`mma...bf16`) in every kernel with
16-bit dot operands (`dot16`: a bf16 program's matmuls and its scan kernels' dots of bf16
values). The fast tier (every kernel of tiny.yaml in float32 + tf32, scan kernels included;
its dot kernels in bfloat16; one small bf16 scan kernel) runs in `make test`; large_125m's
column reductions, attention and head in bf16 and the medium width's head and FFN (cold
ptxas compiles of half a minute) in `make test-all`;
TITANC_AOT_FULL=1 adds every tiny example, in float32 and bfloat16 (the numbers are in the
README's "targets" section).
Compiled results are cached on disk by `runtime.targets.aot`, so a second run compiles nothing.
"""
from __future__ import annotations

import ast
import os
import re

os.environ.setdefault("TRITON_INTERPRET", "1")  # read when kernels are decorated: set first

import pytest
import torch

from titanc.runtime.targets import aot
from titanc.codegen.families.scatter import render_scatter_along
from titanc.codegen.lower.dispatch import plan_kernels
from titanc.codegen.meta import EXACT_F32_TILE, MATMUL_TILES, needs_int64
from titanc.codegen.emit import GRAPHS
from titanc.codegen.render import load_module
from titanc.compiler import compile_graphs
from titanc.errors import TitancError
from titanc.runtime.targets.triton_executor import interpreting
from titanc.model.spec import load_spec
from titanc import config

from .conftest import EXAMPLES

SPILL_BUDGET = 256        # bytes of spill stores per thread, every kernel (tiny.yaml's largest:
# 16 B in float32 with tf32, 72 B in bf16; a matmul summing four products spilled 980 B and
# two reductions of 17-21 tensors 264-276 B before they shared one accumulator and ran 8 warps)
ARCHS = (80, 90)


def _record(spec_path, overrides: dict, graphs: tuple[str, ...] = GRAPHS) -> list[aot.Launch]:
    """Every distinct launch (kernel specialisation) of the spec's programs (`graphs`)."""
    compiled = compile_graphs(load_spec(spec_path, overrides))
    launches: dict[str, aot.Launch] = {}
    for g in graphs:
        for launch in aot.record_launches(compiled.plans[g],
                                          allow_tf32=compiled.spec.compile.allow_tf32):
            launches.setdefault(launch.key(), launch)
    return list(launches.values())


def _compile(spec_path, overrides: dict, skip_scan: bool = False,
             graphs: tuple[str, ...] = GRAPHS, only_scan: bool = False,
             only_dot: bool = False, launches: list[aot.Launch] | None = None,
             archs: tuple[int, ...] = ARCHS) -> list[dict]:
    """Compile every distinct launch of the spec's programs (`graphs`; or `launches`, already
    recorded) for ARCHS (cached on disk); `only_scan` keeps scan kernels alone, `only_dot`
    kernels with a `tl.dot`."""
    if launches is None:
        launches = _record(spec_path, overrides, graphs)
    launches = [l for l in launches
                if not (skip_scan and l.is_scan) and not (only_scan and not l.is_scan)
                and not (only_dot and not l.uses_dot)]
    results = aot.compile_all(launches, archs, jobs=2)
    if any("ptxas" in r.get("error", "") and "not found" in r.get("error", "")
           for r in results):
        pytest.skip("this triton build has no ptxas")
    return results


def _check(results: list[dict], tensor_cores: bool) -> None:
    failed = [(r["name"], r["arch"], r["error"]) for r in results if not r["ok"]]
    assert not failed, failed[:3]
    for r in results:
        where = f"{r['name']} sm_{r['arch']}"
        assert r["shared"] <= aot.SHARED_LIMIT[r["arch"]], (where, r["shared"])
        assert r["registers"] is not None, f"{where}: no ptxas -v report"
        assert r["spill_bytes"] <= SPILL_BUDGET, (where, r["spill_bytes"])
        if tensor_cores and r["matmul"]:
            assert r["mma"], f"{where}: no mma in its PTX"
            # wgmma multiplies 64 rows per warpgroup: a tile shrunk to fewer rows (the
            # per-head contractions, M = 16 or 32) takes mma.sync on sm_90
            assert r["wgmma"] or r["arch"] < 90 or r["tile"][0] < 64, \
                f"{where}: no wgmma on sm_90 with a {r['tile']} tile"
        if r["dot16"]:      # bf16 operand tiles (a bf16 program's matmuls and scan dots)
            assert r["mma_bf16"], f"{where}: no bf16 mma in its PTX"


def test_every_tiny_scan_kernel_compiles_for_sm90() -> None:
    """Every scan kernel of tiny.yaml's training, optimizer and forward programs (the memory's
    chunk recurrences, `codegen.scan.kernel.scan_form`; no exemption) compiles for sm_90
    within its shared memory and the spill budget, its dots on tensor cores, and no kernel is
    compiled twice for a host loop's first iteration. The fast tier's AOT check (cold, the
    chunk backward alone is 20 CPU-s a architecture): sm_80, and every kernel, are the slow
    tier's `test_every_tiny_kernel_compiles_for_sm80_and_sm90_with_tensor_cores`."""
    assert interpreting()
    launches = _record(EXAMPLES / "tiny.yaml", {"compile.allow_tf32": True})
    _one_specialisation_per_kernel(launches)
    results = _compile(EXAMPLES / "tiny.yaml", {}, only_scan=True, launches=launches,
                       archs=(90,))
    assert {r["arch"] for r in results} == {90}
    # the memory chunk scans of the MAC segment (forward, the backward's recompute and the
    # backward), one kernel each, each compiled once
    names = [r["name"] for r in results]
    assert len(names) >= 3 and len(set(names)) == len(names), names
    assert all(r["scan"] for r in results)
    assert all(r["mma"] for r in results if r["uses_dot"])
    _check(results, tensor_cores=True)


def _one_specialisation_per_kernel(launches: list[aot.Launch]) -> None:
    """Triton compiles a kernel once per specialisation of its arguments (an integer equal to
    1 becomes a constant). A host loop's first iteration used to read its initial carries as
    stride-0 broadcasts (the zero state, the zero cotangent) and the later iterations dense
    carries, so 13 of tiny.yaml's kernels were compiled twice (35 CPU-s of 165); the
    triton target now lays such an initial carry out densely once (`carry_init`). Kernels
    recorded twice may differ in pointer alignment (a [layers, 2] parameter's second row
    starts 8 bytes in) or a template constant (causal or not), never in an argument's type."""
    by_name: dict[str, list[aot.Launch]] = {}
    for l in launches:
        by_name.setdefault(l.name, []).append(l)
    for name, ls in by_name.items():
        assert all(l.signature == ls[0].signature for l in ls), (
            name, [sorted(set(l.signature) - set(ls[0].signature)) for l in ls])
    assert len(launches) - len(by_name) <= 5, sorted(n for n, ls in by_name.items() if len(ls) > 1)


@pytest.mark.slow
def test_every_tiny_kernel_compiles_for_sm80_and_sm90_with_tensor_cores() -> None:
    """Every kernel of tiny.yaml's training, optimizer and forward programs, scan kernels
    included (the memory's chunk recurrences; the layer and segment scans are host loops of
    ordinary kernels, `codegen.scan.kernel.scan_form`): within each architecture's shared
    memory and the spill budget, with tensor-core dots."""
    assert interpreting()
    results = _compile(EXAMPLES / "tiny.yaml", {"compile.allow_tf32": True})
    assert {r["arch"] for r in results} == set(ARCHS)
    assert sum(r["matmul"] for r in results) >= 2 * 5      # the model's projections, fwd + bwd
    scans = [r for r in results if r["scan"]]
    # the memory chunk scans of the MAC segment (forward, the backward's recompute and the
    # backward), one kernel each
    assert len({r["name"] for r in scans}) >= 3 and len(scans) >= 3 * len(ARCHS)
    assert all(r["mma"] for r in scans if r["uses_dot"])
    _check(results, tensor_cores=True)


@pytest.mark.slow
def test_exact_float32_matmuls_compile_without_spilling() -> None:
    """tiny.yaml's default program (float32, tf32 off): every matmul kernel, its dots FMAs on
    the EXACT_F32_TILE, compiles for sm_80 and sm_90 within the spill budget (on the table's
    128 x 64 x 32 tile one spilled 980 B and several needed 255 registers)."""
    results = _compile(EXAMPLES / "tiny.yaml", {}, only_dot=True)
    mm = [r for r in results if r["matmul"]]
    assert len(mm) >= 20
    failed = [(r["name"], r["arch"], r.get("error")) for r in mm if not r["ok"]]
    assert not failed, failed[:3]
    assert max(r["spill_bytes"] for r in mm) <= SPILL_BUDGET, sorted(
        (r["spill_bytes"], r["name"], r["arch"]) for r in mm)[-3:]


@pytest.mark.slow
def test_exact_float32_attention_at_head_width_64_compiles_without_spilling() -> None:
    """tiny_attn at d_model 128, 2 heads (head width 64), float32, tf32 off: the flash
    templates' FMA dots fit sm_80 and sm_90 within the spill budget (large_125m's forward at
    64-query blocks on 4 warps: 32 registers and 34 KB spilled per thread)."""
    over = {"model.d_model": 128, "model.attention.heads": 2, "model.ffn_hidden": 128}
    launches = [l for l in _record(EXAMPLES / "tiny_attn.yaml", over, ("training",))
                if "attention" in l.name]
    assert {l.num_warps for l in launches} == {8} and len(launches) >= 3
    _check(_compile(EXAMPLES / "tiny_attn.yaml", over, launches=launches),
           tensor_cores=False)


# tiny_lmm shrunk (as tests/test_scan_kernel.py shrinks it): its forward's scan kernel, the
# memory-chunk group scan with the chunk scan inside, is small
SMALL = {"model.d_model": 8, "model.n_layers": 1, "model.seq_len": 8, "model.vocab_size": 16,
         "model.ffn_hidden": 8, "train.batch_size": 1, "model.memory.heads": 2,
         "model.memory.chunk_size": 2}


def test_bf16_scan_kernel_multiplies_on_bf16_tensor_cores() -> None:
    """Under train.dtype bfloat16 a scan kernel's dots of bf16 values take bf16 tiles: the
    PTX has `mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32` (float32 accumulation) on
    sm_80 and sm_90 (`wgmma` needs 64-row tiles; these are 16 x 16), where the float32
    workspace values used to take exact float32 dots (no mma at all). A small such kernel
    (the memory-chunk group scan of a shrunk tiny_lmm forward); every bf16 scan kernel of
    every example is in the TITANC_AOT_FULL tier."""
    assert interpreting()
    results = _compile(EXAMPLES / "tiny_lmm.yaml", {**SMALL, "train.dtype": "bfloat16"},
                       graphs=("forward",), only_scan=True)
    assert {r["arch"] for r in results} == set(ARCHS)
    assert results and all(r["scan"] and r["dot16"] for r in results)
    _check(results, tensor_cores=False)
    assert all(r["mma_bf16"] for r in results)


def test_exact_float32_keeps_ieee_dots() -> None:
    """Without compile.allow_tf32 (the default) no kernel asks for tf32 (float32 stays exact);
    the option is validated like every spec field."""
    assert load_spec(EXAMPLES / "tiny.yaml").compile.allow_tf32 is False
    with pytest.raises(TitancError, match="compile.allow_tf32"):
        load_spec(EXAMPLES / "tiny.yaml", {"compile.allow_tf32": "yes"})
    compiled = compile_graphs(load_spec(EXAMPLES / "tiny.yaml"))
    sources = [code.source for _, _, code in plan_kernels(compiled.plans["training"])]
    assert not any('"tf32"' in s for s in sources)
    tf32 = compile_graphs(load_spec(EXAMPLES / "tiny.yaml", {"compile.allow_tf32": True}))
    assert any('input_precision="tf32"' in code.source
               for _, _, code in plan_kernels(tf32.plans["training"], allow_tf32=True))
    # exact float32 dots are FMAs on a GPU: the small EXACT_F32_TILE, the table's with tf32
    exact = [_tiles(s) for s in sources if "def tiles_for(" in s]
    fast = [_tiles(code.source) for _, _, code in plan_kernels(tf32.plans["training"],
                                                               allow_tf32=True)
            if "def tiles_for(" in code.source]
    assert exact and fast
    for tiles in exact:
        for arch in (80, 90):
            bm, bn, bk, warps, stages = tiles[arch]
            assert (warps, stages) == EXACT_F32_TILE[3:] and bk <= EXACT_F32_TILE.block_k
            assert bm <= EXACT_F32_TILE.block_m and bn <= EXACT_F32_TILE.block_n
    assert any(t[90][:3] != tuple(EXACT_F32_TILE[:3]) for t in fast)
    assert all(t[90][3:] == tuple(MATMUL_TILES[90][4][3:]) for t in fast)


def _tiles(source: str) -> dict[int, tuple[int, ...]]:
    """The per-architecture TILES table a matmul kernel's module states."""
    return ast.literal_eval(re.search(r"^TILES = (\{.*\})$", source, re.M).group(1))


def test_matmul_tiles_fit_each_architecture() -> None:
    """Pipelined operand tiles stay under each architecture's shared memory (the float64
    64^3 x 3-stage tile needed 192 KiB, above A100's 163 KiB)."""
    for arch, by_size in MATMUL_TILES.items():
        for size, t in by_size.items():
            smem = t.num_stages * (t.block_m * t.block_k + t.block_k * t.block_n) * size
            assert arch == 0 or smem <= aot.SHARED_LIMIT[arch] * 0.75, (arch, size, t, smem)


@pytest.mark.skipif(os.environ.get("TITANC_AOT_FULL") != "1",
                    reason="every example with its scan kernels: set TITANC_AOT_FULL=1")
@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("example", sorted(p.name for p in EXAMPLES.glob("tiny*.yaml")))
def test_every_kernel_of_every_example_compiles(example: str, dtype: str) -> None:
    results = _compile(EXAMPLES / example, {"compile.allow_tf32": True, "train.dtype": dtype})
    _check(results, tensor_cores=True)


# --- int64 offsets ----------------------------------------------------------------------------

def _kernel_body(source: str) -> str:
    return source.split("@triton.jit", 1)[1].split("def launch", 1)[0]


@pytest.mark.parametrize("fused", [True, False])
def test_loss_chunk_times_vocab_over_2_31_generates_int64_offsets(fused: bool) -> None:
    """16,384 x 151,936 logits gradient: the fused linear cross-entropy's row and vocabulary
    offsets (or, with `compile.fused_loss: false`, the chunked loss's scatter) are int64; the
    embedding's gradient is the segment sum, whose offsets are int64 at every size."""
    spec = load_spec(EXAMPLES / "tiny.yaml", {"model.vocab_size": 151936,
                                               "train.loss_chunk": 16384,
                                               "train.batch_size": 128,
                                               "compile.fused_loss": fused})
    assert 16384 * 151936 >= 2 ** 31 and needs_int64(16384 * 151936)
    kinds = {}
    for _, kern, code in plan_kernels(compile_graphs(spec).plans["training"]):
        for kind in ("scatter_along", "segment_sum", "cross_entropy"):
            if f"templates/{kind}.py.jinja" in code.source:
                kinds[kind] = "tl.int64" in _kernel_body(code.source)
    loss = "cross_entropy" if fused else "scatter_along"
    assert kinds == {loss: True, "segment_sum": True}


def test_int64_path_matches_torch_when_interpreted() -> None:
    """The wide (int64) variant gives the same results as the narrow one and as torch."""
    torch.manual_seed(0)
    rows, size = 37, 70
    grad1, idx1 = torch.randn(rows), torch.randint(0, size, (rows,))
    want1 = torch.zeros(rows, size).scatter_add_(-1, idx1[:, None], grad1[:, None])
    for wide in (False, True):
        src1 = render_scatter_along(f"k_sa_{int(wide)}", wide=wide)
        assert ("tl.int64" in _kernel_body(src1)) == wide
        out1 = torch.zeros(rows, size)
        load_module(src1, f"k_sa_{int(wide)}").launch(grad1, idx1, out1)
        torch.testing.assert_close(out1, want1, rtol=0, atol=0)


def test_attention_over_2_31_elements_generates_int64_offsets() -> None:
    """q, k, v of 2**31 elements (tiny_attn at batch 65,536 and 512 tokens): the flash kernels'
    query, key and width offsets are int64; at the spec's own batch they stay int32 (batch and
    head offsets are int64 at every size)."""
    def attention_sources(batch: int | None) -> list[str]:
        over = {} if batch is None else {"train.batch_size": batch, "model.seq_len": 512}
        plan = compile_graphs(load_spec(EXAMPLES / "tiny_attn.yaml", over)).plans["training"]
        codes = [code for _, _, code in plan_kernels(plan)
                 if code.family in ("attention_fwd", "attention_bwd")]
        assert {c.family for c in codes} == {"attention_fwd", "attention_bwd"}
        return [c.source for c in codes]
    big, small = attention_sources(65536), attention_sources(None)
    assert 65536 * 512 * 64 >= 2 ** 31 and len(big) == len(small)
    assert all("arange(0, BLOCK_M).to(tl.int64)" in _kernel_body(s) for s in big)
    assert not any("arange(0, BLOCK_M).to(tl.int64)" in _kernel_body(s) for s in small)


def test_int64_attention_path_matches_when_interpreted() -> None:
    """The wide flash kernels (forced at a small size) give the narrow ones' results."""
    from titanc.codegen.families.pattern_ops import KeyGroup, render_attention_bwd, render_attention_fwd

    torch.manual_seed(0)
    groups, lens, T, D = [KeyGroup("p", False), KeyGroup("seq", True, 8)], (2, 19), 19, 12
    q = torch.randn(1, 2, T, D)
    k, v = torch.randn(1, 2, sum(lens), D), torch.randn(1, 2, sum(lens), D)
    do = torch.randn(1, 2, T, D)
    outs = []
    for wide in (False, True):
        kw = dict(groups=groups, head_dim=D, block_m=16, block_n=16, wide=wide)
        fwd, bwd = (render(f"k_att_{part}_{int(wide)}", **kw)
                    for part, render in (("f", render_attention_fwd), ("b", render_attention_bwd)))
        assert all(("arange(0, HEAD_DIM).to(tl.int64)" in _kernel_body(src)) == wide
                   for src in (fwd, bwd))
        o, lse = torch.empty_like(q), torch.empty(1, 2, T)
        ks, vs = k.split(lens, 2), v.split(lens, 2)       # a key and a value view per group
        load_module(fwd, f"k_att_f_{int(wide)}").launch(q, *ks, *vs, o, lse, *lens, D ** -0.5)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        load_module(bwd, f"k_att_b_{int(wide)}").launch(q, *ks, *vs, o, lse, do, dq,
                                                       *dk.split(lens, 2), *dv.split(lens, 2),
                                                       None, *lens, D ** -0.5)
        outs.append((o, lse, dq, dk, dv))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.slow
def test_every_bf16_tiny_kernel_compiles_with_16bit_mma() -> None:
    """train.dtype bfloat16 (passes/precision.py): every kernel with a dot of tiny.yaml's
    training, optimizer and forward programs as the program launches them (bf16 and float32
    pointers mixed; scan kernels: the float32 test and the full tier) compiles for sm_80 and
    sm_90 within the budgets, and every matmul-family kernel multiplies bf16 tiles on tensor
    cores (mma ... bf16 on sm_80, wgmma ... bf16 on sm_90) with float32 accumulation; no tf32
    needed. Every bf16 kernel of every example: the TITANC_AOT_FULL tier."""
    assert interpreting()
    results = _compile(EXAMPLES / "tiny.yaml", {"train.dtype": "bfloat16"}, skip_scan=True,
                       only_dot=True)
    _check(results, tensor_cores=False)
    mm = [r for r in results if r["matmul"]]
    assert len(mm) >= 2 * 5
    for r in mm:
        assert r["mma_bf16"], f"{r['name']} sm_{r['arch']}: no bf16 mma in its PTX"
    # wgmma needs 64 rows per warpgroup: tiny.yaml's per-head contractions (M = 16 or 32,
    # tiles shrunk to the problem) take mma.sync on sm_90, the model-wide projections wgmma
    assert any(r["wgmma"] for r in mm if r["arch"] == 90)


def test_reductions_and_cumsums_over_2_31_elements_index_in_int64() -> None:
    """Every reduction and cumsum kernel indexes rows and columns in int64 exactly when one
    of its tensors reaches 2**31 elements: the softmax over 16,384 x 151,936 logits of the
    chunked loss (`compile.fused_loss: false`) does, the norms do not."""
    spec = load_spec(EXAMPLES / "tiny.yaml", {"model.vocab_size": 151936,
                                               "train.loss_chunk": 16384,
                                               "train.batch_size": 128,
                                               "compile.fused_loss": False})
    seen = {True: 0, False: 0}
    for plan, kern, code in plan_kernels(compile_graphs(spec).plans["training"]):
        if code.family not in ("reduction", "cumsum"):
            continue
        g = plan.schedule.graph
        ids = set(kern.nodes) | {i for n in kern.nodes for i in g.node(n).inputs}
        big = needs_int64(*(g.node(i).type.numel for i in ids
                            if not isinstance(g.node(i).type, tuple)))
        assert ("pid.to(tl.int64)" in _kernel_body(code.source)) == big, kern.name
        seen[big] += 1
    assert seen[True] >= 1 and seen[False] >= 1


def test_int64_reduction_and_cumsum_path_matches_when_interpreted(monkeypatch) -> None:
    """Forced wide, the reduction and cumsum kernels of a memory model give the cpu target's
    loss (interpreted, tiny shapes)."""
    import titanc
    from titanc.codegen.lower import rows as hooks_rows
    from tests.helpers import TINY, tokens

    over = {"model.block": "lmm", "model.n_layers": 1, "train.dtype": "float32"}
    toks = tokens(load_spec(TINY))
    want = titanc.compile(TINY, **over, **{"compile.target": "cpu"}).loss(toks)
    monkeypatch.setattr(hooks_rows, "needs_int64", lambda *numels: True)
    # host loops: the body's reductions and cumsums run as the forced-wide kernels themselves
    with config.override(scan_kernels=False):
        tri = titanc.compile(TINY, **over, **{"compile.target": "triton"})
        plan = tri.compiled.plans["forward"]
        sources = [code.source for _, _, code in plan_kernels(plan)
                   if code.family in ("reduction", "cumsum")]
        assert sources and all("pid.to(tl.int64)" in _kernel_body(s) for s in sources)
        assert any("tl.cumsum" in s for s in sources)
        assert abs(tri.loss(toks) - want) <= 1e-5 * abs(want)


def test_a_failed_compile_is_not_cached(tmp_path, monkeypatch) -> None:
    """A failure is reported, not kept: it may be the compiling process's (a worker left in
    interpreter mode failed every kernel with "'value' object has no attribute 'dtype'"), and
    a cached failure would be reported again by every later run with a sound process."""
    import triton

    launch = _record(EXAMPLES / "tiny_attn.yaml", {}, ("optimizer",))[0]

    def broken(*args, **kwargs):
        raise RuntimeError("the process, not the kernel")

    monkeypatch.setattr(triton, "compile", broken)
    with config.override(cache_dir=tmp_path):
        r = aot.compile_launch(launch, 90)
        assert not r["ok"] and "the process, not the kernel" in r["error"]
        assert not list(tmp_path.glob("aot/*.json"))


@pytest.mark.slow
def test_wide_model_head_and_ffn_kernels_fit_the_spill_budget() -> None:
    """At d_model 128 (the GPU check's medium width) the LM head's cross-entropy kernels (exact
    float32 dots: FMAs) and the FFN's three-contraction matmul compile for sm_90 within the
    spill budget: the CUDA vocabulary block (`pattern_ops.CE_FMA_PER_THREAD`; 8,784 B spilled
    a thread at the interpreter's block) and the accumulator bound on the matmul tile
    (`meta.ACCUMULATOR_REGISTERS`; 336-368 B at 128 x 64)."""
    launches = _record(EXAMPLES / "tiny.yaml",
                       {"model.d_model": 128, "model.n_layers": 1, "model.seq_len": 32,
                        "model.attention.segment": 16, "model.attention.window": 16,
                        "train.batch_size": 1, "train.dtype": "bfloat16"}, graphs=("training",))
    wanted = [l for l in launches if "cross_entropy" in l.name
              or (l.is_matmul and l.source.count("tl.dot(") >= 3)]
    assert len([l for l in wanted if "cross_entropy" in l.name]) == 3, [l.name for l in wanted]
    assert any(l.is_matmul for l in wanted)
    _check(_compile(None, {}, launches=wanted, archs=(90,)), tensor_cores=False)


@pytest.mark.slow
def test_large_bf16_column_reductions_attention_and_head_compile_for_sm90() -> None:
    """At large_125m's sizes in bf16 (one layer, 1,024 tokens), the column reductions (sums
    over the tokens, rows contiguous: 16 rows a program, 128-column blocks on CUDA,
    `meta.cuda_column_blocks`), the flash attention's kernels (128 x 64 and 64 x 64 on 8
    warps, `meta.attention_cuda_blocks`) and the LM head's cross-entropy kernels (the width
    768 in slices of CE_MAX_BLOCK_D; as one 1,024 block the dW kernel spilled 644 B) compile
    for sm_90 within the spill budget, the compile takes those blocks, and the attention
    multiplies with wgmma."""
    launches = _record(EXAMPLES / "large_125m.yaml",
                       {"model.n_layers": 1, "model.seq_len": 1024, "model.vocab_size": 64,
                        "train.dtype": "bfloat16"}, graphs=("training",))
    column = re.compile(r"COLS = \{False: (\d+), True: (\d+)\}")
    columns = [l for l in launches if any(a != b for a, b in column.findall(l.source))]
    attention = [l for l in launches if "_attention" in l.name]
    head = [l for l in launches if "cross_entropy" in l.name]
    assert len(head) == 3 and all("BLOCK_D = 256" in l.source for l in head), \
        [l.name for l in head]
    assert columns, "no column reduction at large_125m's sizes"
    assert {l.name.rsplit("_", 1)[-1] for l in attention} >= {"dq", "dkdv"}, \
        [l.name for l in attention]
    results = _compile(None, {}, launches=columns + attention + head, archs=(90,))
    _check(results, tensor_cores=False)
    assert all(r["wgmma"] for r in results if "_attention" in r["name"]), \
        [(r["name"], r["wgmma"]) for r in results]
    for l in columns + attention:
        module = load_module(l.source, l.name, interpret=False)
        constexprs, _, _ = aot.launch_constexprs(l, module, 90)
        blocks = {k.rsplit("_", 1)[-1] if "_" in k else k: v for k, v in constexprs.items()
                  if "BLOCK" in k}
        if l in columns:
            assert 128 in [v for k, v in constexprs.items() if k.endswith("BLOCK_C")], l.name
        else:
            assert constexprs["BLOCK_N"] == 64 and constexprs["BLOCK_M"] in (64, 128), blocks


def test_mainloop_counts_the_loop_around_the_tensor_core_instructions() -> None:
    """`aot.mainloop` on SASS text: the longest loop holding an MMA, its instructions, MMAs and
    shared stores; a kernel without such a loop has none."""
    sass = "\n".join([
        "        /*0000*/                   MOV R1, c[0x0][0x28] ;",
        "  .L_x_0:",
        "        /*0010*/                   LDGSTS.E.BYPASS.128 [R2], desc[UR4][R4.64] ;",
        "        /*0020*/                   STS.128 [R6], R8 ;",
        "        /*0030*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], R24 ;",
        "        /*0040*/                   IADD3 R3, R3, 0x1, RZ ;",
        "        /*0050*/              @P0   BRA `(.L_x_0) ;",
        "        /*0060*/                   EXIT ;"])
    assert aot.mainloop(sass) == {"instructions": 5, "mma": 1, "shared_stores": 1}
    assert aot.mainloop(sass.replace("HGMMA.64x64x16.F32.BF16", "FFMA")) is None


def test_bf16_matmuls_load_their_operands_straight_into_wgmma() -> None:
    """A bf16 program of 4,096 tokens a micro-batch (passes/hoist_casts.py casts the layers'
    weights before the layer scan): its matmuls whose einsums read kernel inputs as stored
    (no cast or view before them) load both operands straight, so their sm_90 main loop stages nothing through shared stores and
    issues at most 40 instructions per wgmma (a hand-written bf16 matmul: 28.5; with the
    float32 weight rounded in the loop: 71-128, docs/gpu_kernels.md)."""
    assert interpreting()
    spec = {"model.block": "attn", "model.n_layers": 1, "model.d_model": 64,
            "model.ffn_hidden": 128, "model.seq_len": 512, "train.batch_size": 8,
            "train.dtype": "bfloat16"}
    launches = [l for l in _record(EXAMPLES / "tiny_attn.yaml", spec, graphs=("forward",))
                if l.is_matmul]
    # the matmuls whose einsums read kernel inputs as they are: the first IR node of the
    # kernel's header is an einsum (no cast, view or prologue before it)
    direct = {l.name for l in launches
              if re.search(r"# IR nodes:\n#   %\d+:\S+ = einsum\[", l.source)}
    results = _compile(EXAMPLES / "tiny_attn.yaml", spec, launches=launches, archs=(90,))
    plain = [r for r in results if r["name"] in direct]
    assert plain, [r["name"] for r in results]
    for r in plain:
        loop = r["mainloop"]
        assert loop and r["wgmma"], r["name"]
        assert loop["shared_stores"] == 0 and loop["instructions"] <= 40 * loop["mma"], (
            r["name"], loop)
