"""The arena executor: same numbers as the interpreter, and no allocation after warm-up."""
from __future__ import annotations

import pytest
import torch

import tests.reference as R
import titanc
from tests.helpers import BLOCKS, TINY, tiny_spec, tokens
from titanc.compiler import compile_graphs
from titanc.ir import interpret
from titanc.runtime.targets.executor import ArenaExecutor
from titanc.runtime.diagnostics.alloc_probe import allocations_during


@pytest.mark.parametrize("block", BLOCKS)
def test_executor_matches_interpreter_on_training_graph(block: str) -> None:
    spec = tiny_spec(**{"model.block": block})
    c = compile_graphs(spec)
    inputs = {"tokens": tokens(spec), **R.init_params(spec.model, seed=1)}
    want = interpret(c.grad, inputs)
    ex = ArenaExecutor(c.plans["training"])
    for _ in range(2):                                # the second run reuses every buffer
        got = ex.run(inputs)
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, rtol=1e-10, atol=1e-12)


def test_probe_sees_allocations() -> None:
    x = torch.randn(8, 8)
    assert len(allocations_during(lambda: x + x, [x])) == 1
    out = torch.empty(8, 8)
    assert allocations_during(lambda: torch.add(x, x, out=out), [x, out]) == []


@pytest.mark.parametrize("block", ["attn", "mac", "mag"])
def test_steady_state_training_step_allocates_nothing(block: str) -> None:
    prog = titanc.compile(TINY, **{"model.block": block, "train.grad_accum": 2,
                                   "train.dtype": "float32"})
    toks = tokens(prog.spec, batch=4)
    prog.train_step(toks)                             # warm-up: executors bind their storage
    allocs = allocations_during(lambda: prog.train_step(toks), prog.storages() + [toks])
    assert allocs == []


def test_cpu_target_matches_reference_target() -> None:
    spec = {**TINY, "model": {**TINY["model"], "block": "mal"}}
    progs = [titanc.compile(spec, **{"compile.target": t}) for t in ("cpu", "reference")]
    toks = tokens(progs[0].spec, seed=9)
    losses = [p.train_step(toks) for p in progs]
    assert abs(losses[0] - losses[1]) < 1e-12
    for name, t in progs[0].parameters().items():
        torch.testing.assert_close(t, progs[1].parameters()[name], rtol=1e-10, atol=1e-12)
