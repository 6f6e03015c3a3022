"""The lowered program (codegen/lowered.py): one flat list of steps per graph that the cpu
target, the triton target and the emitted program.py each walk (siblings, issue 28)."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # read when kernels are decorated: set first

import importlib.util  # noqa: E402
import re  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import tests.reference as R  # noqa: E402
from titanc.codegen.emit import GRAPHS, emit_artifact, lowered_program  # noqa: E402
from titanc.codegen.lower.dispatch import plan_kernels  # noqa: E402
from titanc.codegen.lowered import Launch, Lowered, ScanLaunch, ScanLoop, lower  # noqa: E402
from titanc.compiler import compile_graphs  # noqa: E402
from titanc.model.spec import load_spec  # noqa: E402
from titanc.runtime.targets.executor import ArenaExecutor, PlanExecutor  # noqa: E402
from titanc.runtime.targets.triton_executor import TritonExecutor  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SMALL = {"model.d_model": 16, "model.n_layers": 1, "model.seq_len": 8, "model.vocab_size": 16,
         "model.ffn_hidden": 24, "model.memory.chunk_size": 4, "model.attention.segment": 4,
         "model.attention.window": 4, "model.attention.persistent_tokens": 2,
         "train.batch_size": 1, "train.loss_chunk": 0, "train.dtype": "float64"}

def compiled(example: str = "tiny_lmm") -> Any:
    return compile_graphs(load_spec(ROOT / "examples" / f"{example}.yaml", SMALL))


def _inputs(c: Any) -> dict[str, torch.Tensor]:
    return {"tokens": torch.randint(0, 16, (1, 9), generator=torch.Generator().manual_seed(3)),
            **R.init_params(c.spec.model, seed=1)}


def _names(low: Lowered) -> list[str]:
    return [s.kernel.name for s in low.steps]


def test_lower_is_the_schedule_without_no_ops() -> None:
    plan = compiled().plans["training"]
    low = lower(plan)
    kept = [k for k in range(len(plan.schedule.kernels)) if not plan.is_noop(k)]
    assert [s.index for s in low.steps] == kept
    assert all(isinstance(s, (Launch, ScanLoop)) for s in low.steps)   # no scan kernels asked
    loops = [s for s in low.steps if isinstance(s, ScanLoop)]
    assert loops and all(s.body.plan is plan.bodies[s.scan] for s in loops)
    assert low.walk()[0] is low and len(low.walk()) > 1


def test_the_targets_are_siblings() -> None:
    assert not issubclass(TritonExecutor, ArenaExecutor)
    assert not issubclass(ArenaExecutor, TritonExecutor)
    assert issubclass(TritonExecutor, PlanExecutor) and issubclass(ArenaExecutor, PlanExecutor)


@pytest.mark.parametrize("cls", [ArenaExecutor, TritonExecutor], ids=["cpu", "triton"])
def test_each_target_walks_its_lowered_program(cls: type) -> None:
    """An executor runs the steps of the program it lowered, and only those: a target whose
    `lower` drops a step launches everything but that step."""
    plan = compiled().plans["training"]
    ex = cls(plan)
    assert ex._b.order == _names(ex.program)
    if cls is TritonExecutor:
        assert ex.launches_per_run() == ex.program.launches()
        assert {s.kernel.name for s in ex.program.scan_steps() if isinstance(s, ScanLoop)} \
            == {f["scan"] for f in ex.fallbacks}

    class Dropping(cls):  # type: ignore[misc, valid-type]
        def lower(self, plan: Any) -> Lowered:
            low = super().lower(plan)
            low.steps = [s for s in low.steps if s.index != last.index]
            return low

    last = cls(plan).program.steps[-1]
    dropped = Dropping(plan)
    assert dropped._b.order == _names(ex.program)[:-1]


def _import(path: Path, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_program_py_prints_the_lowered_program(tmp_path: Path) -> None:
    """program.py's launches, graph by graph, are the lowered program's steps (a loop's
    prologue and its body function in place of the scan), as the triton target lowers it."""
    c = compiled("tiny_mal")
    emit_artifact(c, tmp_path)
    source = (tmp_path / "program.py").read_text()
    for graph in GRAPHS:
        plan = c.plans[graph]
        rendered = {(id(p), k.name): code for p, k, code in plan_kernels(
            plan, scan_kernels=True)}
        low = lowered_program(plan, rendered)
        ex = TritonExecutor(plan)
        assert [type(s) for s in low.steps] == [type(s) for s in ex.program.steps]
        assert _names(low) == _names(ex.program)
        body = source.split(f"\ndef {graph}(arena")[1].split("\ndef ")[0]
        launched = re.findall(r"^ {4,8}(?:out = )?(\w+)(?:\.launch|\(ws\[)", body, re.M)
        want = []
        for s in low.steps:
            if isinstance(s, ScanLoop):
                want += ([s.prologue.name] if s.prologue is not None else [])
                want.append(f"{graph}_{s.kernel.name}_body")
            else:
                want.append(s.kernel.name)
        assert launched == want


@pytest.mark.parametrize("example", ["tiny_mal", pytest.param("tiny_lmm", marks=pytest.mark.slow)])
def test_program_py_equals_both_targets(tmp_path: Path, example: str) -> None:
    """program.py == the triton target == the cpu target on the forward and training graphs
    (float64)."""
    c = compiled(example)
    art = emit_artifact(c, tmp_path)
    source = (tmp_path / "program.py").read_text()
    # the memory's chunk loops are kernels inside the layer scan's body, a host loop
    # (codegen/scan/kernel.py scan_form)
    assert "ws = workspace(" in source and "for i, t in enumerate(layout.order()):" in source
    assert set(art.modules) == {"forward", "training", "optimizer"}
    program = _import(tmp_path / "program.py", f"titanc_lowered_{example}")
    inputs = _inputs(c)
    for graph in ("forward", "training"):
        plan = c.plans[graph]
        arena, persistent = program.allocate(graph)
        got = getattr(program, graph)(arena, persistent,
                                      {k: inputs[k] for k in program.INPUTS[graph]})
        for cls in (ArenaExecutor, TritonExecutor):
            want = cls(plan).run(inputs)
            assert set(got) == set(want)
            for k, v in want.items():
                torch.testing.assert_close(got[k], v, rtol=1e-9, atol=1e-11,
                                           msg=lambda m: f"{cls.__name__} {graph} {k}: {m}")
