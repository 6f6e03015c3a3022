"""What one training step runs, modeled from the compiled plans: kernels by family, bytes moved
and FLOPs, with and without the pattern passes (report.json `step`, `titanc inspect`).

A training step is `grad_accum` runs of the training graph and one of the optimizer graph.
Figures per step:

- `kernels`: the distinct kernels the step launches on the triton target: every top-level
  kernel of both schedules that is not a no-op (`BufferPlan.is_noop`: all its outputs alias
  storage that holds them), a scan that renders to one scan kernel counting once, and a scan
  that falls back to a host loop counting its body's kernels by the same rule (and the
  kernel of its prologue gathers, `ir.schedule.prologue_kernel`, if any). Repetition is
  not counted here (a kernel launched every iteration of a host loop, or once per gradient
  accumulation step, is one kernel); `launches_per_step` counts launches.
- `kernels_all`: every kernel of the schedules and their scan bodies that is not a no-op (the
  cpu target, where every scan is a host loop over its body's kernels); report.json
  `kernel_counts` is the same count per graph (`launched_kernels`), so for one gradient
  accumulation step `kernels_all` = `kernel_counts.training` + `kernel_counts.optimizer`.
- `families`: per kernel family (pointwise, reduction, matmul, or a template's name:
  attention_fwd, attention_bwd, adamw_multi, segment_sum, scatter_along, scan) the kernels
  (counted as in `kernels_all`), launches, bytes and FLOPs;
- `bytes`: the modeled traffic: each kernel's reads and writes (`Kernel.bytes`) times its
  launches per step (a body kernel runs once per iteration of its scan); a scan kernel adds
  only its own operands and results, its body's traffic being its body's kernels';
- `flops`: the modeled work (`passes.fusion.node_flops`) of every kernel but the scans, times
  its launches (a scan's FLOPs are its body's kernels');
- `copy_kernels`: the launched kernels (counted as in `kernels_all`) without a computing node
  (`is_computing`), by name with why each stays (`copy_reason`).

A computing node computes values: an elementwise op or CAST, a reduction (SUM, AMAX, CUMSUM),
a contraction (EINSUM), a scatter-add (INDEX_ADD, SCATTER_ALONG), a scan or a pattern op. A
view (RESHAPE, PERMUTE, EXPAND, SLICE), a constant (FULL, ROPE, MASK), a PAD, a CONCAT or a
gather (TAKE, TAKE_ALONG) only moves or makes values: a kernel of those alone is a pure copy.
The buffer plan binds views and constants without a kernel (`BufferPlan.views`); what stays
is a gather, a pad or concat, or a view some reader needs dense (a segment sum's gradient rows).

`step_cost(spec)` compiles the spec twice: as the pipeline does (`after`) and with the
pattern passes left out (`before`: attention as its scores/softmax/PV chain, AdamW as
per-parameter kernels). The embedding gradient is the same INDEX_ADD node both ways (its
segment-sum kernel is a codegen choice, not a pass), so it shows as segment_sum in both.
"""
from __future__ import annotations

from typing import Any, Callable

from titanc.ir import Graph, Op, OpGroup
from titanc.ir.buffer_plan import BufferPlan
from titanc.ir.schedule import scan_prologue
from titanc.ir.structural import STRUCTURAL

from titanc.compiler import Compiled, compile_graphs

FAMILY_ORDER = ("pointwise", "reduction", "matmul", "attention_fwd", "attention_bwd",
                "adamw_multi", "segment_sum", "scatter_along", "scan")


def _dense_reader(op: Op) -> bool:
    """A template reader that needs some operand dense (its entry's `strided` is not "all")."""
    return (op in (Op.INDEX_ADD, Op.SCATTER_ALONG) or op in OpGroup.PATTERN) \
        and STRUCTURAL[op].strided != "all"


def is_computing(op: Op) -> bool:
    """Does a node of `op` compute values (module docstring), rather than move or make them?"""
    return not (op in OpGroup.INDEXING or op in OpGroup.GENERATOR
                or op in (Op.TAKE, Op.TAKE_ALONG, Op.ITEM, Op.INPUT))


def copy_reason(plan: BufferPlan, kern: Any) -> str:
    """Why a launched kernel without a computing node is not a view (module docstring)."""
    g: Graph = plan.schedule.graph
    ops = {g.node(n).op for n in kern.nodes}
    if ops & {Op.TAKE, Op.TAKE_ALONG}:
        return "gather: a copy through indices, which no strided view expresses"
    if Op.CONCAT in ops or Op.PAD in ops:
        return "concat/pad: its pieces are copied into one buffer"
    dense = sorted({g.node(r).op.name.lower() for v in kern.outputs for r in g.users(v)
                    if _dense_reader(g.node(r).op)})
    if dense:
        return f"a view read densely by {', '.join(dense)}"
    return "a view torch cannot express over its source (a reshape of a strided view)"


