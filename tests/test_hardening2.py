"""Issue 32 (hardening II), one regression test per defect of its table, numbered as there:
every process of a job stops with it, nothing destroys good data before its replacement is
complete, a run's files are checked against each other, every number is bounded.

The serving defects (13, 14, 16) and the text policy of the API are in test_hardening2_serve.py;
the Hypothesis fuzzing of every command and endpoint in test_fuzz_cli.py and test_fuzz_api.py."""
from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

import titanc
from titanc import bounds
from titanc.errors import TitancError
from titanc.model.spec import spec_to_dict
from titanc.runtime.data import prepare as prepare_module
from titanc.runtime.data import tokenizer as tokenizer_module
from titanc.runtime.data.prepare import prepare
from titanc.runtime.data.shards import read_header
from titanc.runtime.data.tokenizer import ByteTokenizer, train_bpe
from titanc.runtime.train.checkpoint import CHECKPOINT_NAME, save_checkpoint
from titanc.runtime.train.rundir import run_tokenizer
from titanc.runtime.train.trainer import Trainer
from titanc.tools.cli import main

from .test_hardening import cli, one_error_line
from .test_trainer import one_thread, tiny  # noqa: F401 (autouse)

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "examples" / "tiny.yaml"
SMALL = ["--set", "model.d_model=32", "--set", "model.n_layers=1", "--set", "model.ffn_hidden=64",
         "--set", "train.batch_size=1"]


# ---------------------------------------------------------------- process trees (1, 12)

