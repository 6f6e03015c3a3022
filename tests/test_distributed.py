"""Data-parallel training on torch.distributed (gloo on CPU, float64): W ranks of batch B equal
one rank of batch W·B (plain all-reduce and ZeRO-1, with and without gradient accumulation),
checkpoints move between world sizes, and a rank that dies stops the job with one line.

The multi-rank runs are real processes: `tests/dist_worker.py` ranks that train several jobs
in one process group, and `titanc train --nproc 2` for the launcher."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from titanc.tools.cli import main
from titanc.errors import SpecError
from titanc.runtime.train.checkpoint import load_checkpoint
from titanc.runtime.data.datasets import SyntheticRecall, TextData
from titanc.runtime.train.launch import free_port
from titanc.runtime.data.prepare import prepare
from titanc.runtime.data.shards import ShardData
from titanc.runtime.train.trainer import Trainer, read_metrics
from titanc.model.spec import load_spec

from tests.helpers import one_thread  # noqa: F401 (autouse)

ROOT = Path(__file__).resolve().parent.parent
SPEC = str(ROOT / "examples" / "tiny_attn.yaml")
B = 2                                                 # per-rank batch of the 2-rank runs
BASE = {"model.d_model": 16, "model.n_layers": 1, "model.seq_len": 16,
        "model.attention.segment": 8, "model.memory.chunk_size": 4, "train.dtype": "float64",
        "train.batch_size": B, "train.steps": 3, "train.warmup": 1, "train.eval_every": 0,
        "train.checkpoint_every": 0, "train.weight_decay": 0.1,
        "train.bucket_mb": 0.002, "compile.target": "cpu"}     # buckets of 262 float64
CONFIGS = [(zero, accum) for zero in (0, 1) for accum in (1, 2)]
# AdamW's step barely depends on the gradient's scale (and not at all once clipped), so the
# moments are compared too; clipping is off without accumulation, on with it
CLIP = {1: 0.0, 2: 0.5}


def env(nproc: int) -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(free_port()), WORLD_SIZE=str(nproc))


def run_ranks(tmp: Path, nproc: int, jobs: list[dict[str, Any]]) -> None:
    """Train `jobs` (see dist_worker.py) on `nproc` ranks, one process each."""
    path = tmp / f"jobs{len(list(tmp.glob('jobs*')))}.json"
    path.write_text(json.dumps(jobs))
    base = env(nproc)
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "dist_worker.py"), str(path)],
                              env={**base, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stderr=subprocess.PIPE, text=True) for r in range(nproc)]
    errs = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0] * nproc, "\n".join(errs)


def single(out: Path, over: dict[str, Any], **kw: Any) -> Trainer:
    t = Trainer(load_spec(SPEC, over), out, progress=False, log=lambda _: None, **kw)
    t.run()
    return t


def state(run: Path) -> dict[str, torch.Tensor]:
    tensors, meta = load_checkpoint(run / "checkpoint.safetensors")
    return tensors


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tol: float = 1e-12) -> None:
    keys = [k for k in a if k.startswith(("param.", "opt."))]
    assert keys and sorted(keys) == sorted(k for k in b if k.startswith(("param.", "opt.")))
    for k in keys:
        diff = (a[k].double() - b[k].double()).abs().max().item() if a[k].numel() else 0.0
        assert diff <= tol, f"{k}: max |diff| {diff:.3g}"


# ------------------------------------------------------------------------- fast: no processes


@pytest.mark.parametrize("field,value,message", [
    ("train.zero", 2, "train.zero: 2 must be 0 (all-reduce) or 1 (ZeRO-1"),
    ("train.bucket_mb", 0, "train.bucket_mb: 0.0 must be > 0"),
    ("train.dist_timeout_s", -1, "train.dist_timeout_s: -1.0 must be > 0"),
])
def test_spec_fields(field: str, value: Any, message: str) -> None:
    with pytest.raises(SpecError) as err:
        load_spec(SPEC, {field: value})
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_rank_rows_are_part_of_the_global_batch(tmp_path: Path) -> None:
    """A rank's rows are its slice of the batch one process draws: the generator advances the
    same whatever the slice, so the global batch sequence does not depend on the world size."""
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 40)
    prepare([text], tmp_path / "shards", workers=1, progress=False)
    for data in (TextData(text, seq_len=8), ShardData(tmp_path / "shards", 8, 256),
                 SyntheticRecall(seq_len=16, vocab_size=256)):
        g_all, g_part = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
        for _ in range(2):                          # two global batches in a row
            whole = data.batch(6, "train", g_all)
            before, got = g_part.get_state(), []
            for rank in range(3):                   # 3 ranks of 2 rows
                g_part.set_state(before)
                got.append(data.batch(6, "train", g_part, rows=slice(2 * rank, 2 * rank + 2)))
            assert torch.equal(torch.cat(got), whole)
            assert torch.equal(g_part.get_state(), g_all.get_state())


def test_nproc_refused_under_torchrun(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["train", SPEC, "--nproc", "2", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("titanc: error: --nproc starts its own ranks") and "\n" not in err


# ------------------------------------------------------------------------- ranks as processes


def test_two_ranks_equal_one_rank_of_twice_the_batch(tmp_path: Path) -> None:
    """After 3 optimizer steps, parameters and AdamW moments of 2 ranks × B equal 1 rank × 2B
    to 1e-12, for the all-reduce and ZeRO-1, without and with gradient accumulation. Buckets
    of 262 elements cut parameters (and ZeRO shards) mid-tensor."""
    jobs = [{"spec": SPEC, "out": str(tmp_path / f"dp{z}{a}"),
             "set": {**BASE, "train.zero": z, "train.grad_accum": a, "train.grad_clip": CLIP[a]}}
            for z, a in CONFIGS]
    run_ranks(tmp_path, 2, jobs)
    for (zero, accum), job in zip(CONFIGS, jobs):
        ref = tmp_path / f"ref{zero}{accum}"
        single(ref, {**BASE, "train.batch_size": 2 * B, "train.grad_accum": accum,
                     "train.grad_clip": CLIP[accum]})
        dp = state(Path(job["out"]))
        assert int(dp["opt.step"]) == 3
        assert_same(dp, state(ref))
        # the metrics record the mean loss over ranks and the global gradient norm, as the
        # single run logs its batch's
        a, b = ([(m["loss"], m["grad_norm"]) for m in read_metrics(run / "metrics.jsonl")
                 if "loss" in m] for run in (Path(job["out"]), ref))
        assert len(a) == 3
        assert [x for r in a for x in r] == pytest.approx([x for r in b for x in r], abs=1e-12)


@pytest.mark.slow      # 22 s; the default tier resumes a 2-rank job in test_a_killed_rank_stops_the_job
def test_resume_across_world_sizes(tmp_path: Path) -> None:
    """Stopped at step 2 on 2 ranks (ZeRO-1, through `titanc train --nproc 2`) and resumed on
    1 rank, or stopped on 1 and resumed on 2: the same parameters as 4 steps straight."""
    over = {**BASE, "train.steps": 4, "train.zero": 1, "train.grad_accum": 2}
    one = {**over, "train.batch_size": 2 * B}
    straight = tmp_path / "straight"
    single(straight, one)
    # 2 ranks -> 1 rank: the CLI and its launcher
    two = tmp_path / "two"
    sets = [a for k, v in over.items() for a in ("--set", f"{k}={v}")]
    proc = subprocess.run([sys.executable, "-m", "titanc", "train", SPEC, *sets, "--nproc", "2",
                           "--until", "2", "--out", str(two)], env=dict(os.environ,
                          OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert int(state(two)["opt.step"]) == 2
    single(two, one, resume=two)
    assert_same(state(two), state(straight))
    # 1 rank -> 2 ranks
    first = tmp_path / "first"
    single(first, one, until=2)
    run_ranks(tmp_path, 2, [{"spec": SPEC, "set": over, "out": str(first), "resume": str(first)}])
    assert_same(state(first), state(straight))


def test_a_killed_rank_stops_the_job(tmp_path: Path) -> None:
    """SIGKILL one rank mid-run: `titanc train --nproc 2` exits 1 within train.dist_timeout_s
    with a one-line reason naming the rank; the checkpoint on disk loads and resumes."""
    out, timeout = tmp_path / "run", 30
    over = {**BASE, "train.steps": 100000, "train.checkpoint_every": 2,
            "train.dist_timeout_s": timeout}
    sets = [a for k, v in over.items() for a in ("--set", f"{k}={v}")]
    proc = subprocess.Popen([sys.executable, "-m", "titanc", "train", SPEC, *sets, "--nproc", "2",
                             "--out", str(out)], env=dict(os.environ, OMP_NUM_THREADS="1"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not (out / "checkpoint.safetensors").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.1)
        victim = _rank_pid(proc.pid, 1)
        os.kill(victim, signal.SIGKILL)
        _, err = proc.communicate(timeout=timeout + 30)
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = err.strip().splitlines()
    assert proc.returncode == 1
    assert "Traceback" not in err
    assert lines[-1].startswith("titanc: error: rank 1 of 2 was killed by SIGKILL, so the job "
                                "stopped; the last checkpoint (step ")
    assert lines[-1].endswith(f"continue with --resume {out}")
    step = int(lines[-1].split("(step ")[1].split(")")[0])
    assert step >= 2 and step % 2 == 0
    assert int(state(out)["opt.step"]) == step
    t = single(out, {**over, "train.steps": step + 1, "train.batch_size": 2 * B}, resume=out)
    assert t.prog.step == step + 1


def _rank_pid(launcher: int, rank: int) -> int:
    """The pid of `rank` among the launcher's children (by the RANK in its environment)."""
    for _ in range(100):
        kids = Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split()
        for pid in kids:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            if f"RANK={rank}".encode() in environ:
                return int(pid)
        time.sleep(0.1)
    raise AssertionError(f"no rank {rank} under pid {launcher}")
