"""Liveness packing of a scan kernel's workspace (`codegen/scan/pack.py`), tier (c).

Lifetimes are counted in stages (between `tl.debug_barrier()`s) and widened over loops; buffers
with disjoint lifetimes share addresses, buffers of one stage never do. The numerical side
(packed kernels equal the reference scans, every block kind) is tests/test_scan_kernel.py.
"""
from __future__ import annotations

import re
from pathlib import Path

from titanc.codegen.scan.kernel import render_scan
from titanc.codegen.scan.pack import BARRIER, lifetimes, pack, wsoff
from titanc.compiler import compile_graphs
from titanc.ir import Op
from titanc.model.spec import load_spec

ROOT = Path(__file__).resolve().parent.parent


def _program(*stages: list[str]) -> list[str]:
    lines = []
    for st in stages:
        lines += st + [f"    {BARRIER}"]
    return lines


def test_disjoint_lifetimes_share_addresses_one_stage_never_does() -> None:
    a, b, c = wsoff(0), wsoff(1), wsoff(2)
    lines = _program([f"    store({a})"], [f"    load({a}); store({b})"],
                     [f"    load({b}); store({c})"], [f"    load({c})"])
    assert lifetimes(lines, 3) == [(0, 1), (1, 2), (2, 3)]
    out, ws = pack(lines, [32, 32, 32])
    offs = [int(m) for line in out for m in re.findall(r"store\((\d+)\)", line)]
    assert ws == 64                               # a and c share; b (alive with both) does not
    assert offs[0] == offs[2] != offs[1]
    assert not any("__wsoff" in line for line in out)


def test_loops_widen_lifetimes() -> None:
    """A value made before a loop lives through it; a value written in an iteration and read
    after the loop lives from the loop's start (a later iteration must not overwrite it)."""
    before, inside, ys, tmp = (wsoff(k) for k in range(4))
    lines = [f"    store({before})", f"    {BARRIER}",                  # stage 0
             "    for it in range(0, 4):",
             f"        load({before}); store({tmp})", f"        {BARRIER}",   # stage 1
             f"        load({tmp}); store({inside})", f"        {BARRIER}",   # stage 2
             f"        load({inside}); store({ys} + it)", f"        {BARRIER}",  # stage 3
             f"    load({ys})", f"    {BARRIER}"]                          # stage 4
    live = lifetimes(lines, 4)
    assert live[0] == (0, 3)                  # read in the loop: lives to its last stage
    assert live[1] == (2, 3) and live[3] == (1, 2)      # inside one iteration: not widened
    assert live[2] == (1, 4)                  # the stacked ys: from the loop's first stage
    out, ws = pack(lines, [16, 16, 64, 16])
    assert ws == 64 + 3 * 16                  # all four alive together in stage 2


def test_packing_shrinks_the_tiny_layer_scan() -> None:
    c = compile_graphs(load_spec(ROOT / "examples" / "tiny.yaml"))
    g = c.plans["forward"].schedule.graph
    scan = next(n for n in g if n.op is Op.SCAN and n.attr("body").name.startswith("layer"))
    sk = render_scan(g, scan.id)
    assert "__wsoff" not in sk.source
    unpacked = int(re.search(r"liveness-packed from (\d+)", sk.source).group(1))
    assert sk.ws_per_program * 1.5 < unpacked
