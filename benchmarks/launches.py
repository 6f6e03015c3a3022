"""Kernel launches per training step on the triton target: with and without scan kernels and
launch groups.

    python benchmarks/launches.py examples/tiny.yaml examples/tiny_lmm.yaml [--set k=v ...]

Counted from the compiled plans (`runtime.triton_executor.count_launches`, the same figure
`TritonExecutor.launches_per_run()` reports after binding): the training graph (forward +
backward) plus the optimizer. A scan that runs as a host loop counts its body's launches once
per iteration; the scans that still do are listed with the reason. `launch_groups` is the triton
target's default: scan kernels, and each wave of independent pointwise / reduction / matmul
launches one launch (`codegen/horizontal.py`); `split_k` the same with split-K on
(`TITANC_SPLIT_K=1`: a split matmul is two launches). `scan_rounds` lists each scan kernel of
the training graph: its grid (programs) and its serial tile rounds an iteration
(`codegen.scan.kernel.serial_rounds`: what one program's chunk loop waits on). Prints JSON,
then two tables.
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


def launches(path: str, overrides: dict[str, object]) -> dict[str, object]:
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
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("specs", nargs="+")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args(argv)
    overrides = parse_set_args(args.set)
    rows = [launches(p, overrides) for p in args.specs]
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
    sys.stdout.flush()


if __name__ == "__main__":
    main()
