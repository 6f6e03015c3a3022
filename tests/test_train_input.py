"""`titanc train` under bad input: what a user of `titanc train` hits with an --out that
is not a run directory, a damaged checkpoint header, a distributed run's checkpoint guard and
the launcher's error lines. Each test failed before its fix."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import titanc
from titanc.errors import DistributedError, TitancError
from titanc.runtime.data.datasets import draw
from titanc.runtime.train.checkpoint import (CHECKPOINT_NAME, checkpoint_path, load_checkpoint,
                                             save_checkpoint)
from titanc.runtime.train.distributed import Dist
from titanc.runtime.train.trainer import Trainer

from tests.helpers import one_thread  # noqa: F401 (autouse)
from tests.test_trainer import tiny, train

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "examples" / "tiny.yaml"
QUIET: dict[str, Any] = {"progress": False, "log": lambda _: None}
SMALL = ["--set", "model.d_model=16", "--set", "model.n_layers=1", "--set", "model.seq_len=16",
         "--set", "model.attention.segment=8", "--set", "model.memory.chunk_size=4",
         "--set", "train.batch_size=2", "--set", "train.eval_every=0"]


def _cli(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TITANC_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "titanc", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


def _error_lines(err: str) -> list[str]:
    assert "Traceback" not in err, err
    return [line for line in err.replace("\r", "\n").splitlines() if "error:" in line]


# ---------------------------------------------------------- --out: someone else's directory


def test_out_at_an_unrelated_directory_overwrites_nothing(tmp_path: Path) -> None:
    """A directory no trainer made (no .lock) holding files a run writes or removes
    (spec.yaml, tokenizer.json, ...) is refused before anything is written; it used to have
    its spec.yaml, metrics.jsonl and loss.png overwritten and its tokenizer.json deleted."""
    mine = tmp_path / "project"
    mine.mkdir()
    files = {"spec.yaml": "my: own spec\n", "tokenizer.json": "{}", "notes.txt": "keep\n"}
    for name, text in files.items():
        (mine / name).write_text(text)
    with pytest.raises(TitancError) as e:
        Trainer(tiny("attn"), mine, steps=1, **QUIET)
    assert str(e.value).startswith(f"--out {mine} is not a titanc run directory and holds "
                                   f"spec.yaml, tokenizer.json, which a run would overwrite")
    assert sorted(p.name for p in mine.iterdir()) == sorted(files)
    assert all((mine / n).read_text() == t for n, t in files.items())
    # a directory of other files only, and a run killed before its first checkpoint (its
    # .lock marks it as titanc's), train as before
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("keep\n")
    train(tiny("attn"), other, steps=1)
    assert (other / "notes.txt").read_text() == "keep\n"
    (other / CHECKPOINT_NAME).unlink()
    train(tiny("attn"), other, steps=1)
    assert (other / CHECKPOINT_NAME).exists()


def test_an_empty_out_or_resume_is_refused(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """`--out ""` trained into the current directory (Path("") is "."); `--resume ""` read
    the current directory's checkpoint."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TitancError, match=r"^--out is empty; pass a directory for the run$"):
        Trainer(tiny("attn"), "", steps=1, **QUIET)
    with pytest.raises(TitancError, match=r"^--resume is empty; pass a run directory"):
        checkpoint_path("")
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------- the checksum cannot be skipped


def test_a_damaged_checksum_entry_name_is_refused(tmp_path: Path) -> None:
    """A bit flip in the name of the `checksum` metadata entry ("checksum" -> "chdcksum")
    made load_checkpoint treat the file as older than checksums and skip the check."""
    prog = titanc.compile(tiny("lmm"))
    path = save_checkpoint(tmp_path / CHECKPOINT_NAME, prog)
    raw = bytearray(path.read_bytes())
    n = struct.unpack("<Q", raw[:8])[0]
    at = raw.index(b'"checksum"', 8, 8 + n)
    raw[at + 3] ^= 1                                  # "checksum" -> "chdcksum"
    path.write_bytes(bytes(raw))
    with pytest.raises(TitancError, match="is damaged: it has no checksum but an unknown "
                                          "metadata entry chdcksum"):
        load_checkpoint(path)
    # a checkpoint written before checksums (the same entries, no checksum) still loads
    tensors, _ = load_checkpoint(save_checkpoint(tmp_path / "new.safetensors", prog))
    old = {"format": "titanc-checkpoint", "version": "1", "step": "0",
           "spec": json.dumps({"name": "x"}), "extra": "{}"}
    save_file(tensors, str(tmp_path / "old.safetensors"), metadata=old)
    assert load_checkpoint(tmp_path / "old.safetensors")[1]["step"] == 0


