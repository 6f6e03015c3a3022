"""A scan kernel's lines after emission: stores nothing loads and names nothing reads dropped.

`drop_dead_stores(lines)` drops the stores of workspace buffers nothing loads (a value a
stage of several nodes kept in registers for all its readers), then what only they used
(`prune`), loops left empty and barriers that no longer separate anything. `prune(lines)`
drops assignments whose name nothing reads (index and zero tiles a stage made but did not
use), to a fixpoint: the GPU compiler drops them too, but the interpreter would run each one
in every iteration (tiny.yaml's memory-chunk backward made 148 zero tiles and used 29).
"""
from __future__ import annotations

import re
from collections import Counter

from titanc.codegen.scan.pack import BARRIER

__all__ = ["drop_dead_stores", "prune"]

# generated names (fresh: a prefix and a number), an assignment to one, and the calls a line
# must keep even when its result is unread
_NAME = re.compile(r"\b[a-z]+\d+\b")
_ASSIGN = re.compile(r"^\s*([a-z]+\d+) = ")
_EFFECT = re.compile(r"tl\.(store|atomic|debug_barrier)")
# a workspace buffer's symbolic offset (`pack.wsoff`), and a line that only stores to one
_WSOFF = re.compile(r"__wsoff\d+__")
_WS_STORE = re.compile(r"^\s*tl\.store\(ws_ptr \+ pbase \+ [^,]*__wsoff\d+__[^,]*, [a-z]+\d+"
                       r"(, mask=[a-z]+\d+)?\)$")


def prune(lines: list[str]) -> list[str]:
    """`lines` without assignments whose name nothing reads, to a fixpoint."""
    while True:
        uses = Counter(_NAME.findall("\n".join(lines)))
        keep = [line for line in lines
                if not ((m := _ASSIGN.match(line)) and uses[m.group(1)] == 1
                        and not _EFFECT.search(line))]
        if len(keep) == len(lines):
            return lines
        lines = keep


def _drop_empty_loops(lines: list[str]) -> list[str]:
    while True:
        keep, changed = [], False
        for i, line in enumerate(lines):
            body = line.lstrip()
            ind = len(line) - len(body)
            if body.startswith("for "):
                nxt = next((x for x in lines[i + 1:] if not x.lstrip().startswith("#")), "")
                if len(nxt) - len(nxt.lstrip()) <= ind:
                    changed = True
                    continue
            keep.append(line)
        lines = keep
        if not changed:
            return lines


def _drop_idle_barriers(lines: list[str]) -> list[str]:
    """Without barriers after nothing but comments (or at a block's start)."""
    out: list[str] = []
    for line in lines:
        if line.strip() == BARRIER:
            prev = next((x for x in reversed(out) if not x.lstrip().startswith("#")), "")
            if prev.strip() in (BARRIER, "") or prev.rstrip().endswith(":"):
                continue
        out.append(line)
    return out


def drop_dead_stores(lines: list[str]) -> list[str]:
    """`lines` without the stores of workspace buffers nothing loads and what only they
    needed (the module's docstring); unchanged where there are none."""
    named: dict[str, list[int]] = {}
    for i, line in enumerate(lines):
        for t in set(_WSOFF.findall(line)):
            named.setdefault(t, []).append(i)
    dead = {i for at in named.values() if all(_WS_STORE.match(lines[i]) for i in at)
            for i in at}
    if not dead:
        return lines
    lines = prune([line for i, line in enumerate(lines) if i not in dead])
    return _drop_idle_barriers(_drop_empty_loops(lines))
