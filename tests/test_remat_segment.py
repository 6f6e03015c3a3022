"""`train.remat: per_segment`: a layer's per-token work a segment at a time, MAC one sequence
at a time (blocks.Parallel).

- parity (float64, 1e-10): loss and every gradient equal the no-remat program's, for every
  block kind, on the reference interpreter and on the cpu target's arena executor, with
  the MAC conv history crossing segment boundaries (kernel 4), no conv (kernel 1), and a
  segment shorter than the conv history (the unsegmented MAC is kept);
- structure: no whole-sequence FFN hidden value exists in any plan; while the MAC backward
  runs, the only whole-sequence buffers of the layer backward are the cotangent it reads and
  the one it writes (per_layer keeps the queries' projection, conv taps and norm alive
  there), and inside it nothing is bigger than one sequence's [T, D]; the arena of a
  scaled-down large_125m (MAC, 2 layers, 8 segments, batch 4) shrinks below 0.6x.
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # the triton test: set before triton is imported

from pathlib import Path

import pytest
import torch

import tests.reference as R
from tests.helpers import (BLOCKS, one_step_on_both_targets, one_thread,  # noqa: F401
                           plans_nested, tiny_spec, tokens)
from titanc.compiler import compile_graphs
from titanc.ir import Op, interpret
from titanc.ir.buffer_plan import BufferPlan
from titanc.runtime.targets.executor import ArenaExecutor
from titanc.model.spec import load_spec

ROOT = Path(__file__).resolve().parents[1]
BASE = {"model.seq_len": 32, "model.memory.chunk_size": 2, "model.attention.segment": 8}


def _grads(spec, executor: bool = False) -> dict[str, torch.Tensor]:
    c = compile_graphs(spec)
    inputs = {"tokens": tokens(spec), **R.init_params(spec.model, seed=7)}
    if executor:
        return ArenaExecutor(c.plans["training"]).run(inputs)
    return interpret(c.grad, inputs)


def _same(got: dict, want: dict) -> None:
    assert set(got) >= set(want)
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=1e-10, atol=1e-12, msg=lambda m: f"{k}: {m}")


@pytest.mark.parametrize("block,rows", [(b, 1) if b == "mac" else
                                       pytest.param(b, 1, marks=pytest.mark.slow)
                                       for b in BLOCKS] + [pytest.param("mac", 0, marks=pytest.mark.slow)])
def test_per_segment_matches_no_remat_float64(block: str, rows: int) -> None:
    """rows 1: MAC one sequence at a time; 0 (auto): the tiny batch in one group."""
    want = _grads(tiny_spec(**BASE, **{"model.block": block, "train.remat": "none"}))
    seg = tiny_spec(**BASE, **{"model.block": block, "train.remat": "per_segment",
                               "train.remat_rows": rows})
    _same(_grads(seg), want)
    _same({k: v.clone() for k, v in _grads(seg, executor=True).items()}, want)


@pytest.mark.parametrize("extra", [{"model.memory.conv_kernel": 1},
                                   pytest.param({"model.attention.segment": 2,
                                                 "model.memory.chunk_size": 1},
                                                marks=pytest.mark.slow)])
def test_per_segment_mac_conv_history_variants(extra: dict) -> None:
    over = {**BASE, "model.block": "mac", **extra}
    want = _grads(tiny_spec(**over, **{"train.remat": "none"}))
    _same(_grads(tiny_spec(**over, **{"train.remat": "per_segment", "train.remat_rows": 1})),
          want)


def test_per_segment_is_segmented() -> None:
    """The parity above compares different programs: per_segment has the FFN chunk scan, a
    scan over the batch rows, and MAC's query projection inside its segment body; per_layer
    has none of them."""
    def scans(remat: str) -> dict[str, list]:
        fwd = compile_graphs(tiny_spec(**BASE, **{"model.block": "mac", "train.remat": remat,
                                                  "train.remat_rows": 1})).forward
        layer = next(n.attr("body") for n in fwd if n.op is Op.SCAN and n.attr("role") == "layer")
        return {n.attr("body").name: n.attr("body") for n in layer if n.op is Op.SCAN}

    seg, per_layer = scans("per_segment"), scans("per_layer")
    assert set(seg) == {"mac_rows", "ffn_chunk"} and set(per_layer) == {"mac_segment"}
    segment = next(n.attr("body") for n in seg["mac_rows"] if n.op is Op.SCAN)
    names = lambda g: {g.node(i).attr("name") for i in g.inputs}      # noqa: E731
    assert segment.name == "mac_segment" and segment.node(segment.inputs[0]).type.shape[0] == 1
    assert {"x_prev", "mem_wq", "mem_norm"} <= names(segment)
    assert "hq" in names(per_layer["mac_segment"]) and "hq" not in names(segment)


def _large_like(remat: str):
    """large_125m's shape of program at a CPU-test size: MAC, 8 segments, FFN 2.67 D."""
    return load_spec(ROOT / "examples" / "large_125m.yaml", {
        "model.d_model": 64, "model.n_layers": 2, "model.seq_len": 512, "model.ffn_hidden": 172,
        "model.attention.heads": 4, "model.attention.window": 64,
        "model.attention.segment": 64, "model.memory.chunk_size": 16,
        "train.batch_size": 4, "train.remat": remat, "train.remat_rows": 1})


MAC_BWD = ("mac_rows_bwd", "mac_segment_bwd")       # the MAC backward scan, outermost first


