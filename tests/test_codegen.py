"""Codegen from the IR: Triton kernels for the kernels of a schedule, the emitted program, and
the `triton` target, all under TRITON_INTERPRET=1 on tiny shapes.

- the templates added for the hooks (cumsum, index_add, scatter_along) against torch, with
  sizes that are no multiple of the blocks (masked edges), float32 and float64;
- per-kernel parity (tier d): a sample of generated kernels, one per (family, op set), run on
  random inputs against the reference interpreter evaluating the kernel's own nodes, in
  float32 and in float64 with row loops forced (`hooks_rows.MAX_ROW_BLOCK`);
- mode parity (tier e): one training step (gradient graph + optimizer) of every tiny example
  on target `triton` against target `cpu`, and the emitted program.py against the executor;
- the artifact: byte-identical across compiles and processes, and import-safe for a spec whose
  name, data source and path are hostile strings.

Tolerances. float32 kernels: rtol = atol = 2e-5 (as tests/test_templates.py); float64: 1e-12.
Training step (float32): the loss within 1e-5 relative, gradients rtol 1e-4 / atol 1e-6,
parameters after the AdamW step rtol 1e-5 / atol 1e-7, the clipped gradient norm 1e-5 relative.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # read when kernels are decorated: set first

import pytest
import torch
import yaml

pytest.importorskip("triton")

import titanc
from titanc.codegen.emit import emit_artifact
from titanc.codegen.families import CumsumScan, render_cumsum, render_scatter_along
from titanc.codegen.lower import rows as hooks_rows
from titanc.codegen.lower.dispatch import render_kernel
from titanc.codegen.render import load_module
from titanc.codegen.scan.kernel import ScanFallback
from titanc.compiler import compile_graphs
from titanc.ir import Interpreter, Op
from titanc.runtime.targets.executor import ArenaExecutor
from titanc.runtime.targets.triton_executor import TritonExecutor, launch_tensors, module_for
from titanc.model.spec import load_spec

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning",
                                        "ignore:invalid value encountered:RuntimeWarning",
                                        "ignore:overflow encountered:RuntimeWarning")

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ["tiny", "tiny_attn", "tiny_lmm", "tiny_mag", "tiny_mal"]
SMALL = {"model.d_model": 8, "model.n_layers": 1, "model.seq_len": 8, "model.vocab_size": 16,
         "model.ffn_hidden": 8, "train.batch_size": 1}
TOL = {torch.float32: dict(rtol=2e-5, atol=2e-5), torch.float64: dict(rtol=1e-12, atol=1e-12)}


def small(example: str, **extra: object) -> dict[str, object]:
    """Overrides that keep an example's training step to a few hundred interpreted launches."""
    block = load_spec(ROOT / "examples" / f"{example}.yaml").model.block
    ov: dict[str, object] = dict(SMALL)
    if block != "lmm":
        ov.update({"model.attention.heads": 2, "model.attention.segment": 4,
                   "model.attention.window": 4, "model.attention.persistent_tokens": 2})
    if block != "attn":
        ov.update({"model.memory.chunk_size": 2, "model.memory.heads": 1})
    return {**ov, **extra}


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- templates added for the hooks ----------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("block_c", [None, 16])   # the whole row in one block / a column loop
def test_cumsum_template(dtype: torch.dtype, reverse: bool, block_c: int | None) -> None:
    rows, cols = 5, 37
    load = "tl.load(in0_ptr + rows * stride_in0_0 + cols * stride_in0_1, mask=mask, other=0)"
    src = render_cumsum(
        "titanc_red_fused_cumsum_0", indexed=[("in0", 2), ("out0", 2)], n_cols=cols,
        block_c=block_c, block_r=2, reverse=reverse, dtype=str(dtype).removeprefix("torch."),
        prologue=[f"x = {load}", "t = x * 2.0"], scans=[CumsumScan("t", "r")],
        epilogue=["y = r + x", "o = rows * stride_out0_0 + cols * stride_out0_1"],
        stores=[("out0", "o", "y")])
    module = load_module(src, "cumsum")
    x = torch.randn(rows, cols, dtype=dtype, generator=gen(1))
    out = torch.empty(cols, rows, dtype=dtype).t()          # a strided output
    module.launch(x, out, rows, cols)
    want = (2 * x).flip(1).cumsum(1).flip(1) if reverse else (2 * x).cumsum(1)
    torch.testing.assert_close(out, want + x, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_scatter_along_template(dtype: torch.dtype) -> None:
    n, size = 23, 40
    module = load_module(render_scatter_along("titanc_tem_fused_scatter_along_0", block_r=8,
                                              block_c=16,
                                              dtype=str(dtype).removeprefix("torch.")), "sa")
    grad = torch.randn(n, dtype=dtype, generator=gen(4))
    idx = torch.randint(0, size, (n,), generator=gen(5))
    out = torch.full((n, size), float("nan"), dtype=dtype)
    module.launch(grad, idx, out)
    want = torch.zeros(n, size, dtype=dtype).scatter_add(-1, idx[:, None], grad[:, None])
    torch.testing.assert_close(out, want, **TOL[dtype])


def test_extended_templates_declare_their_locals() -> None:
    """The indexed variants and the new families bind no name outside TEMPLATE_LOCALS (user
    names here contain "zz"), so `expr.Scope` keeps hook names clear of them."""
    from tests.test_templates import _bound_names
    from titanc.codegen.families import TEMPLATE_LOCALS, ReductionStage, render_matmul, \
        render_pointwise, render_reduction

    load = "tl.load(zz_a_ptr + rows * stride_zz_a_0, mask=mask, other=0)"
    sources = {
        "pointwise": [render_pointwise("titanc_poi_fused_zz_0", inputs=["zz_x"], rank=1,
                                       indexed=[("zz_a", 2)], outputs=[("zz_y", "zz_t")],
                                       body=["zz_t = zz_x + 1.0"])],
        "reduction": [render_reduction(
            "titanc_red_fused_zz_0", inputs=[], n_cols=40, block_c=block_c,
            indexed=[("zz_a", 1), ("zz_o", 1)], row_stores=[("zz_o", "zz_off", "zz_v")],
            stages=[ReductionStage("sum", "zz_v", "zz_s", prologue=(f"zz_v = {load}",))],
            row_epilogue=["zz_off = rows + cols"]) for block_c in (None, 16)],
        "matmul": [render_matmul("titanc_mm_fused_zz_0", indexed=[("zz_a", 1), ("zz_o", 1)],
                                 operand_loads=["zz_p = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)",
                                                "zz_q = tl.zeros([BLOCK_K, BLOCK_N], tl.float32)"],
                                 operands=("zz_p", "zz_q"), epilogue=["zz_off = rows + cols"],
                                 stores=[("zz_o", "zz_off", "acc")])],
        "cumsum": [render_cumsum("titanc_red_fused_zz_0", indexed=[("zz_a", 1)], n_cols=40,
                                 block_c=block_c, prologue=[f"zz_v = {load}"],
                                 scans=[CumsumScan("zz_v", "zz_r")]) for block_c in (None, 16)],
    }
    for family, srcs in sources.items():
        for src in srcs:
            own = {n for n in _bound_names(ast.parse(src)) if "zz" not in n}
            assert own <= TEMPLATE_LOCALS[family], (family, sorted(own - TEMPLATE_LOCALS[family]))


# --- per-kernel parity ----------------------------------------------------------------------------

def _walk(plan):
    for k, kern in enumerate(plan.schedule.kernels):
        scan = [n for n in kern.nodes if n in plan.bodies]
        if scan:
            yield from _walk(plan.bodies[scan[0]])
        elif not plan.is_noop(k):
            yield plan, kern


def _index_bound(g, kern) -> int:
    """Indices read by the kernel's gathers and scatters must be in range."""
    bounds = [2]
    for nid in kern.nodes:
        n = g.node(nid)
        if n.op is Op.TAKE:
            bounds.append(g.node(n.inputs[0]).type.shape[0])
        elif n.op is Op.TAKE_ALONG:
            bounds.append(g.node(n.inputs[0]).type.shape[-1])
        elif n.op is Op.INDEX_ADD:
            bounds.append(n.attr("rows"))
        elif n.op is Op.SCATTER_ALONG:
            bounds.append(n.attr("size"))
    return min(bounds[1:] or bounds)


def check_kernel(plan, kern, dtype: torch.dtype, seed: int = 0) -> None:
    """Run the generated kernel on random inputs; compare with the interpreter on its nodes."""
    g = plan.schedule.graph
    code = render_kernel(g, kern, dtype=str(dtype).removeprefix("torch."),
                         skip=set(plan.aliases))
    interp = Interpreter(dtype)
    g_ = gen(seed)
    env: dict[int, torch.Tensor] = {}
    for v in kern.inputs:
        t = g.node(v).type
        env[v] = (torch.randint(0, _index_bound(g, kern), t.shape, generator=g_)
                  if t.dtype == "i64" else torch.rand(t.shape, generator=g_, dtype=dtype) + 0.5)
    ref = dict(env)
    for nid in kern.nodes:
        n = g.node(nid)
        for i in n.inputs:
            if i not in ref:                               # immediates the kernel inlines
                ref[i] = interp._eval(g.node(i), [])
        ref[nid] = interp._eval(n, [ref[i] for i in n.inputs])
    got = dict(env)
    for v in kern.outputs:
        t = g.node(v).type
        got[v] = (torch.full(t.shape, -7, dtype=torch.int64) if t.dtype == "i64"
                  else torch.full(t.shape, float("nan"), dtype=dtype))
    module_for(code).launch(*launch_tensors(code, got.__getitem__), *code.sizes)
    for v in kern.outputs:
        if v not in plan.aliases:
            torch.testing.assert_close(got[v], ref[v], **TOL[dtype], equal_nan=True,
                                       msg=lambda m: f"{kern.name} output %{v}: {m}")


def _signature(plan, kern) -> tuple:
    g = plan.schedule.graph
    return (kern.category, frozenset(g.node(n).op for n in kern.nodes))


def _sample(compiled) -> list[tuple]:
    """One kernel per (category, op set) of the training and optimizer schedules."""
    seen, out = set(), []
    for name in ("training", "optimizer"):
        for plan, kern in _walk(compiled.plans[name]):
            sig = _signature(plan, kern)
            if sig not in seen:
                seen.add(sig)
                out.append((plan, kern))
    return out


@pytest.mark.parametrize("example", ["tiny", pytest.param("tiny_mag", marks=pytest.mark.slow)])
def test_generated_kernels_match_interpreter(example: str) -> None:
    c = compile_graphs(load_spec(ROOT / "examples" / f"{example}.yaml", small(example)))
    sample = _sample(c)
    assert len(sample) > 40
    for plan, kern in sample:
        check_kernel(plan, kern, torch.float32)


def test_generated_kernels_float64_with_row_loops(monkeypatch) -> None:
    """Wider shapes (two heads, two layers), float64, and every row of more than 16 columns
    reduced or scanned in a loop over column blocks."""
    monkeypatch.setattr(hooks_rows, "MAX_ROW_BLOCK", 16)
    spec = load_spec(ROOT / "examples" / "tiny.yaml", {
        "model.d_model": 16, "model.n_layers": 2, "model.seq_len": 24, "model.vocab_size": 40,
        "model.ffn_hidden": 24, "model.attention.heads": 2, "model.attention.segment": 8,
        "model.attention.persistent_tokens": 2, "model.memory.chunk_size": 4,
        "train.batch_size": 2, "train.dtype": "float64"})
    sample = _sample(compile_graphs(spec))
    looped = [k for _, k in sample if k.category == "reduction"]
    assert looped
    for plan, kern in sample:
        check_kernel(plan, kern, torch.float64, seed=1)


def test_unmappable_kernel_says_which() -> None:
    c = compile_graphs(load_spec(ROOT / "examples" / "tiny_attn.yaml", small("tiny_attn")))
    g = c.schedules["training"].graph
    scan = next(k for k in c.schedules["training"].kernels
                if any(g.node(n).op is Op.SCAN for n in k.nodes))
    with pytest.raises(NotImplementedError, match=f"kernel {scan.name} of graph"):
        render_kernel(g, scan)


# --- the triton target ----------------------------------------------------------------------------

@pytest.mark.parametrize("example", [e if e == "tiny" else pytest.param(e, marks=pytest.mark.slow)
                                     for e in EXAMPLES])
def test_training_step_matches_cpu_target(example: str) -> None:
    path = ROOT / "examples" / f"{example}.yaml"
    progs = {t: titanc.compile(path, **small(example, **{"compile.target": t}))
             for t in ("cpu", "triton")}
    toks = torch.randint(0, 16, (1, 9), generator=gen(7))
    losses = {t: p.train_step(toks) for t, p in progs.items()}
    assert abs(losses["triton"] - losses["cpu"]) <= 1e-5 * max(1.0, abs(losses["cpu"]))
    for name, g in progs["cpu"].grad_acc.items():          # the step's gradients
        torch.testing.assert_close(progs["triton"].grad_acc[name], g, rtol=1e-4, atol=1e-6,
                                   msg=lambda m: f"grad of {name}: {m}")
    norms = {t: p.last["grad_norm"] for t, p in progs.items()}
    assert abs(norms["triton"] - norms["cpu"]) <= 1e-5 * max(1.0, norms["cpu"])
    for name, p in progs["cpu"].parameters().items():
        torch.testing.assert_close(progs["triton"].parameters()[name], p, rtol=1e-5, atol=1e-7,
                                   msg=lambda m: f"parameter {name} after the step: {m}")
    assert all(type(ex) is TritonExecutor for ex in progs["triton"].executors.by_graph.values())


def test_auto_target_is_cpu_without_cuda() -> None:
    from titanc.runtime.targets.executors import resolve_target

    assert resolve_target("auto") == ("triton" if torch.cuda.is_available() else "cpu")
    assert resolve_target("triton") == "triton"


# --- the artifact ---------------------------------------------------------------------------------

def _import(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.parametrize("scan_kernels", [True, False], ids=["scan-kernels", "host-loops"])
def test_emitted_program_matches_executor(tmp_path, monkeypatch, scan_kernels) -> None:
    """program.py == the cpu target, with its scans as scan kernels and as host loops (the
    `ScanHomes` walk, as when a scan cannot be one kernel). `make test` runs program.py with
    scan kernels against both targets in float64 (tests/test_lowered.py)."""
    import tests.reference as R
    import titanc.codegen.emit as emit
    import titanc.codegen.lower.dispatch as dispatch

    if not scan_kernels:
        def refuse(*args, **kwargs):
            raise ScanFallback("refused by the test")
        monkeypatch.setattr(dispatch, "scan_kernel_for", refuse)
    spec = load_spec(ROOT / "examples" / "tiny_mal.yaml", small("tiny_mal"))
    c = compile_graphs(spec)
    art = emit_artifact(c, tmp_path)
    source = (tmp_path / "program.py").read_text()
    assert ("ws = workspace(" in source) == scan_kernels
    # the layer scan is always a host loop (codegen/scan/kernel.py scan_form); with scan
    # kernels the memory's chunk loops are kernels inside its body
    assert "for i, t in enumerate(layout.order()):" in source
    assert set(art.modules) == {"forward", "training", "optimizer"}
    program = _import(tmp_path / "program.py", "titanc_test_program")
    inputs = {"tokens": torch.randint(0, 16, (1, 9), generator=gen(3)),
              **{k: v.float() for k, v in R.init_params(spec.model, seed=1).items()}}
    for graph in ("forward", "training"):
        want = ArenaExecutor(c.plans[graph]).run(inputs)
        arena, persistent = program.allocate(graph)
        got = getattr(program, graph)(arena, persistent,
                                      {k: inputs[k] for k in program.INPUTS[graph]})
        assert set(got) == set(want)
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, rtol=1e-4, atol=1e-6)


def _digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and "__pycache__" not in p.parts}


