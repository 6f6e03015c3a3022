"""Time to the first training step: `titanc train SPEC`, cold (empty kernel caches), then warm.

    python benchmarks/first_step.py [examples/tiny.yaml] [--set key=value ...] [--runs cold warm]
        [--timeout 600] [--out benchmarks/results/first_step.json]

Each run is a fresh `titanc train SPEC --steps 1` process with `TITANC_CACHE_DIR` and
`TRITON_CACHE_DIR` pointing into one temporary directory: the first run starts from empty
caches (cold: every kernel compiles, in parallel before the step on CUDA, `runtime.targets.precompile`),
the second keeps them (warm: nothing compiles). The time is from the process start to the
moment the first step's record lands in the run's metrics.jsonl (written and flushed right
after the step), read by polling; the process is then stopped (its evaluation and plots are
not timed). Prints one JSON object:
per run the seconds to the first step, the loss, the process's exit status and the lines it
printed about compiling (the precompile progress bar's last state). On a machine without CUDA
it runs the triton target under Triton's interpreter (`compile.target: triton`; pass toy
sizes with --set): the same code path, without the precompile.
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


def first_step(spec: str, sets: list[str], caches: Path, out: Path, timeout: float
               ) -> dict[str, Any]:
    """Seconds from starting `titanc train` to its first step's metrics record."""
    env = os.environ | {"TITANC_CACHE_DIR": str(caches / "titanc"),
                        "TRITON_CACHE_DIR": str(caches / "triton")}
    cmd = [sys.executable, "-m", "titanc", "train", spec, "--steps", "1",
           "--out", str(out)] + [a for s in sets for a in ("--set", s)]
    metrics = out / "metrics.jsonl"
    log = out.parent / f"{out.name}.log"
    t0 = time.perf_counter()
    with open(log, "w") as sink:
        proc = subprocess.Popen(cmd, env=env, stdout=sink, stderr=subprocess.STDOUT)
        seconds, record = None, None
        while time.perf_counter() - t0 < timeout:
            if metrics.exists():
                lines = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
                steps = [x for x in lines if x.get("step") == 1 and "loss" in x]
                if steps:
                    seconds, record = time.perf_counter() - t0, steps[0]
                    break
            if proc.poll() is not None:
                break
            time.sleep(0.05)
        if seconds is not None:          # the rest of the run (evaluation, plots) is not timed
            proc.terminate()
        try:
            rc = proc.wait(timeout=max(10.0, timeout - (time.perf_counter() - t0)))
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
    text = log.read_text(errors="replace")
    compiling = [ln.strip() for ln in text.replace("\r", "\n").splitlines()
                 if "compiling" in ln or "precompile" in ln]
    return {"seconds_to_first_step": None if seconds is None else round(seconds, 2),
            "loss": None if record is None else record["loss"], "exit": rc,
            "compile_lines": compiling[-2:],
            "log_tail": text[-600:] if seconds is None else ""}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/first_step.py")
    ap.add_argument("spec", nargs="?", default="examples/tiny.yaml")
    ap.add_argument("--set", action="append", default=[], help="spec override key=value")
    ap.add_argument("--runs", nargs="+", default=["cold", "warm"])
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    import torch

    cuda = torch.cuda.is_available()
    sets = args.set
    result: dict[str, Any] = {"spec": args.spec, "set": sets, "cuda": cuda,
                              "device": torch.cuda.get_device_name() if cuda else "cpu",
                              "load_average": os.getloadavg()}
    with tempfile.TemporaryDirectory(prefix="titanc-first-step-") as tmp:
        caches = Path(tmp) / "caches"
        for k, run in enumerate(args.runs):
            result[run] = first_step(args.spec, sets, caches, Path(tmp) / f"run{k}",
                                     args.timeout)
            print(json.dumps({run: result[run]}), file=sys.stderr, flush=True)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0 if all(result[r]["seconds_to_first_step"] is not None for r in args.runs) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
