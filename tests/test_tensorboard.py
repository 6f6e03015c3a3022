"""`train.tensorboard: DIR`: the event file a run writes holds, step by step, the numbers its
metrics.jsonl holds (read back with tensorboard's EventAccumulator); a resumed run's events
past the restored step replace those a lost process wrote; an empty directory name is a spec
error."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from titanc.errors import SpecError
from titanc.model.spec import load_spec
from titanc.runtime.train.trainer import read_metrics, run_training

from tests.helpers import one_thread  # noqa: F401 (autouse)

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TINY = {"model.d_model": 16, "model.n_layers": 1, "model.seq_len": 16, "model.vocab_size": 256,
        "model.attention.segment": 8, "model.memory.chunk_size": 4, "train.batch_size": 2,
        "train.eval_every": 2, "train.eval_batches": 1, "train.checkpoint_every": 0,
        "train.memory_stats_every": 2, "compile.target": "cpu"}
TAGS = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
        "tokens_per_s": "train/tokens_per_s", "eval_loss": "eval/loss"}


def _train(out: Path, tb: Path, **kw: Any) -> None:
    spec = load_spec(ROOT / "examples" / "tiny_lmm.yaml",
                     {**TINY, "train.tensorboard": str(tb)})
    run_training(spec, out, progress=False, log=lambda _: None, **kw)


def _scalars(logdir: Path) -> dict[str, dict[int, float]]:
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    out = {}
    for tag in acc.Tags()["scalars"]:
        steps = [e.step for e in acc.Scalars(tag)]
        assert len(steps) == len(set(steps)), (tag, steps)     # each step once
        out[tag] = {e.step: e.value for e in acc.Scalars(tag)}
    return out


def _expected(metrics: Path) -> dict[str, dict[int, float]]:
    want: dict[str, dict[int, float]] = {}
    for rec in read_metrics(metrics):
        for key, tag in TAGS.items():
            if key in rec:
                want.setdefault(tag, {})[rec["step"]] = rec[key]
    return want


def _check(got: dict[str, dict[int, float]], want: dict[str, dict[int, float]]) -> None:
    for tag, by_step in want.items():
        assert sorted(got[tag]) == sorted(by_step), tag
        for step, value in by_step.items():       # TensorBoard stores float32
            assert got[tag][step] == pytest.approx(value, rel=1e-6, abs=1e-12), (tag, step)


def test_event_file_holds_the_metrics(tmp_path: Path) -> None:
    _train(tmp_path / "run", tmp_path / "tb", steps=4)
    got = _scalars(tmp_path / "tb" / "run")      # DIR/<run directory name>
    want = _expected(tmp_path / "run" / "metrics.jsonl")
    assert set(TAGS.values()) <= set(got)
    assert sorted(want["train/loss"]) == [1, 2, 3, 4] and sorted(want["eval/loss"]) == [2, 4]
    _check(got, want)
    memory = [t for t in got if t.startswith("memory/layers/0/")]
    assert "memory/layers/0/w_norm" in memory and sorted(got["memory/layers/0/w_norm"]) == [2, 4]

    # a process that died after writing steps 5, 6 past the step-4 checkpoint
    from torch.utils.tensorboard import SummaryWriter
    with SummaryWriter(str(tmp_path / "tb" / "run")) as lost:
        for step in (5, 6):
            lost.add_scalar("train/loss", 99.0, step)
    # resumed from the step-4 checkpoint to step 6: its steps 5, 6 replace the lost ones
    _train(tmp_path / "run", tmp_path / "tb", steps=6, resume=tmp_path / "run")
    got = _scalars(tmp_path / "tb" / "run")
    want = _expected(tmp_path / "run" / "metrics.jsonl")
    assert sorted(want["train/loss"]) == [1, 2, 3, 4, 5, 6]
    _check(got, want)


def test_empty_directory_is_a_spec_error() -> None:
    with pytest.raises(SpecError, match=r"^train\.tensorboard: must not be empty; name a "
                                        r"directory \(e\.g\. --set train\.tensorboard=tb\)"):
        load_spec(ROOT / "examples" / "tiny_lmm.yaml", {"train.tensorboard": " "})
