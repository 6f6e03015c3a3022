"""The layering of docs/architecture.md, checked on the source: the runtime never reaches a
frontend module, every graph kind goes through the one pipeline, and imports change no
process-wide state."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from titanc import config
from titanc.errors import TitancError

os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton fixes its mode at first import

ROOT = Path(__file__).resolve().parents[1]

# subpackages of titanc that live in their own top-level folder (pyproject.toml package-dir)
PACKAGE_DIRS = {"ir", "passes", "codegen", "runtime"}

# docs/architecture.md, "Layers": each layer and the layers its modules may import
# (the table there is generated from these two dicts: `layer_table`)
LAYER_OF = {                       # module prefix -> layer; the longest prefix wins
    "titanc": "facade", "titanc.errors": "base", "titanc.config": "base",
    "titanc.files": "base", "titanc.version": "base",
    "titanc.ir": "ir", "titanc.passes": "passes", "titanc.codegen": "codegen",
    "titanc.model": "model", "titanc.model.spec": "model.spec", "titanc.model.params": "model.spec",
    "titanc.compiler": "compiler", "titanc.fit": "compiler",
    "titanc.runtime": "runtime", "titanc.tools": "tools", "titanc.train": "tools",
    "titanc.__main__": "tools",
}
MAY_IMPORT = {
    "base": {"base"},
    "ir": {"base", "ir"},
    "passes": {"base", "ir", "passes"},
    "codegen": {"base", "ir", "passes", "codegen"},
    "model.spec": {"base", "ir", "model.spec"},
    "model": {"base", "ir", "passes", "model.spec", "model"},
    "compiler": {"base", "ir", "passes", "codegen", "model.spec", "model", "compiler"},
    "runtime": {"base", "ir", "codegen", "model.spec", "runtime", "facade"},
    "facade": {"base", "ir", "passes", "codegen", "model.spec", "model", "compiler", "runtime",
               "facade"},
    "tools": {"base", "ir", "passes", "codegen", "model.spec", "model", "compiler", "runtime",
              "facade", "tools"},
}
WHAT = {
    "base": "errors, config (settings from the environment), files (atomic writes), version",
    "ir": "graph, ops and their registry, builder, printer, verifier, interpreter; the plan "
          "types the backends consume: `ir/schedule.py` (Schedule, Kernel), "
          "`ir/buffer_plan.py` (BufferPlan, ScanHomes, views)",
    "passes": "graph passes, fusion, the buffer planner (`passes/buffer_plan.py`)",
    "codegen": "Triton kernels rendered from a schedule and its plan; program.py",
    "model.spec": "the model's description: `model.spec`, `model.params`",
    "model": "the frontend: lowers a spec to graphs (`frontend`, `decode`, blocks, attention, "
             "neural memory)",
    "compiler": "`compiler.py`, the one pipeline for every graph kind; `fit.py`",
    "runtime": "targets (cpu, triton), train, data, serve, diagnostics, program.py",
    "facade": "`titanc/__init__.py`: `titanc.compile`, `titanc.load` (the public API)",
    "tools": "the CLI, inspect, bench, demo, artifact, cost model",
}
# the only modules that read or write os.environ: the CLI entry points and titanc.config
ENVIRONMENT = {"titanc.config", "titanc.tools.cli", "titanc.tools.aot"}


def layer_of(mod: str) -> str:
    best = max((p for p in LAYER_OF if mod == p or mod.startswith(p + ".")), key=len)
    return LAYER_OF[best]


def layer_table() -> str:
    """The markdown table of docs/architecture.md's "Layers" section."""
    rows = ["| layer | holds | may import |", "|---|---|---|"]
    for layer, allowed in MAY_IMPORT.items():
        others = [l for l in MAY_IMPORT if l in allowed and l != layer]
        rows.append(f"| {layer} | {WHAT[layer]} | {', '.join(others) or '(nothing)'} |")
    return "\n".join(rows) + "\n"


