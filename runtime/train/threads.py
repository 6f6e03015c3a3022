"""How many CPU threads a training run uses: `--threads`, else `TITANC_THREADS`, else a default.

The default is the smaller of what the model can use and what the machine has free:

- the model: one thread per `FLOPS_PER_THREAD` of work in a training step (6 · parameters ·
  tokens per step); a tiny model's ops are too small to split, and extra threads only add
  synchronisation (measured: 28 tokens/s with torch's default on a busy 2-core machine against
  2,200 with one thread);
- the machine: the cores this process may run on minus the 1-minute load average (at least 1),
  so a run never oversubscribes cores other processes are using.

The CLI sets the count (docs/conventions.md §16: no thread counts set by a constructor) and the trainer
shows it in its start line and progress bar.
"""
from __future__ import annotations

import os
from typing import Any

from titanc.config import current

__all__ = ["ENV", "FLOPS_PER_THREAD", "free_cores", "model_threads", "resolve_threads"]

ENV = "TITANC_THREADS"
FLOPS_PER_THREAD = 4e9


def free_cores() -> int:
    """Cores available to this process minus the 1-minute load average, at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = 0.0
    return max(1, min(cores, round(cores - load)))


def model_threads(spec: Any) -> int:
    """Threads a training step of `spec` can keep busy: one per FLOPS_PER_THREAD of work."""
    from titanc.model.params import param_count

    t = spec.train
    flops = 6.0 * param_count(spec.model) * t.batch_size * t.grad_accum * spec.model.seq_len
    return max(1, int(flops // FLOPS_PER_THREAD))


def resolve_threads(spec: Any, requested: int | None = None) -> tuple[int, str]:
    """(threads, where the number came from): `requested` (--threads), else $TITANC_THREADS
    (`config.current().threads`), else min(model_threads, free_cores)."""
    if requested is not None:
        return requested, "--threads"
    threads = current().threads_or_none()
    if threads is not None:
        return threads, ENV
    free = free_cores()
    return min(model_threads(spec), free), f"auto: model {model_threads(spec)}, free cores {free}"
