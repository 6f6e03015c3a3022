"""The `titanc` command line: bad input gives one `titanc: error:` line and exit status 2, never
a traceback; every help text works; compile/train hand the spec to their backends.

Bad-input cases run `python -m titanc` in a subprocess, as a user would. The backend wiring is
tested in-process against stand-in modules; the real compile/train runs are tested elsewhere.
"""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import yaml

from titanc.tools.cli import main
from titanc.model.spec import Spec

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "examples" / "tiny.yaml"


def titanc(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "titanc", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def _bad_inputs(tmp: Path) -> dict[str, tuple[list[str | Path], str]]:
    """case -> (arguments, the exact error message after 'titanc: error: ')."""
    (tmp / "empty.yaml").write_text("")
    (tmp / "broken.yaml").write_text("name: x\nmodel: {d_model: 64\n")
    (tmp / "typo.yaml").write_text(TINY.read_text().replace("d_model: 64", "d_modle: 64"))
    hostile = yaml.safe_load(TINY.read_text())
    hostile["name"] = "x'\"\n__import__('os').system('touch pwned')  # \"\"\""
    hostile["model"]["memory"]["chunk_size"] = 48
    (tmp / "hostile.yaml").write_text(yaml.safe_dump(hostile))
    return {
        "missing file": (["compile", tmp / "nope.yaml"], f"{tmp / 'nope.yaml'}: no such spec file"),
        "empty file": (["compile", tmp / "empty.yaml"],
                       f"{tmp / 'empty.yaml'}: file is empty; a spec is a YAML mapping with at "
                       f"least name and model (see examples/tiny.yaml)"),
        "non-YAML": (["compile", tmp / "broken.yaml"],
                     f"{tmp / 'broken.yaml'}:3:1: not valid YAML: expected ',' or '}}', but got "
                     f"'<stream end>'"),
        "unknown key": (["compile", tmp / "typo.yaml"],
                        "unknown key 'model.d_modle'; did you mean 'model.d_model'?"),
        "hostile name, bad chunk": (["compile", tmp / "hostile.yaml"],
                                    "model.memory.chunk_size: 48 must divide "
                                    "model.attention.segment=32 (block mac)"),
        "--set without =": (["compile", TINY, "--set", "model.d_model"],
                            "--set 'model.d_model': expected KEY=VALUE, e.g. --set "
                            "model.d_model=128"),
        "--set unknown key": (["compile", TINY, "--set", "model.d_modle=128"],
                              "unknown key 'model.d_modle'; did you mean 'model.d_model'?"),
        "--set bad value": (["compile", TINY, "--set", "model.d_model=big"],
                            "model.d_model: expected an integer, got the string 'big'"),
        "--set bad YAML": (["compile", TINY, "--set", "train.betas=[0.9,"],
                           "--set train.betas: value '[0.9,' is not valid YAML: expected the "
                           "node content, but found '<stream end>'"),
        "train, bad spec": (["train", tmp / "nope.yaml", "--out", tmp / "run"],
                            f"{tmp / 'nope.yaml'}: no such spec file"),
    }


CASES = ["missing file", "empty file", "non-YAML", "unknown key", "hostile name, bad chunk",
         "--set without =", "--set unknown key", "--set bad value", "--set bad YAML",
         "train, bad spec"]


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_error_line_and_exit_2(tmp_path: Path, case: str) -> None:
    args, message = _bad_inputs(tmp_path)[case]
    result = titanc(*args, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    assert result.stderr.splitlines() == [f"titanc: error: {message}"]
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "build").exists()


@pytest.mark.parametrize("argv", [["--help"], ["compile", "--help"], ["train", "--help"]])
def test_help(tmp_path: Path, argv: list[str]) -> None:
    result = titanc(*argv, cwd=tmp_path)
    assert result.returncode == 0 and result.stderr == ""
    assert result.stdout.startswith(f"usage: titanc {argv[0] if len(argv) > 1 else ''}".rstrip())
    if argv[0] == "--help":
        assert "compile" in result.stdout and "train" in result.stdout
    else:
        assert "--set KEY=VALUE" in result.stdout and "SPEC" in result.stdout


@pytest.mark.parametrize("argv, complaint", [
    ([], "the following arguments are required: COMMAND"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    (["compile"], "the following arguments are required: SPEC"),
    (["train", str(TINY)], "the following arguments are required: --out"),
    (["train", str(TINY), "--out", "r", "--steps", "0"], "expected a number of steps: an integer in [1, 1000000000000], got 0"),
    (["compile", str(TINY), "--bogus"], "unrecognized arguments: --bogus"),
])
def test_usage_errors_exit_2(argv: list[str], complaint: str,
                             capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert complaint in err and "Traceback" not in err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("titanc ")


# ---------------------------------------------------------------- wiring to the backends


def _fake_module(monkeypatch: pytest.MonkeyPatch, name: str, **attrs: Any) -> None:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    monkeypatch.setitem(sys.modules, name, module)


def test_compile_calls_write_artifact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    calls: list[tuple[Spec, Path]] = []

    def write_artifact(spec: Spec, out_dir: Path, force: bool = False,
                       arch: Any = None) -> dict[str, Any]:
        calls.append((spec, out_dir))
        assert not force
        return {"graphs": {"forward": {"nodes": 321, "largest_tensor_bytes": 3 * 2**20}}}

    _fake_module(monkeypatch, "titanc.tools.artifact", write_artifact=write_artifact)
    monkeypatch.chdir(tmp_path)
    assert main(["compile", str(TINY), "--set", "model.n_layers=3"]) == 0
    (spec, out_dir), = calls
    assert spec.model.n_layers == 3 and spec.path == str(TINY)
    assert out_dir == Path("build") / "tiny_mac"
    assert capsys.readouterr().out.splitlines() == [
        "compiled tiny-mac -> build/tiny_mac",
        "  forward graph: 321 nodes, largest tensor 3.0 MiB"]
    assert main(["compile", str(TINY), "-o", str(tmp_path / "x")]) == 0
    assert calls[-1][1] == tmp_path / "x"


def test_train_calls_run_training(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[Spec, dict[str, Any]]] = []
    _fake_module(monkeypatch, "titanc.runtime.train.trainer",
                 run_training=lambda spec, **kwargs: calls.append((spec, kwargs)))
    assert main(["train", str(TINY), "--out", "runs/t", "--steps", "5", "--data", "a.txt",
                 "--resume", "runs/old", "--strict", "--profile", "--set", "train.seed=3",
                 "--until", "3"]) == 0
    (spec, kwargs), = calls
    assert spec.train.seed == 3
    assert kwargs == {"out": "runs/t", "data": "a.txt", "steps": 5, "resume": "runs/old",
                      "strict": True, "profile": True, "until": 3, "dist": None,
                      "reschedule": False, "explicit": {"train.seed"}}
    assert main(["train", str(TINY), "--out", "r", "--reschedule"]) == 0
    assert calls[-1][1] == {"out": "r", "data": None, "steps": None, "resume": None,
                            "strict": False, "profile": False, "until": None, "dist": None,
                            "reschedule": True, "explicit": set()}


def test_missing_backend_is_a_clean_error(monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "titanc.tools.artifact", None)  # import raises ModuleNotFoundError
    assert main(["compile", str(TINY), "-o", "unused"]) == 2
    assert capsys.readouterr().err == (
        "titanc: error: titanc compile is not available in this install "
        "(titanc.tools.artifact is missing)\n")


def test_generate_from_a_trained_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`titanc train` in this process (its wiring is above), `titanc generate` of the run as a
    user runs it (a subprocess: exit status and output), and a missing run: one line, exit 2."""
    run = tmp_path / "run"
    sets = ["--set", "model.d_model=16", "--set", "model.n_layers=1", "--set", "model.seq_len=16",
            "--set", "train.batch_size=2", "--set", "model.memory.chunk_size=4",
            "--set", "train.eval_every=0"]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    assert main(["train", str(ROOT / "examples/tiny_lmm.yaml"), *sets, "--steps", "2",
                 "--data", str(corpus), "--out", str(run)]) == 0
    r = titanc("generate", run, "--prompt", "the", "--prompt", "fox", "--max-new-tokens", "5",
               "--temperature", "0", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 2 and lines[0].startswith("the") and lines[1].startswith("fox")
    capsys.readouterr()
    assert main(["generate", str(tmp_path / "missing"), "--prompt", "x"]) == 2
    assert capsys.readouterr().err.strip() == (f"titanc: error: load {tmp_path / 'missing'}: "
                                               f"no such run directory or checkpoint file")
