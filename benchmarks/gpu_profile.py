"""Where a GPU training step's time goes: kernels (their summed device time, by kernel) against
the step's wall time, with and without the step's CUDA graph.

    python3 benchmarks/gpu_profile.py [tiny_bf16 medium_bf16 ...]      # on a CUDA machine
    python3 benchmarks/gpu_check.py --script profile=benchmarks/gpu_profile.py   # as a job
    TRITON_INTERPRET=1 python3 benchmarks/gpu_profile.py --toy          # the code path, here

For each named job of `gpu_check.TITANC` (default tiny_bf16, medium_bf16 and large_bf16):
the program is compiled with `compile.cuda_graphs` off, stepped twice (compiles), then three
steps run under `torch.profiler` (large_125m, last so that its kernels are in the cache by then:
one step); the record gives per step the kernel launches, the kernels' summed device time, the
step's wall time without a graph, and the fifteen kernels with the most device time (name,
launches per step, µs per step), and each scan kernel's serial tile rounds with its µs per
round (`scans`). The measured steps hold the GPU check's lock (no other job's
timed loop meanwhile). A step whose wall time is far above its kernels' summed time is
launch-bound (what a CUDA graph and fewer kernels fix); one near it is kernel-bound (what
faster kernels fix). Records go to $GPU_CHECK_RESULTS when the GPU check
runs it, and are printed.
"""
from __future__ import annotations

import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402  (the sizes and the record format are the GPU check's)


def profile(name: str, toy: bool) -> dict[str, Any]:
    import torch
    import titanc
    from torch.profiler import ProfilerActivity, profile as torch_profile

    size, over = gpu_check.TITANC[name]
    extra = {**gpu_check.TOY_SIZES} if toy else {}
    spec = gpu_check.spec_of(size, {**over, **extra, "compile.target": "triton",
                                    "compile.cuda_graphs": False})
    prog = titanc.compile(spec)
    toks = gpu_check._tokens(prog.spec)
    cuda = torch.cuda.is_available() and not toy
    steps = 1 if size == "large" else 3         # large_125m's step takes seconds
    for _ in range(1 if size == "large" else 2):
        prog.advance(toks)
    gpu_check.sync()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with gpu_check.GpuLock():                   # not while another job times its loop
        t0 = time.perf_counter()
        for _ in range(steps):
            prog.advance(toks)
        gpu_check.sync()
        wall_us = 1e6 * (time.perf_counter() - t0) / steps
        with torch_profile(activities=acts) as prof:
            for _ in range(steps):
                prog.advance(toks)
            gpu_check.sync()
    per: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if cuda and getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA:
            row = per[e.name]
            row[0] += 1
            row[1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time
    launches = sum(r[0] for r in per.values()) / steps
    kernel_us = sum(r[1] for r in per.values()) / steps
    top = sorted(per.items(), key=lambda kv: -kv[1][1])[:15]
    return {"size": gpu_check.SIZE_NOTE.get(size, size), "dtype": str(prog.spec.train.dtype),
            "eager_wall_us_per_step": round(wall_us, 1),
            "kernels_per_step": round(launches, 1),
            "kernel_us_per_step": round(kernel_us, 1),
            "top": [{"kernel": k[:90], "per_step": round(v[0] / steps, 1),
                     "us_per_step": round(v[1] / steps, 1)} for k, v in top],
            "scans": scan_rounds(prog, per, steps)}


def scan_rounds(prog: Any, per: dict[str, list[float]], steps: int) -> list[dict[str, Any]]:
    """Each scan kernel of the training program that ran: its serial tile rounds an
    iteration (`codegen.scan.rounds.serial_rounds`), iterations, launches and µs per step,
    and µs per round (µs / (launches x iterations x rounds)): the figure that says whether
    a scan's time follows its rounds (docs/gpu_kernels.md, "Scan tiles")."""
    from titanc.runtime.targets.triton_executor import count_launches

    forms: list[dict] = []
    count_launches(prog.compiled.plans["training"], forms=forms)
    out = []
    for f in {f["scan"]: f for f in forms if f["form"] == "kernel"}.values():
        launches, us = per.get(f["scan"], (0, 0.0))
        if not launches:        # a kernel whose source another's module runs
            continue
        n = launches / steps
        out.append({"kernel": f["scan"], "grid": f["grid"], "rounds": f["rounds"],
                    "iterations": f["length"], "per_step": round(n, 1),
                    "us_per_step": round(us / steps, 1),
                    "us_per_round": round(us / steps / (n * f["length"] * f["rounds"]), 3)})
    return out


def main(argv: list[str]) -> int:
    toy = "--toy" in argv or bool(os.environ.get("GPU_CHECK_TOY"))
    names = [a for a in argv if not a.startswith("--")] or ["tiny_bf16", "medium_bf16",
                                                                 "large_bf16"]
    out = os.environ.get("GPU_CHECK_RESULTS")
    for name in names:
        job = f"profile_{name}"
        try:
            rec = {"job": job, "phase": "profile", "t": round(time.time(), 2),
                   **profile(name, toy)}
        except Exception as e:         # one size failing does not hide the others
            rec = {"job": job, "phase": "error", "error": f"{type(e).__name__}: {e}"[:600]}
        line = json.dumps(rec, default=str)
        print(line, flush=True)
        if out:
            with open(out, "a") as f:
                f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
