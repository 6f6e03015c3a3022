"""How the next token is drawn: `Sampling` (every field checked, one TitancError naming it)
and `sample` (greedy at temperature 0, else top-k / top-p from a request's own generator).
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from titanc.errors import TitancError
from titanc.runtime.serve.penalties import check_penalty

__all__ = ["Sampling", "sample", "as_integer", "short_repr"]

Tensor = torch.Tensor
NEG_INF = -math.inf


@dataclass
class Sampling:
    """How the next token is drawn; every field is checked here, so a bad value is one
    TitancError, never a torch error (or a NaN temperature silently sampling greedily)."""
    temperature: float = 1.0                 # 0: greedy
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0                            # in [0, 2**64)
    stop: Sequence[str] = field(default_factory=tuple)
    presence_penalty: float = 0.0            # in [-2, 2]: runtime/serve/penalties.py
    frequency_penalty: float = 0.0           # in [-2, 2]

    def __post_init__(self) -> None:
        # numbers of any numeric type (numpy's too) are taken as Python int / float
        t = _real(self.temperature)
        if t is None or not 0 <= t < math.inf:
            raise TitancError(f"temperature: {short_repr(self.temperature)} must be a finite "
                              f"number >= 0 (0 is greedy)")
        self.temperature = t
        if self.top_k is not None:
            k = as_integer(self.top_k)
            if k is None or k < 1:
                raise TitancError(f"top_k: {short_repr(self.top_k)} must be a positive integer")
            self.top_k = k
        if self.top_p is not None:
            p = _real(self.top_p)
            if p is None or not 0 < p <= 1:
                raise TitancError(f"top_p: {short_repr(self.top_p)} must be in (0, 1]")
            self.top_p = p
        seed = as_integer(self.seed)
        if seed is None or not 0 <= seed < 2**64:
            raise TitancError(f"seed: {short_repr(self.seed)} must be an integer in [0, 2**64)")
        self.seed = seed
        self.stop = _stops(self.stop)
        self.presence_penalty = check_penalty(self.presence_penalty, "presence_penalty")
        self.frequency_penalty = check_penalty(self.frequency_penalty, "frequency_penalty")


def short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def as_integer(value: Any) -> int | None:
    """`value` as an int when it is an integer (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    return int(value)


def _real(value: Any) -> float | None:
    """`value` as a float when it is a real number (not a bool), else None (nan stays nan)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    try:
        return float(value)
    except OverflowError:                    # an int past float's range
        return math.inf


def _stops(stop: Any) -> tuple[str, ...]:
    """Stop sequences as a tuple of strings: one string is one stop sequence (not one per
    character), None is none; each must be valid Unicode."""
    if stop is None:
        return ()
    stops = (stop,) if isinstance(stop, str) else stop
    if isinstance(stops, (bytes, Mapping)) or not isinstance(stops, Iterable):
        raise TitancError(f"stop: expected a string or a list of strings, got "
                          f"{type(stop).__name__}")
    stops = tuple(stops)
    for x in stops:
        if not isinstance(x, str):
            raise TitancError(f"stop: expected a string or a list of strings, got an item "
                              f"{short_repr(x)}; decode bytes first")
        try:
            x.encode("utf-8")
        except UnicodeEncodeError:
            raise TitancError(f"stop: {ascii(x)[:40]} is not valid Unicode (a lone "
                              f"surrogate)") from None
    return stops


def sample(logits: Tensor, s: Sampling, gen: torch.Generator) -> Tensor:
    """Next token per row of logits (B, V): greedy at temperature 0, else top-k / top-p."""
    logits = logits.to(torch.float64)
    if s.temperature <= 0:
        return logits.argmax(-1)
    # shifted to a maximum of 0 first: divided by a tiny temperature the logits then reach
    # -inf at worst, never inf (whose softmax is nan); softmax does not change
    logits = (logits - logits.amax(-1, keepdim=True)) / s.temperature
    if s.top_k:
        kth = torch.topk(logits, min(s.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, NEG_INF)
    if s.top_p is not None and s.top_p < 1.0:
        sorted_l, idx = torch.sort(logits, descending=True, dim=-1)
        probs = torch.softmax(sorted_l, -1)
        drop = probs.cumsum(-1) - probs > s.top_p                  # keep the smallest prefix > p
        sorted_l = sorted_l.masked_fill(drop, NEG_INF)
        logits = torch.full_like(logits, NEG_INF).scatter(-1, idx, sorted_l)
    return torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)[:, 0]
