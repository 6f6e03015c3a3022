"""Exclusive wall time per kernel category of every executor run inside `with profiling()`
(`titanc bench --profile`, the trainer's profile): each bound kernel carries its category
(`kernel_label`), and a run times its kernels' steps by category when a profiler is active in
its context (thread, task)."""
from __future__ import annotations

import time
from contextvars import ContextVar
from typing import Any, Callable

from titanc.ir import Graph
from titanc.ir.kernel_family import PROFILE_LABELS, family_of

Step = Callable[[], None]


class Profiler:
    """Exclusive wall time per kernel category (a scan's own time excludes its body's, and
    the profiler's own bookkeeping for the body's kernels)."""

    def __init__(self) -> None:
        self.seconds = {c: 0.0 for c in PROFILE_LABELS}
        self.calls = {c: 0 for c in PROFILE_LABELS}
        self._child = [0.0]

    def run(self, label: str, fns: list[Step]) -> None:
        clock = time.perf_counter
        enter = clock()
        stack = self._child
        stack.append(0.0)
        t0 = clock()
        for f in fns:
            f()
        dt = clock() - t0
        self.seconds[label] += dt - stack.pop()
        self.calls[label] += 1
        stack[-1] += clock() - enter          # the parent is not charged our bookkeeping


# the profiler of the run in progress in this context (thread, task), if any: `profiling`
_PROFILER: ContextVar["Profiler | None"] = ContextVar("titanc_profiler", default=None)


def active_profiler() -> Profiler | None:
    """The profiler of this context's `with profiling()`, or None outside one."""
    return _PROFILER.get()


def kernel_label(g: Graph, kernel: Any, role: str = "") -> str:
    """Profile category: its family's (`KernelFamily.profile`: attention for the flash
    attention kernels, scan for a scan's own time, its loop excluding its body's kernels), except
    where it runs: optimizer (the optimizer graph), memory update (a kernel in the body of a
    scan of role "memory")."""
    if g.name.startswith("optimizer"):
        return "optimizer"
    fam = family_of(g, kernel)
    if role == "memory" and fam.category != "template":
        return "memory update"
    return fam.profile


class profiling:
    """`with profiling() as prof:` times every kernel run inside, by category."""

    def __enter__(self) -> Profiler:
        prof = Profiler()
        self._token = _PROFILER.set(prof)
        return prof

    def __exit__(self, *exc: Any) -> None:
        _PROFILER.reset(self._token)