def _whole_sequence_live_at_mac_bwd(plan: BufferPlan, row_bytes: int) -> int:
    """Buffers of at least B·T·D floats live while the layer backward runs its MAC backward
    scan (per_segment: over the batch rows, per_layer: over the segments)."""
    def mac_bwd(p: BufferPlan) -> list[int]:
        g = p.schedule.graph
        return [b.first for b in p.buffers if b.kind == "workspace"
                and g.node(b.value).attr("body").name in MAC_BWD]

    layer_bwd = next(p for p in plans_nested(plan) if mac_bwd(p))
    (k,) = mac_bwd(layer_bwd)
    return sum(1 for b in layer_bwd.buffers
               if b.kind != "workspace" and b.first <= k <= b.last and b.size >= row_bytes)


def test_per_segment_shrinks_the_large_like_arena() -> None:
    plans = {}
    for remat in ("per_layer", "per_segment"):
        spec = _large_like(remat)
        plans[remat] = compile_graphs(spec, verify_each=False).plans["training"]
    m, B = spec.model, spec.train.batch_size
    row_bytes = B * m.seq_len * m.d_model * 4                       # one [B, T, D] float32
    assert _whole_sequence_live_at_mac_bwd(plans["per_layer"], row_bytes) > 2
    # per_segment: the FFN-chunk backward's cotangent of the MAC output alone (the MAC rows'
    # cotangent, a reshape of a scan-body output, is written at its home: no second buffer)
    assert _whole_sequence_live_at_mac_bwd(plans["per_segment"], row_bytes) == 1
    for plan in plans_nested(plans["per_segment"]):                # one sequence at a time
        g = plan.schedule.graph
        if g.name == "mac_rows_bwd":
            assert all(b.size <= row_bytes // B for b in plan.buffers if b.kind != "workspace")
    for plan in plans_nested(plans["per_segment"]):                # FFN hidden: a segment's
        g = plan.schedule.graph
        for b in plan.buffers:
            t = g.node(b.value).type
            if b.kind != "workspace" and t.shape and t.shape[-1] == m.ffn:
                assert t.numel <= B * m.attention.segment * m.ffn, (b, t)
    ratio = plans["per_segment"].arena_bytes / plans["per_layer"].arena_bytes
    print(f"large-like arena per_layer {plans['per_layer'].arena_bytes} per_segment "
          f"{plans['per_segment'].arena_bytes} ratio {ratio:.3f}")
    assert ratio < 0.6


@pytest.mark.parametrize("example", ["tiny", pytest.param("tiny_mal", marks=pytest.mark.slow)])
def test_per_segment_triton_matches_cpu_float64(example: str) -> None:
    """The FFN chunk scan and the segmented MAC body on the (interpreted) triton target: one
    sequence (`train.remat_rows` 1: the row scan still runs, once; two rows took 25 s against
    14 s, and the cpu target's tests run several)."""
    from titanc.runtime.targets.triton_executor import TritonExecutor

    pytest.importorskip("triton")
    over = {"model.d_model": 8, "model.n_layers": 1, "model.seq_len": 8, "model.vocab_size": 16,
            "model.ffn_hidden": 8, "train.batch_size": 1, "model.attention.heads": 2,
            "model.attention.segment": 4, "model.attention.window": 4,
            "model.attention.persistent_tokens": 2, "model.memory.chunk_size": 2,
            "model.memory.heads": 1, "train.dtype": "float64", "train.remat": "per_segment",
            "train.remat_rows": 1}
    progs = one_step_on_both_targets(ROOT / "examples" / f"{example}.yaml", over, batch=1)
    assert all(type(ex) is TritonExecutor for ex in progs["triton"].executors.by_graph.values())


def test_peak_lists_what_the_peak_holds() -> None:
    plan = compile_graphs(_large_like("per_segment"), verify_each=False).plans["training"]
    at, live = plan.peak()
    assert sum(b.size for b in live) == plan.peak_activation_bytes
    assert [b.size for b in live] == sorted((b.size for b in live), reverse=True)
    assert all(b.first <= at <= b.last for b in live)


def test_rows_per_group_auto() -> None:
    """Auto (remat_rows 0): large_125m's MAC (S 512, D 768: 1.5 MiB a sequence) runs one
    sequence at a time; the benchmark's (S 64, D 128: 32 KiB) keeps its batch of 4 together;
    an explicit count is rounded down to a divisor of the batch."""
    from titanc.model.blocks import Parallel

    m = _large_like("per_segment").model
    assert Parallel(None, {}, m, True)._rows_per_group(8, 512, 768) == 1   # type: ignore[arg-type]
    assert Parallel(None, {}, m, True)._rows_per_group(4, 64, 128) == 4    # type: ignore[arg-type]
    assert Parallel(None, {}, m, True, 3)._rows_per_group(8, 64, 128) == 2  # type: ignore[arg-type]


def test_memory_stats_unchanged_by_per_segment() -> None:
    """Only the loss graph (forward, training) is segmented: the logits graph that
    runtime.memory_stats watches keeps one chunk scan per layer over the whole batch."""
    import titanc
    from titanc.runtime.diagnostics.neural_memory import memory_stats

    stats = []
    for remat in ("per_layer", "per_segment"):
        spec = tiny_spec(**BASE, **{"model.block": "mac", "train.remat": remat,
                                    "train.remat_rows": 1})
        stats.append(memory_stats(titanc.compile(spec), tokens(spec)))
    assert stats[0] == stats[1] and len(stats[0]["layers"]) == 2


def test_per_segment_mac_options_match_no_remat_float64() -> None:
    """MAC's options (memory.mac_write input, memory.mac_read residual) through the segmented
    scan: the write reads the segment's normalised input, the read h joins the output."""
    opts = {"model.block": "mac", "model.memory.mac_write": "input",
            "model.memory.mac_read": "residual"}
    want = _grads(tiny_spec(**BASE, **opts, **{"train.remat": "none"}))
    _same(_grads(tiny_spec(**BASE, **opts, **{"train.remat": "per_segment",
                                              "train.remat_rows": 1})), want)
