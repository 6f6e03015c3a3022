"""Liveness packing of a scan kernel's workspace (`codegen.scan`).

While a scan kernel is emitted, every workspace buffer gets a symbolic offset, the token
`wsoff(k)` (buffer k), in the lines that read or write it. `pack(lines, sizes)` then gives
buffers whose lifetimes do not overlap the same addresses and substitutes the offsets.

Lifetimes are measured in *stages* (the lines between two `tl.debug_barrier()`s), the unit
at which the threads of a program agree on the workspace: two buffers used in the same
stage never share addresses (a warp may still read one while another writes the other).
A buffer lives from the first to the last stage that names it, widened over loops: if it is
named both inside a loop and outside it, it lives through the whole loop (a value made
before a loop and read in it must survive every iteration; a value written in an iteration
and read after the loop, such as the stacked ys of a nested scan, must not be overwritten by
a later iteration). Carry slots are made before their loop, so they live through it.

Offsets: greedy by size (largest first, the lowest offset that overlaps no placed buffer
whose lifetime intersects), the strategy of the activation arena (`passes/buffer_plan.py`),
every buffer aligned to 16 elements.
"""
from __future__ import annotations

import re

__all__ = ["BARRIER", "pack", "wsoff"]

BARRIER = "tl.debug_barrier()"
_TOKEN = re.compile(r"__wsoff(\d+)__")


def wsoff(k: int) -> str:
    """The symbolic offset of buffer `k` (replaced by `pack`)."""
    return f"__wsoff{k}__"


def _loops(lines: list[str], stage: list[int]) -> list[tuple[int, int]]:
    """(first stage, last stage) of every `for` loop, from indentation."""
    out = []
    for i, s in enumerate(lines):
        body = s.lstrip()
        if not body.startswith("for "):
            continue
        ind = len(s) - len(body)
        j = i + 1
        while j < len(lines) and len(lines[j]) - len(lines[j].lstrip()) > ind:
            j += 1
        out.append((stage[i], stage[j - 1]))
    return out


def lifetimes(lines: list[str], n: int) -> list[tuple[int, int]]:
    """(first, last) stage of each of the `n` buffers, widened over loops."""
    stage, s = [], 0
    for line in lines:
        stage.append(s)
        if line.strip() == BARRIER:
            s += 1
    first, last = [None] * n, [None] * n
    for i, line in enumerate(lines):
        for m in _TOKEN.finditer(line):
            k = int(m.group(1))
            if first[k] is None:
                first[k] = stage[i]
            last[k] = stage[i]
    live = [(f, l) if f is not None else (0, -1) for f, l in zip(first, last)]
    loops = _loops(lines, stage)
    changed = True
    while changed:
        changed = False
        for k, (f, l) in enumerate(live):
            if l < f:
                continue
            for ls, le in loops:
                nf = ls if f >= ls and f <= le < l else f          # written in, read after
                nl = le if f < ls <= l <= le else l                # made before, read in
                if (nf, nl) != (f, l):
                    f, l, changed = nf, nl, True
            live[k] = (f, l)
    return live


def pack(lines: list[str], sizes: list[int]) -> tuple[list[str], int]:
    """`lines` with every `wsoff(k)` replaced by buffer k's offset, and the workspace size
    (elements per program)."""
    live = lifetimes(lines, len(sizes))
    placed: list[tuple[int, int, int]] = []          # (offset, end, buffer)
    offset = [0] * len(sizes)
    for k in sorted(range(len(sizes)), key=lambda k: (-sizes[k], k)):
        f, l = live[k]
        if l < f:                                    # never named: no storage
            continue
        size = -(-max(sizes[k], 1) // 16) * 16
        busy = sorted((o, e) for o, e, j in placed
                      if not (live[j][1] < f or l < live[j][0]))
        at = 0
        for o, e in busy:
            if at + size <= o:
                break
            at = max(at, e)
        offset[k] = at
        placed.append((at, at + size, k))
    total = max((e for _, e, _ in placed), default=0)
    out = [_TOKEN.sub(lambda m: str(offset[int(m.group(1))]), line) for line in lines]
    return out, total