def test_emit_is_deterministic(tmp_path) -> None:
    """Compiling twice (here and in another process, with another hash seed) writes the same
    bytes."""
    path, overrides = str(ROOT / "examples" / "tiny.yaml"), small("tiny")
    emit_artifact(compile_graphs(load_spec(path, overrides)), tmp_path / "a")
    script = ("from titanc.model.spec import load_spec; from titanc.compiler import compile_graphs; "
              "from titanc.codegen.emit import emit_artifact; "
              f"emit_artifact(compile_graphs(load_spec({path!r}, {overrides!r})), "
              f"{str(tmp_path / 'b')!r})")
    env = dict(os.environ, PYTHONHASHSEED="12345")
    subprocess.run([sys.executable, "-c", script], check=True, cwd=ROOT, env=env)
    a, b = _digest(tmp_path / "a"), _digest(tmp_path / "b")
    assert a == b
    assert len([k for k in a if k.startswith("kernels/")]) > 30
    modules = (tmp_path / "a" / "kernels" / "index.json").read_text()
    assert "titanc_" in modules
    # scans are launched as their scan kernels, as the triton target runs them
    program = (tmp_path / "a" / "program.py").read_text()
    assert "ws = workspace(" in program
    scan_files = [p for p in (tmp_path / "a" / "kernels").glob("*.py")
                  if "scan.py.jinja" in p.read_text()]
    assert scan_files


