"""Compile budget, measured without a GPU: every kernel of every graph of each example, cold.

    python benchmarks/compile_time.py examples/tiny.yaml [examples/...] [--arch 90 80]
        [--jobs 2] [--set key=value ...] [--out benchmarks/results/compile_time.json]

For each spec, a fresh process runs `python -m titanc.tools.aot SPEC --arch ...` with an
empty `TITANC_CACHE_DIR` and `TRITON_CACHE_DIR` (cold: nothing cached), which records every
distinct launch of the training, optimizer and forward programs under the interpreter and
compiles each with Triton for the architectures (ptxas from the wheel, no driver). Per spec
and architecture: kernels, the sum and maximum of per-kernel compile seconds (CPU seconds of
the compiling process and its ptxas, `compile_cpu_s`: a shared machine's load stretches the
wall time, not this; on an idle core they are equal; the wall sum is kept too), the largest
register count, spill bytes and shared memory, and the kernels over the budgets (DESIGN.md
§7: > 10 s of compile, > 256 B spilled per thread). The JSON (every kernel's row too) goes
to `--out`; a table to stdout. `--jobs` compiles that many kernels at once: the sum is CPU
seconds of compile either way, the wall time shrinks. Quote the load average with it.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

COMPILE_BUDGET_S = 10.0       # per kernel
SPILL_BUDGET = 256            # bytes of spill stores per thread


def measure(spec: str, archs: list[int], jobs: int, sets: list[str]) -> dict[str, Any]:
    """Cold AOT compile of every kernel of `spec` (a subprocess with empty caches)."""
    with tempfile.TemporaryDirectory(prefix="titanc-cold-") as tmp:
        env = os.environ | {"TITANC_CACHE_DIR": str(Path(tmp) / "titanc"),
                            "TRITON_CACHE_DIR": str(Path(tmp) / "triton"),
                            "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "titanc.tools.aot", spec, "--jobs", str(jobs),
               "--arch", *map(str, archs)] + [a for s in sets for a in ("--set", s)]
        t0 = time.perf_counter()
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    if not rows:
        raise SystemExit(f"{spec}: no kernel compiled (exit {r.returncode}):\n"
                         f"{r.stderr[-2000:]}")
    out: dict[str, Any] = {"spec": spec, "set": sets, "wall_s": round(wall, 1), "jobs": jobs,
                           "load_average": os.getloadavg(), "archs": {}, "kernels": rows}
    for arch in archs:
        rs = [x for x in rows if x["arch"] == arch]
        ok = [x for x in rs if x["ok"]]
        out["archs"][str(arch)] = {
            "kernels": len(rs), "failed": len(rs) - len(ok),
            "compile_cpu_s_sum": round(sum(x["compile_cpu_s"] for x in ok), 1),
            "compile_cpu_s_max": max((x["compile_cpu_s"] for x in ok), default=0.0),
            "compile_wall_s_sum": round(sum(x["compile_s"] for x in ok), 1),
            "slowest": max(ok, key=lambda x: x["compile_cpu_s"])["name"] if ok else "",
            "registers_max": max((x["registers"] or 0 for x in ok), default=0),
            "spill_bytes_max": max((x["spill_bytes"] for x in ok), default=0),
            "shared_max": max((x["shared"] for x in ok), default=0),
            "over_10s": sorted(x["name"] for x in ok if x["compile_cpu_s"] > COMPILE_BUDGET_S),
            "spilling_over_256": sorted(x["name"] for x in ok
                                        if x["spill_bytes"] > SPILL_BUDGET),
            "scan_kernels": sum(x["scan"] for x in rs)}
    return out


def table(results: list[dict[str, Any]]) -> str:
    head = ("spec", "arch", "kernels", "scan", "sum CPU s", "max CPU s", "regs", "spill B",
            "shared B", ">10 s", ">256 B")
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for res in results:
        for arch, a in res["archs"].items():
            lines.append(" | ".join(str(v) for v in (
                Path(res["spec"]).name, f"sm_{arch}", a["kernels"], a["scan_kernels"],
                a["compile_cpu_s_sum"], a["compile_cpu_s_max"], a["registers_max"],
                a["spill_bytes_max"], a["shared_max"], len(a["over_10s"]),
                len(a["spilling_over_256"]))))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/compile_time.py")
    ap.add_argument("specs", nargs="+")
    ap.add_argument("--arch", type=int, nargs="+", default=[90, 80])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--set", action="append", default=[], help="spec override key=value")
    ap.add_argument("--out", default="benchmarks/results/compile_time.json")
    args = ap.parse_args(argv)
    results = []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for spec in args.specs:                # the JSON after each spec: a cut-off run keeps some
        res = measure(spec, args.arch, args.jobs, args.set)
        results.append(res)
        print(json.dumps({k: v for k, v in res.items() if k != "kernels"}), flush=True)
        out.write_text(json.dumps(results, indent=1) + "\n")
    print(table(results))
    over = [(Path(r["spec"]).name, arch) for r in results for arch, a in r["archs"].items()
            if a["over_10s"] or a["spilling_over_256"] or a["failed"]]
    print(f"over budget: {over or 'none'}; load average {os.getloadavg()}")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
