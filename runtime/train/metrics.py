"""A run's metrics.jsonl and its loss plot (loss.png), read and written apart from the loop.

    records = read_metrics("runs/tiny/metrics.jsonl")
    write_loss_plot("runs/tiny/metrics.jsonl", "runs/tiny/loss.png")   # False: no matplotlib
"""
from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any

from titanc.errors import TitancError

__all__ = ["read_metrics", "write_loss_plot", "PLOT_EXTRA"]

# what to install for loss.png (matplotlib), as the one-line note says
PLOT_EXTRA = "pip install 'titanc[plot]'"


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl: JSON objects with an integer `step` ([] when the file
    does not exist). A torn last line, undecodable bytes and lines that are not such records
    are skipped; a metrics.jsonl that cannot be read at all is a TitancError."""
    p = Path(path)
    if not p.exists():
        return []
    try:
        if not p.is_file():                        # a directory; a FIFO would block
            raise IsADirectoryError(errno.EISDIR, "not a regular file")
        text = p.read_bytes().decode("utf-8", errors="replace")
    except OSError as exc:
        raise TitancError(f"{p} cannot be read ({exc.strerror or exc}); move it away to start "
                          f"the metrics afresh") from None
    out = []
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int) \
                and not isinstance(rec["step"], bool):
            out.append(rec)
    return out


def write_loss_plot(metrics: str | os.PathLike, png: str | os.PathLike, title: str = "",
                    baseline: float | None = None) -> bool:
    """Plot training and held-out loss from `metrics` into `png`. Returns False (and writes
    nothing) when matplotlib is not installed."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return False
    records = read_metrics(metrics)
    train = [(m["step"], m["loss"]) for m in records if "loss" in m]
    evals = [(m["step"], m["eval_loss"]) for m in records if "eval_loss" in m]
    fig = Figure(figsize=(6, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    if train:
        ax.plot(*zip(*train), label="train loss", lw=1)
    if evals:
        ax.plot(*zip(*evals), "o-", label="held-out loss", ms=3)
    if baseline is not None:
        ax.axhline(baseline, color="gray", ls="--", lw=1, label="unigram baseline")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if train or evals or baseline is not None:
        ax.legend()
    fig.tight_layout()
    fig.savefig(os.fspath(png))
    return True
