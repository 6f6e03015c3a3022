"""A user's first day (issue 53): runs that keep their work, shards that carry their tokenizer,
`titanc compile` from the cache with a status line, help for every argument, the subcommand's
own usage for an unknown flag, the demo's fixed run directory, benchmark outputs outside the
committed results."""
from __future__ import annotations

import argparse
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from titanc.errors import TitancError
from titanc.model.spec import Spec, load_spec
from titanc.runtime.train.checkpoint import load_checkpoint
from titanc.runtime.lr_schedule import MIN_RATIO
from titanc.runtime.train.trainer import Trainer, read_metrics
from titanc.tools.cli import build_parser, main

from tests.helpers import one_thread  # noqa: F401 (autouse)

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "examples" / "tiny_attn.yaml"
SMALL = {"model.d_model": 16, "model.n_layers": 1, "model.seq_len": 16, "model.vocab_size": 256,
         "train.batch_size": 2, "train.eval_every": 0, "train.checkpoint_every": 0,
         "train.warmup": 1, "train.lr": 1e-3}
SETS = [a for k, v in SMALL.items() for a in ("--set", f"{k}={v}")]


def small(**over: Any) -> Spec:
    return load_spec(SPEC, {**SMALL, **over})


def quiet(spec: Spec, out: Path, logs: list[str] | None = None, **kw: Any) -> dict[str, Any]:
    sink = logs.append if logs is not None else (lambda _: None)
    return Trainer(spec, out, progress=False, log=sink, **kw).run()


# ------------------------------------------------------------------------ the command line


def _walk(parser: argparse.ArgumentParser, path: str) -> list[str]:
    """The arguments and subcommands under `parser` that have no help text."""
    missing = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helped = {a.dest for a in action._choices_actions if a.help}
            for name, sub in action.choices.items():
                if name not in helped:
                    missing.append(f"{path} {name}")
                missing += _walk(sub, f"{path} {name}")
        elif not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            if not action.help:
                missing.append(f"{path} {'/'.join(action.option_strings) or action.metavar}")
    if parser.description is None and path != "titanc":
        missing.append(f"{path} (no description)")
    return missing


def test_every_argument_and_subcommand_has_help() -> None:
    assert _walk(build_parser(), "titanc") == []


