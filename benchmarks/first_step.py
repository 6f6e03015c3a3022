"""Time to the first training step: `titanc train SPEC`, cold (empty kernel caches), then warm.

    python benchmarks/first_step.py [examples/tiny.yaml] [--set key=value ...] [--runs cold warm]
        [--timeout 600] [--out benchmarks/results/first_step.json]

Each run is a fresh `titanc train SPEC --steps 1` process with `TITANC_CACHE_DIR` and
`TRITON_CACHE_DIR` pointing into one temporary directory: the first run starts from empty
caches (cold: every kernel compiles, in parallel before the step on CUDA, `runtime.targets.precompile`),
the second keeps them (warm: nothing compiles). The time is from the process start to the
moment the first step's record lands in the run's metrics.jsonl (written and flushed right
after the step), read by polling; the process is then stopped (its evaluation and plots are
not timed). Prints one JSON object: per run the seconds to the first step, the loss, the
process's exit status, its output stamped with the seconds since the start (`timeline`: where
the time went), and the kernels Triton compiled in the training process itself rather than
in the precompile's pool (`compiled_in_process`, their seconds: a second run should have none). It runs the spec's
`compile.target` (`auto`: the cpu target without CUDA); on a machine without CUDA the triton
target runs under Triton's interpreter with `TRITON_INTERPRET=1` and `--set
compile.target=triton` (pass toy sizes with --set): the same code path, without the
precompile.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any


# `titanc train` with every compile Triton does in the training process itself (not in the
# precompile's workers) timed and printed: what the precompile missed shows up here
_TRACED = """
import os, runpy, sys, time
import triton.compiler as tc
try:
    import triton.compiler.compiler as tcc
except ImportError:
    tcc = None
_compile = tc.compile

def _timed(src, *a, **k):
    t0 = time.perf_counter()
    out = _compile(src, *a, **k)
    dt = time.perf_counter() - t0
    if dt > 0.2:
        name = getattr(getattr(src, "fn", None), "__name__", type(src).__name__)
        print(f"[first_step] compiled in the training process: {name} {dt:.1f} s",
              file=sys.stderr, flush=True)
    return out

import triton.runtime.jit as tj
for mod in (tc, tcc, tj):       # wherever this Triton's JIT takes `compile` from
    if mod is not None and hasattr(mod, "compile"):
        mod.compile = _timed
sys.argv = ["titanc"] + sys.argv[1:]
profile_to = os.environ.get("FIRST_STEP_PROFILE")
if profile_to:
    import cProfile
    prof = cProfile.Profile()
    prof.enable()
try:
    runpy.run_module("titanc", run_name="__main__", alter_sys=True)
finally:
    if profile_to:
        prof.disable()
        prof.dump_stats(profile_to)
"""


def first_step(spec: str, sets: list[str], caches: Path, out: Path, timeout: float,
               profile: bool = False) -> dict[str, Any]:
    """Seconds from starting `titanc train` to its first step's metrics record, and the
    process's output lines stamped with the seconds since its start (`timeline`); with
    `profile`, the run under cProfile and its 40 most expensive calls (cumulative, `profile`;
    the profiler's overhead inflates the seconds)."""
    env = os.environ | {"TITANC_CACHE_DIR": str(caches / "titanc"),
                        "TRITON_CACHE_DIR": str(caches / "triton")}
    stats = out.parent / f"{out.name}.pstats"
    if profile:
        env["FIRST_STEP_PROFILE"] = str(stats)
    cmd = [sys.executable, "-c", _TRACED, "train", str(Path(spec).resolve()), "--steps", "1",
           "--out", str(out)] + [a for s in sets for a in ("--set", s)]
    metrics = out / "metrics.jsonl"
    timeline: list[tuple[float, str]] = []
    t0 = time.perf_counter()
    # cwd outside the checkout: `python -c` puts its cwd first on sys.path, and the
    # checkout's titanc/ folder is not the package (package-dir maps ir/, runtime/... in)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            cwd=out.parent)

    def read() -> None:              # every line (and progress-bar update) with its time
        assert proc.stdout is not None
        buf = b""
        while chunk := proc.stdout.read1(4096):
            buf += chunk
            *done, buf = re.split(rb"[\r\n]", buf)
            stamp = round(time.perf_counter() - t0, 2)
            timeline.extend((stamp, x.decode(errors="replace").strip()) for x in done
                            if x.strip())
        if buf.strip():
            timeline.append((round(time.perf_counter() - t0, 2), buf.decode(errors="replace")))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
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
    reader.join(timeout=5)
    # a progress bar's updates: its first and last state only
    kept: list[tuple[float, str]] = []
    for stamp, line in timeline:
        if kept and "%|" in line and "%|" in kept[-1][1] and \
                line.split(":")[0] == kept[-1][1].split(":")[0] and len(kept) > 1 and \
                "%|" in kept[-2][1] and line.split(":")[0] == kept[-2][1].split(":")[0]:
            kept[-1] = (stamp, line)
        else:
            kept.append((stamp, line))
    traced = [line for _, line in timeline if line.startswith("[first_step]")]
    top: list[str] = []
    if profile and stats.exists():
        import io
        import pstats
        text = io.StringIO()
        pstats.Stats(str(stats), stream=text).sort_stats("cumulative").print_stats(40)
        top = [ln.rstrip()[:200] for ln in text.getvalue().splitlines() if ln.strip()][-42:]
    return {"seconds_to_first_step": None if seconds is None else round(seconds, 2),
            "loss": None if record is None else record["loss"], "exit": rc,
            "compiled_in_process": len(traced),
            "compiled_in_process_s": round(sum(float(x.split()[-2]) for x in traced), 1),
            "timeline": [f"{stamp:7.2f} {line[:160]}" for stamp, line in kept[:80]],
            **({"profile": top} if profile else {})}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/first_step.py")
    ap.add_argument("spec", nargs="?", default="examples/tiny.yaml")
    ap.add_argument("--set", action="append", default=[], help="spec override key=value")
    ap.add_argument("--runs", nargs="+", default=["cold", "warm"],
                    help="runs in order, each cold (empty caches), warm (the caches the runs "
                         "before left) or warm-profile (warm, under cProfile)")
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
            if run == "cold":
                shutil.rmtree(caches, ignore_errors=True)
            elif not caches.exists():
                # a warm run needs the caches a run before it filled, and they live only as
                # long as this invocation: fill them first, untimed (on the H100 a lone
                # `--runs warm` was a cold run by another name)
                result["priming"] = first_step(args.spec, sets, caches, Path(tmp) / "prime",
                                               args.timeout)
            result[run] = first_step(args.spec, sets, caches, Path(tmp) / f"run{k}",
                                     args.timeout, profile=run == "warm-profile")
            print(json.dumps({run: result[run]}), file=sys.stderr, flush=True)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0 if all(result[r]["seconds_to_first_step"] is not None for r in args.runs) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
