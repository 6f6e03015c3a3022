"""Learning-rate schedule: linear warmup, then cosine decay to 10% of the peak (`lr_at`), and
the device table a compiled optimizer step gathers its lr from (`LrTable`)."""
from __future__ import annotations

import math
from typing import Any

import torch

Tensor = torch.Tensor

MIN_RATIO = 0.1
# steps of the schedule the device table holds at once: a longer schedule is refilled from
# the host when a step leaves the window (`LrTable.hold`), so the table and its build cost
# stay bounded however large `train.steps` is
LR_WINDOW = 4096


def lr_at(step: int, train: Any) -> float:
    """Learning rate of optimizer step `step` (0-based) under `train.lr/warmup/steps`."""
    peak = train.lr
    if train.warmup > 0 and step < train.warmup:
        return peak * (step + 1) / train.warmup
    span = max(1, train.steps - train.warmup)
    progress = min(1.0, (step - train.warmup) / span)
    return peak * (MIN_RATIO + (1 - MIN_RATIO) * 0.5 * (1 + math.cos(math.pi * progress)))


class LrTable:
    """lr_at(s) for s in [base, base + len) on the device: the whole schedule when it fits
    LR_WINDOW, else a window that `hold` moves along with the steps. `gather` reads a step's
    lr on the device (what a captured CUDA graph replays)."""

    def __init__(self, train: Any, dtype: torch.dtype, device: Any) -> None:
        self.train, self.dtype = train, dtype
        self.end = max(train.steps, train.warmup) + 1      # past it the lr stays constant
        self.base = 0
        self.table = torch.tensor([lr_at(s, train) for s in range(min(self.end, LR_WINDOW))],
                                  dtype=dtype).to(device)
        self.base_dev = torch.zeros(1, dtype=torch.int64, device=device)
        self.clamped = torch.zeros(1, dtype=torch.int64, device=device)

    def storages(self) -> list[Tensor]:
        return [self.table, self.base_dev, self.clamped]

    def hold(self, step: int) -> None:
        """Move the window to hold `step` (a schedule longer than LR_WINDOW); past the
        schedule's end the window holds its last steps, whose last entry `gather` clamps to."""
        n = self.table.shape[0]
        if self.end <= n or 0 <= step - self.base < n:
            return
        base = max(0, min(step, self.end - n))
        if base == self.base:
            return
        self.table.copy_(torch.tensor([lr_at(s, self.train) for s in range(base, base + n)],
                                      dtype=self.dtype))
        self.base_dev.fill_(base)
        self.base = base

    def gather(self, step_index: Tensor, out: Tensor) -> None:
        """out[0] = the lr of the device step counter `step_index` (no host read)."""
        torch.sub(step_index, self.base_dev, out=self.clamped)
        self.clamped.clamp_(0, self.table.shape[0] - 1)
        torch.index_select(self.table, 0, self.clamped, out=out)
