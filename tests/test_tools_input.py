"""The compiler's tools under bad input: `titanc inspect` on
damaged or edited artifacts, `python -m titanc.tools.aot` on bad input and failed kernels,
`titanc bench`'s table. Every bad input is one line naming the file or field and the fix,
exit 2, never a traceback, never a hang.

One artifact of a tiny attn spec is compiled per module; each test damages a private copy."""
from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any, Callable

import pytest

from tests.helpers import set_at, tiny_spec
from titanc.model.spec import load_spec, spec_hash
from titanc.tools.artifact import write_artifact
from titanc.tools.cli import main

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("art4") / "build"
    write_artifact(tiny_spec(**{"model.block": "attn", "model.n_layers": 1}), out)
    return out


@pytest.fixture
def art(artifact: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(artifact, tmp_path / "build"))


def run(capsys: pytest.CaptureFixture[str], *args: Any) -> tuple[int, str, str]:
    code = main(["inspect", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert err.startswith("titanc: error: "), err
    for n in needles:
        assert n in err, (n, err)


def edit_json(path: Path, fn: Callable[[Any], Any]) -> None:
    data = json.loads(path.read_text())
    data = fn(data) or data
    path.write_text(json.dumps(data))


def with_launches(r: dict[str, Any]) -> None:
    """report.json rows with launch counts, so inspect reads the rows as written."""
    for k in r["kernels"]:
        k.setdefault("launches", 1)


# -- report.json: every field inspect reads is checked where the report is opened -------------

def _set_row(i: int, field: str, value: Any) -> Callable[[Any], None]:
    def fn(r: dict[str, Any]) -> None:
        with_launches(r)
        r["kernels"][i][field] = value
    return fn


@pytest.mark.parametrize("edit, field, flags", [
    (_set_row(0, "depth", 10 ** 12), "kernels[0].depth", ()),          # was a MemoryError
    (_set_row(1, "flops", 10 ** 400), "kernels[1].flops", ()),         # was an OverflowError
    (_set_row(1, "bytes", float("inf")), "kernels[1].bytes", ()),
    (_set_row(1, "flops", float("nan")), "kernels[1].flops", ()),
    (_set_row(0, "launches", 1.5), "kernels[0].launches", ()),
    (set_at("kernel_counts", [1, 2]), "kernel_counts", ()),           # was an AttributeError
    (set_at("parameters", "many"), "parameters", ()),                 # was a TypeError
    (set_at("step", "before", "families", {"x": {}}), "step.before.families.x.kernels", ()),
    (set_at("step", "after", "families", [1]), "step.after.families", ()),
    (set_at("memory", "arena_bytes", "x"), "memory.arena_bytes", ("--memory",)),
    (set_at("name", ["a"]), "name", ()),
])
def test_damaged_report_fields_are_one_line_naming_the_field(
        art: Path, capsys: pytest.CaptureFixture[str], edit: Callable[[Any], None],
        field: str, flags: tuple[str, ...]) -> None:
    edit_json(art / "report.json", edit)
    code, _, err = run(capsys, art, *flags)
    one_line_error(code, err, "report.json", f": {field} is ", "recompile")


def test_deeply_nested_json_is_unreadable_not_a_recursion_error(
        art: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (art / "report.json").write_text("[" * 100_000 + "]" * 100_000)
    code, _, err = run(capsys, art)
    one_line_error(code, err, "report.json: unreadable")


def test_names_from_the_report_reach_the_terminal_escaped(
        art: Path, capsys: pytest.CaptureFixture[str]) -> None:
    edit_json(art / "report.json", set_at("name", "evil\n\x1b[2Jname\r"))
    code, out, _ = run(capsys, art, "--limit", "1")
    assert code == 0
    assert "\x1b" not in out and "\r" not in out
    assert out.splitlines()[0].startswith("'evil\\n\\x1b[2Jname\\r': ")


def test_step_table_columns_line_up_with_long_family_names(
        art: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, art)
    assert code == 0
    lines = out.split("before -> after the pattern passes", 1)[1].splitlines()[1:]
    head = lines[0]
    end = head.index("kernels") + len("kernels")
    rows = [l for l in lines[2:] if re.match(r"^\S+\s+\S+ -> \S+", l)]
    assert any(len(l.split()[0]) > 14 for l in rows)      # linear_cross_entropy_bwd
    for l in rows:
        assert re.match(r"^\S+\s+\S+ -> \S+", l).end() == end, l


# -- manifest.json: re-lowering only the spec report.json was compiled from --------------------

def _without_launch_counts(report: dict[str, Any]) -> dict[str, Any]:
    """report.json as titanc wrote it before it recorded launch counts: inspect then lowers
    manifest.json's spec again to count them (the path these tests hold)."""
    for k in report["kernels"]:
        for f in ("depth", "launches", "scan"):
            k.pop(f, None)
    return report


def _manifest_set(art: Path, section: str, field: str, value: Any, rehash: bool) -> None:
    edit_json(art / "report.json", _without_launch_counts)
    m = json.loads((art / "manifest.json").read_text())
    m["spec"][section][field] = value
    (art / "manifest.json").write_text(json.dumps(m))
    if rehash:              # a report that records the edited spec: only the planner sees it
        edit_json(art / "report.json",
                  set_at("spec_hash", spec_hash(load_spec(m["spec"]))))


def test_edited_manifest_is_not_relowered(art: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An edited manifest.json (another d_model than report.json's spec) is not re-lowered to
    count launches: a note, and --graph refuses it in one line (`resolved_rows`)."""
    _manifest_set(art, "model", "d_model", 48, rehash=False)
    code, out, err = run(capsys, art)
    assert code == 0 and err == ""
    assert "no launch counts" in out and "its spec is not the one report.json" in out
    code, _, err = run(capsys, art, "--graph")
    one_line_error(code, err, "manifest.json: its spec is not the one report.json")


@pytest.mark.parametrize("section, field, value, bound", [
    ("model", "d_model", 10 ** 30, "model.d_model"),
    ("train", "batch_size", 10 ** 18, "train.batch_size"),
])
def test_a_recorded_spec_past_the_spec_bounds_is_a_one_line_error(
        art: Path, capsys: pytest.CaptureFixture[str], section: str, field: str,
        value: int, bound: str) -> None:
    """Sizes past what torch indexes once overflowed when re-lowered; the spec's bounds
    (titanc/bounds.py) now refuse them first, naming the field."""
    _manifest_set(art, section, field, value, rehash=False)
    code, _, err = run(capsys, art, "--graph")
    one_line_error(code, err, bound, "must be at most")


def test_without_a_spec_hash_an_absurd_spec_is_checked_against_the_machine(
        art: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A spec within every field's bound that no machine holds (65,536 sequences of width
    65,536): checked against this machine's memory before anything is planned."""
    _manifest_set(art, "train", "batch_size", 1 << 16, rehash=False)
    _manifest_set(art, "model", "d_model", 1 << 16, rehash=False)
    edit_json(art / "report.json", lambda r: {k: v for k, v in r.items() if k != "spec_hash"})
    code, _, err = run(capsys, art, "--graph")
    one_line_error(code, err, "manifest.json: its spec needs at least", "this machine's")


def test_the_recorded_spec_still_relowers(art: Path, capsys: pytest.CaptureFixture[str]) -> None:
    edit_json(art / "report.json", _without_launch_counts)
    code, out, _ = run(capsys, art)
    assert code == 0 and "no launch counts" not in out and "(per training step)" in out


# -- kernels/, program.py, memory_plan.txt ------------------------------------------------------

def _some_kernel(art: Path) -> str:
    return json.loads((art / "report.json").read_text())["kernels"][1]["name"]


@pytest.mark.parametrize("damage, flags", [
    ("kernel", ("--kernel", None)),
    ("program.py", ("--kernel", "training/titanc_tem_fused_scan_layer_1")),
    ("memory_plan.txt", ("--memory",)),
])
def test_files_that_are_not_utf8_are_named(art: Path, capsys: pytest.CaptureFixture[str],
                                           damage: str, flags: tuple[Any, ...]) -> None:
    name = _some_kernel(art)
    index = json.loads((art / "kernels" / "index.json").read_text())
    path = (art / "kernels" / f"{index['training'][name]}.py" if damage == "kernel"
            else art / damage)
    if damage == "program.py":
        scan = flags[1].split("/")[1]
        if index["training"].get(scan):
            pytest.skip("the layer scan runs as one scan kernel here: no body in program.py")
    path.write_bytes(b"\xff\xfe\x00 damaged")
    flags = tuple(name if f is None else f for f in flags)
    code, _, err = run(capsys, art, *flags)
    one_line_error(code, err, f"{path}: not UTF-8 text", "recompile")


def test_a_file_in_kernels_that_the_index_does_not_list(
        art: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (art / "kernels" / "notes.py").write_text("x = 1\n")
    code, _, err = run(capsys, art, "--kernel", "notes")
    one_line_error(code, err, "kernels/notes.py is not a kernel of this artifact")
    assert "did you mean notes" not in err


def test_an_unknown_kernel_name_is_quoted_short(art: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, art, "--kernel", "a" * 50_000)
    one_line_error(code, err, "unknown kernel")
    assert len(err) < 1000
    code, _, err = run(capsys, art, "--kernel", "b" * 5_000 + "/x")
    one_line_error(code, err, "unknown graph")
    assert len(err) < 1000


def test_a_run_directory_is_named_as_one(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "spec.yaml").write_text("name: t\n")
    (tmp_path / "metrics.jsonl").write_text("")
    code, _, err = run(capsys, tmp_path)
    one_line_error(code, err, "a run directory", "titanc compile")


# -- python -m titanc.tools.aot ----------------------------------------------------------------

def aot_main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    from titanc.tools.aot import main as aot
    code = aot(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("argv, needle", [
    (("no_such_spec.yaml", "--arch", "90"), "no_such_spec.yaml: no such spec file"),
    (("no_such_spec.yaml", "--arch", "75"), "75: one of 80, 86, 89, 90"),
    (("no_such_spec.yaml", "--jobs", "0"), "--jobs"),
    (("examples/tiny_attn.yaml", "--set", "model.d_model=7", "--arch", "90"),
     "model.attention.heads"),
])
def test_aot_bad_input_is_one_line_exit_2(capsys: pytest.CaptureFixture[str],
                                          argv: tuple[str, ...], needle: str) -> None:
    code, out, err = aot_main(capsys, *argv)
    assert code == 2 and out == "" and "Traceback" not in err, err
    assert needle in err.strip().splitlines()[-1], err       # argparse: usage, then one line


def test_aot_names_each_kernel_that_failed(capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from titanc.runtime.targets import aot

    monkeypatch.setattr(aot, "record_launches", lambda plan, **kw: [])
    monkeypatch.setattr(aot, "compile_all", lambda launches, archs, jobs: [
        {"name": "titanc_mm_fused_einsum_3", "arch": 90, "ok": False, "uses_dot": True,
         "error": "CompilationError: out of resource: shared memory\nmore detail"},
        {"name": "titanc_poi_fused_add_1", "arch": 90, "ok": True, "uses_dot": False,
         "shared": 0, "registers": 20, "spill_bytes": 0, "mma": False}])
    code, out, err = aot_main(capsys, str(Path(__file__).parent.parent / "examples" /
                                          "tiny_attn.yaml"), "--arch", "90",
                              "--set", "model.n_layers=1")
    assert code == 1
    assert "sm_90: 1/2 compiled" in err
    assert ("  failed: titanc_mm_fused_einsum_3: CompilationError: out of resource: shared "
            "memory\n") in err


# -- titanc bench's table ------------------------------------------------------------------------

def test_bench_table_escapes_the_spec_name(monkeypatch: pytest.MonkeyPatch) -> None:
    from titanc.tools import bench

    monkeypatch.setattr(bench, "format_summary", lambda result: "profile: ...")
    text = bench.bench_table({"name": "evil\n\x1b[2J", "compile_seconds": 0.1,
                              "warmup_steps": 1, "warmup_seconds": 0.1, "loss": 1.0})
    assert "\x1b" not in text
    assert text.splitlines()[0].startswith("'evil\\n\\x1b[2J': compiled in 0.10 s")


@pytest.mark.parametrize("override", [
    "model.d_model=1000000000000000000000000000000",    # TypeError: Overflow when unpacking
    "train.batch_size=1000000000000000000",             # RuntimeError: Storage size ... overflowed
])
def test_compile_force_of_sizes_past_torch_is_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], override: str) -> None:
    """`titanc compile --force` writes the plan of a spec that does not fit; sizes past what
    torch indexes were a torch traceback from the buffer planner. The spec's bounds refuse
    them, --force or not, naming the field. Nothing is written."""
    tiny_attn = Path(__file__).resolve().parent.parent / "examples" / "tiny_attn.yaml"
    code = main(["compile", str(tiny_attn), "-o", str(tmp_path / "out"), "--set", override,
                 "--force"])
    one_line_error(code, capsys.readouterr().err, override.split("=")[0], "must be at most")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.partial-*"))
