"""Does a compiled spec fit the machine? Refuse it at compile time, not in the allocator.

    check_fits(planned_bytes(compiled), spec)          # TitancError when it cannot fit

`planned_bytes` is what the memory plans allocate when the program runs: every graph's
activation arena (training, forward, optimizer each own one) plus the persistent region
(parameters, gradients, AdamW moments), plus the constant-size decoding state of one sequence
(the KV ring of `attention.window` tokens and the memory weights). The machine is the
physical memory (or, on the triton target with CUDA, the device's memory): a spec that needs
more can never run, so `titanc compile` refuses it (`--force` writes the artifact anyway, to
read the plan), and `titanc.compile`, `titanc train` and `titanc generate` refuse it before
allocating anything.
"""
from __future__ import annotations

import os
from typing import Any

from titanc.errors import TitancError

__all__ = ["planned_bytes", "decode_state_bytes", "machine_bytes", "check_fits"]


def _itemsize(spec: Any) -> int:
    return 8 if spec.train.dtype == "float64" else 4


def decode_state_bytes(spec: Any, batch: int = 1) -> int:
    """Bytes of a decoding state of `batch` sequences (titanc.decode.state_shapes, L layers)."""
    from math import prod

    from titanc.decode import state_shapes

    m = spec.model
    elems = sum(prod(s) for s in state_shapes(m, batch).values())
    return m.n_layers * elems * _itemsize(spec)


def planned_bytes(compiled: Any) -> int:
    """Arenas of every planned graph + the training plan's persistent region + decode state."""
    plans = compiled.plans
    arenas = sum(p.arena_bytes for p in plans.values())
    persistent = max((p.persistent_bytes for p in plans.values()), default=0)
    return arenas + persistent + decode_state_bytes(compiled.spec)


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


def check_fits(needed: int, spec: Any, device: str = "cpu", force_hint: bool = False) -> None:
    """Raise TitancError when `needed` bytes exceed the machine's memory."""
    have = machine_bytes(device)
    if needed <= have:
        return
    fix = ("; pass --force to write the artifact anyway (it cannot run here)" if force_hint
           else "")
    raise TitancError(f"{spec.safe_name} needs {needed:,} bytes ({_gib(needed)}) by its memory "
                      f"plan, more than this machine's {have:,} bytes ({_gib(have)}) of "
                      f"{'device' if device.startswith('cuda') else 'physical'} memory; reduce "
                      f"model.d_model, model.vocab_size, model.attention.window, "
                      f"train.batch_size or model.seq_len{fix}")
