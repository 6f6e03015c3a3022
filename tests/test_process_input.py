"""The processes of a job under signals: every process of a job (the launcher's ranks, data
prepare's workers, the trainer) stops with it, at a step boundary where it can.

The serving side is in test_serve_streams_input.py; the Hypothesis fuzzing of every command
and endpoint in test_fuzz_cli.py and test_fuzz_api.py."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import titanc
from titanc.runtime.train.checkpoint import CHECKPOINT_NAME
from titanc.runtime.train.trainer import Trainer

from .test_trainer import one_thread, tiny  # noqa: F401 (autouse)

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "examples" / "tiny.yaml"
SMALL = ["--set", "model.d_model=32", "--set", "model.n_layers=1", "--set", "model.ffn_hidden=64",
         "--set", "train.batch_size=1"]


# ---------------------------------------------------------------- process trees

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
def test_ranks_die_with_their_launcher(tmp_path: Path, sig: int) -> None:
    argv = ["train", str(SPEC), *SMALL, "--steps", "20000", "--nproc", "2",
            "--out", str(tmp_path / "o")]
    _kill_tree_and_check(argv, 2, sig, tmp_path)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_data_workers_die_with_prepare(tmp_path: Path, sig: int) -> None:
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

