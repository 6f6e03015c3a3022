"""Host overhead of a training step on the triton target, measured without a GPU.

    TRITON_INTERPRET=1 .venv/bin/python benchmarks/host_overhead.py          # tiny.yaml
    TRITON_INTERPRET=1 .venv/bin/python benchmarks/host_overhead.py --seq 128,512,2048 --steps 200

The triton target's host path runs for real (`Program.advance`: token check, micro-batch
loop, executors, scalar updates) with every kernel launch *recorded instead of executed*: Triton's
`InterpretedFunction.run` is replaced by a counter, as `runtime/targets/aot.py`'s `record_launches`
replaces it, so what is timed is titanc's own Python per step and per launch, up to the call
into Triton. Two modes:

  graphs     the step as it runs on CUDA with compile.cuda_graphs: after the first step the
             whole optimizer step is one captured graph, so a step's host work is the token
             check and copy, the replay call and the bookkeeping (the replay is recorded, not
             executed: `cudaGraphLaunch` itself, a few µs, is not included)
  launches   every kernel launched from Python, one call per launch (what CUDA without graphs
             pays, before Triton's own launcher: `JITFunction.run` adds its argument binding
             and cache lookup per launch, not included)

Prints JSON (per seq_len: µs per step in each mode, launches per step, µs per launch) then a
table, with the load average. One torch thread.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TRITON_INTERPRET", "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import titanc  # noqa: E402


class _Replay:
    """Stands for a captured CUDA graph: `replay()` is recorded, not run."""

    def __init__(self) -> None:
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1


def _recording() -> tuple[Any, list[int]]:
    """Replace Triton's interpreted kernel call by a counter; returns (restore, count)."""
    from triton.runtime.interpreter import InterpretedFunction

    saved = InterpretedFunction.run
    count = [0]

    def record(self: Any, *args: Any, **kwargs: Any) -> None:
        count[0] += 1

    InterpretedFunction.run = record

    def restore() -> None:
        InterpretedFunction.run = saved
    return restore, count


def _time(fn: Any, steps: int, rounds: int = 5) -> tuple[float, float]:
    """Median over rounds of the mean seconds per call: wall time and this process's CPU
    time (what a shared machine's load inflates less)."""
    wall, cpu = [], []
    for _ in range(rounds):
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(steps):
            fn()
        wall.append((time.perf_counter() - t0) / steps)
        cpu.append((time.process_time() - c0) / steps)
    return statistics.median(wall), statistics.median(cpu)


def measure(spec: str, seq: int | None, steps: int) -> dict[str, Any]:
    over: dict[str, Any] = {"compile.target": "triton"}
    if seq:
        over["model.seq_len"] = seq
    prog = titanc.compile(ROOT / "examples" / spec, **over)
    s = prog.spec
    toks = torch.randint(0, s.model.vocab_size, (s.train.grad_accum * s.train.batch_size,
                                                 s.model.seq_len + 1),
                         generator=torch.Generator().manual_seed(0))
    restore, count = _recording()
    try:
        prog.advance(toks)                          # binds every executor (renders, loads)
        count[0] = 0
        prog.advance(toks)
        launches = count[0]
        launches_s, launches_cpu = _time(lambda: prog.advance(toks), max(1, steps // 10))
        prog.stepper.graph = graph = _Replay()      # as after the capture on CUDA
        graphs_s, graphs_cpu = _time(lambda: prog.advance(toks), steps)
        assert graph.replays > 0 and count[0] == launches * (1 + 5 * max(1, steps // 10))
    finally:
        restore()
    return {"spec": spec, "seq_len": s.model.seq_len, "batch": s.train.batch_size,
            "grad_accum": s.train.grad_accum, "launches_per_step": launches,
            "us_per_step_graphs": round(1e6 * graphs_s, 1),
            "cpu_us_per_step_graphs": round(1e6 * graphs_cpu, 1),
            "us_per_step_launches": round(1e6 * launches_s, 1),
            "us_per_launch": round(1e6 * launches_s / max(launches, 1), 2),
            "cpu_us_per_launch": round(1e6 * launches_cpu / max(launches, 1), 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", default="tiny.yaml")
    ap.add_argument("--seq", default="128,512",
                    help="comma-separated seq_len values (empty: the spec's)")
    ap.add_argument("--steps", type=int, default=200, help="steps per round in graphs mode")
    args = ap.parse_args()
    torch.set_num_threads(1)
    load0 = os.getloadavg()
    rows = [measure(args.spec, int(q) if q else None, args.steps)
            for q in (args.seq.split(",") if args.seq else [""])]
    print(json.dumps({"rows": rows, "loadavg_before": load0, "loadavg_after": os.getloadavg(),
                      "threads": torch.get_num_threads()}))
    print(f"\n{'spec':14s} {'seq':>5s} {'launches':>9s} {'µs/step graphs (cpu)':>21s} "
          f"{'µs/step launches':>17s} {'µs/launch (cpu)':>16s}")
    for r in rows:
        print(f"{r['spec']:14s} {r['seq_len']:5d} {r['launches_per_step']:9d} "
              f"{r['us_per_step_graphs']:12.1f} ({r['cpu_us_per_step_graphs']:6.1f}) "
              f"{r['us_per_step_launches']:17.1f} {r['us_per_launch']:8.2f} "
              f"({r['cpu_us_per_launch']:6.2f})")


if __name__ == "__main__":
    main()