# ---------------------------------------------------------- the guard of a distributed run


def _rank(tmp_path: Path, rank: int, **over: Any) -> Trainer:
    """A Trainer as rank `rank` of 2 would build it (no process group: nothing here runs a
    collective but those the test replaces)."""
    dist = Dist(rank=rank, world=2, local_rank=rank, backend="gloo", timeout_s=10)
    t = Trainer(tiny("lmm", train__grad_accum=2, **over), tmp_path / "run", steps=4,
                dist=dist, **QUIET)
    t._start_step = 0
    return t


def test_the_probe_tries_this_ranks_rows_of_the_next_batch(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The checkpoint guard tried `rows` rows of a draw of its own size, not the rows of the
    global batch the next step gives this rank: on 2 ranks it proved a batch no step trains."""
    t = _rank(tmp_path, 1)
    seen: list[torch.Tensor] = []
    real = t.prog.grads_in_place
    monkeypatch.setattr(t.prog, "grads_in_place", lambda tokens, docs=None: (
        seen.append(tokens.clone()), real(tokens, docs))[1])
    t._probe_next_step()
    gen = torch.Generator()
    gen.set_state(t.gen.get_state())
    nxt, _ = draw(t.data, t.spec, t.global_rows, "train", gen, rows=t.my_rows)
    assert nxt.shape[0] == t.rows
    assert torch.equal(seen[0], nxt[:t.spec.train.batch_size])


def test_rank_0_writes_no_checkpoint_another_rank_refused(tmp_path: Path) -> None:
    """Each rank tries its own rows of the next batch; when another rank's are not finite,
    rank 0 used to write the checkpoint anyway (one that fails on resume)."""
    t = _rank(tmp_path, 0)
    calls: list[tuple[bool, str]] = []

    def count(flag: bool, what: str) -> int:
        calls.append((flag, what))
        return 1                                    # rank 1 failed its probe
    t.reducer.count = count                         # type: ignore[method-assign]
    with pytest.raises(TitancError, match="the next batch's loss or gradient norm on 1 other "
                                          "rank is not finite"):
        t._checkpoint()
    assert calls == [(False, "checking the checkpoint")]
    assert not (t.out / CHECKPOINT_NAME).exists() and t.last_ckpt_step is None


def test_a_rank_counts_a_checkpoint_only_once_rank_0_wrote_it(tmp_path: Path) -> None:
    """Rank 1 set its last checkpoint step before rank 0 had written it, so a rank 0 that failed
    during the write left rank 1 telling the user of a checkpoint that does not exist."""
    t = _rank(tmp_path, 1)

    def count(flag: bool, what: str) -> int:
        if what == "writing the checkpoint":      # rank 0 died during its save
            raise DistributedError("rank 1: writing the checkpoint at step 1 failed")
        return 0
    t.reducer.count = count                         # type: ignore[method-assign]
    with pytest.raises(DistributedError):
        t._checkpoint()
    assert t.last_ckpt_step is None


# ---------------------------------------------------------- the launcher: one line, exit 2


@pytest.mark.parametrize("case", ["missing-resume", pytest.param("locked-out", marks=pytest.mark.slow)])
def test_bad_input_under_nproc_is_one_line_exit_2(tmp_path: Path, case: str) -> None:
    """Bad input that every rank (or rank 0 alone) sees used to print one line per rank plus
    the launcher's, and exit 1 as if a rank had crashed."""
    out = tmp_path / "run"
    extra: list[str] = []
    holder = None
    if case == "missing-resume":
        extra = ["--resume", str(tmp_path / "nope")]
        expect = f"titanc: error: --resume {tmp_path / 'nope'}: no such run directory"
    else:                                           # another trainer holds --out
        out.mkdir()
        holder = subprocess.Popen([sys.executable, "-c",
                                   "import fcntl, os, sys, time\n"
                                   f"fd = os.open({str(out / '.lock')!r}, os.O_RDWR | os.O_CREAT)\n"
                                   "fcntl.flock(fd, fcntl.LOCK_EX)\n"
                                   "print('locked', flush=True)\ntime.sleep(120)\n"],
                                  stdout=subprocess.PIPE, text=True)
        assert holder.stdout.readline().strip() == "locked"
        expect = f"titanc: error: --out {out} is in use by"
    try:
        proc = _cli(["train", str(SPEC), *SMALL, "--steps", "2", "--nproc", "2",
                     "--out", str(out), *extra])
    finally:
        if holder is not None:
            holder.kill()
            holder.wait()
    lines = _error_lines(proc.stderr)
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith(expect), proc.stderr


# ---------------------------------------------------------- resuming: what --strict and spec.yaml see


def test_strict_allows_every_run_control_field(tmp_path: Path) -> None:
    """The documented run-control fields (log cadence, remat, every compile.* field) never
    block a --strict resume; train.log_every, train.memory_stats_every, train.remat_rows and
    compile.* other than target used to be refused as a difference."""
    from titanc.model.spec import spec_to_dict
    from titanc.runtime.train.checkpoint import check_resumable

    prog = titanc.compile(tiny("lmm"))
    tensors, meta = load_checkpoint(save_checkpoint(tmp_path / CHECKPOINT_NAME, prog))
    for field, value in (("train__log_every", 7), ("train__memory_stats_every", 3),
                         ("train__remat_rows", 4),
                         ("compile__fused_loss", False), ("compile__cuda_graphs", False),
                         ("compile__chunk_groups", True)):
        spec = tiny("lmm", **{field: value})
        assert spec_to_dict(spec) != meta["spec"]
        check_resumable(tensors, meta, spec, strict=True, path="ckpt")
    with pytest.raises(TitancError, match=r"differs from the spec in train\.lr"):
        check_resumable(tensors, meta, tiny("lmm", train__lr=0.5), strict=True, path="ckpt")


def test_an_upgrade_stopped_before_its_first_checkpoint_keeps_spec_yaml(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Resuming a run in place with an upgraded model rewrote spec.yaml at the start; a run
    stopped before its first checkpoint (a non-finite loss, Ctrl-C, a kill) left a spec.yaml
    describing a model the checkpoint does not hold, so generate, serve and eval refused the
    run and the spec it was trained with was gone."""
    from titanc.runtime.train.rundir import run_tokenizer

    old, new = tiny("lmm", model__memory__adaptive=False), tiny("lmm")
    run = tmp_path / "run"
    train(old, run, steps=1)
    before = (run / "spec.yaml").read_text()
    t = Trainer(new, run, steps=3, resume=run, **QUIET)
    monkeypatch.setattr(t, "step", lambda: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        t.run()
    assert (run / "spec.yaml").read_text() == before
    run_tokenizer(run)                                 # the pair still belongs together
    monkeypatch.undo()
    train(new, run, steps=2, resume=run)               # the first checkpoint writes it
    assert "adaptive: true" in (run / "spec.yaml").read_text()
    run_tokenizer(run)


def test_a_mac_checkpoint_with_the_normalised_write_says_how_to_resume(tmp_path: Path) -> None:
    """A MAC checkpoint whose memory was written with rmsnorm(ỹ) (its layers.mac_norm) under a
    spec that says `mac_write: attention`, the write's name before it became the paper's ỹ,
    is refused with the setting that resumes it."""
    from titanc.runtime.train.checkpoint import check_resumable

    prog = titanc.compile(tiny("mac", model__memory__mac_write="attention_norm"))
    tensors, meta = load_checkpoint(save_checkpoint(tmp_path / CHECKPOINT_NAME, prog))
    meta["spec"]["model"]["memory"]["mac_write"] = "attention"   # as such a run recorded it
    with pytest.raises(TitancError, match=r"mac_norm.*mac_write: attention_norm in its "
                                          r"spec\.yaml"):
        check_resumable(tensors, meta, tiny("mac"), strict=False, path="ckpt")
