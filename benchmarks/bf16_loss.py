"""bfloat16 mixed precision against float32: the loss curve and the activation arena.

    .venv/bin/python benchmarks/bf16_loss.py                   # examples/tiny.yaml, 200 steps
    .venv/bin/python benchmarks/bf16_loss.py --steps 20        # a quick look

Trains the same spec twice on the cpu target (same seed, same batches), `train.dtype:
float32` and `bfloat16`, and compares the training loss at the end (mean of the last 10
steps, and the last evaluation) and the activation arena of each compiled graph
(`plan.arena_bytes`, what report.json calls `graphs.<kind>.arena_bytes`). The target:
the bf16 loss within 3% of float32's at the end. Prints JSON and writes it to
benchmarks/results/bf16_loss.json (unless --no-save).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from titanc.compiler import compile_graphs  # noqa: E402
from titanc.runtime.train.trainer import read_metrics, run_training  # noqa: E402
from titanc.model.spec import load_spec  # noqa: E402


def arena(spec_path: str, dtype: str) -> dict[str, int]:
    c = compile_graphs(load_spec(spec_path, {"train.dtype": dtype}), verify_each=False)
    return {k: p.arena_bytes for k, p in c.plans.items()}


def train(spec_path: str, dtype: str, steps: int, out: Path) -> dict:
    spec = load_spec(spec_path, {"train.dtype": dtype, "train.steps": steps,
                                 "compile.target": "cpu", "train.checkpoint_every": 0})
    t0 = time.perf_counter()
    summary = run_training(spec, out, progress=False, log=lambda _: None)
    losses = [r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    tail = losses[-10:]
    return {"seconds": round(time.perf_counter() - t0, 1), "final_loss": losses[-1],
            "last10_mean": sum(tail) / len(tail), "eval_loss": summary.get("eval_loss"),
            "losses": losses}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--spec", default=str(ROOT / "examples" / "tiny.yaml"))
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args()
    import torch
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    res: dict = {"spec": os.path.relpath(args.spec, ROOT), "steps": args.steps,
                 "load_average": os.getloadavg()}
    with tempfile.TemporaryDirectory() as tmp:
        for dt in ("float32", "bfloat16"):
            res[dt] = train(args.spec, dt, args.steps, Path(tmp) / dt)
            res[dt]["arena_bytes"] = arena(args.spec, dt)
    f32, bf = res["float32"], res["bfloat16"]
    res["last10_rel_diff"] = abs(bf["last10_mean"] - f32["last10_mean"]) / f32["last10_mean"]
    if f32["eval_loss"] and bf["eval_loss"]:
        res["eval_rel_diff"] = abs(bf["eval_loss"] - f32["eval_loss"]) / f32["eval_loss"]
    res["arena_ratio"] = {k: bf["arena_bytes"][k] / f32["arena_bytes"][k]
                          for k in f32["arena_bytes"] if f32["arena_bytes"][k]}   # optimizer: 0
    text = json.dumps(res, indent=1)
    if not args.no_save:
        (ROOT / "benchmarks" / "results" / "bf16_loss.json").write_text(text + "\n")
    short = {k: v for k, v in res.items() if k not in ("float32", "bfloat16")}
    for dt in ("float32", "bfloat16"):
        short[dt] = {k: v for k, v in res[dt].items() if k != "losses"}
    print(json.dumps(short, indent=1))


if __name__ == "__main__":
    main()
