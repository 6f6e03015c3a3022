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
register count, spill bytes and shared memory, and the kernels over the budgets
(docs/gpu_kernels.md: > 10 s of compile, > 256 B spilled per thread). The JSON (every kernel's row too) goes
to `--out`; a table to stdout. `--jobs` compiles that many kernels at once: the sum is CPU
seconds of compile either way, the wall time shrinks. Quote the load average with it.
Each result carries the date it was measured and replaces the entry of the same spec and
`--set` in an existing `--out` (the others stay): benchmarks/results/compile_time.json holds
the latest result of each example (and large_125m in bf16) that docs/gpu_kernels.md quotes.

CPU seconds are not comparable across hosts: the same tree measured 80.1 s for tiny.yaml on
one day's machine and 38-44 s on the next day's (docs/gpu_kernels.md). Each result therefore
carries `host_reference_cpu_s`, the mean CPU seconds of eleven cold compiles of one fixed
kernel (REFERENCE_KERNEL, a float32 matmul tile loop with a fused epilogue) on the same host
at the same time, and `sum_in_reference_units` = the sum divided by it: a figure that follows
the code, not the host.
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


REFERENCE_KERNEL = """
import triton
import triton.language as tl


@triton.jit
def NAME(a_ptr, b_ptr, c_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
         BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        a = tl.load(a_ptr + rm[:, None] * K + (k + rk)[None, :],
                    mask=(rm[:, None] < M) & ((k + rk)[None, :] < K), other=0.0)
        b = tl.load(b_ptr + (k + rk)[:, None] * N + rn[None, :],
                    mask=((k + rk)[:, None] < K) & (rn[None, :] < N), other=0.0)
        acc += tl.dot(a, b, input_precision="ieee")
    acc = acc * tl.sigmoid(acc)
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))
"""


def host_reference(arch: int, repeats: int = 12) -> float:
    """Mean CPU seconds of `repeats` cold compiles of REFERENCE_KERNEL for sm_`arch` (each
    under its own name, so no cache answers; the first, which pays the process's imports, left
    out), in a fresh process with empty caches."""
    from titanc.runtime.targets.aot import Launch, compile_all

    launches = []
    for i in range(repeats):
        name = f"titanc_host_reference_{i:02d}"   # one length: compiled in order
        launches.append(Launch(
            name, REFERENCE_KERNEL.replace("NAME", name),
            (("a_ptr", "*fp32"), ("b_ptr", "*fp32"), ("c_ptr", "*fp32"), ("M", "i32"),
             ("N", "i32"), ("K", "i32"), ("BLOCK_M", "constexpr"), ("BLOCK_N", "constexpr"),
             ("BLOCK_K", "constexpr")),
            (("BLOCK_M", 32), ("BLOCK_N", 64), ("BLOCK_K", 16)),
            ("a_ptr", "b_ptr", "c_ptr", "M", "N", "K"), 8, 1))
    with tempfile.TemporaryDirectory(prefix="titanc-ref-") as tmp:
        saved = {k: os.environ.get(k) for k in ("TITANC_CACHE_DIR", "TRITON_CACHE_DIR")}
        os.environ |= {"TITANC_CACHE_DIR": str(Path(tmp) / "titanc"),
                       "TRITON_CACHE_DIR": str(Path(tmp) / "triton")}
        try:
            rows = compile_all(launches, [arch], jobs=1)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    bad = [r["error"] for r in rows if not r["ok"]]
    if bad:
        raise SystemExit(f"the reference kernel did not compile: {bad[0]}")
    rest = [r["compile_cpu_s"] for r in rows[1:]]
    return round(sum(rest) / len(rest), 3)


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
    out: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "spec": spec, "set": sets,
                           "wall_s": round(wall, 1), "jobs": jobs,
                           "load_average": os.getloadavg(), "archs": {}, "kernels": rows}
    ref = host_reference(max(archs))
    out["host_reference_cpu_s"] = ref
    for arch in archs:
        rs = [x for x in rows if x["arch"] == arch]
        ok = [x for x in rs if x["ok"]]
        out["archs"][str(arch)] = {
            "kernels": len(rs), "failed": len(rs) - len(ok),
            "compile_cpu_s_sum": round(sum(x["compile_cpu_s"] for x in ok), 1),
            "compile_cpu_s_max": max((x["compile_cpu_s"] for x in ok), default=0.0),
            "sum_in_reference_units": round(sum(x["compile_cpu_s"] for x in ok) / ref, 1),
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
            "shared B", ">10 s", ">256 B", "host ref CPU s", "sum / ref")
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for res in results:
        for arch, a in res["archs"].items():
            lines.append(" | ".join(str(v) for v in (
                Path(res["spec"]).name, f"sm_{arch}", a["kernels"], a["scan_kernels"],
                a["compile_cpu_s_sum"], a["compile_cpu_s_max"], a["registers_max"],
                a["spill_bytes_max"], a["shared_max"], len(a["over_10s"]),
                len(a["spilling_over_256"]), res["host_reference_cpu_s"],
                a["sum_in_reference_units"])))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/compile_time.py")
    ap.add_argument("specs", nargs="+")
    ap.add_argument("--arch", type=int, nargs="+", default=[90, 80])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--set", action="append", default=[], help="spec override key=value")
    ap.add_argument("--out", default="benchmarks/results/compile_time.json")
    args = ap.parse_args(argv)
    results: list[dict[str, Any]] = []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # an existing --out keeps its other entries: each result replaces the one of its spec and
    # --set (the latest measurement of each, dated), so the file stays one entry per measurement
    earlier = json.loads(out.read_text()) if out.is_file() else []
    for spec in args.specs:                # the JSON after each spec: a cut-off run keeps some
        res = measure(spec, args.arch, args.jobs, args.set)
        results.append(res)
        print(json.dumps({k: v for k, v in res.items() if k != "kernels"}), flush=True)
        mine = {(r["spec"], tuple(r["set"])) for r in results}
        kept = [e for e in earlier if (e["spec"], tuple(e["set"])) not in mine or e.get("variant")]
        out.write_text(json.dumps(kept + results, indent=1) + "\n")
    print(table(results))
    over = [(Path(r["spec"]).name, arch) for r in results for arch, a in r["archs"].items()
            if a["over_10s"] or a["spilling_over_256"] or a["failed"]]
    print(f"over budget: {over or 'none'}; load average {os.getloadavg()}")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
