"""Horizontal fusion: independent launches of one program as one launch.

A training step on a GPU is a chain of small kernels (tiny.yaml: ~900 per step, about 4 µs
each on an H100 whatever their work), so their count, not their work, sets the step time.
Many of them do not depend on one another: the projections of one input, the weight
gradients of one layer, the gradients of a gate and of its input. `group_launches` puts every
launch of a lowered program into the earliest *wave* its hazards allow (`waves`), and
`codegen.lowered.lower` makes the groupable launches of a wave one `LaunchGroup`: the triton
target runs it as one kernel whose programs are the members' programs side by side
(`codegen.group`).

Hazards are read from the memory plan, not only from the values: a later launch `b` follows an
earlier launch `a` when their storage overlaps and either writes it,

    a writes what b reads (RAW)   a reads what b writes (WAR: b reuses a dead value's bytes)
    a and b write the same bytes (WAW)

so every launch keeps its order against every launch it touches storage with, and only
launches that touch disjoint bytes (or read the same bytes) change places. A value's bytes
are its root's planned extent (a view: its root's; a scan body's inputs and outputs: a region
per carry, in and out, and one per other input or output, `_external`); constants have
none. A scan step (a scan kernel, a host loop) is a barrier: nothing moves across it.

The waves keep the schedule's order inside them, and the steps come out wave by wave. Launches
the target cannot group (a template kernel, a kernel with more than one launch) stay single
launches in their wave. A group holds at most `MAX_MEMBERS` launches (a kernel's parameter
space and its compile time grow with its members).
"""
from __future__ import annotations

from typing import Sequence

from titanc.ir.buffer_plan import OUTPUT_PREFIX, BufferPlan
from titanc.ir.schedule import Kernel, is_immediate
from titanc.ir.types import type_bytes

__all__ = ["MAX_MEMBERS", "extents", "waves"]

MAX_MEMBERS = 8

Extent = tuple[str, int, float]            # (region, first byte, end byte)


def extents(plan: BufferPlan, vid: int) -> list[Extent]:
    """The planned bytes value `vid` occupies: [] for an immediate or a generated constant."""
    g = plan.schedule.graph
    if is_immediate(g, vid):
        return []
    root = plan.views[vid][0] if vid in plan.views else vid
    root = plan.aliases.get(root, root)
    if plan.is_constant_root(root):
        return []
    where, at = plan.location(root)
    if where == "external":            # a scan body's input or output (`_external`)
        return [_external(plan, str(at))]
    if where == "persistent":
        name = plan.persistent_values[root][0]
        off, size = plan.persistent[name]
        return [("persistent", off, off + size)]
    size = next((b.size for b in plan.buffers if b.value == root and b.kind != "workspace"),
                type_bytes(g.node(root).type))
    return [("arena", int(at), int(at) + size)]


def _external(plan: BufferPlan, name: str) -> Extent:
    """The region of a scan body's input or output `name`. A body writes only its outputs:
    its stacked outputs `out:y<k>` (each a slice of its own ITEM buffer, made at the scan
    while every operand lives) and its carries `out:carry<j>`, which share storage with
    carry input j alone (the carry slots: the iteration's input slot, the output slot, or
    the same one where the carry is updated in place). So carry j in and out are one region
    ("carry j"), and every other input (xs, consts, which the body only reads) and output
    is its own."""
    g = plan.schedule.graph
    if name.startswith(OUTPUT_PREFIX + "carry"):
        return (f"carry {name[len(OUTPUT_PREFIX + 'carry'):]}", 0, float("inf"))
    if not name.startswith(OUTPUT_PREFIX):
        n_carry = sum(out.startswith("carry") for out, _ in g.outputs)
        k = g.input_names().index(name)
        if k < n_carry:
            return (f"carry {k}", 0, float("inf"))
    return (name, 0, float("inf"))


def _overlap(xs: Sequence[Extent], ys: Sequence[Extent]) -> bool:
    return any(r == s and lo < e2 and lo2 < e for r, lo, e in xs for s, lo2, e2 in ys)


def waves(plan: BufferPlan, kernels: Sequence[Kernel]) -> list[int]:
    """The wave of each kernel of a straight run of launches: one more than the latest
    earlier kernel it has a hazard with (module docstring), 0 for none."""
    reads, writes, wave = [], [], []
    for kern in kernels:
        r = [x for v in kern.inputs for x in extents(plan, v)]
        w = [x for v in kern.outputs for x in extents(plan, v)]
        w_ = 0
        for j in range(len(wave)):
            if (_overlap(writes[j], r) or _overlap(writes[j], w) or _overlap(reads[j], w)):
                w_ = max(w_, wave[j] + 1)
        reads.append(r)
        writes.append(w)
        wave.append(w_)
    return wave
