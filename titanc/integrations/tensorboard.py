"""`train.tensorboard: DIR`: the trainer's metrics as TensorBoard scalars.

Every record the trainer writes to metrics.jsonl is also written, by its `step`, to an event
file under DIR/<run directory name>/ (so `tensorboard --logdir DIR` shows each run as its own
line), through `torch.utils.tensorboard.SummaryWriter`:

    train/loss  train/lr  train/grad_norm  train/tokens_per_s     every train.log_every steps
    eval/loss   eval/accuracy                                      every train.eval_every steps
    memory/layers/<i>/<name>                      every train.memory_stats_every steps

A run purges the events an earlier process wrote there past its starting step (all of them
for a fresh run; past the restored step on resume, as metrics.jsonl drops them). Only rank 0
writes.
"""
from __future__ import annotations

import math
import numbers
import os
from pathlib import Path
from typing import Any

from titanc.errors import TitancError

__all__ = ["TensorBoardLog", "open_tensorboard", "TAGS"]

# metrics.jsonl key -> TensorBoard tag; any other number keeps its key path as its tag
TAGS = {
    "loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
    "tokens_per_s": "train/tokens_per_s", "eval_loss": "eval/loss",
    "eval_accuracy": "eval/accuracy",
}


class TensorBoardLog:
    """One run's event file: `write(record)` for each metrics.jsonl record, `close()` at the end."""

    def __init__(self, log_dir: Path, purge_step: int | None = None):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except (ModuleNotFoundError, ImportError):
            raise TitancError("train.tensorboard: writing TensorBoard events needs the "
                              "tensorboard package; pip install tensorboard, or unset "
                              "train.tensorboard") from None
        self.log_dir = log_dir
        try:
            self._writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)
        except OSError as exc:
            raise TitancError(f"train.tensorboard: cannot write in {log_dir} "
                              f"({exc.strerror or exc}); choose a writable directory") from None

    def write(self, record: dict[str, Any]) -> None:
        step = record.get("step")
        if isinstance(step, bool) or not isinstance(step, int):
            return
        for tag, value in _scalars({k: v for k, v in record.items() if k != "step"}):
            self._writer.add_scalar(TAGS.get(tag, tag), value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def _scalars(value: Any, tag: str = "") -> list[tuple[str, float]]:
    """(tag, number) for every finite number of a record, nested mappings and lists of
    mappings joined by '/' (memory/layers/0/w_norm); lists of numbers are left out."""
    if isinstance(value, dict):
        return [x for k, v in value.items() for x in _scalars(v, f"{tag}/{k}" if tag else str(k))]
    if isinstance(value, list):
        return [x for i, v in enumerate(value) if isinstance(v, dict)
                for x in _scalars(v, f"{tag}/{i}")]
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return []
    return [(tag, float(value))] if math.isfinite(value) else []


def open_tensorboard(spec: Any, out: str | os.PathLike, start_step: int
                     ) -> TensorBoardLog | None:
    """The run's TensorBoard log when `train.tensorboard` names a directory, else None.
    `start_step`: the step the run starts from (0, or the restored step of a resumed run);
    events an earlier process wrote in the same place past it are purged."""
    root = getattr(spec.train, "tensorboard", None)
    if not root:
        return None
    return TensorBoardLog(Path(root) / Path(os.path.abspath(out)).name,
                          purge_step=start_step + 1)