HOSTILE = "__import__('os').system('touch PWNED')\n\"\"\"'''\r\u2028# {{ name }}"


def test_hostile_spec_compiles_to_import_safe_python(tmp_path, monkeypatch) -> None:
    evil_dir = tmp_path / "x'\"; __import__('os').system('touch PWNED') #\u2028"
    evil_dir.mkdir()
    spec_file = evil_dir / "spec.yaml"
    data = yaml.safe_load((ROOT / "examples" / "tiny_attn.yaml").read_text())
    data["name"] = HOSTILE
    data["data"]["source"] = HOSTILE
    spec_file.write_text(yaml.safe_dump(data))
    spec = load_spec(spec_file, small("tiny_attn"))
    assert spec.name == HOSTILE and spec.data.source == HOSTILE
    out = tmp_path / "build"
    monkeypatch.chdir(tmp_path)
    emit_artifact(compile_graphs(spec), out)
    allowed = {"__future__", "importlib.util", "math", "pathlib", "torch", "triton",
               "triton.language",
               "titanc.codegen.scan.kernel", "titanc.ir.buffer_plan",  # the scan loop's two
               "titanc.codegen.render"}      # a launch group loads its members' modules
    files = sorted(out.rglob("*.py"))
    assert len(files) > 10          # kernels, program.py (views and fills run no kernel)
    for path in files:
        src = path.read_text()
        assert src.isascii(), path
        tree = ast.parse(src)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                assert {a.name for a in node.names} <= allowed, path
            if isinstance(node, ast.ImportFrom):
                assert node.module in allowed, path
            if isinstance(node, ast.Name):
                assert not node.id.startswith("__") or node.id == "__file__", (path, node.id)
                assert node.id not in ("eval", "exec", "os", "system", "open"), (path, node.id)
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                assert "PWNED" not in node.value, path
        # the spec's strings survive only inside comments, one line each
        assert all(line.lstrip().startswith("#") for line in src.splitlines() if "PWNED" in line)
        _import(path, f"titanc_hostile_{path.stem}")
    program = _import(out / "program.py", "titanc_hostile_program")
    assert "training" in program.ARENA_BYTES
    assert not (tmp_path / "PWNED").exists() and not (ROOT / "PWNED").exists()


