"""Modeled elementwise traffic of a training step: the bytes the pointwise and reduction
launches move (issue #50: large_125m's at most 50 GB a step).

    .venv/bin/python benchmarks/elementwise_traffic.py examples/large_125m.yaml \
        --set train.dtype=bfloat16 --set train.grad_accum=1

Compiles each spec as `benchmarks/launches.py` does and walks the step as the cost model
counts it (`titanc.tools.cost_model.plan_cost`: `grad_accum` runs of the training plan and
one of the optimizer's; a scan body's kernels once per iteration, whether its scan runs as
a scan kernel or a host loop): per kernel family of category pointwise or reduction
(`ir.kernel_family`: pointwise, reduction, cumsum) the launches and the modeled bytes
(`Kernel.bytes`: distinct inputs read and outputs written, times the launches), split into
`outside` (the dense part: every kernel not in the body of a scan of role "memory" or
"memory_group") and `inside` (the memory's chunk recurrence, issue #50 item 2). The outside
kernels are also classed (`outside_by_role`: GB per family and role) by their neighbours in
their schedule: `epilogue` (it reads an einsum kernel's result: a candidate matmul
epilogue), `prologue` (an einsum kernel reads its result) or `other`; and by what keeps each
out of the kernel that writes its largest input (`outside_by_reason`, GB per reason): the
rule of `passes.fusion_rules.KernelRules` that refuses the two as one kernel, node ids as
`%n` ("%n (permute) views a computed value", "%n reduces a reduction"), or "input" (it reads no kernel's
output), "template" (a scan or pattern op writes it), "legal" (the rules allow the pair:
fusion left it for the order, the peak or the score). Which rule to relax first, in bytes.
`--top N` lists the N outside elementwise kernels moving the most bytes, each with its
reason. Prints JSON, then a table.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any

os.environ.setdefault("TRITON_INTERPRET", "1")

from titanc.compiler import compile_graphs  # noqa: E402
from titanc.ir import Op  # noqa: E402
from titanc.ir.kernel_family import family_of  # noqa: E402
from titanc.passes.fusion_rules import KernelRules  # noqa: E402
from titanc.model.spec import load_spec, parse_set_args  # noqa: E402

ELEMENTWISE = ("pointwise", "reduction")          # the schedule categories counted
MEMORY_ROLES = ("memory", "memory_group")         # scans of the chunk recurrence


def _einsum_ids(plan: Any) -> tuple[set[int], set[int]]:
    """(values an einsum kernel writes, values an einsum kernel reads) of a plan's graph."""
    g = plan.schedule.graph
    made: set[int] = set()
    read: set[int] = set()
    for k in plan.schedule.kernels:
        if any(g.node(n).op is Op.EINSUM for n in k.nodes):
            made.update(k.outputs)
            read.update(k.inputs)
    return made, read


def _blocked(plan: Any, k: Any, rules: KernelRules) -> str:
    """Why kernel `k` is not in the kernel that writes its largest input (see the module
    docstring): a rule's reason with node ids as `%n`, "input", "template" or "legal"."""
    s, g = plan.schedule, plan.schedule.graph
    writer = {v: w for w in s.kernels for v in w.outputs}
    made = [v for v in k.inputs if v in writer]
    if not made:
        return "input"
    w = writer[max(made, key=lambda v: (g.node(v).type.nbytes, -v))]
    if w.category == "template":
        return "template"
    members = sorted(set(w.nodes) | set(k.nodes))
    inside, outs = set(members), {v for _, v in g.outputs}
    written = [m for m in members if not isinstance(g.node(m).type, tuple)
               and (m in outs or any(u not in inside for u in g.users(m)))]
    if rules.category(members, inside, written) is not None:
        return "legal"
    return re.sub(r"%\d+", "%n", rules.why)


