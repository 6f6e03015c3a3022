"""What a compiled spec allocates, in bytes, so that it can be refused at compile time when it
cannot fit the machine, not in the allocator:

    check_fits(planned_bytes(compiled), spec)          # runtime/capacity.py: TitancError

`planned_bytes` is what a Program allocates when it runs: its own state (parameters, two
gradient buffers, two AdamW moments: `state_bytes`), every planned graph's activation arena
(training, forward, optimizer each own one) and the largest persistent region, plus the
constant-size decoding state of one sequence (the KV ring of `attention.window` tokens and the
memory weights). `lower_bound_bytes` is the part known without compiling (state + decoding),
so a spec of absurd size is refused before the compiler spends any time on it. The machine is the
physical memory (or, on the triton target with CUDA, the device's memory): a spec that needs
more can never run, so `titanc compile` refuses it (`--force` writes the artifact anyway, to
read the plan), and `titanc.compile`, `titanc train` and `titanc generate` refuse it before
allocating anything.
"""
from __future__ import annotations

from typing import Any

__all__ = ["planned_bytes", "lower_bound_bytes", "state_bytes", "decode_state_bytes"]


def _itemsize(spec: Any) -> int:
    return 8 if spec.train.dtype == "float64" else 4


def decode_state_bytes(spec: Any, batch: int = 1) -> int:
    """Bytes of a decoding state of `batch` sequences (titanc.model.decode.state_shapes, L layers)."""
    from math import prod

    from titanc.model.decode import state_shapes

    m = spec.model
    elems = sum(prod(s) for s in state_shapes(m, batch).values())
    return m.n_layers * elems * _itemsize(spec)


def state_bytes(spec: Any) -> int:
    """What runtime.program.Program holds per parameter: itself, 2 gradient buffers, 2 moments."""
    from titanc.model.params import param_count

    return 5 * param_count(spec.model) * _itemsize(spec)


def lower_bound_bytes(spec: Any) -> int:
    """Bytes any program of `spec` needs, known before compiling."""
    return state_bytes(spec) + decode_state_bytes(spec)


def planned_bytes(compiled: Any) -> int:
    """lower_bound_bytes + every planned graph's arena + the largest persistent region."""
    plans = compiled.plans
    arenas = sum(p.arena_bytes for p in plans.values())
    persistent = max((p.persistent_bytes for p in plans.values()), default=0)
    return arenas + persistent + lower_bound_bytes(compiled.spec)