def test_every_template_is_reached_by_a_compiled_program() -> None:
    """Each non-partial template under codegen/templates renders a kernel of some compiled
    program of examples/tiny.yaml (training, forward and optimizer; scan kernels and their
    bodies' kernels; the fused loss and `compile.fused_loss: false`): none is kept for tests
    alone."""
    import re
    import tempfile
    from pathlib import Path

    from titanc.codegen.lower.dispatch import plan_kernels
    from titanc.compiler import compile_graphs
    from titanc.model.spec import load_spec

    root = Path(__file__).resolve().parent.parent

    from titanc.codegen.emit import emit_artifact

    reached: set[str] = set()
    for over in ({}, {"compile.fused_loss": False}):
        c = compile_graphs(load_spec(root / "examples" / "tiny.yaml", over), verify_each=False)
        with tempfile.TemporaryDirectory() as out:       # launch groups: the build's kernels
            for f in emit_artifact(c, out).files:
                reached |= set(re.findall(r"^# Generated by titanc from codegen/templates/"
                                          r"(\w+)\.py\.jinja", f.read_text(), re.M))
        for kind in ("forward", "training", "optimizer"):
            for scan_kernels in (False, True):
                for _, _, code in plan_kernels(c.plans[kind], scan_kernels=scan_kernels):
                    reached |= set(re.findall(r"codegen/templates/(\w+)\.py\.jinja",
                                              code.source))
    on_disk = {p.name.removesuffix(".py.jinja")
               for p in (root / "codegen" / "templates").glob("*.py.jinja")
               if not p.name.startswith("_")}
    assert on_disk == reached, (sorted(on_disk - reached), sorted(reached - on_disk))


