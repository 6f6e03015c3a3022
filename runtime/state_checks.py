"""The checks `Program.load_state_dict` makes before it copies anything: the state dict is a
mapping, every tensor it shares with the program has the program's shape and a floating-point
dtype and holds no NaN or inf, `opt.step` is one integer in [0, bounds.STEPS], and under
`strict` the names match. Each failure is one `TitancError` (a `TypeError` for a state dict
that is not a mapping) naming the entry."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from titanc.bounds import STEPS
from titanc.errors import TitancError
from titanc.runtime.api_checks import check_state_tensor, first_nonfinite

Tensor = torch.Tensor


def check_loadable(sd: Any, mine: dict[str, Tensor], strict: bool
                   ) -> tuple[list[str], list[str], int | None]:
    """(new, unused, step) of loading `sd` into a program whose state dict is `mine`: the
    names `sd` lacks, the names the program does not use, and `opt.step` (None if absent);
    raises on any problem, before anything is copied."""
    if not isinstance(sd, Mapping):
        raise TypeError(f"load_state_dict: state_dict must be a mapping of names to "
                        f"tensors (Program.state_dict() or a checkpoint's), got "
                        f"{type(sd).__name__}")
    new = sorted(k for k in mine if k not in sd and k != "opt.step")
    unused = sorted((k for k in sd if k not in mine), key=str)
    for k, t in sd.items():
        if k not in mine or (k == "opt.step" and isinstance(t, int)):
            continue
        check_state_tensor(t, f"load_state_dict: state_dict[{k!r}]")
        if k == "opt.step":
            continue
        if tuple(t.shape) != tuple(mine[k].shape):
            raise TitancError(f"checkpoint tensor {k} has shape {list(t.shape)}, "
                              f"the spec needs {list(mine[k].shape)}")
        if not t.is_floating_point():
            raise TitancError(f"checkpoint tensor {k} is {t.dtype}, the spec needs a "
                              f"floating-point tensor ({mine[k].dtype})")
    step = checked_step(sd["opt.step"]) if "opt.step" in sd else None
    if strict and (new or unused):
        raise TitancError(f"checkpoint does not match the spec (--strict): "
                          f"missing {new[:5]}, unexpected {unused[:5]}")
    bad = first_nonfinite({k: t for k, t in sd.items() if k in mine and k != "opt.step"})
    if bad is not None:
        raise TitancError(f"checkpoint tensor {bad} holds a NaN or an inf; load a finite "
                          f"state (every checkpoint titanc writes is)")
    return new, unused, step


def checked_step(t: Any) -> int:
    """`opt.step` of a state dict: an integer in [0, 10**12] (bounds.STEPS; a Python int or a
    one-element integer tensor)."""
    if isinstance(t, Tensor):
        ok = t.numel() == 1 and not (t.is_floating_point() or t.is_complex()
                                     or t.dtype == torch.bool)
        value = int(t.reshape(())) if ok else None
    else:
        value = t if isinstance(t, int) and not isinstance(t, bool) else None
    if value is None or not 0 <= value <= STEPS.hi:
        shown = (f"a {t.dtype} tensor of shape {list(t.shape)}" if isinstance(t, Tensor)
                 else repr(t)[:40])
        raise TitancError(f"checkpoint entry opt.step must be one integer in [0, "
                          f"{STEPS.hi}] (the optimizer steps taken), got {shown}"
                          + (f" = {value}" if value is not None else ""))
    return value
