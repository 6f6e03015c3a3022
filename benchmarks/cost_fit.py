"""Fit the cost model's constants (`titanc.tools.cost_model.FIT`) to the measured GPU calls and
print the error per call: JSON, then a table.

    python benchmarks/cost_fit.py              # the stored constants: error per measured call
    python benchmarks/cost_fit.py --fit        # fit them again, print the new FIT and errors
    python benchmarks/cost_fit.py --fit --only tiny,medium     # without large_125m (fast)

The measured calls are `benchmarks/results/gpu_check_<device>*.json` (each {device, measures,
calls: [one `benchmarks/gpu_check.py` results.json per call]}). Every titanc throughput job of
a call is an anchor: its job's spec and environment (`gpu_check.TITANC`, `JOB_ENV`) are
compiled here, on the CPU, into today's lowered program, and `cost_model.predict_step` gives
its step. A call taken on an older tree whose program differs is re-predicted where an
environment setting gives its program back (`TREE_ENV`: large_125m's H200 call and the medium
size's `remat: none` calls ran their memory scans as scan kernels, `TITANC_SCAN_COST=0`
today), and where a spec default changed since the call, its setting then is compiled
(`SPEC_THEN`: the calls before 2026-11-29 ran the memory's chunk groups, MAC wrote its
memory with rmsnorm(ỹ), a scan stacked a value saved for two users twice, and views were
not copied into their readers); an anchor whose
launches a step differ from the call's is printed but not fitted
(`fitted: false`, the reason in `note`). Rows a call measured while another job held the GPU
are left out (`CONTENDED`).

The fit: every constant of `FIT` but `floor_eager_us` is shared by the devices (they differ in
their datasheet's peaks and bandwidth), found by coordinate descent (multiplicative steps in a
fixed order, so a fit is reproducible) on `loss`: the fitted anchors' largest and summed
squared relative errors, and the profiled categories' (large_125m's scans, matmuls, ...).
`floor_eager_us` (a launch outside a CUDA graph) is the smallest eager wall time per kernel
of the calls' profiled steps (`benchmarks/gpu_profile.py`: kernel-light steps are bound by the
executor's host path). Per category, where a call has a profile of the job (`profile_<job>`),
the measured time of each category is its share of the profile's kernel time (the fifteen
kernels it lists by name; the rest as `rest`) times the job's measured step.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("TRITON_INTERPRET", "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402  (the jobs' specs and environments)

from titanc import config  # noqa: E402
from titanc.tools import cost_model as cm  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
FILES = {"gpu_check_h100.json": "h100", "gpu_check_h200.json": "h200",
         "gpu_check_h200_large_125m.json": "h200"}
# rows measured while large_125m's warm-up steps held the GPU (2x the warm calls')
CONTENDED = {"gpu_check_h200_large_125m.json": "every job but large_bf16"}
# the environment that gives a call's program back on today's tree
_SCAN_KERNELS = {"TITANC_SCAN_COST": "0",
                 "why": "that call's tree ran the memory scans as scan kernels; today's cost "
                        "rule makes them host loops"}
TREE_ENV = {("gpu_check_h200_large_125m.json", "large_bf16"): _SCAN_KERNELS,
            ("gpu_check_h100.json", "medium_bf16_remat_none"): _SCAN_KERNELS,
            ("gpu_check_h200.json", "medium_bf16_remat_none"): _SCAN_KERNELS}
# spec defaults that changed since a call: (calls dated before, the blocks it applies to or
# None for all, the settings then, why)
SPEC_THEN = [("2026-11-29", None, {"compile.chunk_groups": True},
              "the memory's chunk groups were the default then"),
             ("2026-11-29", ("mac",), {"model.memory.mac_write": "attention_norm"},
              "MAC wrote its memory with rmsnorm(ỹ) then"),
             ("2026-11-29", None, {"compile.stack_once": False},
              "a scan stacked a value it saves for two users once per user then"),
             ("2026-11-29", None, {"compile.views_per_reader": False},
              "a kernel wrote a view of a stored value for readers in other kernels then")]
# environment variable -> (config field, whether the value turns it on)
ENV_FIELD = {"TITANC_SPLIT_K": ("split_k", lambda v: v == "1"),
             "TITANC_GPU_BLOCKS": ("gpu_blocks", lambda v: v != "0"),
             "TITANC_SCAN_COST": ("scan_cost", lambda v: v != "0"),
             "TITANC_SCAN_KERNELS": ("scan_kernels", lambda v: v != "0"),
             "TITANC_GROUP_LAUNCHES": ("group_launches", lambda v: v != "0")}
_PROGRAMS: dict[str, tuple[str, list[cm.LaunchCost]]] = {}
_COMPILED: dict[str, object] = {}


def anchors(only: set[str] | None = None) -> list[dict[str, Any]]:
    """Every measured titanc job of the stored calls, with its device and environment."""
    out = []
    for fname, dev in FILES.items():
        data = json.loads((RESULTS / fname).read_text())
        for i, call in enumerate(data["calls"]):
            for job, rec in sorted(call["jobs"].items()):
                if job not in gpu_check.TITANC or "ms_median" not in rec:
                    continue
                if fname in CONTENDED and (fname, job) not in TREE_ENV:
                    continue
                size = gpu_check.TITANC[job][0]
                if only and size not in only:
                    continue
                over = gpu_check.TITANC[job][1]
                block = gpu_check.spec_of(size, over).model.block
                then = {k: v for until, blocks, sets, _ in SPEC_THEN
                        if str(call.get("date", "")) < until and block in (blocks or (block,))
                        for k, v in sets.items() if k not in over}
                env = {**gpu_check.JOB_ENV.get(job, {}),
                       **{k: v for k, v in TREE_ENV.get((fname, job), {}).items()
                          if k.startswith("TITANC_")}}
                out.append({"file": fname, "call": i, "date": call.get("date"), "device": dev,
                            "job": job, "env": env, "then": then,
                            "measured_ms": rec["ms_median"],
                            "launches_then": rec.get("launches_per_step"),
                            "tree": TREE_ENV.get((fname, job), {}).get("why", ""),
                            "profile": call["jobs"].get(f"profile_{job}")})
    return out


def program(job: str, env: dict[str, str], then: dict[str, Any] | None = None
            ) -> tuple[str, list[cm.LaunchCost]]:
    """(compute dtype, launches) of a job's step on today's tree, compiled once per job and
    setting (`then`: spec settings of the call's tree, `SPEC_THEN`)."""
    size, over = gpu_check.TITANC[job]
    over = {**(then or {}), **over}
    key = json.dumps([size, sorted(over.items()), sorted(env.items())])
    if key not in _PROGRAMS:
        from titanc.compiler import compile_graphs
        spec_key = json.dumps([size, sorted(over.items())])
        if spec_key not in _COMPILED:
            _COMPILED[spec_key] = compile_graphs(gpu_check.spec_of(
                size, {**over, "compile.target": "triton"}))
        c = _COMPILED[spec_key]
        fields = {ENV_FIELD[k][0]: ENV_FIELD[k][1](v) for k, v in env.items()}
        with config.override(**fields):
            _PROGRAMS[key] = (cm.compute_dtype(c.spec), cm.step_launches(c))
    return _PROGRAMS[key]


def evaluate(rows: list[dict[str, Any]], fit: dict[str, Any]) -> list[dict[str, Any]]:
    """Each anchor with its prediction under `fit`: ms, error, launches now, fitted or not."""
    out = []
    for a in rows:
        dtype, launches = program(a["job"], a["env"], a.get("then"))
        p = cm.predict_step(cm.device(a["device"], fit), launches, dtype)
        now = p["launches"]
        same = a["launches_then"] in (None, now)
        note = a["tree"] or ("" if same else f"today's program launches {now:,} a step, the "
                             f"call's {a['launches_then']:,}: not fitted")
        out.append({k: a[k] for k in ("file", "call", "date", "device", "job", "env", "then",
                                      "measured_ms", "launches_then")}
                   | {"launches_now": now, "predicted_ms": round(1e3 * p["seconds"], 4),
                      "error": round(1e3 * p["seconds"] / a["measured_ms"] - 1, 4),
                      "fitted": same, "note": note,
                      "categories": categories(p, a["profile"], a["measured_ms"])})
    return out


def categories(p: dict[str, Any], profile: dict[str, Any] | None, measured_ms: float
               ) -> dict[str, dict[str, float | None]]:
    """Per profile category: predicted ms and, with a profile of the job, measured ms."""
    measured = cm.measured_categories(profile, measured_ms) if profile else {}
    names = list(p["categories"]) + [c for c in measured if c not in p["categories"]]
    return {c: {"predicted_ms": round(1e3 * p["categories"].get(c, {}).get("seconds", 0.0), 4),
                "measured_ms": None if c not in measured else round(measured[c], 4)}
            for c in names}


def loss(rows: list[dict[str, Any]], fit: dict[str, Any]) -> float:
    """The fit's objective over the fitted anchors: 50 times the largest squared relative
    error (every call within the band counts, not the average), plus the sum of them, plus
    a quarter of each profiled category's squared log error (a category of at least 2% of
    its step: its share pins the rates)."""
    errs, cats = [], []
    for r in evaluate(rows, fit):
        if not r["fitted"]:
            continue
        errs.append(r["error"] ** 2)
        for c, v in r["categories"].items():
            m = v["measured_ms"]
            if c != "rest" and m and m >= 0.02 * r["measured_ms"] and v["predicted_ms"] > 0:
                cats.append(math.log(v["predicted_ms"] / m) ** 2)
    return 50 * max(errs, default=0.0) + sum(errs) + 0.25 * sum(cats)


PARAMS = ("floor_graph_us", "bandwidth_share", "efficiency.tensor", "efficiency.cuda",
          "round_us", "round_gflops")
BOUNDS = {"bandwidth_share": (0.05, 0.95), "efficiency": (0.01, 0.9)}
STEPS = (0.5, 0.7, 0.85, 0.95, 0.98, 0.995, 1.005, 1.02, 1.05, 1.18, 1.4, 2.0)


def _get(fit: dict[str, Any], p: str) -> float:
    a, _, b = p.partition(".")
    return fit[a][b] if b else fit[a]


def _set(fit: dict[str, Any], p: str, v: float) -> dict[str, Any]:
    a, _, b = p.partition(".")
    lo, hi = BOUNDS.get(a, (1e-3, 1e6))
    v = round(min(hi, max(lo, v)), 4)
    return {**fit, a: {**fit[a], b: v}} if b else {**fit, a: v}


def fit_constants(rows: list[dict[str, Any]], start: dict[str, Any]) -> dict[str, Any]:
    """Coordinate descent from `start` (module docstring)."""
    best, best_loss = start, loss(rows, start)
    for _ in range(20):
        moved = False
        for p in PARAMS:
            for s in STEPS:
                trial = _set(best, p, _get(best, p) * s)
                trial_loss = loss(rows, trial)
                if trial_loss < best_loss - 1e-9:
                    best, best_loss, moved = trial, trial_loss, True
        if not moved:
            break
    profiles = [rec for fname in FILES for call in json.loads((RESULTS / fname).read_text())[
        "calls"] for job, rec in call["jobs"].items() if job.startswith("profile_")]
    if profiles:
        best = {**best, "floor_eager_us": round(min(
            p["eager_wall_us_per_step"] / p["kernels_per_step"] for p in profiles), 1)}
    return best


def table(result: dict[str, Any]) -> str:
    lines = [f"{'call':<36} {'job':<26} {'launches':>15} {'measured':>9} {'predicted':>9} "
             f"{'error':>7}  note"]
    for r in result["calls"]:
        call = f"{r['file']}#{r['call']} ({(r['date'] or '')[:10]})"
        launches = f"{r['launches_then'] or '?'}/{r['launches_now']}"
        lines.append(f"{call:<36} {r['job']:<26} {launches:>15} {r['measured_ms']:>9.2f} "
                     f"{r['predicted_ms']:>9.2f} {100 * r['error']:>6.1f}%  "
                     f"{'' if r['fitted'] else '(not fitted) '}{r['note']}")
    lines.append("launches: the call's / today's program; ms a step")
    for r in result["calls"]:
        cats = {c: v for c, v in r["categories"].items() if v["measured_ms"] is not None}
        if not cats:
            continue
        lines.append(f"\n{r['file']}#{r['call']} {r['job']}: per category (measured: the "
                     f"profile's shares of the measured step)")
        for c, v in r["categories"].items():
            m = v["measured_ms"]
            lines.append(f"  {c:<14} predicted {v['predicted_ms']:>10.3f} ms   measured "
                         f"{'-' if m is None else f'{m:.3f}':>10} ms")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fit", action="store_true", help="fit the constants again")
    ap.add_argument("--only", default="", help="sizes to use (tiny,medium,large)")
    args = ap.parse_args(argv)
    rows = anchors(set(args.only.split(",")) if args.only else None)
    fit = fit_constants(rows, cm.FIT) if args.fit else cm.FIT
    result = {"fit": fit, "calls": evaluate(rows, fit),
              "max_abs_error_fitted": None}
    errs = [abs(r["error"]) for r in result["calls"] if r["fitted"]]
    result["max_abs_error_fitted"] = round(max(errs), 4) if errs else None
    print(json.dumps(result, indent=1))
    print()
    print(table(result))


if __name__ == "__main__":
    main()