# tiny (bf16 and scan kernels too), a block without attention and one with it in sequence;
# attn and mag in `make test-all`
@pytest.mark.parametrize("example", ["tiny", "tiny_lmm", "tiny_mal",
                                     *(pytest.param(e, marks=pytest.mark.slow)
                                       for e in ("tiny_attn", "tiny_mag"))])
def test_no_kernel_computes_rotary_tables_per_element(example: str) -> None:
    """Rotary cos/sin come from a table made once at bind time (a ROPE node is a kernel of
    its own that the buffer plan binds as a constant; scan kernels get it from the host), so
    no generated kernel evaluates tl.cos / tl.sin: every scan run as a host loop (its body's
    kernels rendered) and as scan kernels, float32 and (tiny) bf16."""
    import re

    from titanc.codegen.lower.dispatch import plan_kernels

    dtypes = ("float32", "bfloat16") if example == "tiny" else ("float32",)
    for dt in dtypes:
        c = compile_graphs(load_spec(ROOT / "examples" / f"{example}.yaml",
                                     {"train.dtype": dt}), verify_each=False)
        ropes = 0
        for scan_kernels in (False, True) if example == "tiny" else (False,):
            for plan, kern, code in plan_kernels(c.plans["training"], scan_kernels=scan_kernels):
                assert not re.search(r"tl\.(cos|sin)\(", code.source), (dt, kern.name)
                g = plan.schedule.graph
                ropes += sum(g.node(n).op is Op.ROPE for n in kern.nodes)
        assert ropes == 0          # every ROPE node is a no-op kernel, its table bound once

        def count(g):
            return sum(1 if n.op is Op.ROPE else count(n.attr("body")) if n.op is Op.SCAN
                       else 0 for n in g)
        assert (count(c.grad) > 0) == (example != "tiny_lmm")   # attention has rotary tables
