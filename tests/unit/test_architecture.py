"""The layering of docs/architecture.md, checked on the source: the layer table, no cycles, no
private name used outside its module, the environment read in one place, the declared
pipeline, and no op conditional in the scan kernel outside its lowering table."""
from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

from titanc import config
from titanc.errors import TitancError

os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton fixes its mode at first import

ROOT = Path(__file__).resolve().parents[2]

# subpackages of titanc that live in their own top-level folder (pyproject.toml package-dir)
PACKAGE_DIRS = {"ir", "passes", "codegen", "runtime"}

# docs/architecture.md, "Layers": each layer and the layers its modules may import
# (the table there is generated from these two dicts: `layer_table`)
LAYER_OF = {                       # module prefix -> layer; the longest prefix wins
    "titanc": "facade", "titanc.errors": "base", "titanc.config": "base",
    "titanc.files": "base", "titanc.version": "base", "titanc.bounds": "base",
    "titanc.cache_files": "base",
    "titanc.ir": "ir", "titanc.passes": "passes", "titanc.codegen": "codegen",
    "titanc.model": "model", "titanc.model.spec": "model.spec", "titanc.model.params": "model.spec",
    "titanc.model.spec_engine": "model.spec", "titanc.model.objective": "model.spec",
    "titanc.compiler": "compiler", "titanc.fit": "compiler", "titanc.compile_cache": "compiler",
    "titanc.runtime": "engine", "titanc.runtime.train": "applications",
    "titanc.runtime.serve": "applications", "titanc.runtime.data": "applications",
    "titanc.runtime.diagnostics": "applications",
    "titanc.tools": "tools", "titanc.train": "tools",
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
    "engine": {"base", "ir", "codegen", "model.spec", "engine"},
    "applications": {"base", "ir", "model.spec", "engine", "applications", "facade"},
    "facade": {"base", "ir", "passes", "codegen", "model.spec", "model", "compiler", "engine",
               "applications", "facade"},
    "tools": {"base", "ir", "passes", "codegen", "model.spec", "model", "compiler", "engine",
              "applications", "facade", "tools"},
}
WHAT = {
    "base": "errors, config (settings from the environment), files (atomic writes), version, "
            "bounds (every numeric input's range)",
    "ir": "graph, ops and their registry, builder, printer, verifier, interpreter; the plan "
          "types the backends consume: `ir/schedule.py` (Schedule, Kernel), "
          "`ir/buffer_plan.py` (BufferPlan, ScanHomes, views)",
    "passes": "graph passes, fusion, the buffer planner (`passes/buffer_plan.py`)",
    "codegen": "Triton kernels rendered from a schedule and its plan; program.py",
    "model.spec": "the model's description: `model.spec` (the schema), `model.spec_engine` "
                  "(its validation and YAML engine), `model.params`, `model.objective` (the "
                  "memory's inner objective, as IR)",
    "model": "the frontend: lowers a spec to graphs (`frontend`, `decode`, blocks, attention, "
             "neural memory)",
    "compiler": "`compiler.py`, the one pipeline for every graph kind; `compile_cache.py`, "
                "its results on disk; `fit.py`",
    "engine": "the runtime's engine, `runtime/*.py` and `runtime/targets/`: `program.py` "
              "(Program, the compiled model's calls), the targets (cpu, triton) and their "
              "lowered-program executors, the lr schedule, document inputs, API input checks",
    "applications": "what runs on the engine: `runtime/train/`, `runtime/serve/`, "
                    "`runtime/data/`, `runtime/diagnostics/`",
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


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _module_names(mod: str, tree: ast.AST, root: Path | None) -> dict[str, str]:
    """Local names bound to titanc modules in a file: `import a.b as c`, `from a import b`
    (b a module)."""
    package = mod.rsplit(".", 1)[0]
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update({a.asname: a.name for a in node.names if a.asname})
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            for a in node.names:
                if _module_file(f"{base}.{a.name}", root) is not None:
                    out[a.asname or a.name] = f"{base}.{a.name}"
    return {k: v for k, v in out.items() if v.split(".")[0] == "titanc"}


def private_imports(root: Path | None = None) -> list[str]:
    """A private name used outside its module: `from m import _x`, or `m._x` through a
    module `m` the file imports (the importer another module of the product packages)."""
    bad = []
    for mod, path in all_modules(root).items():
        where = path.relative_to(root or ROOT)
        for dep, name, line in imports(mod, path, root):
            if _private(name) and dep != mod:
                bad.append(f"{where}:{line}: {mod} imports {dep}.{name}")
        tree = ast.parse(path.read_text())
        names = _module_names(mod, tree, root)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr) and \
                    isinstance(node.value, ast.Name) and node.value.id in names:
                bad.append(f"{where}:{node.lineno}: {mod} uses "
                           f"{names[node.value.id]}.{node.attr}")
    return bad


