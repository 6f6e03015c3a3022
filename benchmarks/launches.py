"""Kernel launches per training step on the triton target: with and without scan kernels and
launch groups.

    python benchmarks/launches.py examples/tiny.yaml examples/tiny_lmm.yaml [--set k=v ...]

Counted from the compiled plans (`runtime.targets.triton_executor.count_launches`, the same figure
`TritonExecutor.launches_per_run()` reports after binding): the training graph (forward +
backward) plus the optimizer. A scan that runs as a host loop counts its body's launches once
per iteration; the scans that still do are listed with the reason. `launch_groups` is the triton
target's default: scan kernels, and each wave of independent pointwise / reduction / matmul
launches one launch (`codegen/horizontal.py`); `split_k` the same with split-K on
(`TITANC_SPLIT_K=1`: a split matmul is two launches). `scan_rounds` lists each scan kernel of
the training graph: its grid (programs) and its serial tile rounds an iteration
(`codegen.scan.rounds.serial_rounds`: what one program's chunk loop waits on). `--grids`
adds `grids`: the programs of each distinct pointwise / reduction / cumsum launch of the
training graph (alone, or a launch group of them: its members' together) with the
interpreter's blocks and with the blocks a CUDA launch takes (`codegen.meta.cuda_flat_block`,
`cuda_row_block`; recorded under the interpreter, `runtime.targets.aot.fresh_kernel_modules`),
and how many run fewer programs than a quarter of an H100's SMs; and `flops`: the share of
the step's FLOPs in launches of fewer than 132 programs with CUDA blocks (the budget of
docs/gpu_kernels.md: a kernel with a real share of the FLOPs fills the chip). `--predict
DEVICE` (h100, h200) adds `predicted`: the cost model's training step on that GPU from the
same lowered program (`titanc.tools.cost_model.predict`, docs/cost_model.md): ms a step, the
launches and ms per profile category. Prints JSON, then the tables.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

from titanc import config  # noqa: E402
from titanc.compiler import compile_graphs  # noqa: E402
from titanc.runtime.targets.triton_executor import count_launches  # noqa: E402
from titanc.model.spec import load_spec, parse_set_args  # noqa: E402


def launches(path: str, overrides: dict[str, object], grids: bool = False,
             predict: str | None = None) -> dict[str, object]:
    c = compile_graphs(load_spec(path, overrides))
    row: dict[str, object] = {"spec": path}
    for mode, scans, groups in (("host_loops", False, False), ("scan_kernels", True, False),
                                ("launch_groups", True, True)):
        fallbacks: list[dict[str, str]] = []
        row[mode] = sum(count_launches(c.plans[g], scan_kernels=scans, fallbacks=fallbacks,
                                       groups=groups)
                        for g in ("training", "optimizer"))
        if scans and not groups:
            row["fallbacks"] = sorted({f"{f['scan']}: {f['reason']}" for f in fallbacks})
    with config.override(split_k=True):       # TITANC_SPLIT_K=1 (off by default)
        row["split_k"] = sum(count_launches(c.plans[g], groups=True)
                             for g in ("training", "optimizer"))
    forms: list[dict] = []
    count_launches(c.plans["training"], forms=forms)
    row["scan_rounds"] = list({f["scan"]: {k: f[k] for k in ("scan", "role", "grid", "rounds")}
                                for f in forms if f["form"] == "kernel"}.values())
    if grids:
        row["grids"] = program_grids(c)
    if predict:
        from titanc.tools.cost_model import predict as predict_step
        p = predict_step(c, predict)
        row["predicted"] = {"device": predict, "dtype": p["dtype"],
                            "ms": round(1e3 * p["seconds"], 4), "launches": p["launches"],
                            "categories": {k: {"ms": round(1e3 * v["seconds"], 4),
                                               "launches": v["launches"]}
                                           for k, v in p["categories"].items()},
                            "bound_by_ms": {k: round(1e3 * v, 4) for k, v in p["terms"].items()}}
    return row


QUARTER_SMS = 33          # a quarter of an H100's 132 SMs


def flops_by_grid(c, grids: dict[str, int], aliases: dict[str, str]) -> dict[str, object]:
    """The share of the training step's modeled FLOPs in launches of fewer programs than an
    H100 has SMs, CUDA blocks (`titanc.tools.cost_model.grid_shares`, as report.json
    `occupancy` without the AOT compile), and the kernels of more than 1% among them."""
    from titanc.tools.cost_model import SMS, grid_shares

    rows = grid_shares(c, grids, aliases)
    return {"under_sms_share": round(sum(r["flops_share"] for r in rows
                                         if (r["programs"] or 0) < SMS), 4),
            "under_sms_kernels": {r["name"]: [r["programs"], r["flops_share"]]
                                  for r in rows if "why_under" in r}}


def program_grids(c) -> dict[str, object]:
    """Programs per distinct non-scan launch of the training graph, interpreter vs CUDA
    blocks (module docstring)."""
    from statistics import median

    from titanc.runtime.targets.aot import fresh_kernel_modules, record_launches

    out: dict[str, object] = {}
    for mode, cuda in (("interpreter", False), ("cuda", True)):
        grids: dict[str, int] = {}
        aliases: dict[str, str] = {}
        with fresh_kernel_modules(cuda_blocks=cuda):
            launches = record_launches(c.plans["training"], grids=grids, aliases=aliases)
        programs = sorted(grids[l.name] for l in {l.name: l for l in launches}.values()
                          if not l.name.startswith("titanc_tem_") and not l.uses_dot)
        out[mode] = {"kernels": len(programs), "median_programs": median(programs),
                     "under_quarter": sum(p < QUARTER_SMS for p in programs),
                     "programs": programs}
        if cuda:
            out["flops"] = flops_by_grid(c, grids, aliases)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("specs", nargs="+")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--grids", action="store_true",
                    help="programs per launch, interpreter vs CUDA blocks (records a step)")
    ap.add_argument("--predict", choices=("h100", "h200"), default=None, metavar="DEVICE",
                    help="the cost model's step on DEVICE (h100, h200) beside the launches")
    args = ap.parse_args(argv)
    overrides = parse_set_args(args.set)
    rows = [launches(p, overrides, args.grids, args.predict) for p in args.specs]
    print(json.dumps(rows, indent=1))
    print(f"\n{'spec':32} {'host loops':>10} {'scan kernels':>12} {'+ launch groups':>15} "
          f"{'+ split-K':>10}")
    for r in rows:
        print(f"{r['spec']:32} {r['host_loops']:>10} {r['scan_kernels']:>12} "
              f"{r['launch_groups']:>15} {r['split_k']:>10}")
    print(f"\n{'spec':32} {'scan kernel (training graph)':48} {'programs':>8} "
          f"{'rounds/iteration':>16}")
    for r in rows:
        for k in r["scan_rounds"]:
            print(f"{r['spec']:32} {k['scan']:48} {k['grid']:>8} {k['rounds']:>16}")
    if args.grids:
        print(f"\n{'spec':32} {'blocks':12} {'kernels':>8} {'median programs':>16} "
              f"{'under ' + str(QUARTER_SMS) + ' programs':>19}")
        for r in rows:
            for mode in ("interpreter", "cuda"):
                g = r["grids"][mode]
                print(f"{r['spec']:32} {mode:12} {g['kernels']:>8} {g['median_programs']:>16} "
                      f"{g['under_quarter']:>19}")
        print(f"\n{'spec':32} {'FLOPs in launches under 132 programs':>36} "
              f"{'kernels over 1% of them':>24}")
        for r in rows:
            f = r["grids"]["flops"]
            print(f"{r['spec']:32} {100 * f['under_sms_share']:>35.1f}% "
                  f"{len(f['under_sms_kernels']):>24}")
    if args.predict:
        print(f"\n{'spec':32} {'predicted on ' + args.predict:>16} {'launches':>9}  "
              f"ms per category")
        for r in rows:
            p = r["predicted"]
            cats = "; ".join(f"{k} {v['ms']:.3f}" for k, v in p["categories"].items())
            print(f"{r['spec']:32} {p['ms']:>13.3f} ms {p['launches']:>9}  {cats}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