def _module_file(mod: str, root: Path | None = None) -> Path | None:
    """The source file of a titanc module: titanc.runtime.x lives in runtime/x.py (the
    package-dir mapping of pyproject.toml), titanc.model.x in titanc/model/x.py."""
    root = root or ROOT
    parts = mod.split(".")
    if parts[0] != "titanc":
        return None
    top = parts[1:2] if parts[1:2] and parts[1] in PACKAGE_DIRS else ["titanc"] + parts[1:2]
    base = root.joinpath(*top, *parts[2:])
    for cand in (base.with_suffix(".py"), base / "__init__.py"):
        if cand.is_file():
            return cand
    return None


def all_modules(root: Path | None = None) -> dict[str, Path]:
    """Every titanc module of the source tree: name -> file."""
    root = root or ROOT
    out = {}
    for folder in ["titanc", *sorted(PACKAGE_DIRS)]:
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root).with_suffix("").parts
            parts = rel[1:] if folder == "titanc" else rel
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            out[".".join(("titanc",) + tuple(parts))] = path
    return out


def imports(mod: str, path: Path, root: Path | None = None) -> list[tuple[str, str, int]]:
    """(module, imported name or "", line) for every titanc import in `path`, at module level
    or inside functions; `from m import x` where x is a submodule imports titanc module m.x."""
    package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    out: list[tuple[str, str, int]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, "", node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            for a in node.names:
                sub = f"{name}.{a.name}"
                out.append((sub, "", node.lineno) if _module_file(sub, root) is not None
                           else (name, a.name, node.lineno))
    return [i for i in out if i[0].split(".")[0] == "titanc"]


def import_graph(root: Path | None = None) -> dict[str, set[str]]:
    mods = all_modules(root)
    return {m: {d for d, _, _ in imports(m, p, root) if d != m} for m, p in mods.items()}


def layer_violations(root: Path | None = None) -> list[str]:
    bad: list[str] = []
    for mod, path in all_modules(root).items():
        for dep, _, line in imports(mod, path, root):
            if layer_of(dep) not in MAY_IMPORT[layer_of(mod)]:
                bad.append(f"{path.relative_to(root or ROOT)}:{line}: {mod} ({layer_of(mod)}) "
                           f"imports {dep} ({layer_of(dep)})")
    return list(dict.fromkeys(bad))


def cycles(root: Path | None = None) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    graph = import_graph(root)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def private_imports(root: Path | None = None) -> list[str]:
    """`from a.b import _x` where the importer is not in package a (nor a test)."""
    bad = []
    for mod, path in all_modules(root).items():
        for dep, name, line in imports(mod, path, root):
            owner = dep.rsplit(".", 1)[0] if _module_file(dep, root) and \
                not str(_module_file(dep, root)).endswith("__init__.py") else dep
            here = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
            if name.startswith("_") and not name.startswith("__") and owner != here:
                bad.append(f"{path.relative_to(root or ROOT)}:{line}: {mod} imports {dep}.{name}")
    return bad


def environment_uses(root: Path | None = None) -> list[str]:
    """Reads and writes of os.environ / os.getenv / os.putenv outside `ENVIRONMENT`."""
    bad = []
    for mod, path in all_modules(root).items():
        if mod in ENVIRONMENT:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv",
                                                                 "unsetenv") \
                    and isinstance(node.value, ast.Name) and node.value.id == "os":
                bad.append(f"{path.relative_to(root or ROOT)}:{node.lineno}: {mod}: os.{node.attr}")
    return bad


def test_every_import_follows_the_layer_table() -> None:
    assert layer_violations() == []


def test_no_import_cycles_even_through_function_level_imports() -> None:
    assert cycles() == []


def test_no_private_name_is_imported_across_packages() -> None:
    assert private_imports() == []


def test_only_the_cli_and_the_config_touch_the_environment() -> None:
    assert environment_uses() == []


def test_the_layer_table_in_the_docs_is_the_checked_one() -> None:
    assert layer_table() in (ROOT / "docs" / "architecture.md").read_text()


