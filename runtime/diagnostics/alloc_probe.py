"""Allocation probe: which torch ops create tensor storage while a function runs.

A `TorchDispatchMode` sees every op's results; a result whose storage is none of the known
storages (the executor's arena, persistent region, scratch, bound tensors and constants) was
allocated by that op. Views share their base's storage and are not allocations.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class AllocationProbe(TorchDispatchMode):
    def __init__(self, storages: Iterable[torch.Tensor]):
        super().__init__()
        self.known = {_storage_ptr(s) for s in storages}
        self.allocations: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.numel() > 0 and _storage_ptr(t) not in self.known:
                self.allocations.append((str(func), tuple(t.shape)))
                self.known.add(_storage_ptr(t))
        return out


def allocations_during(fn: Callable[[], Any], storages: Iterable[torch.Tensor]) -> list[tuple[str, tuple[int, ...]]]:
    """Run fn under the probe; returns (op, shape) of every storage it created."""
    probe = AllocationProbe(storages)
    with probe:
        fn()
    return probe.allocations