def kernel_family(plan: BufferPlan, kern: Any) -> str:
    """pointwise | reduction | matmul, or the template a template kernel runs."""
    if kern.category != "template":
        return kern.category
    g = plan.schedule.graph
    pro = scan_prologue(g, kern)                     # a scan's gather: the scan's family
    return next(STRUCTURAL[g.node(n).op].family or g.node(n).op.name.lower()
                for n in kern.nodes if g.node(n).op is not Op.ITEM and n not in pro)


def _one_kernel_rule() -> Callable[[BufferPlan, int], bool]:
    """Does the triton target run scan `sid` of `plan` as one scan kernel?"""
    from titanc.codegen.lower.dispatch import graph_dtype
    from titanc.codegen.scan.kernel import ScanFallback, scan_kernel_for

    def one(p: BufferPlan, sid: int) -> bool:
        kern = next(k for k in p.schedule.kernels if sid in k.nodes)
        try:
            scan_kernel_for(p, kern, sid, graph_dtype(p.schedule.graph))
            return True
        except ScanFallback:
            return False
    return one


def plan_cost(plan: BufferPlan, runs: int, one_kernel: Callable[[BufferPlan, int], bool],
                 acc: dict[str, Any]) -> None:
    """Add `runs` runs of `plan` to `acc` (see the module docstring for each figure)."""
    g = plan.schedule.graph
    for k, kern in enumerate(plan.schedule.kernels):
        if plan.is_noop(k):
            continue
        fam = kernel_family(plan, kern)
        row = acc["families"].setdefault(fam, {"kernels": 0, "launches": 0, "bytes": 0,
                                                "flops": 0})
        row["kernels"] += 1
        row["launches"] += runs
        row["bytes"] += runs * kern.bytes
        acc["kernels_all"] += 1
        if not any(is_computing(g.node(n).op) for n in kern.nodes):
            acc["copy_kernels"][f"{g.name}/{kern.name}"] = copy_reason(plan, kern)
        scans = [n for n in kern.nodes if n in plan.bodies]
        if not scans:
            row["flops"] += runs * kern.flops
            acc["kernels"] += 1
            continue
        sid = scans[0]
        length = int(g.node(sid).attr("length"))
        if one_kernel(plan, sid):
            acc["kernels"] += 1
            inner = dict(acc, kernels=0)
            plan_cost(plan.bodies[sid], runs * length, one_kernel, inner)
            acc.update({key: inner[key] for key in ("kernels_all", "families", "copy_kernels")})
        else:                        # a host loop, after its prologue gathers' launch
            acc["kernels"] += bool(scan_prologue(g, kern))
            plan_cost(plan.bodies[sid], runs * length, one_kernel, acc)


def launched_kernels(plan: BufferPlan) -> int:
    """Kernels of a plan and its scan bodies that run something (no-ops left out): the
    count report.json `kernel_counts` and `graphs.<kind>.kernels` give, and per graph what
    `kernels_all` sums over the step."""
    own = sum(not plan.is_noop(k) for k in range(len(plan.schedule.kernels)))
    return own + sum(launched_kernels(b) for b in plan.bodies.values())


def compiled_cost(c: Compiled) -> dict[str, Any]:
    """The per-step figures of one compile (module docstring)."""
    acc: dict[str, Any] = {"kernels": 0, "kernels_all": 0, "families": {}, "copy_kernels": {}}
    one = _one_kernel_rule()
    plan_cost(c.plans["training"], c.spec.train.grad_accum, one, acc)
    plan_cost(c.plans["optimizer"], 1, one, acc)
    fams = dict(sorted(acc["families"].items(),
                       key=lambda kv: (FAMILY_ORDER.index(kv[0]) if kv[0] in FAMILY_ORDER
                                       else len(FAMILY_ORDER), kv[0])))
    return {"kernels": acc["kernels"], "kernels_all": acc["kernels_all"], "families": fams,
            "bytes": sum(f["bytes"] for f in fams.values()),
            "flops": sum(f["flops"] for f in fams.values()), "copy_kernels": acc["copy_kernels"]}


def step_cost(spec: Any, after: Compiled | None = None) -> dict[str, Any]:
    """report.json `step`: {definition, before, after} (before: the pattern passes off)."""
    after = after or compile_graphs(spec)
    before = compile_graphs(spec, after.batch, verify_each=False, patterns=False)
    return {"definition": "per training step (grad_accum training runs + one optimizer run); "
                          "kernels: distinct kernels launched on the triton target, a scan "
                          "kernel once, a host-loop scan's body kernels each once; "
                          "kernels_all: every kernel, scan bodies included; bytes/flops: "
                          "modeled per kernel times its launches; before: without the pattern "
                          "passes (flash attention, fused linear cross-entropy, fused AdamW)",
            "before": compiled_cost(before), "after": compiled_cost(after)}