def test_the_pipeline_is_a_table_and_the_diagram_prints_it(capsys) -> None:
    """Every graph kind has a row; each step names the pass it makes; the docs' diagram holds
    `titanc inspect --pipeline`'s text."""
    from titanc.compiler import GRAPH_KINDS, LOWER, PIPELINE, Compiled, pipeline_text
    from titanc.model.params import param_specs
    from titanc.model.spec import load_spec
    from titanc.tools.cli import main

    assert list(PIPELINE) == list(LOWER) == list(GRAPH_KINDS)
    spec = load_spec(ROOT / "examples" / "tiny.yaml")
    c = Compiled(spec, 1, param_specs(spec.model))
    for kind, steps in PIPELINE.items():
        for step in steps:
            assert step.make(c).name == step.name, (kind, step)
    text = pipeline_text()
    docs = (ROOT / "docs" / "architecture.md").read_text()
    assert "\n".join("  " + line for line in text.rstrip("\n").split("\n")) in docs
    assert main(["inspect", "--pipeline"]) == 0
    assert capsys.readouterr().out == text
    assert main(["inspect"]) == 2 and "needs DIR" in capsys.readouterr().err


def test_config_overrides_are_scoped_and_the_cli_reads_the_environment(monkeypatch) -> None:
    from titanc.tools import cli

    base = config.current()
    with config.override(debug=3, scan_kernels=False) as inner:
        assert config.current() is inner and config.debug_level() == 3
        with config.override(debug=1):
            assert config.current().debug == 1 and not config.current().scan_kernels
        assert config.debug_level() == 3
    assert config.current() == base
    seen = []
    monkeypatch.setattr(cli, "_main", lambda argv: seen.append(config.current()) or 0)
    monkeypatch.setenv("TITANC_DEBUG", "2")
    monkeypatch.setenv("TITANC_THREADS", "many")
    assert cli.main([]) == 0 and seen[0].debug == 2 and config.current() == base
    with pytest.raises(TitancError, match="TITANC_THREADS='many'"):
        seen[0].threads_or_none()


def test_the_checks_see_violations(tmp_path) -> None:
    """Each check fails on a tree that breaks its rule (function-level and relative imports
    included), so the tests above can fail."""
    for folder in ("runtime", "codegen", "titanc/model", "passes"):
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "runtime" / "leak.py").write_text("def f():\n    from ..model.decode import lower_step\n")
    (tmp_path / "titanc" / "model" / "decode.py").write_text("from titanc.passes.x import _helper\n")
    (tmp_path / "passes" / "x.py").write_text("import os\nos.environ['A'] = '1'\n")
    (tmp_path / "codegen" / "a.py").write_text("def g():\n    import titanc.codegen.b\n")
    (tmp_path / "codegen" / "b.py").write_text("from titanc.codegen import a\n")
    assert any("titanc.runtime.leak (runtime) imports titanc.model.decode (model)" in v
               for v in layer_violations(tmp_path))
    assert private_imports(tmp_path) == ["titanc/model/decode.py:1: titanc.model.decode imports "
                                         "titanc.passes.x._helper"]
    assert cycles(tmp_path) == [["titanc.codegen.a", "titanc.codegen.b"]]
    assert environment_uses(tmp_path) == ["passes/x.py:2: titanc.passes.x: os.environ"]


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
    y = (x.exp() @ x).sum((0,))          # the einsum reads a computed operand: refused
    b.graph.set_outputs([("y", y.id)])
    with config.override(debug=2):
        fuse(b.graph)
        err = capsys.readouterr().err
        assert "refused: " in err and "reads a computed operand" in err


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
    from titanc.model.spec import load_spec

    for p in (*SHARED, ChunkedLoss(64), CheckpointChunks(), Autodiff(("x",)),
              ConstantsPerReader(), SplitCasts()):
        doc = type(p).__doc__ or ""
        assert isinstance(p.name, str) and ("Pre:" in doc or "pre/postconditions" in doc), p
    seen: list[tuple[str, str]] = []
    spec = load_spec(examples_dir / "tiny.yaml")
    log = PassLog(callbacks=[lambda record, g: seen.append((record["name"], g.name))])
    c = Compiled(spec, 1, param_specs(spec.model), log)
    c.graph("decode_write")
    assert seen == [("frontend", "write"), ("canonicalize", "write"), ("aggregate", "write"),
                    ("flash_attention", "write"), ("split_casts", "write"),
                    ("constants_per_reader", "write")]
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
