"""Counting a scan kernel's serial work from its emitted lines: `serial_rounds` (dependent
tile rounds an iteration, what one program's chunk loop waits on), `group_barriers` (the
barriers an iteration passes: in a split kernel each is a group barrier) and `split_stages`
(a split kernel's stages that hand out no blocks, run by sub-program 0 alone). The scan
kernel (`codegen/scan/kernel.py`) and its cost rule read them."""
from __future__ import annotations

import re
from math import prod

from titanc.codegen.scan.emitter import SUB_LOOP

__all__ = ["group_barriers", "rounds_and_barriers", "serial_rounds", "split_stages"]

_FOR = re.compile(r"for (\w+) in range\(([^,()]+), ([^,()]+)(?:, ([^,()]+))?\):$")
_SUB_START = re.compile(r"^sub(?: \* \d+)?$")


def serial_rounds(lines: list[str]) -> int:
    """Dependent tile rounds in one iteration of a scan kernel's loop (`it1`), one program:
    every block of loads or dots between two barriers counts once per execution, the
    product of the trip counts of the loops around it inside the scan loop (a nested scan's
    loop included; a trip count that is no literal counts 1). One program runs its chunk
    loop serially and each round waits on the workspace, so this count, not the FLOPs, is
    what the kernel's time follows (`MAX_TILE` and `DOT_BLOCK` set it)."""
    return rounds_and_barriers(lines)[0]


def rounds_and_barriers(lines: list[str]) -> tuple[int, int]:
    """`serial_rounds` and `group_barriers` of `lines`."""
    loops: list[tuple[int, int, int]] = []     # (indent, trips, id) of the open loops
    inside, segment, ids, blocks, barriers = None, 0, 0, {}, 0
    for line in lines:
        body = line.lstrip()
        if not body or body.startswith("#"):
            continue
        indent = len(line) - len(body)
        while loops and indent <= loops[-1][0]:
            loops.pop()
        if inside is not None and indent <= inside:
            inside = None
        m = _FOR.match(body)
        if m:
            if inside is None and m.group(1) == "it1":
                inside = indent
                continue
            a, b, c = m.group(2), m.group(3), m.group(4) or "1"
            a = _SUB_START.sub("0", a)     # a split stage's loop: sub-program 0's blocks
            trips = -(-(int(b) - int(a)) // int(c)) if all(
                x.strip().lstrip("-").isdigit() for x in (a, b, c)) else 1
            ids += 1
            loops.append((indent, max(trips, 1), ids))
            continue
        if inside is None:
            continue
        inner = [x for x in loops if x[0] > inside]
        if body.startswith("tl.debug_barrier()"):
            segment += 1
            barriers += prod(t for _, t, _ in inner)
        elif "tl.load(" in body or "tl.dot(" in body:
            blocks[(segment, tuple(i for _, _, i in inner))] = prod(t for _, t, _ in inner)
    return sum(blocks.values()), barriers


def group_barriers(lines: list[str]) -> int:
    """Barriers one iteration of a scan kernel's loop (`it1`) passes, one program: each
    once per trip of the loops around it inside the scan loop, counted like
    `serial_rounds`'s rounds (in a split kernel each is a group barrier)."""
    return rounds_and_barriers(lines)[1]


def split_stages(lines: list[str]) -> list[str]:
    """A split kernel's lines with the header of every stage that hands out no blocks
    (`ScanEmitter.stage`: no line of it names `sub`) made `if sub_lo == 0:`: sub-program 0
    runs it alone."""
    out = list(lines)
    for i, line in enumerate(lines):
        if line.strip() != SUB_LOOP:
            continue
        ind = len(line) - len(line.lstrip())
        j = i + 1
        while j < len(lines) and (not lines[j].strip()
                                  or len(lines[j]) - len(lines[j].lstrip()) > ind):
            j += 1
        if not any(re.search(r"\bsub\b", x) for x in lines[i + 1:j]
                   if not x.lstrip().startswith("#")):
            out[i] = line[:ind] + "if sub_lo == 0:"
    return out
