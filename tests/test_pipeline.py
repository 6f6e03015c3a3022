"""The pipeline end to end: every graph kind goes through it, scans carry their role, a new op
runs everywhere, and imports or decoding change no process-wide state."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from titanc import config

os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton fixes its mode at first import

ROOT = Path(__file__).resolve().parents[1]


def test_triton_imported_in_compile_mode_is_refused_in_one_line() -> None:
    """On CPU the triton target needs Triton's interpreter, which Triton fixes when it is first
    imported: a process that imported it in compile mode gets a one-line reason, not a crash
    inside a kernel."""
    code = ("import torch.func, triton.language; import titanc; "
            "from titanc.errors import TitancError; "
            "p = titanc.compile('examples/tiny.yaml', **{'compile.target': 'triton', "
            "'model.n_layers': 1, 'model.seq_len': 8, 'model.d_model': 8, "
            "'model.attention.segment': 4, 'model.attention.window': 4, "
            "'model.attention.heads': 2, 'model.memory.chunk_size': 2, 'train.batch_size': 1}); "
            "import torch\n"
            "try:\n    p.loss(torch.zeros(1, 9, dtype=torch.long))\n"
            "except TitancError as e:\n    print('REFUSED', e)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "REFUSED" in r.stdout and "TRITON_INTERPRET=1" in r.stdout


@pytest.mark.parametrize("module", ["titanc.runtime.targets.triton_executor", "titanc.runtime.serve.generate",
                                    "titanc.runtime.program"])
def test_importing_changes_no_process_state(module) -> None:
    """No environment variable or torch flag is changed by importing a runtime module."""
    code = (f"import os, torch; env = dict(os.environ); fd = torch.get_num_threads(); "
            f"import {module}; "
            f"assert dict(os.environ) == env, set(os.environ.items()) ^ set(env.items()); "
            f"assert torch.get_num_threads() == fd")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_decoding_leaves_the_denormal_mode_as_it_was() -> None:
    import torch

    import titanc
    from titanc.runtime.serve.generate import Generator

    from .helpers import tiny_spec

    subnormal = lambda: float(torch.tensor(5e-324, dtype=torch.float64) * 1.0) != 0.0
    assert subnormal()
    gen = Generator(titanc.compile(tiny_spec()))
    assert subnormal()
    gen.generate([[1, 2, 3]], 3)
    assert subnormal()


def test_every_graph_kind_goes_through_the_pipeline(examples_dir) -> None:
    """report.json lists each graph kind with its pass log; the decode write graph is
    aggregated like the training graphs (no per-token outer product survives)."""
    from titanc.tools.artifact import build_report
    from titanc.compiler import GRAPH_KINDS, compile_graphs
    from titanc.model.decode import lower_write
    from titanc.ir import graph_stats
    from titanc.model.spec import load_spec

    spec = load_spec(examples_dir / "tiny.yaml")
    report = build_report(spec, compile_graphs(spec), 0.0)
    assert set(report["graphs"]) == set(GRAPH_KINDS)
    for kind, row in report["graphs"].items():
        names = [p["name"] for p in row["passes"]]
        assert names[-2:] == [f"fusion_{kind}", f"memory_plan_{kind}"], kind
        assert {"canonicalize", "aggregate"} <= set(names), kind
    direct = graph_stats(lower_write(spec, spec.train.batch_size))["largest_tensor_bytes"]
    write = report["graphs"]["decode_write"]
    # the per-token outer product [B, Nm, U, o, i] of the direct graph is gone
    assert write["largest_tensor_bytes"] < direct
    agg = next(p for p in write["passes"] if p["name"] == "aggregate")
    assert agg["largest_tensor_bytes_after"] < agg["largest_tensor_bytes_before"] == direct
    assert write["largest_tensor_bytes"] == agg["largest_tensor_bytes_after"]


def test_scans_carry_their_role(examples_dir) -> None:
    """What a scan is comes from its `role` attribute (body names are only names)."""
    from titanc.compiler import compile_graphs
    from titanc.ir import Op
    from titanc.model.spec import load_spec

    c = compile_graphs(load_spec(examples_dir / "tiny.yaml"))
    roles: dict[str, set[str]] = {}

    def walk(g) -> None:
        for n in g:
            if n.op is Op.SCAN:
                roles.setdefault(n.attr("role"), set()).add(n.attr("body").name)
                walk(n.attr("body"))

    for g in (c.forward, c.grad, c.graph("decode_write").graph, c.graph("logprobs").graph):
        walk(g)
    assert set(roles) == {"layer", "segment", "memory", "loss"}   # chunks too few to group
    assert roles["loss"] == {"logprob_chunk"}        # the training loss is the fused op
    assert {"memory_chunk", "memory_chunk_bwd", "write_layer"} <= roles["memory"]
    assert roles["layer"] == {"layer", "layer_bwd"}


def test_debug_2_prints_fusion_refusals(monkeypatch, capsys) -> None:
    from titanc.ir import Builder
    from titanc.passes.fusion import fuse

    b = Builder("g")
    x = b.input("x", (4, 4), "f32")
    y = ((x @ x).exp() @ x).sum((0,))    # an einsum reads a value after a contraction: refused
    b.graph.set_outputs([("y", y.id)])
    with config.override(debug=2):
        fuse(b.graph)
        err = capsys.readouterr().err
        assert "refused: " in err and "computed after a contraction" in err


@pytest.fixture
def cube():
    """A toy elementwise op, added the way docs/architecture.md says: an `Op` and one registry
    entry (removed again after the test)."""
    import torch

    from titanc.ir import Op
    from titanc.ir.elementwise import Elementwise, register, unregister

    op = Op.define("CUBE")
    register(Elementwise(
        op, 1,
        ref=lambda x: x * x * x,
        out=lambda o, x: torch.pow(x, 3, out=o),
        fold=lambda a: a ** 3,
        vjp=lambda ct, xs, y: [ct * xs[0] * xs[0] * 3.0],
        reads=(0,),
        triton="{0} * {0} * {0}"))
    yield op
    unregister(op)
    delattr(Op, "CUBE")


def _cube_graph(op, scan: bool):
    """loss = sum(cube(x) * w), the cube inside a two-step scan when `scan`."""
    from titanc.ir import Builder

    b = Builder("forward")
    x = b.input("x", (2, 3, 4), "f64")
    w = b.input("w", (3, 4), "f64")
    if scan:
        def body(bb, carry, xs, consts):
            return [carry[0] + bb.op(op, xs[0]) * consts[0]], []
        (acc,), _ = b.scan(body, [b.full(0.0, (3, 4), "f64")], [x], [w])
        loss = acc.sum((0, 1))
    else:
        loss = (b.op(op, x) * w).sum((0, 1, 2))
    b.graph.set_outputs([("loss", loss.id)])
    return b.graph


@pytest.mark.parametrize("scan", [False, True])
def test_a_new_elementwise_op_runs_everywhere(cube, scan: bool) -> None:
    """interpreter, autodiff, the cpu target and the triton target (interpreted), from the
    registry entry alone."""
    import torch

    from titanc.ir import interpret
    from titanc.passes.autodiff import grad_graph
    from titanc.passes.canonicalize import canonicalize
    from titanc.passes.fusion import fuse
    from titanc.passes.buffer_plan import plan_buffers
    from titanc.runtime.targets.executor import ArenaExecutor
    from titanc.runtime.targets.triton_executor import TritonExecutor

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    want = (x ** 3 * w).sum()
    want.backward()
    g = canonicalize(grad_graph(_cube_graph(cube, scan), ["x", "w"]))
    assert any(n.op is cube for n in g) or scan
    inputs = {"x": x.detach(), "w": w.detach()}
    plan = plan_buffers(fuse(g), set())
    for name, run in (("interpreter", lambda: interpret(g, inputs)),
                      ("cpu", lambda: ArenaExecutor(plan).run(inputs)),
                      ("triton", lambda: TritonExecutor(plan).run(inputs))):
        got = run()
        torch.testing.assert_close(got["loss"], want.detach(), rtol=1e-12, atol=1e-12,
                                   msg=name)
        torch.testing.assert_close(got["grad.x"], x.grad, rtol=1e-12, atol=1e-12, msg=name)
        torch.testing.assert_close(got["grad.w"], w.grad, rtol=1e-12, atol=1e-12, msg=name)
    # constant folding uses the entry's `fold`
    from titanc.ir import Builder
    b = Builder("c")
    c = b.op(cube, b.full(2.0, (), "f64"))
    b.graph.set_outputs([("c", c.id)])
    folded = canonicalize(b.graph)
    out = folded.node(folded.outputs[0][1])
    assert out.op.name == "FULL" and out.attr("value") == 8.0


def test_passes_are_typed_objects_and_the_log_calls_back(examples_dir) -> None:
    """Each graph pass of the pipeline is a `Pass` (name, options as fields, a docstring); a
    callback added to the log sees every pass's record and graph."""
    from titanc.compiler import SHARED, Compiled
    from titanc.model.params import param_specs
    from titanc.passes.autodiff import Autodiff
    from titanc.passes.checkpoint_chunks import CheckpointChunks
    from titanc.passes.chunked_loss import ChunkedLoss
    from titanc.passes.constants import ConstantsPerReader
    from titanc.passes.manager import PassLog
    from titanc.passes.split_casts import SplitCasts
    from titanc.passes.views_per_reader import ViewsPerReader
    from titanc.model.spec import load_spec

    for p in (*SHARED, ChunkedLoss(64), CheckpointChunks(), Autodiff(("x",)),
              ConstantsPerReader(), SplitCasts(), ViewsPerReader()):
        doc = type(p).__doc__ or ""
        assert isinstance(p.name, str) and ("Pre:" in doc or "pre/postconditions" in doc), p
    seen: list[tuple[str, str]] = []
    spec = load_spec(examples_dir / "tiny.yaml")
    log = PassLog(callbacks=[lambda record, g: seen.append((record["name"], g.name))])
    c = Compiled(spec, 1, param_specs(spec.model), log)
    c.graph("decode_write")
    assert seen == [("frontend", "write"), ("canonicalize", "write"), ("aggregate", "write"),
                    ("flash_attention", "write"), ("hoist_scan_invariants", "write"),
                    ("split_casts", "write"),
                    ("constants_per_reader", "write"), ("views_per_reader", "write")]
    assert ChunkedLoss(0)(c.graph("decode_write").graph) is c.graph("decode_write").graph


def test_every_op_has_exactly_one_registry_entry() -> None:
    """Each op's rules live in one entry: elementwise.py or structural.py, never both, never
    neither (docs/architecture.md, "The op registry")."""
    from titanc.ir import Op
    from titanc.ir.elementwise import ELEMENTWISE
    from titanc.ir.structural import STRUCTURAL

    ops = [v for v in vars(Op).values() if isinstance(v, Op)]
    assert len(ops) > 30
    assert [o for o in ops if (o in ELEMENTWISE) == (o in STRUCTURAL)] == []
