"""`titanc inspect DIR`: the kernel table and its totals, one kernel's source, the IR as DOT,
the memory summary, and one-line errors (exit 2) for a bad directory, kernel or pass.

One artifact of a tiny MAC spec is compiled per module; the kernels/ directory is faked
(kernel emission is tested with codegen)."""
from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest

from tests.helpers import tiny_spec
from titanc.tools import inspect
from titanc.tools.artifact import write_artifact
from titanc.tools.build_dir import open_artifact
from titanc.tools.cli import main


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("art") / "build"
    write_artifact(tiny_spec(**{"model.block": "mac"}), out)
    return out


@pytest.fixture
def art(artifact: Path, tmp_path: Path) -> Path:
    """A private copy (tests write graph files into it)."""
    return Path(shutil.copytree(artifact, tmp_path / "build"))


@pytest.fixture
def bare(art: Path) -> Path:
    """The copy without generated kernels/ and program.py (tests fake them)."""
    shutil.rmtree(art / "kernels", ignore_errors=True)
    (art / "program.py").unlink(missing_ok=True)
    return art


def run(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, str, str]:
    code = main(["inspect", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def test_table_lists_every_kernel_with_intensity_and_per_step_totals(
        art: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = json.loads((art / "report.json").read_text())
    # the launch counts are in the report: inspect lowers nothing again
    assert all({"depth", "launches", "scan"} <= set(k) for k in report["kernels"])
    assert max(k["launches"] for k in report["kernels"]) > 1
    code, out, err = run(capsys, art)
    assert code == 0 and err == ""
    for k in report["kernels"]:
        assert k["name"] in out
    assert "launches" in out and "FLOP/B" in out and "totals (per training step):" in out
    for cat in {k["category"] for k in report["kernels"]}:
        assert any(line.startswith(cat) for line in out.splitlines()), cat
    row = next(k for k in report["kernels"] if k["category"] == "matmul")
    line = next(l for l in out.splitlines() if l.strip().startswith(row["name"] + " "))
    assert line.split()[-2] == f"{row['flops'] / row['bytes']:.2f}"  # arithmetic intensity


def test_step_before_and_after_the_pattern_passes(
        art: Path, capsys: pytest.CaptureFixture[str]) -> None:
    step = json.loads((art / "report.json").read_text())["step"]
    code, out, _ = run(capsys, art)
    assert code == 0 and "per training step, before -> after the pattern passes" in out
    lines = out.splitlines()
    for fam, row in step["after"]["families"].items():
        before = step["before"]["families"].get(fam, {"kernels": 0})["kernels"]
        line = next(l for l in lines if l.startswith(fam + " ") and "->" in l)
        assert line.split()[1:4] == [str(before), "->", str(row["kernels"])], line
    assert "attention_fwd" in step["after"]["families"]      # a MAC block: flash attention
    assert (f"kernels launched per step on the triton target (a scan kernel once): "
            f"{step['before']['kernels']} -> {step['after']['kernels']}") in out
    (art / "report.json").write_text(json.dumps(
        {k: v for k, v in json.loads((art / "report.json").read_text()).items() if k != "step"}))
    code, out, _ = run(capsys, art)
    assert code == 0 and "before -> after" not in out       # an older report: no table


def test_launch_counts_make_leaf_totals_equal_the_top_level_flops(art: Path) -> None:
    rows, note = inspect.resolved_rows(open_artifact(art))
    assert note == ""
    assert {r["name"] for r in rows} == {k["name"] for k in json.loads(
        (art / "report.json").read_text())["kernels"]}
    top = sum(r["flops"] for r in rows if r["depth"] == 0)        # a scan: length x its body
    totals = inspect.category_totals(rows)
    assert sum(t["flops"] for t in totals.values()) == top
    assert max(r["launches"] for r in rows) > 1                   # memory chunks inside layers


def test_table_without_launch_counts_says_so(art: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An artifact of a titanc whose report.json had no launch counts, without the
    manifest.json to lower again: body kernels count once."""
    report = json.loads((art / "report.json").read_text())
    for k in report["kernels"]:
        for f in ("depth", "launches", "scan"):
            k.pop(f)
    (art / "report.json").write_text(json.dumps(report))
    (art / "manifest.json").unlink()
    code, out, _ = run(capsys, art, "--limit", "3")
    assert code == 0
    assert "totals (each kernel counted once):" in out
    assert ("  (no launch counts in report.json and no manifest.json to recompute them: body "
            "kernels count once, not once per iteration)") in out
    assert "more kernels (drop --limit to list all)" in out


def test_kernel_of_a_compiled_artifact(art: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if not (art / "kernels").is_dir():
        pytest.skip("this titanc compile emits no kernels/")
    rows = json.loads((art / "report.json").read_text())["kernels"]
    for row in (next(r for r in rows if r["category"] == "matmul"),
                next(r for r in rows if inspect.is_scan(r))):
        code, out, _ = run(capsys, art, "--kernel", row["name"])
        assert code == 0 and row["name"] in out.split("\n\n", 1)[0]   # named in the header
    # a kernel of a body whose scan runs as one scan kernel: shown inside that kernel's source
    index = json.loads((art / "kernels" / "index.json").read_text())["training"]
    body = next(k for k, m in index.items()
                if m != k and m.startswith("titanc_tem_fused_scan_") and "_mm_" in k)
    code, out, _ = run(capsys, art, "--kernel", body)
    assert code == 0 and "a kernel of a scan body" in out.splitlines()[0]
    assert "templates/scan.py.jinja" in out


def test_kernel_prints_source_with_header(bare: Path, capsys: pytest.CaptureFixture[str]) -> None:
    art = bare
    names = [k["name"] for k in json.loads((art / "report.json").read_text())["kernels"]]
    shutil.rmtree(art / "kernels", ignore_errors=True)         # stand-in sources below
    (art / "kernels").mkdir()
    source = (f"# {names[0]}\n# IR nodes: %3 %4 (spec: tiny.yaml)\n\nimport triton\n\n"
              f"@triton.jit\ndef {names[0]}(x_ptr, N: tl.constexpr):\n    pass\n")
    (art / "kernels" / f"{names[0]}.py").write_text(source)
    code, out, _ = run(capsys, art, "--kernel", names[0])
    assert code == 0 and out == source
    # a deduplicated kernel: its name appears in another file's header
    (art / "kernels" / f"{names[0]}.py").write_text(f"# {names[0]}\n# also: {names[1]}\n\npass\n")
    code, out, _ = run(capsys, art, "--kernel", names[1])
    assert code == 0 and f"deduplicated into kernels/{names[0]}.py" in out


def test_kernel_through_index_graphs_and_scans(bare: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """kernels/index.json (graph -> kernel -> module): deduplicated kernels, names repeated
    across graphs (training wins unqualified), and a scan's loop body from program.py."""
    art = bare
    k = art / "kernels"
    k.mkdir()
    (k / "titanc_mm_fused_einsum_5.py").write_text("# titanc_mm_fused_einsum_5: matmul\npass\n")
    (k / "titanc_mm_fused_einsum_6.py").write_text("# titanc_mm_fused_einsum_6: matmul\npass\n")
    (k / "index.json").write_text(json.dumps({
        "training": {"titanc_mm_fused_einsum_5": "titanc_mm_fused_einsum_5",
                     "titanc_mm_fused_einsum_9": "titanc_mm_fused_einsum_5"},
        "forward": {"titanc_mm_fused_einsum_5": "titanc_mm_fused_einsum_6"}}))
    (art / "program.py").write_text(
        "import torch\n\n\ndef training_titanc_tem_fused_scan_layer_2_body(arena, v0):\n"
        "    return v0\n\n\ndef training(arena):\n    pass\n")
    code, out, _ = run(capsys, art, "--kernel", "titanc_mm_fused_einsum_5")
    assert code == 0 and out == (
        "# note: forward/titanc_mm_fused_einsum_5 is another kernel (kernels/"
        "titanc_mm_fused_einsum_6.py); select it with --kernel forward/titanc_mm_fused_einsum_5\n"
        "# titanc_mm_fused_einsum_5: matmul\npass\n")
    code, out, _ = run(capsys, art, "--kernel", "forward/titanc_mm_fused_einsum_5")
    assert out.splitlines()[:2] == [
        "# forward/titanc_mm_fused_einsum_5: identical source deduplicated into "
        "kernels/titanc_mm_fused_einsum_6.py", "# titanc_mm_fused_einsum_6: matmul"]
    code, out, _ = run(capsys, art, "--kernel", "titanc_mm_fused_einsum_9")
    assert "deduplicated into kernels/titanc_mm_fused_einsum_5.py" in out
    code, out, _ = run(capsys, art, "--kernel", "titanc_tem_fused_scan_layer_2")
    assert code == 0 and out == (
        "# training/titanc_tem_fused_scan_layer_2: a scan; program.py runs this body once per "
        "iteration (program.py line 4)\n"
        "def training_titanc_tem_fused_scan_layer_2_body(arena, v0):\n    return v0\n")
    code, _, err = run(capsys, art, "--kernel", "eval/titanc_mm_fused_einsum_5")
    assert code == 2 and err == ("titanc: error: unknown graph 'eval' in --kernel "
                                 "eval/titanc_mm_fused_einsum_5; choose one of forward, training\n")


def test_kernel_errors(bare: Path, capsys: pytest.CaptureFixture[str]) -> None:
    art = bare
    shutil.rmtree(art / "kernels", ignore_errors=True)         # an artifact from before kernels
    code, out, err = run(capsys, art, "--kernel", "titanc_poi_fused_add_1")
    assert code == 2 and out == ""
    assert err == (f"titanc: error: {art} has no kernels/ directory (compiled before kernels "
                   f"were emitted); recompile with 'titanc compile SPEC -o {art}'\n")
    (art / "kernels").mkdir()
    (art / "kernels" / "titanc_poi_fused_add_1.py").write_text("# titanc_poi_fused_add_1\n")
    (art / "kernels" / "titanc_red_fused_sum_2.py").write_text("# titanc_red_fused_sum_2\n")
    code, _, err = run(capsys, art, "--kernel", "titanc_poi_fused_add_7")
    assert code == 2
    assert err == ("titanc: error: unknown kernel 'titanc_poi_fused_add_7'; did you mean "
                   "titanc_poi_fused_add_1, titanc_red_fused_sum_2? (2 in kernels/)\n")
    code, _, err = run(capsys, art, "--kernel", "../report")
    assert code == 2 and err.startswith("titanc: error: unknown kernel '../report'")


def test_graph_writes_dot_and_png_with_graphviz(art: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    code, out, _ = run(capsys, art, "--graph")
    assert code == 0
    stage = sorted(p.stem for p in (art / "ir").glob("*_grad.txt"))[-1]   # final training graph
    dot = art / f"graph_{stage.split('_', 1)[1]}.dot"
    assert out.startswith(f"{stage}: wrote {dot}")
    text = dot.read_text()
    assert text.startswith('digraph "grad" {') and text.rstrip().endswith("}")
    assert "scan body" in text and "->" in text
    # with Graphviz: a PNG next to it (a stand-in `dot` that writes its -o file)
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "dot").write_text('#!/bin/sh\nwhile [ "$1" != "-o" ]; do shift; done\n'
                              'printf PNG > "$2"\n')
    (fake / "dot").chmod((fake / "dot").stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{fake}{os.pathsep}{os.environ['PATH']}")
    code, out, _ = run(capsys, art, "--graph", "--pass", "aggregate")
    assert code == 0
    assert "_aggregate_grad: wrote" in out and (art / "graph_aggregate_grad.png").exists()
    code, out, _ = run(capsys, art, "--graph", "--pass", "00_frontend_forward")
    assert code == 0 and out.startswith("00_frontend_forward: wrote")
    assert (art / "graph_frontend_forward.dot").read_text().startswith('digraph "forward"')


def test_graph_unknown_pass_names_the_choices(art: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, art, "--graph", "--pass", "fusion")
    stages = sorted(p.stem for p in (art / "ir").glob("*.txt"))
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("titanc: error: unknown pass 'fusion'; choose one of frontend, "
                          "canonicalize, aggregate, flash_attention, linear_cross_entropy, "
                          "chunked_loss")
    assert err.rstrip().endswith(", ".join(stages))


def test_memory_summary(art: Path, capsys: pytest.CaptureFixture[str]) -> None:
    mem = json.loads((art / "report.json").read_text())["memory"]
    code, out, _ = run(capsys, art, "--memory")
    assert code == 0
    assert out.startswith("training step:\n")
    arena = inspect.format_bytes(mem["arena_bytes"])
    ratio = mem["arena_bytes"] / mem["lower_bound_bytes"]
    assert f"activation arena {arena:>49}"[-10:] in out
    assert f"(arena / lower bound {ratio:.3f})" in out
    for key in ("peak activation", "persistent (params, grads, optimizer)",
                "largest logits buffer", "total planned (arena + persistent)"):
        assert key in out
    n = len((art / "memory_plan.txt").read_text().splitlines())
    assert f"memory_plan.txt (first 40 of {n} lines):\n== training ==\nbuffer plan grad:" in out


@pytest.mark.parametrize("case", ["missing", "file", "no report", "bad json", "pass alone"])
def test_bad_input_is_one_line_exit_2(case: str, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "d"
    args: list[str | Path] = [d]
    if case == "missing":
        want = f"{d}: no such artifact directory; create one with 'titanc compile SPEC -o {d}'"
    elif case == "file":
        d.write_text("x")
        want = f"{d}: not a directory; pass the directory 'titanc compile -o' wrote"
    elif case == "no report":
        d.mkdir()
        want = f"{d}: not a titanc artifact (no report.json); create one with " \
               f"'titanc compile SPEC -o {d}'"
    elif case == "bad json":
        d.mkdir()
        (d / "report.json").write_text("[1, 2")
        want = f"{d / 'report.json'}: unreadable ("
    else:
        args = [d, "--pass", "aggregate"]
        want = "--pass selects the graph to draw; use it with --graph"
    code, out, err = run(capsys, *args)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith(f"titanc: error: {want}")
