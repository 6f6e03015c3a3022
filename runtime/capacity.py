"""Does a number of bytes fit this machine? `check_fits(titanc.fit.planned_bytes(c), spec)`
raises a one-line TitancError naming the spec fields to reduce when it does not. The machine
is the physical memory, or on the triton target with CUDA the device's memory.
"""
from __future__ import annotations

import os
from typing import Any

from titanc.errors import TitancError

__all__ = ["check_fits", "machine_bytes"]


def machine_bytes(device: str = "cpu") -> int:
    """Physical memory of the machine, or of the CUDA device when `device` is cuda."""
    if device.startswith("cuda"):
        import torch
        return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):  # not POSIX: no check
        return 1 << 62


def _gib(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB"


def check_fits(needed: int, spec: Any, device: str = "cpu", force_hint: bool = False,
               lower: bool = False) -> None:
    """Raise TitancError when `needed` bytes (a lower bound when `lower`) exceed the
    machine's memory."""
    have = machine_bytes(device)
    if needed <= have:
        return
    fix = ("; pass --force to write the artifact anyway (it cannot run here)" if force_hint
           else "")
    raise TitancError(f"{spec.safe_name} needs {'at least ' if lower else ''}{needed:,} bytes "
                      f"({_gib(needed)}) by its buffer plan, more than this machine's {have:,} bytes ({_gib(have)}) of "
                      f"{'device' if device.startswith('cuda') else 'physical'} memory; reduce "
                      f"model.d_model, model.vocab_size, model.attention.window, "
                      f"train.batch_size or model.seq_len{fix}")
