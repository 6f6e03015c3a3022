"""The subprocesses of `runtime/targets/precompile.py`: the recording under Triton's
interpreter and the compile workers.

    python -m titanc.runtime.targets.precompile_worker --record PLANS.pickle OUT.json [--allow-tf32]
    python -m titanc.runtime.targets.precompile_worker --worker ARCH jit|aot

A worker reads one JSON launch a line on stdin and writes one JSON result a line on stdout:
`aot.compile_launch` ahead of time, or the kernel's own `JITFunction.warmup` on `standins`
(the GPU: Triton computes the cache key the real launch will and caches the kernel under it).
"""
from __future__ import annotations

import json
import pickle
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from titanc.codegen.render import load_module
from titanc.runtime.targets.aot import Launch, compile_launch, launch_constexprs, record_launches

__all__ = ["standins", "warm"]

_POINTEE = {"fp64": "float64", "fp32": "float32", "fp16": "float16", "bf16": "bfloat16",
            "i64": "int64", "i32": "int32", "i16": "int16", "i8": "int8", "u8": "uint8",
            "i1": "bool"}


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
    compiled kernel lands in its persistent cache under it. Then its launcher: Triton 3.6
    builds a C launcher per kernel signature with the host's C compiler at the kernel's first
    launch and caches it by its source (newer Tritons share one generic launcher, and this is
    cheap there); built here, the training process finds it cached."""
    import triton

    module = load_module(launch.source, launch.name, False)
    args, warps, stages = standins(launch, module, arch)
    kernel = getattr(module, launch.name).warmup(*args, grid=(1,), num_warps=warps,
                                                 num_stages=stages)
    if kernel is not None and hasattr(kernel, "src") and hasattr(kernel, "metadata"):
        triton.runtime.driver.active.launcher_cls(kernel.src, kernel.metadata)


def _record_main(argv: list[str]) -> int:
    """The recording subprocess: PLANS.pickle -> OUT.json (the plans' distinct launches,
    grids and aliases)."""
    src, out = Path(argv[0]), Path(argv[1])
    plans, float_dtype = pickle.loads(src.read_bytes())
    grids: dict[str, int] = {}
    aliases: dict[str, str] = {}
    launches: dict[str, Launch] = {}
    for plan in plans:
        for launch in record_launches(plan, float_dtype=float_dtype,
                                      allow_tf32="--allow-tf32" in argv, grids=grids,
                                      aliases=aliases):
            launches.setdefault(launch.key(), launch)
    out.write_text(json.dumps({"launches": [asdict(l) for l in launches.values()],
                               "grids": grids, "aliases": aliases}, default=str))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--record"]:
        sys.exit(_record_main(sys.argv[2:]))
    if sys.argv[1:2] == ["--worker"]:
        sys.exit(_worker_main(int(sys.argv[2]), sys.argv[3] == "jit"))
    sys.exit("usage: python -m titanc.runtime.targets.precompile_worker --record|--worker ...")
