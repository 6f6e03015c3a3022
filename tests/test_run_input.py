"""A run and its files under hostile input: damaged checkpoints and run files, failing writes,
a second trainer on one run directory, non-finite losses, a run's files that do not belong
together; and what reaches a run from outside: a spec's numbers (bounded, checked against the
machine), files that are not regular, the threads setting, every numeric flag. Each ends in a
one-line error (exit 2 from the CLI), never a traceback, a hang or a non-finite result with
exit 0; the checkpoint on disk is always one a run can continue from.

Tests that would hang or exhaust memory on a broken build (an alias bomb, /dev/zero, a FIFO)
run the CLI in a subprocess with a timeout and a memory limit."""

from __future__ import annotations

import errno
import json
import os
import resource
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import save_file

import titanc
from titanc import bounds
from titanc.tools.cli import main
from titanc.errors import TitancError
from titanc.runtime.train import checkpoint as ckpt_module
from titanc.runtime.train.checkpoint import (CHECKPOINT_NAME, RNG_KEY, load_checkpoint,
                                       remove_stale_temps, save_checkpoint)
from titanc.runtime.serve.generate import Sampling
from titanc.runtime.data.tokenizer import ByteTokenizer, train_bpe
from titanc.runtime.train.rundir import LOCK_NAME, RunDir, run_tokenizer
from titanc import config
from titanc.runtime.train.threads import ENV, free_cores, model_threads, resolve_threads
from titanc.runtime.train.trainer import Trainer, read_metrics
from titanc.model.spec import spec_to_dict

# one_thread is an autouse fixture
from .test_trainer import one_thread, tiny, train  # noqa: F401

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "examples" / "tiny.yaml"
SMALL = ["--set", "model.d_model=32", "--set", "model.n_layers=1", "--set", "model.ffn_hidden=64",
         "--set", "train.batch_size=1"]
QUIET = {"progress": False, "log": lambda _: None}


def run_cli(args: list[str], timeout: float = 60, **kw: Any) -> subprocess.CompletedProcess:
    """`titanc ARGS` in a subprocess with at most 8 GiB of address space: a regression that
    reads without end fails the test instead of the machine."""
    def limits() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TITANC_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "titanc", *args], capture_output=True,
                          text=True, timeout=timeout, preexec_fn=limits, env=env, **kw)


def one_error_line(err: str) -> str:
    """stderr ends in one error line, `titanc: error: ...` (or argparse's usage + error),
    after at most a progress bar; no traceback."""
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines and "error:" in lines[-1], err
    assert sum("error:" in line for line in lines) == 1, err
    return lines[-1]


def cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    if code:
        one_error_line(err)
    return code, out, err


