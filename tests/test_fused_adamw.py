"""The optimizer graph as one multi-tensor AdamW (passes/fused_adamw.py).

(c) the optimizer schedule is one kernel (cpu: one kernel of in-place calls; triton: the
norm's partial sums plus one update launch); (e) float64 parity of the cpu target and the
interpreted triton target with the direct (unfused) optimizer graph on the interpreter, with
and without clipping, over flat regions (the program's layout) and over separate tensors;
(d) a graph that is not the direct optimizer graph is left as it is.
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from tests.helpers import tiny_spec
from titanc.codegen.lower.dispatch import render_kernel
from titanc.compiler import SHARED, compile_graphs
from titanc.ir import Op, interpret
from titanc.passes.fused_adamw import FusedAdamW
from titanc.passes.optimizer import optimizer_graph
from titanc.runtime.targets.executor import ArenaExecutor
from titanc.runtime.targets.triton_executor import TritonExecutor


def _direct(c):
    g = optimizer_graph(c.params, c.spec.train, "f64")
    for p in SHARED:
        g = p(g)
    return g


def _inputs(c, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {"lr": torch.tensor(3e-3, dtype=torch.float64),
           "step": torch.tensor(3.0, dtype=torch.float64),
           "grad_scale": torch.tensor(0.5, dtype=torch.float64)}
    for p in c.params:
        for kind, f in (("param", 1.0), ("grad", 4.0), ("opt.m", 0.1), ("opt.v", 0.01)):
            x = torch.randn(p.shape, generator=gen, dtype=torch.float64) * f
            out[f"{kind}.{p.name}"] = x.abs() if kind == "opt.v" else x
    return out


def _flat_bound(c, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """param/grad/m/v each as consecutive views of one flat buffer, as the program binds them."""
    bound = {}
    for kind in ("param", "grad", "opt.m", "opt.v"):
        flat = torch.cat([inputs[f"{kind}.{p.name}"].reshape(-1) for p in c.params])
        at = 0
        for p in c.params:
            n = inputs[f"{kind}.{p.name}"].numel()
            bound[f"{kind}.{p.name}"] = flat[at:at + n].view(p.shape)
            at += n
    return bound


@pytest.mark.parametrize("clip", [1.0, 0.0])
def test_optimizer_is_one_kernel_and_matches_the_direct_graph(clip: float) -> None:
    c = compile_graphs(tiny_spec(**{"model.block": "mac", "train.grad_clip": clip}))
    cg = c.graphs["optimizer"]
    assert [n.op for n in cg.graph].count(Op.ADAMW) == 1
    assert len(cg.schedule.kernels) == 1 and cg.plan.launches() == 1
    code = render_kernel(cg.graph, cg.schedule.kernels[0], dtype="float64")
    assert code.family == "adamw_multi"
    assert code.source.count("@triton.jit") == 2            # the norm's partials, the update
    inputs = _inputs(c)
    want = interpret(_direct(c), inputs)
    runs = {"cpu, flat": lambda: ArenaExecutor(cg.plan, _flat_bound(c, inputs)),
            "cpu, separate": lambda: ArenaExecutor(cg.plan),
            "triton, flat": lambda: TritonExecutor(cg.plan, _flat_bound(c, inputs)),
            "triton, separate": lambda: TritonExecutor(cg.plan)}
    for label, make in runs.items():
        ex = make()
        got = ex.run({k: v.clone() for k, v in inputs.items() if k not in ex.bound})
        for name, ref in want.items():
            torch.testing.assert_close(got[name], ref, rtol=1e-12, atol=1e-14,
                                       msg=lambda m: f"{label}: {name}: {m}")


def test_a_different_graph_is_left_alone() -> None:
    c = compile_graphs(tiny_spec())
    g = _direct(c)
    other = FusedAdamW(tuple(not p.decay for p in c.params), tuple(c.spec.train.betas),
                       c.spec.train.weight_decay, c.spec.train.grad_clip, SHARED)
    assert other(g) is g                                   # decay flags differ: no match
    same = FusedAdamW(tuple(p.decay for p in c.params), tuple(c.spec.train.betas),
                      c.spec.train.weight_decay, c.spec.train.grad_clip, SHARED)
    assert [n.op for n in same(g)].count(Op.ADAMW) == 1