def kernel_rows(compiled: Any) -> list[dict[str, Any]]:
    """report.json `kernels` rows with `depth` (scan nesting) and `launches` (runs per step:
    the product of the enclosing scans' lengths) for the training then optimizer schedule,
    each scan followed by its body's kernels; no-op kernels (their outputs are views of
    stored values or constants, `BufferPlan.is_noop`) run nothing and are left out. The
    report writer uses these rows."""
    rows: list[dict[str, Any]] = []

    def walk(plan: Any, depth: int, launches: int) -> None:
        schedule = plan.schedule
        for i, k in enumerate(schedule.kernels):
            if plan.is_noop(i):                      # views and constants: nothing runs
                continue
            scan = any(nid in schedule.bodies for nid in k.nodes)
            rows.append({"name": k.name, "category": k.category, "flops": k.flops,
                         "bytes": k.bytes, "nodes": len(k.nodes), "depth": depth,
                         "launches": launches, "scan": scan})
            for nid in k.nodes:                      # a scan's body right under it
                if nid in schedule.bodies:
                    length = int(schedule.graph.node(nid).attr("length"))
                    walk(plan.bodies[nid], depth + 1, launches * length)

    for name in ("training", "optimizer"):
        walk(compiled.plans[name], 0, 1)
    return rows


SMS = 132      # streaming multiprocessors of an H100 SXM: a grid below this leaves SMs idle


def grid_shares(compiled: Any, grids: dict[str, int], aliases: dict[str, str]
                ) -> list[dict[str, Any]]:
    """Every kernel a training step launches, from a recording of its launches (`grids`:
    programs by launched kernel, `aliases`: schedule kernel -> launched module, as
    `runtime.targets.aot.record_launches` or the precompile fill them): its grid (`programs`,
    the largest of its launches; a template of several kernels, such as attention's
    backward, the largest of theirs), its runs a step and its share of the step's modeled
    FLOPs (a scan kernel: its body's); `why_under` for a kernel holding more than 1% of the
    FLOPs on fewer than `SMS` programs."""
    rows = kernel_rows(compiled)
    total = max(1, sum(r["flops"] * r["launches"] for r in rows if not r["scan"]))
    out = []
    for r in rows:
        if r["name"] not in aliases:          # inside a scan kernel: no launch of its own
            continue
        module = aliases[r["name"]]     # its module's kernels: <module>, or <module>_<part>
        parts = [k for k in grids if k == module or k.startswith(module + "_")]
        share = r["flops"] * r["launches"] / total
        row = {"name": r["name"], "programs": max((grids[k] for k in parts), default=None),
               "launches": r["launches"], "flops_share": round(share, 4)}
        if share > 0.01 and (row["programs"] or 0) < SMS:
            row["why_under"] = (
                f"a chunk recurrence: one program per independent (batch, memory head) pair, "
                f"{row['programs']} at these sizes; column tiles of W (several programs per "
                f"head) are not implemented" if r["scan"] else
                f"its grid tiles its output: {row['programs']} tiles at these sizes (a larger "
                "batch, sequence or width gives more)")
        out.append(row)
    return out


def occupancy(compiled: Any, arch: int, jit: bool = False) -> dict[str, Any]:
    """report.json `occupancy` (`titanc compile --arch`): every kernel a training step
    launches (training and optimizer programs at the compiled shapes) with its grid
    (`programs`, the largest of its launches, recorded; a template of several kernels, such as
    attention's backward, the largest of theirs), its share of the step's modeled
    FLOPs (a scan kernel: its body's), and, compiled ahead of time for sm_`arch`
    (`runtime.targets.precompile`; not when `jit`: compiled through the device's JIT instead), its
    registers, spill bytes and shared memory (`grid_shares` for the rest; `why_under` says,
    for a kernel holding more than 1% of the FLOPs on fewer than `SMS` programs, why its
    grid is that small)."""
    from titanc.runtime.targets.precompile import precompile

    grids: dict[str, int] = {}
    aliases: dict[str, str] = {}
    built: dict[str, dict[str, Any]] = {}
    for name in ("training", "optimizer"):
        s = precompile(compiled.plans[name], arch, allow_tf32=compiled.spec.compile.allow_tf32,
                       jit=jit, progress=False)
        grids |= s["grids"]
        aliases |= s["aliases"]
        for r in s["results"]:
            if r.get("ok"):
                old = built.get(r["name"], {})
                built[r["name"]] = {k: max(old.get(k, 0), r[k] or 0)
                                    for k in ("registers", "spill_bytes", "shared")}
    out = grid_shares(compiled, grids, aliases)
    for row in out:
        module = aliases[row["name"]]
        for k in [k for k in grids if k == module or k.startswith(module + "_")]:
            for key, v in built.get(k, {}).items():
                row[key] = max(row.get(key, 0), v)
    return {"arch": arch, "sms": SMS, "kernels": out,
            "under": sum("why_under" in r for r in out)}
