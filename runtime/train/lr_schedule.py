"""Learning-rate schedule: linear warmup, then cosine decay to 10% of the peak."""
from __future__ import annotations

import math
from typing import Any

MIN_RATIO = 0.1


def lr_at(step: int, train: Any) -> float:
    """Learning rate of optimizer step `step` (0-based) under `train.lr/warmup/steps`."""
    peak = train.lr
    if train.warmup > 0 and step < train.warmup:
        return peak * (step + 1) / train.warmup
    span = max(1, train.steps - train.warmup)
    progress = min(1.0, (step - train.warmup) / span)
    return peak * (MIN_RATIO + (1 - MIN_RATIO) * 0.5 * (1 + math.cos(math.pi * progress)))