# the scan kernel's op knowledge: its TRITON_SCAN lowering table (codegen/scan/rules.py)
SCAN_TABLE = "rules.py"


def scan_op_conditionals(root: Path | None = None) -> list[str]:
    """Op tests in codegen/scan/ outside its lowering table: a name `Op` / `OpGroup` (as in
    `n.op is Op.SCAN`, `op in OpGroup.ELEMENTWISE`) or a comparison of a node's `.op`."""
    root = root or ROOT
    bad = []
    for path in sorted((root / "codegen" / "scan").glob("*.py")):
        if path.name == SCAN_TABLE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Name) and node.id in ("Op", "OpGroup"):
                bad.append(f"{path.relative_to(root)}:{node.lineno}: {node.id}")
            elif isinstance(node, ast.Compare) and any(
                    isinstance(x, ast.Attribute) and x.attr == "op"
                    for x in [node.left, *node.comparators]):
                bad.append(f"{path.relative_to(root)}:{node.lineno}: compares .op")
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


# private names still used outside their module, in files their owners are restructuring:
# each becomes a public name of its module (then leaves this list)
PRIVATE_LEFT: set[tuple[str, str]] = set()


def test_no_private_name_is_used_outside_its_module() -> None:
    left = [v for v in private_imports()
            if (v.split(":")[0], v.rsplit(" ", 1)[-1]) not in PRIVATE_LEFT]
    assert left == []


def test_the_scan_kernel_asks_its_lowering_table_about_ops() -> None:
    """Whether an op stays inside a scan kernel, and how, is its TRITON_SCAN rule alone."""
    assert scan_op_conditionals() == []


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
    (tmp_path / "passes" / "y.py").write_text("from titanc.passes import x\nx._helper()\n")
    (tmp_path / "passes" / "z.py").write_text("from .x import _helper\n")
    (tmp_path / "runtime" / "targets").mkdir()
    (tmp_path / "runtime" / "targets" / "up.py").write_text(
        "from titanc.runtime.train.trainer import Trainer\n")
    bad = layer_violations(tmp_path)
    assert any("titanc.runtime.leak (engine) imports titanc.model.decode (model)" in v
               for v in bad)
    assert any("titanc.runtime.targets.up (engine) imports titanc.runtime.train.trainer "
               "(applications)" in v for v in bad)
    assert private_imports(tmp_path) == [
        "titanc/model/decode.py:1: titanc.model.decode imports titanc.passes.x._helper",
        "passes/y.py:2: titanc.passes.y uses titanc.passes.x._helper",
        "passes/z.py:1: titanc.passes.z imports titanc.passes.x._helper"]
    assert cycles(tmp_path) == [["titanc.codegen.a", "titanc.codegen.b"]]
    assert environment_uses(tmp_path) == ["passes/x.py:2: titanc.passes.x: os.environ"]
    (tmp_path / "codegen" / "scan").mkdir()
    (tmp_path / "codegen" / "scan" / "rules.py").write_text("ok = n.op is Op.SCAN\n")
    (tmp_path / "codegen" / "scan" / "s.py").write_text("a = n.op == b\nc = op in OpGroup.X\n")
    assert scan_op_conditionals(tmp_path) == ["codegen/scan/s.py:1: compares .op",
                                              "codegen/scan/s.py:2: OpGroup"]
