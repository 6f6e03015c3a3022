"""Frequency and presence penalties, with OpenAI's and vLLM's semantics.

For each request, over the tokens it has generated so far (not its prompt):

    logits[t] -= frequency_penalty * count[t] + presence_penalty * (count[t] > 0)

Both penalties lie in [-2, 2] (OpenAI's range; a negative one encourages repetition). They
are applied to one request's row of logits only, from that request's own tokens, so a
request's output does not depend on what else is in the batch; with both at 0 the logits are
returned unchanged (the same tensor). Log-probabilities a response reports are the model's,
before penalties (vLLM's default, "raw_logprobs").
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from titanc.errors import TitancError

__all__ = ["PENALTY_RANGE", "check_penalty", "penalize"]

PENALTY_RANGE = (-2.0, 2.0)


def check_penalty(value: Any, name: str) -> float:
    """`value` as a float in PENALTY_RANGE, else a TitancError naming `name`."""
    lo, hi = PENALTY_RANGE
    ok = (not isinstance(value, bool) and isinstance(value, (int, float))
          and math.isfinite(float(value)) and lo <= float(value) <= hi)
    if not ok:
        raise TitancError(f"{name}: {str(value)[:40]} must be a number in [{lo:g}, {hi:g}] "
                          f"(0 turns it off)")
    return float(value)


def penalize(logits: torch.Tensor, outputs: Sequence[Sequence[int]], sampling: Any) -> torch.Tensor:
    """Logits (B, V) with row b penalised by the counts of `outputs[b]` (the tokens sequence
    b generated), with `sampling`'s presence_penalty and frequency_penalty; the input tensor
    itself when both are 0 or nothing was generated yet (never modified in place)."""
    presence = float(getattr(sampling, "presence_penalty", 0.0) or 0.0)
    frequency = float(getattr(sampling, "frequency_penalty", 0.0) or 0.0)
    if (presence == 0.0 and frequency == 0.0) or not any(len(o) for o in outputs):
        return logits
    out = logits.to(torch.float64).clone()                        # (B, V)
    V = out.shape[-1]
    for b, toks in enumerate(outputs):
        if not len(toks):
            continue
        ids = torch.as_tensor(list(toks), dtype=torch.int64)
        counts = torch.bincount(ids, minlength=V)[:V].to(torch.float64)     # (V,)
        out[b] -= frequency * counts + presence * (counts > 0).to(torch.float64)
    return out
