"""Compile every kernel of a program before its first launch, in parallel, into the caches.

Triton compiles a kernel at its first launch, one after another in the launching process:
tiny.yaml's first training step on an H100 waited minutes for it. `precompile(plan)` instead

1. records the plan's distinct launches (`codegen.aot.record_launches`) in a subprocess under
   Triton's interpreter (a process picks compile or interpreter mode once; nothing runs);
2. compiles them in a process pool (`jobs`, default one per CPU core) with a progress bar
   (`compiling 84 kernels for sm_90`), each worker one kernel at a time:
   - `jit=True` (on the GPU, before the first step): the worker calls the kernel's own
     `JITFunction.warmup` with stand-ins that specialise as the recorded arguments did
     (pointer dtypes and 16-byte alignment, integer widths and divisibility, the constexpr
     values the CUDA launcher passes), so Triton computes the very cache key the launch will
     and writes the compiled kernel into its persistent cache (`TRITON_CACHE_DIR`); the first
     launch then loads it;
   - `jit=False` (ahead of time, no GPU needed): `codegen.aot.compile_launch` for the
     architecture (ptxas from the wheel), which also reports registers, spills and shared
     memory (report.json `occupancy`);
3. writes a marker keyed by the plan, the architecture, the Triton version and titanc's
   code generator, so a second run records and compiles nothing.

A kernel that fails to precompile is left to its first launch (and named); the program runs
the same either way. `TITANC_PRECOMPILE=0` turns it off.

    python -m titanc.codegen.precompile --record PLAN.pickle OUT.json [--allow-tf32]
    python -m titanc.codegen.precompile --worker ARCH jit|aot

are the recording subprocess and a compile worker (internal).
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from titanc.codegen.aot import Launch, compile_launch, record_launches
from titanc.codegen.render import cache_dir, load_module

__all__ = ["precompile", "precompile_for_device", "recorded_launches"]

_HERE = Path(__file__).resolve().parent

# torch dtype of each pointer type a recorded signature names
_POINTEE = {"fp64": "float64", "fp32": "float32", "fp16": "float16", "bf16": "bfloat16",
            "i64": "int64", "i32": "int32", "i16": "int16", "i8": "int8", "u8": "uint8",
            "i1": "bool"}


def _code_hash() -> str:
    """A hash of the code that renders kernels (codegen/ and the ops' Triton lowerings)."""
    h = hashlib.sha256()
    for root in (_HERE, _HERE.parent / "ir"):
        for f in sorted(root.rglob("*")):
            if f.suffix in (".py", ".jinja"):
                h.update(f.read_bytes())
    return h.hexdigest()[:16]


def recorded_launches(plan: Any, allow_tf32: bool = False, float_dtype: Any = None
                      ) -> tuple[list[Launch], dict[str, Any]]:
    """The distinct launches of one run of `plan`, and {"grids": each kernel's largest grid
    (programs), "aliases": each schedule kernel -> the kernel whose module it launches},
    recorded in a subprocess under Triton's interpreter (this process may have Triton in
    compile mode)."""
    with tempfile.TemporaryDirectory(prefix="titanc-record-") as tmp:
        src, out = Path(tmp) / "plan.pickle", Path(tmp) / "launches.json"
        src.write_bytes(pickle.dumps((plan, float_dtype)))
        env = os.environ | {"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
        cmd = [sys.executable, "-m", "titanc.codegen.precompile", "--record", str(src),
               str(out)] + (["--allow-tf32"] if allow_tf32 else [])
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"recording the launches failed: {r.stderr[-1500:]}")
        data = json.loads(out.read_text())
    return [Launch.from_dict(d) for d in data["launches"]], {k: data[k] for k in ("grids", "aliases")}


def _marker(plan: Any, arch: int, allow_tf32: bool, jit: bool) -> Path:
    import triton

    key = hashlib.sha256(pickle.dumps(plan) + f"{arch}|{allow_tf32}|{jit}|{triton.__version__}|"
                         f"{_code_hash()}".encode()).hexdigest()[:24]
    return cache_dir() / "precompiled" / f"{key}.json"


def precompile(plan: Any, arch: int, *, allow_tf32: bool = False, float_dtype: Any = None,
               jit: bool = True, jobs: int | None = None, progress: bool = True
               ) -> dict[str, Any]:
    """Compile every kernel `plan` launches for sm_`arch` (module docstring); returns
    {"kernels", "compiled", "failed": [{"name", "error"}], "seconds", "cached", "grids",
    "aliases", "results"} (`results`: `compile_launch`'s rows when `jit` is False)."""
    marker = _marker(plan, arch, allow_tf32, jit)
    if marker.exists():
        return json.loads(marker.read_text()) | {"cached": True}
    t0 = time.perf_counter()
    launches, shape = recorded_launches(plan, allow_tf32, float_dtype)
    results = _pool(launches, arch, jit, jobs or os.cpu_count() or 1, progress)
    failed = [{"name": r["name"], "error": r["error"]} for r in results if not r["ok"]]
    summary = {"kernels": len(launches), "compiled": len(launches) - len(failed),
               "failed": failed, "seconds": round(time.perf_counter() - t0, 1),
               "arch": arch, **shape, "results": [] if jit else results}
    if not failed:
        marker.parent.mkdir(parents=True, exist_ok=True)
        tmp = marker.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(summary))
        os.replace(tmp, marker)
    return summary | {"cached": False}