def _children(pid: int) -> set[int]:
    """Every live descendant of `pid` (from /proc)."""
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        try:
            kids = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            continue
        for k in map(int, kids):
            if k not in out:
                out.add(k)
                todo.append(k)
    return out


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its new parent to reap it counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _kill_tree_and_check(argv: list[str], n_children: int, sig: int, cwd: Path) -> None:
    """Start `titanc ARGV`, wait until it has `n_children` descendants, send `sig` to it
    alone, and assert that no descendant is left 5 s later."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TITANC_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "titanc", *argv], cwd=cwd, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seen: set[int] = set()
    try:
        deadline = time.monotonic() + 120
        while len(seen) < n_children:
            assert proc.poll() is None, f"exited early ({proc.returncode}): {proc.stderr.read()}"
            assert time.monotonic() < deadline, "the children never started"
            seen |= _children(proc.pid)
            time.sleep(0.05)
        seen |= _children(proc.pid)
        proc.send_signal(sig)
        proc.wait(30)
        deadline = time.monotonic() + 5
        while any(map(_alive, seen)) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [p for p in seen if _alive(p)]
        assert left == [], f"{len(left)} of {len(seen)} children outlived the parent ({sig})"
    finally:
        if proc.poll() is None:
            proc.kill()
        for p in seen:
            if _alive(p):
                os.kill(p, signal.SIGKILL)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_01_ranks_die_with_their_launcher(tmp_path: Path, sig: int) -> None:
    argv = ["train", str(SPEC), *SMALL, "--steps", "20000", "--nproc", "2",
            "--out", str(tmp_path / "o")]
    _kill_tree_and_check(argv, 2, sig, tmp_path)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_12_data_workers_die_with_prepare(tmp_path: Path, sig: int) -> None:
    big = tmp_path / "big.txt"
    big.write_text(("a line of text for the workers to tokenize\n" * 25000) * 8)   # ~8 MB
    argv = ["data", "prepare", str(big), "--workers", "2", "-o", str(tmp_path / "k"),
            "--no-progress"]
    _kill_tree_and_check(argv, 2, sig, tmp_path)


def test_launcher_stops_its_ranks_with_one_line(tmp_path: Path) -> None:
    """SIGTERM to the launcher: the ranks are stopped and reaped, one line, status 128+15."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TITANC_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "titanc", "train", str(SPEC), *SMALL,
                             "--steps", "20000", "--nproc", "2", "--out", str(tmp_path / "o")],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while len(_children(proc.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=60)[1]
    assert proc.returncode == 128 + signal.SIGTERM
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith(
        "titanc: stopped by SIGTERM: the 2 ranks were stopped"), err


def test_trainer_stops_at_a_step_boundary_on_sigterm(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM to a single-process trainer: the step in flight finishes, is checkpointed,
    one line says so, and the run returns normally (exit 0 from the CLI)."""
    step = Trainer.step

    def step_then_term(self: Trainer) -> dict:
        out = step(self)
        if self.prog.step == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    monkeypatch.setattr(Trainer, "step", step_then_term)
    lines: list[str] = []
    summary = titanc_train(tiny("attn", train__steps=50, train__checkpoint_every=100),
                           tmp_path / "run", lines)
    assert summary["steps"] == 3
    assert lines[-1] == (f"stopped by SIGTERM after step 3; the last checkpoint (step 3) is in "
                         f"{tmp_path / 'run' / CHECKPOINT_NAME}; continue with --resume "
                         f"{tmp_path / 'run'}")
    assert titanc.load(tmp_path / "run").step == 3
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL    # the handler is put back


def titanc_train(spec, out: Path, lines: list[str]) -> dict:
    from titanc.runtime.train.trainer import run_training
    return run_training(spec, out, progress=False, log=lines.append)


# ---------------------------------------------------------------- data prepare (3, 4, 18, 20)

def _corpus(d: Path, name: str = "corpus.txt") -> Path:
    d.mkdir(parents=True, exist_ok=True)
    p = d / name
    p.write_text("the cat sat on the mat\n" * 400)
    return p


def _shard_bytes(d: Path) -> dict[str, bytes]:
    return {n: (d / n).read_bytes() for n in ("header.json", "train.bin", "val.bin")}


def test_03_overwrite_keeps_the_old_shards_until_the_new_ones_are_complete(tmp_path: Path) -> None:
    good = _corpus(tmp_path / "in")
    out = tmp_path / "dp" / "ow"
    prepare([good], out, progress=False)
    before = _shard_bytes(out)
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"fine text\n" * 100 + b"\xff\xfe not utf-8\n")   # fails mid-way
    with pytest.raises(TitancError, match="not UTF-8"):
        prepare([good, bad], out, progress=False, overwrite=True)
    assert _shard_bytes(out) == before and read_header(out)["splits"]["train"]["tokens"] > 0
    with pytest.raises(TitancError, match="does not exist"):
        prepare([tmp_path / "nope.txt"], out, progress=False, overwrite=True)
    assert _shard_bytes(out) == before
    (out / "NOTES.md").write_text("mine")                    # not a shard: kept
    prepare([good, good], out, progress=False, overwrite=True)
    assert read_header(out)["text_bytes"] == 2 * good.stat().st_size
    assert (out / "NOTES.md").read_text() == "mine"
    assert sorted(p.name for p in out.parent.iterdir()) == ["ow"]   # no staging left


def test_03_a_killed_prepare_leaves_the_old_shards(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    good = _corpus(tmp_path / "in")
    out = tmp_path / "ow"
    prepare([good], out, progress=False)
    before = _shard_bytes(out)

    def die(*_: object) -> None:
        raise KeyboardInterrupt
    monkeypatch.setattr(prepare_module, "_move_tail", die)
    with pytest.raises(KeyboardInterrupt):
        prepare([good, good], out, progress=False, overwrite=True)
    assert _shard_bytes(out) == before


def test_04_inputs_holding_a_shard_set_or_the_output_are_skipped(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture) -> None:
    corp = tmp_path / "corp"
    text = _corpus(corp, "a.txt")
    assert main(["data", "prepare", str(corp), "-o", str(corp / "shards"), "--no-progress"]) == 0
    assert main(["data", "prepare", str(corp), "-o", str(tmp_path / "x"), "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert f"titanc: note: skipping {corp / 'shards'}: it is a token-shard set" in err
    header = read_header(tmp_path / "x")
    assert [s["path"] for s in header["sources"]] == [str(text)]
    # the output inside the input tree, overwritten: skipped as the output
    assert main(["data", "prepare", str(corp), "-o", str(corp / "shards"), "--overwrite",
                 "--no-progress"]) == 0
    assert [s["path"] for s in read_header(corp / "shards")["sources"]] == [str(text)]
    # a shard file named explicitly is skipped too
    code, _, err = cli(["data", "prepare", text, corp / "shards" / "train.bin", "-o",
                        tmp_path / "y", "--no-progress"], capsys)
    assert code == 0 and "it is in a token-shard set" in err


def test_18_a_device_is_not_called_an_empty_directory(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture) -> None:
    code, _, err = cli(["data", "prepare", "/dev/zero", "-o", tmp_path / "z"], capsys)
    assert code == 2 and "input /dev/zero is not a regular file or a directory" in err
    code, _, err = cli(["tokenizer", "train", "/dev/null", "--vocab-size", "300",
                        "-o", tmp_path / "t.json"], capsys)
    assert code == 2 and "/dev/null is not a regular file or a directory" in err


def test_20_a_failed_write_names_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    good = _corpus(tmp_path / "in")

    def full(*_: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(prepare_module, "_move_tail", full)
    with pytest.raises(TitancError) as e:
        prepare([good], tmp_path / "out", progress=False)
    assert "val.bin: No space left on device" in str(e.value) and "could not write" in str(e.value)
    assert not (tmp_path / "out").exists() and os.listdir(tmp_path) == ["in"]


# ---------------------------------------------------------------- tokenizer (7, 8, 21)

def test_07_vocabulary_size_is_bounded(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    text = _corpus(tmp_path)
    code, _, err = cli(["tokenizer", "train", text, "--vocab-size", "1000000000",
                        "-o", tmp_path / "t.json"], capsys)
    assert code == 2 and "[257, 2097152]" in one_error_line(err)
    with pytest.raises(TitancError, match="--vocab-size"):
        train_bpe(["text"], 10**9, tmp_path / "t.json")
    code, _, err = cli(["tokenizer", "train", text, "--vocab-size", "300", "--min-frequency",
                        "99999999999999999999", "-o", tmp_path / "t.json"], capsys)
    assert code == 2 and "--min-frequency" in err


def test_08_tokenizer_write_failure_is_one_line_and_leaves_no_temp(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(*_: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(tokenizer_module.os, "replace", full)
    with pytest.raises(TitancError) as e:
        train_bpe(["the cat sat on the mat"] * 50, 300, tmp_path / "t.json")
    assert str(e.value).startswith(f"could not write tokenizer {tmp_path / 't.json'}: No space")
    assert os.listdir(tmp_path) == []
    with pytest.raises(TitancError, match="not a regular file"):
        train_bpe(["the cat"], 300, "/dev/full")


def test_21_an_empty_corpus_is_refused_like_data_prepare(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "empty.txt").write_text("")
    code, _, err = cli(["tokenizer", "train", tmp_path / "empty.txt", "--vocab-size", "300",
                        "-o", tmp_path / "t.json"], capsys)
    assert code == 2 and "holds no text" in err and not (tmp_path / "t.json").exists()


# ---------------------------------------------------------------- identity (5)

@pytest.fixture()
def run_dir(tmp_path: Path) -> Path:
    """A byte-level run directory as `titanc train` leaves it: checkpoint, spec.yaml."""
    spec = tiny("attn")
    prog = titanc.compile(spec)
    run = tmp_path / "run"
    save_checkpoint(run / CHECKPOINT_NAME, prog, torch.Generator().get_state(),
                    extra={"tokenizer_hash": ByteTokenizer.hash})
    (run / "spec.yaml").write_text(yaml.safe_dump(spec_to_dict(spec), sort_keys=False))
    return run


def test_05_a_replaced_tokenizer_is_refused_on_every_load(run_dir: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture) -> None:
    assert isinstance(run_tokenizer(run_dir), ByteTokenizer)
    other = train_bpe(["the cat sat on the mat"] * 50, 300, tmp_path / "other.json")
    (run_dir / "tokenizer.json").write_text(other.text)
    want = (f"tokenizer {run_dir / 'tokenizer.json'} (hash {other.hash[:12]}) is not the one "
            f"{run_dir / CHECKPOINT_NAME} was made with")
    for argv in (["generate", run_dir, "--prompt", "hi"],
                 ["serve", run_dir, "--port", "0"],
                 ["eval", run_dir, "--data", "synthetic:recall"],
                 ["eval", run_dir / CHECKPOINT_NAME, "--task", "recall"]):
        code, _, err = cli(argv, capsys)
        assert code == 2 and want in err, argv
    # (resume compares the spec's data.tokenizer with the checkpoint's record: test_corpus)


def test_05_a_replaced_spec_yaml_is_refused(run_dir: Path, capsys: pytest.CaptureFixture) -> None:
    doc = yaml.safe_load((run_dir / "spec.yaml").read_text())
    doc["model"]["d_model"] *= 2
    (run_dir / "spec.yaml").write_text(yaml.safe_dump(doc))
    code, _, err = cli(["generate", run_dir, "--prompt", "hi"], capsys)
    assert code == 2 and f"{run_dir / 'spec.yaml'} does not describe the model" in err
    assert "model.d_model" in err


def test_05_an_artifact_tokenizer_is_checked_against_its_manifest(tmp_path: Path) -> None:
    art = tmp_path / "art"
    assert main(["compile", str(SPEC), *SMALL, "-o", str(art)]) == 0
    run_tokenizer(art)
    other = train_bpe(["the cat sat on the mat"] * 50, 300, tmp_path / "other.json")
    (art / "tokenizer.json").write_text(other.text)
    with pytest.raises(TitancError, match="manifest.json was made with"):
        run_tokenizer(art)


# ---------------------------------------------------------------- bounds (2, 17)

def test_02_serve_slots_are_bounded_and_fit_checked(run_dir: Path, capsys: pytest.CaptureFixture,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    code, _, err = cli(["serve", run_dir, "--slots", "100000", "--port", "0"], capsys)
    assert code == 2 and "--slots" in err and "[1, 4096]" in err
    import titanc.runtime.capacity as capacity
    monkeypatch.setattr(capacity, "machine_bytes", lambda device="cpu": 64 << 20)
    code, _, err = cli(["serve", run_dir, "--slots", "4096", "--port", "0"], capsys)
    assert code == 2 and "reduce --slots (4096)" in err
    code, _, err = cli(["generate", run_dir, "--prompt", "hi", "--max-new-tokens", "1048576"],
                       capsys)
    assert code == 2 and "reduce --max-new-tokens" in err


def test_17_until_behind_the_checkpoint_blames_until(run_dir: Path, tmp_path: Path) -> None:
    prog = titanc.compile(tiny("attn"))
    prog.step = 20
    save_checkpoint(run_dir / CHECKPOINT_NAME, prog, torch.Generator().get_state(),
                    extra={"tokenizer_hash": ByteTokenizer.hash})
    with pytest.raises(TitancError) as e:
        Trainer(tiny("attn", train__steps=100), tmp_path / "o", resume=run_dir, until=10,
                progress=False)
    assert str(e.value).startswith("--until 10: the checkpoint is already at step 20")


@pytest.mark.parametrize("argv", [
    ["serve", "RUN", "--port", "70000"],
    ["serve", "RUN", "--port", "-1"],
    ["generate", "RUN", "--prompt", "x", "--seed", str(2**64)],
    ["generate", "RUN", "--prompt", "x", "--top-k", str(2**62)],
    ["generate", "RUN", "--prompt", "x", "--max-new-tokens", str(2**40)],
    ["data", "prepare", "IN", "-o", "OUT", "--workers", "100000"],
    ["data", "prepare", "IN", "-o", "OUT", "--val-fraction", "nan"],
    ["eval", "RUN", "--batches", str(10**30)],
    ["eval", "RUN", "--task", "recall", "--distances", "8," + "9" * 5000],
    ["eval", "RUN", "--task", "recall", "--recall-layout", "n_pairs=" + "9" * 40],
    ["train", "SPEC", "--out", "O", "--nproc", "100000"],
    ["train", "SPEC", "--out", "O", "--steps", "1" + "0" * 30],
    ["bench", "SPEC", "--threads", str(2**31)],
])
def test_numeric_flags_are_range_checked_where_parsed(argv: list[str], tmp_path: Path,
                                                      capsys: pytest.CaptureFixture) -> None:
    code, _, err = cli([a.replace("RUN", str(tmp_path)).replace("SPEC", str(SPEC)) for a in argv],
                       capsys)
    assert code == 2, err
    line = one_error_line(err)
    assert "out of range" in line or "expected" in line, line


def test_bounds_table_checks_types_and_ranges() -> None:
    assert bounds.SEED.check(2**64 - 1, "seed") == 2**64 - 1
    for bad in (2**64, -1, True, 1.0, "3"):
        with pytest.raises(TitancError, match="seed"):
            bounds.SEED.check(bad, "seed")
    with pytest.raises(TitancError, match="expected a TCP port"):
        bounds.PORT.parse("８０", "--port")        # fullwidth digits are not a port
