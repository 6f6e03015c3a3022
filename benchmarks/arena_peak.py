"""What a spec's training arena holds at its peak, recursively through the scan workspaces.

    python benchmarks/arena_peak.py examples/large_125m.yaml [--set train.remat=per_layer]
        [--kind training] [--top 12] [--depth 4]

For the plan of the graph kind and, inside it, every scan workspace that is at least 5% of
its level's peak: the kernel where the most bytes are live (`BufferPlan.peak`) and the
largest buffers live there (size, live kernel range, producing kernel, op, type).
"""
from __future__ import annotations

import argparse
import os
import time

import yaml

from titanc.compiler import compile_graphs
from titanc.ir import Op
from titanc.ir.buffer_plan import BufferPlan
from titanc.model.spec import load_spec


def describe(plan: BufferPlan, top: int, depth: int, indent: int = 0) -> list[str]:
    g = plan.schedule.graph
    at, live = plan.peak()
    total = sum(b.size for b in live)
    pad = "  " * indent
    lines = [f"{pad}{g.name}: arena {plan.arena_bytes / 1e6:.1f} MB, peak at kernel {at} "
             f"({plan.schedule.kernels[at].name}): {total / 1e6:.1f} MB live"]
    for b in live[:top]:
        n = g.node(b.value)
        what = n.op.name
        if n.op is Op.ITEM:
            src = g.node(n.inputs[0])
            what += f" {n.attr('index')} of {src.attr('body').name if src.op is Op.SCAN else src.op.name}"
        elif n.op is Op.SCAN:
            what = f"workspace of scan {n.attr('body').name}"
        t = "" if isinstance(n.type, tuple) else f" {n.type}"
        lines.append(f"{pad}  {b.size / 1e6:9.1f} MB [{b.first},{b.last}] %{b.value} {what}{t}"
                     f"  ({b.producer})")
    if live[top:]:
        lines.append(f"{pad}  ... {len(live) - top} more: "
                     f"{sum(b.size for b in live[top:]) / 1e6:.1f} MB")
    if indent < depth:
        for b in live:
            if b.kind == "workspace" and b.size >= 0.05 * total:
                lines += describe(plan.bodies[b.value], top, depth, indent + 1)
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("spec")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--kind", default="training", choices=("forward", "training"))
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--depth", type=int, default=4)
    args = ap.parse_args()
    over = {k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in args.set)}
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    t0 = time.perf_counter()
    c = compile_graphs(load_spec(args.spec, over), verify_each=False)
    print(f"compiled in {time.perf_counter() - t0:.1f} s")
    print("\n".join(describe(c.graphs[args.kind].plan, args.top, args.depth)))


if __name__ == "__main__":
    main()