def precompile_for_device(plan: Any, allow_tf32: bool = False, float_dtype: Any = None
                          ) -> None:
    """`precompile(plan)` for this process's CUDA device, through the JIT (the triton
    target's hook, before it binds a plan); `TITANC_PRECOMPILE=0` skips it. Kernels that
    fail are named and left to their first launch."""
    import torch

    if os.environ.get("TITANC_PRECOMPILE", "1") == "0":
        return
    major, minor = torch.cuda.get_device_capability()
    try:
        s = precompile(plan, 10 * major + minor, allow_tf32=allow_tf32,
                       float_dtype=float_dtype, jit=True)
    except RuntimeError as e:          # recording failed: every kernel compiles at launch
        print(f"titanc: precompile skipped ({e})", file=sys.stderr)
        return
    if s["failed"]:
        print(f"titanc: {len(s['failed'])} of {s['kernels']} kernels left to their first "
              f"launch: " + "; ".join(f"{f['name']}: {f['error'][:200]}"
                                      for f in s["failed"][:3]), file=sys.stderr)


def _pool(launches: list[Launch], arch: int, jit: bool, jobs: int, progress: bool
          ) -> list[dict[str, Any]]:
    """Compile `launches` in `jobs` worker processes (`python -m titanc.codegen.precompile
    --worker`, without the interpreter: subprocesses, not multiprocessing, so a user's
    script is never re-imported), fed one kernel at a time by a thread each."""
    import queue
    import threading

    from tqdm import tqdm

    todo: "queue.Queue[Launch]" = queue.Queue()
    for launch in launches:
        todo.put(launch)
    results: list[dict[str, Any]] = []
    lock = threading.Lock()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    bar = tqdm(total=len(launches), desc=f"compiling {len(launches)} kernels for sm_{arch}",
               disable=not progress, file=sys.stderr)

    def serve() -> None:
        worker = subprocess.Popen([sys.executable, "-m", "titanc.codegen.precompile",
                                   "--worker", str(arch), "jit" if jit else "aot"],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                  env=env)
        assert worker.stdin is not None and worker.stdout is not None
        try:
            while True:
                try:
                    launch = todo.get_nowait()
                except queue.Empty:
                    return
                worker.stdin.write(json.dumps(asdict(launch), default=str) + "\n")
                worker.stdin.flush()
                line = worker.stdout.readline()
                r = json.loads(line) if line else {"name": launch.name, "ok": False,
                                                   "error": "the worker process died"}
                with lock:
                    results.append(r)
                    bar.update(1)
                if not line:
                    return
        finally:
            worker.stdin.close()
            worker.wait()

    threads = [threading.Thread(target=serve) for _ in range(max(1, min(jobs, len(launches))))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    bar.close()
    return results


def _worker_main(arch: int, jit: bool) -> int:
    """A compile worker: one JSON launch a line on stdin, one JSON result a line on stdout."""
    out = sys.stdout
    sys.stdout = sys.stderr             # Triton's own prints stay off the protocol
    for line in sys.stdin:
        r = _compile_one((json.loads(line), arch, jit))
        out.write(json.dumps(r) + "\n")
        out.flush()
    return 0


def _compile_one(item: tuple[dict[str, Any], int, bool]) -> dict[str, Any]:
    data, arch, jit = item
    launch = Launch.from_dict(data)
    if not jit:
        return compile_launch(launch, arch)
    t0 = time.perf_counter()
    try:
        warm(launch, arch)
    except Exception as e:   # left to its first launch, and named
        return {"name": launch.name, "ok": False, "error": f"{type(e).__name__}: {str(e)[-400:]}"}
    return {"name": launch.name, "ok": True, "compile_s": round(time.perf_counter() - t0, 2)}


def launch_constexprs(launch: Launch, module: Any, arch: int) -> tuple[dict[str, Any], int, int]:
    """The constexprs, num_warps and num_stages the CUDA launcher passes for `launch` (recorded
    off CUDA): the matmul family's tile of the architecture (`tiles_for`), and the 16-bit MMA
    (`DOT_F32` off)."""
    constexprs, warps, stages = dict(launch.constexprs), launch.num_warps, launch.num_stages
    if hasattr(module, "tiles_for"):
        bm, bn, bk, warps, stages = module.tiles_for(arch)
        constexprs |= {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}
    if "DOT_F32" in constexprs:
        constexprs["DOT_F32"] = False
    return constexprs, warps, stages


def _pointer(dtype: Any, aligned: bool) -> Any:
    """A stand-in tensor argument: Triton's `MockTensor` whose address is 16-byte aligned or
    not, as the recorded argument's was."""
    from triton.runtime.jit import MockTensor

    class Pointer(MockTensor):
        def data_ptr(self) -> int:             # type: ignore[override]
            return 256 if aligned else 260

    return Pointer(dtype)


def standins(launch: Launch, module: Any, arch: int) -> tuple[list[Any], int, int]:
    """Arguments that specialise as `launch`'s recorded ones did (pointer dtypes and 16-byte
    alignment, integer widths and divisibility, the constexprs the CUDA launcher passes), and
    its num_warps and num_stages."""
    import torch

    constexprs, warps, stages = launch_constexprs(launch, module, arch)
    divisible = set(launch.divisible)
    args: list[Any] = []
    for name, ty in launch.signature:
        if ty == "constexpr":
            value = constexprs[name]
        elif ty.startswith("*"):
            value = _pointer(getattr(torch, _POINTEE[ty[1:].removeprefix("k")]),
                             name in divisible)
        elif ty in ("i32", "i64", "u64"):
            base = {"i32": 16, "i64": 1 << 36, "u64": 1 << 63}[ty]
            value = base if name in divisible else base + 3
        elif ty == "i1":
            value = True
        elif ty.startswith("fp"):
            value = 1.5
        else:
            raise ValueError(f"argument {name}: no stand-in for type {ty}")
        args.append(value)
    return args, warps, stages


def warm(launch: Launch, arch: int) -> None:
    """Compile `launch` through its kernel's own `JITFunction.warmup` (a process with a CUDA
    driver), on `standins`: Triton computes the cache key the real launch will, and the
    compiled kernel lands in its persistent cache under it."""
    module = load_module(launch.source, launch.name, False)
    args, warps, stages = standins(launch, module, arch)
    getattr(module, launch.name).warmup(*args, grid=(1,), num_warps=warps, num_stages=stages)


def _record_main(argv: list[str]) -> int:
    """The recording subprocess: PLAN.pickle -> OUT.json (launches and grids)."""
    src, out = Path(argv[0]), Path(argv[1])
    plan, float_dtype = pickle.loads(src.read_bytes())
    grids: dict[str, int] = {}
    aliases: dict[str, str] = {}
    launches = record_launches(plan, float_dtype=float_dtype,
                               allow_tf32="--allow-tf32" in argv, grids=grids, aliases=aliases)
    out.write_text(json.dumps({"launches": [asdict(l) for l in launches], "grids": grids,
                               "aliases": aliases}, default=str))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--record"]:
        sys.exit(_record_main(sys.argv[2:]))
    if sys.argv[1:2] == ["--worker"]:
        sys.exit(_worker_main(int(sys.argv[2]), sys.argv[3] == "jit"))
    sys.exit("usage: python -m titanc.codegen.precompile --record PLAN.pickle OUT.json")