def tokens(prog: Any, vocab: int = 256, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (prog.batch_size, prog.seq_len + 1),
                         generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- the last good checkpoint


def test_a_diverging_run_leaves_a_checkpoint_that_resumes(tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(tiny("lmm", train__steps=2, train__checkpoint_every=1), run)
    with pytest.raises(TitancError, match="last good checkpoint"):
        train(tiny("lmm", train__steps=8, train__checkpoint_every=1, train__lr=1e38,
                   train__warmup=0), run, resume=run)
    step = load_checkpoint(run / CHECKPOINT_NAME)[1]["step"]
    # following the error's advice (resume with a lower lr) trains on, finitely
    summary = train(tiny("lmm", train__steps=step + 2, train__lr=1e-3), run, resume=run)
    assert summary["steps"] == step + 2 and summary["loss"] < 100
    assert not list(run.glob(".checkpoint*"))       # no pending or temporary file left


def test_a_non_finite_eval_loss_stops_the_run(tmp_path: Path) -> None:
    t = Trainer(tiny("lmm", train__steps=2, train__eval_every=1), tmp_path / "run", **QUIET)
    t.prog.loss = lambda tokens, docs=None: float("nan")
    with pytest.raises(TitancError, match=r"step 1: the held-out loss is nan"):
        t.run()
    assert not (tmp_path / "run" / CHECKPOINT_NAME).exists()


def test_a_huge_lr_is_an_error_not_exit_0_with_nan(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    code, _, err = cli(["train", SPEC, "--out", run, "--steps", "1", "--set", "train.lr=1e38",
                        "--set", "train.warmup=0", "--set", "model.d_model=16",
                        "--set", "model.n_layers=1", "--set", "model.seq_len=32",
                        "--set", "train.batch_size=2", "--set", "train.eval_batches=1"], capsys)
    assert code == 2 and "nan" in err
    assert not (run / CHECKPOINT_NAME).exists()     # nothing unproven was kept


def _overwrite_tensor(path: Path, name: str, data: bytes) -> None:
    """Write `data` over the start of tensor `name` in a safetensors file, in place."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    start = 8 + n + json.loads(raw[8:8 + n])[name]["data_offsets"][0]
    path.write_bytes(raw[:start] + data + raw[start + len(data):])


def test_a_damaged_checkpoint_is_refused_by_its_checksum(tmp_path: Path) -> None:
    prog = titanc.compile(tiny("lmm"))
    prog.train_step(tokens(prog))
    path = save_checkpoint(tmp_path / CHECKPOINT_NAME, prog)
    load_checkpoint(path)
    # finite garbage over an AdamW moment: only the checksum can tell
    _overwrite_tensor(path, "opt.v.embed", struct.pack("<4f", 1.0, 2.0, 3.0, 4.0))
    with pytest.raises(TitancError) as e:
        load_checkpoint(path)
    assert str(e.value) == (f"{path} is damaged: its content does not match the checksum it "
                            f"was written with; resume from another copy or train from scratch")
    with pytest.raises(TitancError, match="is damaged"):
        titanc.load(path)


def test_a_checkpoint_with_non_finite_state_is_refused(tmp_path: Path) -> None:
    prog = titanc.compile(tiny("lmm"))
    with torch.no_grad():
        prog.parameters()["embed"][0, 0] = float("nan")
    path = save_checkpoint(tmp_path / CHECKPOINT_NAME, prog)   # checksum is consistent
    with pytest.raises(TitancError, match="non-finite values in param.embed"):
        load_checkpoint(path)


# -------------------------------------------------------------------------- alias bombs


def _bomb() -> str:
    rows = ["&a [1,1,1,1,1,1,1,1,1]"] + [
        f"&{c} [" + ",".join([f"*{p}"] * 9) + "]" for p, c in zip("abcdefgh", "bcdefghi")]
    return "[" + ", ".join(rows) + "]"


def test_an_alias_bomb_is_refused_quickly(tmp_path: Path) -> None:
    spec = tmp_path / "bomb.yaml"
    spec.write_text("name: bomb\nmodel: {d_model: 16, n_layers: 1, block: lmm, seq_len: 16}\n"
                    f"train: {{betas: {_bomb()}}}\n")
    assert spec.stat().st_size < 600
    for args in (["compile", str(spec)], ["compile", str(SPEC), "--set", f"train.betas={_bomb()}"]):
        t0 = time.monotonic()
        r = run_cli(args, timeout=30)
        assert r.returncode == 2 and time.monotonic() - t0 < 20
        assert one_error_line(r.stderr).startswith(
            "titanc: error: train.betas: expected a list of 2 numbers, got the list [[1, 1, 1")


# ------------------------------------------------------------------------- write failures


def test_a_checkpoint_write_error_of_safetensors_is_one_line(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from safetensors import SafetensorError

    prog = titanc.compile(tiny("lmm"))
    path = save_checkpoint(tmp_path / CHECKPOINT_NAME, prog)
    before = path.read_bytes()

    def full(tensors: dict, filename: str, metadata: dict) -> None:
        Path(filename).write_bytes(b"partial")
        raise SafetensorError("Error while serializing: IoError(No space left on device)")

    monkeypatch.setattr(ckpt_module, "save_file", full)
    with pytest.raises(TitancError) as e:
        save_checkpoint(path, prog)
    assert str(e.value).startswith(f"could not write checkpoint {path}: Error while serializing")
    assert path.read_bytes() == before and sorted(tmp_path.iterdir()) == [path]


@pytest.mark.parametrize("where", ["under_a_file", "proc"])
def test_an_unwritable_out_is_one_line(tmp_path: Path, where: str,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "file").write_text("x")
    out = tmp_path / "file" / "run" if where == "under_a_file" else Path("/proc/titanc_run")
    code, _, err = cli(["train", SPEC, "--out", out, "--steps", "1", "--set", "model.d_model=16",
                        "--set", "model.seq_len=32", "--set", "train.batch_size=1"], capsys)
    assert code == 2 and str(out) in err
    code, _, err = cli(["compile", SPEC, "-o", out, "--set", "model.d_model=16"], capsys)
    assert code == 2 and "cannot create output directory" in err


def test_a_run_directory_that_refuses_writes_is_one_line(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A read-only or immutable directory (root ignores permission bits, so it is simulated)."""
    import titanc.runtime.train.trainer as trainer

    run = tmp_path / "run"

    def refused(path: Path, text: str) -> None:
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(trainer, "write_text_atomic", refused)
    with pytest.raises(TitancError) as e:
        train(tiny("lmm", train__steps=1), run)
    assert str(e.value) == (f"cannot write the run directory {run}: {run / 'spec.yaml'}: "
                            f"Permission denied; choose a writable directory")
    RunDir(run).acquire().release()        # the lock went with the failed run


def test_compile_onto_a_full_disk_is_one_line_and_leaves_no_tmp(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """RLIMIT_FSIZE makes every write past 4 KiB fail with EFBIG, as a full disk would."""
    out = tmp_path / "build"
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
    try:
        code = main(["compile", str(ROOT / "examples" / "tiny_lmm.yaml"), "-o", str(out),
                     "--set", "model.d_model=16", "--set", "model.seq_len=16",
                     "--set", "model.memory.chunk_size=4"])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old)
    err = capsys.readouterr().err
    assert code == 2
    assert one_error_line(err).startswith(f"titanc: error: cannot write the artifact directory "
                                          f"{out}: ") and "File too large; free some space" in err
    assert not list(out.rglob("*.tmp"))


# ------------------------------------------------------------------------------ the lock


def test_a_second_trainer_into_a_locked_run_directory_is_refused(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with RunDir(run):
        with pytest.raises(TitancError) as e:
            train(tiny("lmm", train__steps=1), run)
        assert str(e.value) == (f"--out {run} is in use by process {os.getpid()} (another "
                                f"titanc train holds {run / LOCK_NAME}); wait for it to finish "
                                f"or choose another --out")
        t = Trainer(tiny("lmm", train__steps=1), tmp_path / "run2", **QUIET)
        t.out = run                      # the lock taken between __init__ and run()
        with pytest.raises(TitancError, match=f"is in use by process {os.getpid()}"):
            t.run()
    assert not (run / CHECKPOINT_NAME).exists()
    train(tiny("lmm", train__steps=1), run)        # released: the run goes ahead
    assert (run / CHECKPOINT_NAME).exists()


def test_the_lock_dies_with_its_process(tmp_path: Path) -> None:
    run = tmp_path / "run"
    code = ("import sys, time; from titanc.runtime.train.rundir import RunDir; "
            f"RunDir({str(run)!r}).acquire(); print('locked', flush=True); time.sleep(60)")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "locked"
        with pytest.raises(TitancError, match=f"in use by process {p.pid} "):
            RunDir(run).acquire()
    finally:
        p.kill()                          # kill -9: no cleanup code runs
        p.wait()
    RunDir(run).acquire().release()


# ------------------------------------------------------------ generate, any vocabulary


@pytest.mark.parametrize("vocab", [64, 300])
def test_generate_with_a_vocabulary_other_than_256(tmp_path: Path, vocab: int,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    prog = titanc.compile(tiny("lmm", model__vocab_size=vocab))
    save_checkpoint(tmp_path / CHECKPOINT_NAME, prog)
    for extra in ([], ["--stream"]):
        code, out, _ = cli(["generate", tmp_path, "--prompt", "#!", "--max-new-tokens", "6",
                            "--temperature", "3", *extra], capsys)
        assert code == 0 and out.startswith("#!")
    code, _, err = cli(["generate", tmp_path, "--prompt", "z~", "--max-new-tokens", "2"], capsys)
    if vocab == 64:                     # 'z' is byte 122: outside a 64-token vocabulary
        assert code == 2 and "prompt: id 122 is outside the vocabulary [0, 64)" in err
    else:
        assert code == 0


# --------------------------------------------------------------- numbers that reach torch


@pytest.mark.parametrize("flag, value", [("--temperature", "nan"), ("--temperature", "-1"),
                                         ("--temperature", "inf"), ("--seed", str(10**24)),
                                         ("--seed", "-1")])
def test_bad_sampling_flags_are_usage_errors(flag: str, value: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = cli(["generate", "unused", "--prompt", "x", flag, value], capsys)
    assert code == 2 and f"argument {flag}: expected" in err


def test_sampling_checks_its_fields() -> None:
    for kw in ({"temperature": float("nan")}, {"temperature": -1.0}, {"seed": 10**24},
               {"top_p": 0.0}, {"top_k": 0}):
        with pytest.raises(TitancError):
            Sampling(**kw)


def test_an_lr_past_float32_is_a_spec_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = cli(["compile", SPEC, "--set", "train.lr=1e39"], capsys)
    assert code == 2 and "train.lr: 1e+39 overflows float32" in err


# each field at its bound (titanc/bounds.py) with model.d_model at its own: terabytes
@pytest.mark.parametrize("field, big", [("model.n_layers", 1024), ("model.vocab_size", 2**21),
                                        ("model.attention.window", 2**20)])
def test_a_spec_too_large_for_the_machine_is_refused(tmp_path: Path, field: str, big: int,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = cli(["compile", ROOT / "examples" / "tiny_attn.yaml", "-o", tmp_path / "b",
                        "--set", f"{field}={big}", "--set", "model.d_model=65536"], capsys)
    assert code == 2 and " bytes (" in err and "pass --force" in err
    assert not (tmp_path / "b").exists()
    with pytest.raises(TitancError, match="more than this machine's"):
        titanc.compile(tiny("attn", **{field.replace(".", "__"): big, "model__d_model": 65536}))


def test_force_writes_the_plan_of_a_spec_too_large_to_run(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    code, _, _ = cli(["compile", ROOT / "examples" / "tiny_attn.yaml", "-o", tmp_path / "b",
                      "--set", "model.vocab_size=2097152", "--set", "model.d_model=65536",
                      "--force"], capsys)
    assert code == 0 and (tmp_path / "b" / "memory_plan.txt").exists()


# -------------------------------------------------------------------- unbounded reads


def test_specs_that_are_not_regular_files_are_refused(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    for path in ("/dev/zero", str(fifo)):
        r = run_cli(["compile", path], timeout=30)
        assert r.returncode == 2
        assert one_error_line(r.stderr) == (f"titanc: error: {path}: not a regular file (a "
                                             f"device, FIFO or socket); pass a YAML spec file")
    big = tmp_path / "big.yaml"
    big.write_text("# padding\n" * 200_000)
    r = run_cli(["compile", str(big)], timeout=30)
    assert r.returncode == 2 and "is too large for a spec" in one_error_line(r.stderr)


def test_data_that_is_not_a_regular_file_is_refused(tmp_path: Path) -> None:
    r = run_cli(["train", str(SPEC), "--out", str(tmp_path / "run"), "--data", "/dev/zero"],
                timeout=60)
    assert r.returncode == 2
    assert one_error_line(r.stderr) == ("titanc: error: data file /dev/zero is not a regular "
                                        "file (a device, FIFO or socket); pass a text file")


# ------------------------------------------------------------------- damaged run files


def test_damaged_metrics_files(tmp_path: Path) -> None:
    m = tmp_path / "metrics.jsonl"
    m.mkdir()
    with pytest.raises(TitancError, match="metrics.jsonl cannot be read"):
        read_metrics(m)
    m.rmdir()
    m.write_bytes(b'{"step": 1, "loss": 2.0}\n\xff\xfe{"step": 2}\n[1, 2]\n{"step": "3"}\n'
                  b'"text"\n{"step": 4, "loss": 1.0}\n')
    assert read_metrics(m) == [{"step": 1, "loss": 2.0}, {"step": 4, "loss": 1.0}]


def test_damaged_checkpoint_metadata_and_rng_state(tmp_path: Path) -> None:
    prog = titanc.compile(tiny("lmm"))
    path = save_checkpoint(tmp_path / CHECKPOINT_NAME, prog)
    tensors, _ = load_checkpoint(path)
    meta = {"format": "titanc-checkpoint", "version": "1", "step": "0",
            "spec": json.dumps([spec_to_dict(prog.spec)]), "extra": "{}"}   # no checksum: old
    save_file(tensors, str(path), metadata=meta)
    with pytest.raises(TitancError, match="has malformed metadata"):
        load_checkpoint(path)
    save_checkpoint(path, prog, rng_state=torch.zeros(7, dtype=torch.uint8))
    with pytest.raises(TitancError) as e:
        Trainer(tiny("lmm", train__steps=2), tmp_path, resume=tmp_path, **QUIET)
    assert str(e.value) == (f"{path}: its sampler state {RNG_KEY} is damaged ([7], "
                            f"torch.uint8); it cannot be resumed bit for bit")


def test_damaged_manifest_and_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from titanc.tools.build_dir import open_artifact
    from titanc.runtime.data.tokenizer import load_tokenizer

    (tmp_path / "manifest.json").write_text(json.dumps({"spec": [1, 2]}))
    with pytest.raises(TitancError, match="not a titanc manifest"):
        titanc.load(tmp_path)
    (tmp_path / "manifest.json").write_text("[1, 2]")
    with pytest.raises(TitancError, match="holds no tokenizer.json and no spec"):
        load_tokenizer(tmp_path)
    (tmp_path / "report.json").write_text(json.dumps(
        {"kernels": [{"name": 7, "category": "matmul", "flops": 1, "bytes": 1, "nodes": 1}]}))
    with pytest.raises(TitancError, match=r"kernels\[0\] is malformed"):
        open_artifact(tmp_path)
    code, _, _ = cli(["inspect", tmp_path], capsys)
    assert code == 2


# --------------------------------------------------------------------- leftover temps


def test_temporary_files_of_dead_saves_are_removed(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    path = tmp_path / CHECKPOINT_NAME
    stale = tmp_path / f".{CHECKPOINT_NAME}.{dead.pid}.tmp"
    live = tmp_path / f".{CHECKPOINT_NAME}.{os.getppid()}.tmp"
    other = tmp_path / f".other.safetensors.{dead.pid}.tmp"
    for p in (stale, live, other):
        p.write_bytes(b"\0" * 1000)
    save_checkpoint(path, titanc.compile(tiny("lmm")))
    assert not stale.exists() and live.exists() and other.exists()
    assert remove_stale_temps(path, keep_live=False) == [live]   # what a lock holder may do


# ------------------------------------------------------------------- terminal output


def test_train_never_prints_the_spec_name_raw(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    lines: list[str] = []
    name = "evil\x1b[2J\r\x00name"
    Trainer(tiny("lmm", name=name, train__steps=1), tmp_path / "run", log=lines.append).run()
    err = capsys.readouterr().err
    text = "\n".join(lines) + err
    assert "\x1b[2J" not in text and "\x00" not in text and "\r\x00" not in text
    assert repr(name) in lines[0] and repr(name)[:40] in err
    assert "threads=1" in err                 # item 12: the thread count is on screen


# ------------------------------------------------------------------------------ threads


def test_train_threads_flag_env_and_default(monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    import titanc.runtime.train.threads as threads
    import titanc.runtime.train.trainer as trainer

    seen: list[int] = []
    monkeypatch.setattr(trainer, "run_training",
                        lambda *a, **k: seen.append(torch.get_num_threads()))
    monkeypatch.setenv(ENV, "1")
    assert main(["train", str(SPEC), "--out", "r", "--threads", "2"]) == 0
    assert main(["train", str(SPEC), "--out", "r"]) == 0
    assert seen == [2, 1]
    monkeypatch.setenv(ENV, "many")
    code, _, err = cli(["train", SPEC, "--out", "r"], capsys)
    assert code == 2 and "TITANC_THREADS='many': expected a positive integer" in err

    spec = tiny("lmm")
    with config.override(threads=2):
        assert resolve_threads(spec, 3) == (3, "--threads")
        assert resolve_threads(spec, None) == (2, ENV)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setattr(os, "getloadavg", lambda: (12.2, 0.0, 0.0))
    assert free_cores() == 4
    assert model_threads(spec) == 1 and resolve_threads(spec, None)[0] == 1
    big = tiny("lmm", model__d_model=512, model__seq_len=512, train__batch_size=16)
    assert model_threads(big) > 4 and resolve_threads(big, None)[0] == 4
    monkeypatch.setattr(threads, "free_cores", lambda: 1)
    assert resolve_threads(big, None)[0] == 1


# ---------------------------------------------------------------- identity

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


def test_a_replaced_tokenizer_is_refused_on_every_load(run_dir: Path, tmp_path: Path,
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


def test_a_replaced_spec_yaml_is_refused(run_dir: Path, capsys: pytest.CaptureFixture) -> None:
    doc = yaml.safe_load((run_dir / "spec.yaml").read_text())
    doc["model"]["d_model"] *= 2
    (run_dir / "spec.yaml").write_text(yaml.safe_dump(doc))
    code, _, err = cli(["generate", run_dir, "--prompt", "hi"], capsys)
    assert code == 2 and f"{run_dir / 'spec.yaml'} does not describe the model" in err
    assert "model.d_model" in err


def test_an_artifact_tokenizer_is_checked_against_its_manifest(tmp_path: Path) -> None:
    art = tmp_path / "art"
    assert main(["compile", str(SPEC), *SMALL, "-o", str(art)]) == 0
    run_tokenizer(art)
    other = train_bpe(["the cat sat on the mat"] * 50, 300, tmp_path / "other.json")
    (art / "tokenizer.json").write_text(other.text)
    with pytest.raises(TitancError, match="manifest.json was made with"):
        run_tokenizer(art)


# ---------------------------------------------------------------- bounds

def test_serve_slots_are_bounded_and_fit_checked(run_dir: Path, capsys: pytest.CaptureFixture,
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


def test_until_behind_the_checkpoint_blames_until(run_dir: Path, tmp_path: Path) -> None:
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