@pytest.mark.parametrize("argv, usage", [
    (["train", str(SPEC), "--out", "r", "--bogus"], "usage: titanc train "),
    (["data", "prepare", "in", "-o", "out", "--bogus"], "usage: titanc data prepare "),
    (["eval", "runs/x", "--nope", "1"], "usage: titanc eval "),
])
def test_an_unknown_flag_shows_the_subcommands_usage(argv: list[str], usage: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(usage) and "unrecognized arguments: " in err.splitlines()[-1]
    assert err.splitlines()[-1].startswith(f"titanc {argv[0]}")


def test_compile_status_line() -> None:
    from titanc.tools.status import status

    out = io.StringIO()
    with status("compiling x", after=0.05, stream=out):
        time.sleep(0.3)
    assert out.getvalue() == "titanc: compiling x ...\n"
    quick = io.StringIO()
    with status("compiling x", after=5, stream=quick):
        pass
    assert quick.getvalue() == ""


def test_compile_reads_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A second `titanc compile` of a spec copies the artifact the first wrote into the
    cache: the same files (manifest.json's argv aside), no compile."""
    from titanc import config
    from titanc.tools import artifact

    spec = small(**{"model.d_model": 24})
    with config.override(compile_cache=True, debug=0):
        artifact.write_artifact(spec, tmp_path / "a")
        monkeypatch.setattr(artifact, "compile_graphs",
                            lambda *a, **k: pytest.fail("compiled again instead of the cache"))
        report = artifact.write_artifact(spec, tmp_path / "b")
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*")
                   if p.is_file() and "__pycache__" not in p.parts)
    assert files == sorted(p.relative_to(tmp_path / "b") for p in (tmp_path / "b").rglob("*")
                           if p.is_file() and "__pycache__" not in p.parts)
    for f in files:
        if f.name != "manifest.json":
            assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f
    assert report == json.loads((tmp_path / "a" / "report.json").read_text())


# ------------------------------------------------------------------------ runs keep their work


def test_resume_with_more_steps_keeps_the_schedule(tmp_path: Path) -> None:
    spec = small(**{"train.log_every": 1})
    run, logs = tmp_path / "run", []
    quiet(spec, run, steps=2)
    quiet(spec, run, logs, steps=4, resume=run)
    lrs = {m["step"]: m["lr"] for m in read_metrics(run / "metrics.jsonl") if "lr" in m}
    floor = MIN_RATIO * spec.train.lr
    assert lrs[3] == pytest.approx(floor) and lrs[4] == pytest.approx(floor)
    assert load_checkpoint(run / "checkpoint.safetensors")[1]["spec"]["train"]["steps"] == 2
    assert any(line.startswith("note: train.steps 4: the learning-rate schedule keeps the "
                               "checkpoint's 2 steps") and "--reschedule" in line for line in logs)
    # --reschedule: warmup + cosine over the new total, so the learning rate rises again
    quiet(spec, tmp_path / "re", steps=2)
    quiet(spec, tmp_path / "re", steps=4, resume=tmp_path / "re", reschedule=True)
    again = {m["step"]: m["lr"] for m in read_metrics(tmp_path / "re" / "metrics.jsonl")
             if "lr" in m}
    assert again[3] > 2 * floor


def test_no_matplotlib_is_one_note(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from titanc.runtime.train import trainer

    monkeypatch.setattr(trainer, "write_loss_plot", lambda *a, **k: False)
    logs: list[str] = []
    quiet(small(), tmp_path / "run", logs, steps=1)
    assert "note: no loss.png: matplotlib is not installed (pip install 'titanc[plot]')" in logs


def test_ctrl_c_stops_at_a_step_with_a_checkpoint(tmp_path: Path) -> None:
    """SIGINT to `titanc train` after its first logged step: the step in flight finishes, a
    checkpoint of it is written, one line says so, exit 130; the run resumes from it."""
    run = tmp_path / "run"
    env = dict(os.environ, TITANC_THREADS="1", OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "titanc", "train", str(SPEC), *SETS,
                             "--set", "train.log_every=1", "--steps", "100000", "--out", str(run)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 300
        while not any("loss" in m for m in read_metrics(run / "metrics.jsonl")):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    step = load_checkpoint(run / "checkpoint.safetensors")[1]["step"]
    assert step >= 1
    assert (f"stopped by SIGINT after step {step}; the last checkpoint (step {step}) is in "
            f"{run / 'checkpoint.safetensors'}; continue with --resume {run}") in out
    assert "Traceback" not in err
    assert main(["train", str(SPEC), *SETS, "--steps", str(step + 1), "--resume", str(run),
                 "--out", str(run)]) == 0


# ------------------------------------------------------------------------ shards and their header


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A BPE tokenizer (300 tokens) and shards prepared with it."""
    from titanc.runtime.data.prepare import prepare
    from titanc.runtime.data.tokenizer import train_bpe

    d = tmp_path_factory.mktemp("shards")
    text = " ".join(f"word{i % 37} and thing{i % 11} said" for i in range(3000))
    (d / "corpus.txt").write_text(text)
    tok = d / "tok.json"
    train_bpe([text], 300, tok, min_frequency=1)
    prepare([d / "corpus.txt"], d / "data", tokenizer=str(tok), workers=1, progress=False)
    return tok, d / "data"


def test_train_takes_the_tokenizer_from_the_shard_header(
        shards: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tok, data = shards
    n = json.loads((data / "header.json").read_text())["tokenizer"]["vocab_size"]
    t = Trainer(small(), tmp_path / "run", data=str(data), steps=1, progress=False,
                log=lambda _: None)
    assert t.spec.model.vocab_size == n and t.spec.data.tokenizer == str(tok)
    assert t.notes == [f"data.tokenizer {tok} and model.vocab_size {n}, from the shard header "
                       f"{data / 'header.json'}"]
    # a --set that disagrees is one line naming both
    assert main(["train", str(SPEC), *SETS, "--data", str(data), "--out",
                 str(tmp_path / "r2")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"titanc: error: --set model.vocab_size=256: the shards' tokenizer {tok} has {n} "
        f"tokens ({data / 'header.json'}); drop the --set (the vocabulary is taken from the "
        f"header) or set model.vocab_size={n}")
    with pytest.raises(TitancError, match=r"^--set data.tokenizer=byte: the shards in .* were "
                                          r"prepared with tokenizer .*; drop the --set"):
        Trainer(small(), tmp_path / "r3", data=str(data), explicit={"data.tokenizer"})


def test_a_text_folder_as_data_points_outside_it(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("text")
    with pytest.raises(TitancError) as e:
        Trainer(small(), tmp_path / "run", data=str(tmp_path / "docs"))
    assert str(e.value) == (f"data.source {tmp_path / 'docs'} is a directory without "
                            f"header.json, so not token shards; prepare it with 'titanc data "
                            f"prepare {tmp_path / 'docs'} -o data/docs' and pass --data data/docs")


def test_eval_on_shards_of_another_tokenizer_names_the_fix(shards: tuple[Path, Path],
                                                            tmp_path: Path) -> None:
    from titanc.runtime.data.tokenizer import ByteTokenizer
    from titanc.runtime.train.shard_source import check_eval_shards

    _, data = shards
    with pytest.raises(TitancError) as e:
        check_eval_shards(str(data), ByteTokenizer(), str(tmp_path / "run"))
    msg = str(e.value)
    assert msg.startswith(f"--data {data}: the shards were prepared with tokenizer ")
    assert msg.endswith("evaluate on shards prepared with the run's tokenizer: 'titanc data "
                        "prepare INPUT... -o DIR --tokenizer byte'")
    assert "data.tokenizer" not in msg                  # eval has no --set


# ------------------------------------------------------------------------ demo and benchmarks


def test_the_demo_reuses_its_run_directory(tmp_path: Path) -> None:
    from titanc.tools.demo import DEMO_OUT, fresh_run_dir

    assert DEMO_OUT == "runs/demo" and "--out runs/demo" in (ROOT / "Makefile").read_text()
    run = tmp_path / "demo"
    fresh_run_dir(str(run))
    for name in ("corpus.txt", "checkpoint.safetensors", "metrics.jsonl", "loss.png"):
        (run / name).write_text("old")
    assert fresh_run_dir(str(run)) == run and list(run.iterdir()) == []
    (run / "mine.txt").write_text("keep")
    with pytest.raises(TitancError, match="holds mine.txt, which the demo did not write"):
        fresh_run_dir(str(run))
    assert (run / "mine.txt").read_text() == "keep"


def test_recall_benchmark_writes_outside_the_committed_results() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import recall_distance
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert recall_distance.DEFAULT_OUT == "runs/recall_distance.json"
    assert "benchmarks/results" not in recall_distance.DEFAULT_OUT
