"""waves: a schedule's kernels in waves of independent kernels, for launch groups.

A GPU step of small kernels costs about one kernel's latency per launch, so the triton target
runs the independent pointwise, reduction and matmul kernels of a wave as one launch
(`codegen/horizontal.py`, `codegen/group.py`). Two things decide how many kernels can share a
launch: the values (a kernel waits for what it reads) and the memory plan (a kernel may not
write bytes an unfinished kernel still reads). This module makes the second agree with the
first:

- `in_waves(schedule)`: the kernels reordered into *waves*, stably. Between two barriers (a
  kernel holding a SCAN, or an op that updates an operand in place: ADAMW), a kernel's wave is
  one more than the latest wave of a kernel whose output it reads (0 for none); the kernels
  come out wave by wave, each wave in schedule order, the barriers where they were (a kernel
  of views alone joins its operand's wave: the plan makes it a no-op). Any
  topological order is a valid schedule, so every target runs this one as it ran the old.
  Scan bodies are reordered too.
- `wave_spans(schedule)`: each kernel's wave as the range of kernel indices it occupies in a
  schedule `in_waves` made (`Schedule.waves`). The buffer planner (`passes/buffer_plan.py`) widens every value's
  liveness to the spans of its first and last kernels, so a value never takes the bytes of one
  that a kernel of its own wave (or of a later one) still reads: the waves stay free of storage
  hazards, and the only thing that orders two kernels of a wave is nothing.

Peak memory can grow: a value is live from the start of its producer's wave to the end of its
last reader's (docs/gpu.md gives the arena before and after).
"""
from __future__ import annotations

from titanc.ir import Graph, OpGroup
from titanc.ir.schedule import Kernel, Schedule
from titanc.ir.structural import STRUCTURAL

__all__ = ["in_waves", "wave_spans"]


def _barrier(g: Graph, kern: Kernel, bodies: dict) -> bool:
    for nid in kern.nodes:
        if nid in bodies:
            return True
        op = g.node(nid).op
        if op in STRUCTURAL and STRUCTURAL[op].in_place is not None:
            return True
    return False


def _runs(s: Schedule) -> list[tuple[int, int]]:
    """[start, end) index ranges of the kernels between barriers; a barrier is its own run."""
    out, start = [], 0
    for k, kern in enumerate(s.kernels):
        if _barrier(s.graph, kern, s.bodies):
            if start < k:
                out.append((start, k))
            out.append((k, k + 1))
            start = k + 1
    if start < len(s.kernels):
        out.append((start, len(s.kernels)))
    return out


def _waves(g: Graph, kernels: list[Kernel]) -> list[int]:
    """A kernel of views alone (a lone reshape, which the plan makes a no-op: its output
    shares its operand's storage) takes its operand's wave, so it adds no wave of its own.
    One that writes a graph output (a scan body's y or carry, a program output) is a copy
    into the output's own storage, so it takes a wave like any kernel: in its operand's wave
    the plan could lend the operand's bytes to a kernel of the next wave that runs beside it."""
    made: dict[int, int] = {}
    wave = []
    outs = {v for _, v in g.outputs}
    for kern in kernels:
        view = all(g.node(n).op in OpGroup.VIEW for n in kern.nodes)
        step = 0 if view and not outs.intersection(kern.outputs) else 1
        w = max((made[v] + step for v in kern.inputs if v in made), default=0)
        wave.append(w)
        for v in kern.outputs:
            made[v] = w
    return wave


def in_waves(s: Schedule) -> Schedule:
    """`s` with each run of kernels between barriers in wave order (module docstring)."""
    order: list[Kernel] = []
    for a, b in _runs(s):
        run = s.kernels[a:b]
        wave = _waves(s.graph, run)
        order += [run[i] for i in sorted(range(len(run)), key=lambda i: (wave[i], i))]
    return Schedule(s.graph, order, {sid: in_waves(body) for sid, body in s.bodies.items()},
                    waves=True)


def wave_spans(s: Schedule) -> list[tuple[int, int]]:
    """For each kernel of `s` (in waves), the first and last index of its wave's kernels."""
    spans: list[tuple[int, int]] = []
    for a, b in _runs(s):
        wave = _waves(s.graph, s.kernels[a:b])
        for i, w in enumerate(wave):
            lo = a + wave.index(w)
            hi = a + len(wave) - 1 - wave[::-1].index(w)
            spans.append((lo, hi))
    return spans
