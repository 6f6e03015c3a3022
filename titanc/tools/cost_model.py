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
- `families`: per kernel family (`ir.kernel_family`: pointwise, reduction, cumsum, matmul,
  attention_fwd, ..., scan, in the registry's order) the kernels
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

from dataclasses import dataclass
from typing import Any, Callable

from titanc.ir import Graph, Op, OpGroup
from titanc.ir.buffer_plan import BufferPlan
from titanc.ir.kernel_family import FAMILIES, family_of, prefix
from titanc.ir.schedule import scan_prologue
from titanc.ir.structural import STRUCTURAL

from titanc.compiler import Compiled, compile_graphs

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
    """The name of the kernel family that runs `kern` (`ir.kernel_family.family_of`)."""
    return family_of(plan.schedule.graph, kern).name

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
    order = list(FAMILIES)                         # the registry's order
    fams = dict(sorted(acc["families"].items(),
                       key=lambda kv: (order.index(kv[0]) if kv[0] in order else len(order),
                                       kv[0])))
    return {"kernels": acc["kernels"], "kernels_all": acc["kernels_all"], "families": fams,
            "bytes": sum(f["bytes"] for f in fams.values()),
            "flops": sum(f["flops"] for f in fams.values()), "copy_kernels": acc["copy_kernels"]}


def step_cost(spec: Any, after: Compiled | None = None) -> dict[str, Any]:
    """report.json `step`: {definition, before, after} (before: the pattern passes off)."""
    after = after or compile_graphs(spec)
    # no per-pass dumps: a compile the on-disk cache serves to the next process
    before = compile_graphs(spec, after.batch, verify_each=False, patterns=False, dumps=False)
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


# -- the step's time (`titanc bench --predict`) ---------------------------------------------------
# A training step's time on a GPU, predicted from its lowered program (`codegen.lowered`, as the
# triton target lowers it; docs/cost_model.md). Per launch:
#     time = floor + max(FLOPs / rate[its family's cost class], bytes / bandwidth)
# (a launch group: the floor once, its members' work summed; a split-K matmul: two floors); a
# scan kernel: the floor plus its serial tile rounds, each `round_us` plus one program's share
# of the round's FLOPs at `round_gflops` (a split one: plus `barrier_us` a group barrier); a
# host-loop scan: its body's launches times its iterations. The floor is a launch inside the
# step's CUDA graph (how the triton target runs a step) or outside one.
# Every constant below is shared by the devices but their datasheet peaks and bandwidth;
# `benchmarks/cost_fit.py` fits them to the measured GPU calls and prints the error per call.

FIT: dict[str, Any] = {          # benchmarks/cost_fit.py --fit, 2026-11-28; round_us refit 2026-11-29
    "floor_graph_us": 5.8425,    # a launch inside a CUDA graph
    "floor_eager_us": 122.6,     # a launch outside one: the executor's host path per launch
    "bandwidth_share": 0.6581,   # of the datasheet's HBM bandwidth
    "efficiency": {"tensor": 0.1396, "cuda": 0.1026},   # of the unit's peak (`UNIT`)
    "round_us": 0.4505,          # a scan kernel's serial tile round: its fixed part, µs ...
    "round_gflops": 194.769,     # ... plus one program's share of its FLOPs at this rate
    "barrier_us": 1.0,           # a split scan kernel's group barrier: an estimate, not fitted
}                                # (no split kernel has run on a GPU)
# the unit each cost class (`KernelFamily.cost`) runs its FLOPs on
UNIT = {"matmul": "tensor", "attention": "tensor", "elementwise": "cuda", "reduction": "cuda"}
DATASHEET: dict[str, dict[str, Any]] = {   # HBM GB/s; the peaks are `timing.PEAK_TFLOPS`'
    "h100": {"name": "H100", "bandwidth_gbs": 3350.0},
    "h200": {"name": "H200", "bandwidth_gbs": 4800.0},
}


@dataclass(frozen=True)
class Device:
    """One GPU's constants: its datasheet's and the shared fitted ones (`FIT`)."""
    key: str
    bandwidth: float                 # attainable bytes/s
    peak: dict[str, float]           # dense FLOP/s by compute dtype (datasheet)
    fit: dict[str, Any]

    def rate(self, cost: str, dtype: str) -> float:
        """FLOP/s a kernel of cost class `cost` (`KernelFamily.cost`) attains: its unit's peak
        (`UNIT`: tensor cores in the compute dtype, or the float32 CUDA cores) times the
        unit's fitted efficiency."""
        unit = UNIT[cost]
        return self.peak[dtype if unit == "tensor" else "float32"] * self.fit["efficiency"][unit]


def device(key: str, fit: dict[str, Any] | None = None) -> Device:
    """The constants of device `key` (h100, h200), with `fit` (default `FIT`)."""
    from titanc.runtime.diagnostics.timing import PEAK_TFLOPS

    if key not in DATASHEET:
        raise KeyError(f"no cost model for device {key!r}: one of {', '.join(DATASHEET)}")
    fit = fit or FIT
    sheet = DATASHEET[key]
    return Device(key, sheet["bandwidth_gbs"] * 1e9 * fit["bandwidth_share"],
                  {k: v * 1e12 for k, v in PEAK_TFLOPS[sheet["name"]].items()}, fit)


def device_key(name: str) -> str | None:
    """The cost model's key of a device name (torch's), None when it has none."""
    low = name.replace(" ", "").lower()
    return next((k for k in DATASHEET if k in low), None)


@dataclass
class LaunchCost:
    """One distinct launch of a step and what the model charges it."""
    name: str
    category: str               # its family's profile label (`KernelFamily.profile`)
    cost: str                   # its family's cost class (`KernelFamily.cost`), or "group"
    count: int                  # launches a step
    flops: int                  # per launch
    bytes: int                  # per launch
    members: tuple[tuple[str, int, int], ...] = ()   # a launch group: (cost, flops, bytes)
    rounds: int = 0             # a scan kernel: serial tile rounds a launch (all iterations)
    grid: int = 0               # a scan kernel: its programs
    barriers: int = 0           # a split scan kernel: group barriers a launch (all iterations)
    split: int = 1              # kernels a launch (a split-K matmul: 2)


def step_launches(compiled: Any) -> list[LaunchCost]:
    """The launches of one training step on the triton target (`grad_accum` runs of the
    training program, one of the optimizer's), from the lowered programs as the triton
    target lowers them (`config`: scan kernels and their cost rule, launch groups, split-K)."""
    from titanc.codegen.group import groupable
    from titanc.codegen.lower.dispatch import graph_dtype
    from titanc.codegen.lowered import LaunchGroup, ScanLaunch, ScanLoop, lower
    from titanc.codegen.meta import kernel_split_k
    from titanc.codegen.scan.kernel import ScanFallback, scan_kernel_for
    from titanc.config import current

    rows: dict[str, LaunchCost] = {}

    def one(p: BufferPlan, kern: Any, sid: int) -> Any:
        if not current().scan_kernels:
            return None
        try:
            return scan_kernel_for(p, kern, sid, graph_dtype(p.schedule.graph))
        except ScanFallback:
            return None

    def add(key: str, row: Callable[[], LaunchCost], runs: int) -> None:
        if key not in rows:
            rows[key] = row()
        rows[key].count += runs

    def walk(low: Any, runs: int) -> None:
        g = low.graph
        for s in low.steps:
            key = f"{g.name}/{s.kernel.name}"
            if isinstance(s, ScanLoop):
                if s.prologue is not None:
                    add(key + "/prologue", lambda: _single(g, s.prologue, 1), runs)
                walk(s.body, runs * int(g.node(s.scan).attr("length")))
            elif isinstance(s, ScanLaunch):
                length = int(g.node(s.scan).attr("length"))
                add(key, lambda: LaunchCost(s.kernel.name, "scan", "scan", 0, s.kernel.flops,
                                            s.kernel.bytes, rounds=s.code.rounds * length,
                                            grid=s.code.grid,
                                            barriers=s.code.barriers * length), runs)
            elif isinstance(s, LaunchGroup):
                fams = [family_of(g, m.kernel) for m in s.members]
                add(key, lambda: LaunchCost(
                    s.kernel.name, fams[0].profile, "group", 0, s.kernel.flops,
                    s.kernel.bytes, members=tuple((f.cost, m.kernel.flops, m.kernel.bytes)
                                                  for f, m in zip(fams, s.members))), runs)
            else:
                add(key, lambda: _single(g, s.kernel, kernel_split_k(g, s.kernel)), runs)

    for name, runs in (("training", int(compiled.spec.train.grad_accum)), ("optimizer", 1)):
        walk(lower(compiled.plans[name], one, groupable if current().group_launches else None),
             runs)
    return list(rows.values())


def _single(g: Graph, kern: Any, split: int) -> LaunchCost:
    fam = family_of(g, kern)
    return LaunchCost(kern.name, fam.profile, fam.cost, 0, kern.flops, kern.bytes,
                      split=max(1, split))


TERMS = ("floor", "flops", "bytes", "rounds")


def launch_time(dev: Device, row: LaunchCost, dtype: str, graph: bool = True
                ) -> dict[str, float]:
    """Seconds of one launch of `row` by term (`TERMS`) and `time`, what the model charges:
    the floor plus its work (a scan kernel: its rounds; another launch: its FLOPs at its rate
    or its bytes at bandwidth, whichever is larger, summed over a group's members)."""
    fit = dev.fit
    floor = 1e-6 * (fit["floor_graph_us"] if graph else fit["floor_eager_us"]) * row.split
    if row.cost == "scan":
        per_round = row.flops / max(1, row.grid * row.rounds)     # one program's share
        rounds = row.rounds * (1e-6 * fit["round_us"] + per_round / (1e9 * fit["round_gflops"]))
        rounds += row.barriers * 1e-6 * fit["barrier_us"]
        return {"floor": floor, "flops": 0.0, "bytes": 0.0, "rounds": rounds,
                "time": floor + rounds}
    parts = row.members or ((row.cost, row.flops, row.bytes),)
    fl = [f / dev.rate(c, dtype) for c, f, _ in parts]
    by = [b / dev.bandwidth for _, _, b in parts]
    return {"floor": floor, "flops": sum(fl), "bytes": sum(by), "rounds": 0.0,
            "time": floor + sum(max(a, b) for a, b in zip(fl, by))}


def predict_step(dev: Device, launches: list[LaunchCost], dtype: str, graph: bool = True
                 ) -> dict[str, Any]:
    """The predicted step: `seconds` (the sum of its launches' times), the launches a step,
    `terms` (the floors, and each launch's work under the term that set it: they sum to
    `seconds`) and per profile category its seconds and launches."""
    cats: dict[str, dict[str, float]] = {}
    terms = dict.fromkeys(TERMS, 0.0)
    total = 0.0
    for r in launches:
        t = launch_time(dev, r, dtype, graph)
        terms["floor"] += r.count * t["floor"]
        work = t["time"] - t["floor"]            # the work term that binds takes the rest
        terms[max(TERMS[1:], key=lambda k: t[k])] += r.count * work
        c = cats.setdefault(r.category, {"seconds": 0.0, "launches": 0})
        c["seconds"] += r.count * t["time"]
        c["launches"] += r.count * r.split
        total += r.count * t["time"]
    return {"device": dev.key, "dtype": dtype, "graph": graph, "seconds": total,
            "launches": sum(r.count * r.split for r in launches), "terms": terms,
            "categories": dict(sorted(cats.items(), key=lambda kv: -kv[1]["seconds"]))}


def compute_dtype(spec: Any) -> str:
    """The dtype a spec's matmuls run in: bfloat16, tf32 (float32 with `allow_tf32`), float32."""
    dt = str(spec.train.dtype).removeprefix("torch.")
    return "tf32" if dt == "float32" and spec.compile.allow_tf32 else dt


def predict(compiled: Any, key: str, graph: bool = True) -> dict[str, Any]:
    """`predict_step` of a compiled spec's training step on device `key` (h100, h200)."""
    return predict_step(device(key), step_launches(compiled), compute_dtype(compiled.spec),
                        graph)


def prediction_table(p: dict[str, Any], measured: dict[str, float] | None = None) -> str:
    """`predict`'s result as a table: per category, predicted ms and launches (and measured
    ms beside it where `measured` has the category), then the total and its terms."""
    measured = measured or {}
    lines = [f"predicted step on {p['device']} ({p['dtype']}, "
             f"{'one CUDA graph' if p['graph'] else 'no CUDA graph'}): "
             f"{1e3 * p['seconds']:.3f} ms, {p['launches']:,} launches",
             f"{'category':<14} {'launches':>9} {'predicted ms':>13} {'measured ms':>12}"]
    for c, row in p["categories"].items():
        m = measured.get(c)
        lines.append(f"{c:<14} {row['launches']:>9,} {1e3 * row['seconds']:>13.3f} "
                     f"{'' if m is None else f'{m:.3f}':>12}")
    lines.append("terms: " + ", ".join(f"{k} {1e3 * v:.3f} ms"
                                         for k, v in p["terms"].items()))
    return "\n".join(lines)


def measured_categories(profile: dict[str, Any], measured_ms: float) -> dict[str, float]:
    """A profiled step's kernel time by category (benchmarks/gpu_profile.py's record: each
    kernel it lists by name, `category_of`; the rest as `rest`), scaled to the job's
    measured step (a profiled step runs without its CUDA graph, so only its shares count)."""
    total = profile["kernel_us_per_step"]
    out: dict[str, float] = {}
    for k in profile["top"]:
        c = category_of(k["kernel"])
        out[c] = out.get(c, 0.0) + k["us_per_step"]
    out["rest"] = total - sum(out.values())
    return {c: measured_ms * us / total for c, us in out.items()}


def category_of(name: str) -> str:
    """The profile category of a launched kernel's name (a group: its first member's)."""
    body = name.replace("titanc_group_of_", "titanc_")
    for f in FAMILIES.values():
        if f.category != "template" and body.startswith(f"titanc_{f.prefix}_") and not f.ops:
            return f.profile
    if body.startswith(f"titanc_{prefix('template')}_fused_"):
        rest = body.removeprefix(f"titanc_{prefix('template')}_fused_")
        ops = sorted(((op, e.family) for op, e in STRUCTURAL.items() if e.family),
                     key=lambda x: -len(x[0].name))
        for op, fam in ops:
            if rest.startswith(op.name.lower() + "_"):
                return FAMILIES[fam].profile
    return "other"