def _walk(plan: Any, runs: int, memory: bool, rows: list[dict[str, Any]]) -> None:
    """Add a row per launched elementwise kernel of `plan`, run `runs` times a step, and of
    its scan bodies (`memory`: inside the chunk recurrence, `MEMORY_ROLES`)."""
    g = plan.schedule.graph
    made, read = _einsum_ids(plan)
    rules = KernelRules(g, {n.id: n for n in g})
    for i, k in enumerate(plan.schedule.kernels):
        if plan.is_noop(i):
            continue
        if k.category in ELEMENTWISE:
            role = ("epilogue" if set(k.inputs) & made else
                    "prologue" if set(k.outputs) & read else "other")
            rows.append({"name": f"{g.name}/{k.name}", "family": family_of(g, k).name,
                         "inside": memory, "launches": runs, "bytes": runs * k.bytes,
                         "role": role, "blocked": _blocked(plan, k, rules)})
        for nid in k.nodes:
            if nid in plan.bodies:
                scan = g.node(nid)
                _walk(plan.bodies[nid], runs * int(scan.attr("length")),
                      memory or scan.attr("role", "loop") in MEMORY_ROLES, rows)


def traffic(path: str, overrides: dict[str, object], top: int = 0) -> dict[str, Any]:
    c = compile_graphs(load_spec(path, overrides))
    rows: list[dict[str, Any]] = []
    _walk(c.plans["training"], int(c.spec.train.grad_accum), False, rows)
    _walk(c.plans["optimizer"], 1, False, rows)
    fams: dict[str, dict[str, int]] = {}
    roles: dict[str, int] = {}
    reasons: dict[str, int] = {}
    for r in rows:
        f = fams.setdefault(r["family"], {"launches": 0, "bytes": 0, "outside_bytes": 0,
                                          "inside_bytes": 0})
        f["launches"] += r["launches"]
        f["bytes"] += r["bytes"]
        f["inside_bytes" if r["inside"] else "outside_bytes"] += r["bytes"]
        if not r["inside"]:
            key = f"{r['family']} {r['role']}"
            roles[key] = roles.get(key, 0) + r["bytes"]
            reasons[r["blocked"]] = reasons.get(r["blocked"], 0) + r["bytes"]
    out: dict[str, Any] = {
        "spec": path, "overrides": {k: str(v) for k, v in overrides.items()},
        "bytes": sum(f["bytes"] for f in fams.values()),
        "outside_bytes": sum(f["outside_bytes"] for f in fams.values()),
        "inside_bytes": sum(f["inside_bytes"] for f in fams.values()),
        "families": fams, "outside_by_role": roles,
        "outside_by_reason": dict(sorted(reasons.items(), key=lambda kv: -kv[1]))}
    if top:
        out["top"] = sorted((r for r in rows if not r["inside"]),
                            key=lambda r: -r["bytes"])[:top]
    return out


def _gb(b: int) -> str:
    return f"{b / 1e9:10.2f}"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("specs", nargs="+")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--top", type=int, default=0, metavar="N",
                    help="list the N outside elementwise kernels moving the most bytes")
    args = ap.parse_args(argv)
    overrides = parse_set_args(args.set)
    rows = [traffic(p, overrides, args.top) for p in args.specs]
    print(json.dumps(rows, indent=1))
    for r in rows:
        print(f"\n{r['spec']}: elementwise traffic {r['bytes'] / 1e9:.2f} GB a step "
              f"(outside the memory {r['outside_bytes'] / 1e9:.2f} GB, inside its chunk "
              f"recurrence {r['inside_bytes'] / 1e9:.2f} GB)")
        print(f"{'family':12} {'launches':>9} {'GB':>10} {'outside GB':>10} {'inside GB':>10}")
        for name, f in r["families"].items():
            print(f"{name:12} {f['launches']:>9} {_gb(f['bytes'])} {_gb(f['outside_bytes'])} "
                  f"{_gb(f['inside_bytes'])}")
        print("outside, by family and role: " + "; ".join(
            f"{k} {v / 1e9:.2f} GB" for k, v in sorted(r["outside_by_role"].items())))
        print("outside, by what keeps a kernel out of the one writing its largest input:")
        for why, b in r["outside_by_reason"].items():
            print(f"  {b / 1e9:8.2f} GB  {why}")
        for t in r.get("top", []):
            print(f"  {t['bytes'] / 1e9:8.3f} GB  {t['role']:9} {t['name']}  ({t['blocked']})")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
