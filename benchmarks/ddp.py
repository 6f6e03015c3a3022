"""Data-parallel throughput: tokens/s of the whole job on 1 and 2 ranks (gloo, CPU) and the
share of each rank's step time spent in communication.

    python benchmarks/ddp.py                       # examples/tiny.yaml, 3 warm-up + 6 steps
    python benchmarks/ddp.py --spec examples/tiny_attn.yaml --steps 10 --zero 1

Each rank is its own process with one intra-op thread (what a rank per core looks like), run
through the Trainer as `titanc train --nproc N` runs it. train.batch_size is per rank, so
2 ranks train a global batch twice as large per step; the row "1 rank, 2B" trains that same
global batch on one process for comparison. tokens/s counts the whole job's tokens per wall
second of rank 0's steps after warm-up; `comm` is the time rank 0 waited for collectives
(bucketed all-reduce or ZeRO-1 reduce/all-gather, the loss average) over its step time.
Prints a table, then the JSON.
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

ROOT = Path(__file__).resolve().parent.parent


def worker(result: str, spec_path: str, sets: dict, warmup: int, steps: int) -> None:
    """One rank: train warm-up steps, then time `steps` steps; rank 0 writes `result`."""
    import torch

    from titanc.runtime.train.distributed import init_from_env, shutdown
    from titanc.runtime.train.trainer import Trainer
    from titanc.model.spec import load_spec

    torch.set_num_threads(1)
    spec = load_spec(spec_path, {**sets, "train.steps": warmup + steps})
    dist = init_from_env(spec) if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None
    with tempfile.TemporaryDirectory() as out:
        t = Trainer(spec, out, progress=False, log=lambda _: None, dist=dist)
        t._metrics = None                                  # no run directory: steps only
        t._log_mark = (t.prog.step, time.perf_counter())   # what Trainer.run sets first
        for _ in range(warmup):
            t.step()
        t.times.clear()
        if t.reducer is not None:
            t.reducer.comm_seconds = 0.0
        t0 = time.perf_counter()
        for _ in range(steps):
            t.step()
        wall = time.perf_counter() - t0
    if dist is None or dist.is_main:
        comm = t.times.get("communication", 0.0)
        Path(result).write_text(json.dumps({
            "tokens_per_s": steps * t.tokens_per_step / wall, "step_s": wall / steps,
            "comm_s_per_step": comm / steps, "comm_share": comm / wall,
            "tokens_per_step": t.tokens_per_step}))
    if dist is not None:
        shutdown()


def run(nproc: int, spec: str, sets: dict, warmup: int, steps: int) -> dict:
    from titanc.runtime.train.launch import free_port

    with tempfile.TemporaryDirectory() as d:
        result = Path(d) / "result.json"
        env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(free_port()), WORLD_SIZE=str(nproc))
        if nproc == 1:
            env.pop("WORLD_SIZE")
        cmd = [sys.executable, __file__, "--worker", str(result), "--spec", spec,
               "--sets", json.dumps(sets), "--warmup", str(warmup), "--steps", str(steps)]
        procs = [subprocess.Popen(cmd, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)})
                 for r in range(nproc)]
        if any(p.wait() for p in procs):
            raise SystemExit(f"a rank failed: {[p.returncode for p in procs]}")
        return json.loads(result.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default=str(ROOT / "examples" / "tiny.yaml"))
    ap.add_argument("--batch", type=int, default=8, help="per-rank train.batch_size (B)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--zero", type=int, default=0, choices=(0, 1))
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--sets", default="{}", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a.worker, a.spec, json.loads(a.sets), a.warmup, a.steps)
        return
    base = {"compile.target": "cpu", "train.eval_every": 0, "train.checkpoint_every": 0,
            "train.zero": a.zero}
    rows = []
    for label, nproc, batch in (("1 rank, B", 1, a.batch), ("2 ranks, B each", 2, a.batch),
                                ("1 rank, 2B", 1, 2 * a.batch)):
        r = run(nproc, a.spec, {**base, "train.batch_size": batch}, a.warmup, a.steps)
        rows.append({"config": label, "ranks": nproc, "batch_per_rank": batch, **r})
    load = os.getloadavg()
    result = {"spec": os.path.relpath(a.spec, ROOT), "zero": a.zero, "steps": a.steps,
              "warmup": a.warmup, "cpu_count": os.cpu_count(),
              "load_average": [round(x, 2) for x in load], "runs": rows,
              "speedup_2_ranks": rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"]}
    print(f"{'config':<18} {'tokens/step':>11} {'s/step':>8} {'tokens/s':>9} {'comm/step':>10} "
          f"{'comm share':>10}")
    for r in rows:
        print(f"{r['config']:<18} {r['tokens_per_step']:>11} {r['step_s']:>8.3f} "
              f"{r['tokens_per_s']:>9.0f} {r['comm_s_per_step']:>9.3f}s "
              f"{100 * r['comm_share']:>9.1f}%")
    print(f"2 ranks vs 1: x{result['speedup_2_ranks']:.2f} tokens/s "
          f"(load average {load[0]:.2f} on {os.cpu_count()} cores)")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
