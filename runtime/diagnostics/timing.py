"""Profiler-style summaries of training steps (`titanc bench`, `titanc train --profile`).

    sp = StepProfiler()                             # sums profiler.profiling() per step
    for _ in range(steps):
        with sp.step():
            prog.train_step(tokens)
    print(profile_table(sp, sp.steps, tokens=sp.steps * tokens_per_step, seconds=sp.wall,
                        peak_bytes=peak_rss_bytes(), flops_per_step=step_flops(prog.compiled),
                        model_flops_per_step=prog.compiled.model_flops()))

The summary gives exclusive time per kernel category (pointwise, reduction, matmul,
attention, memory update, optimizer, other; "outside kernels" is the wall time no kernel
accounts for: host glue between graphs), tokens/s, achieved FLOP/s, MFU (the model's FLOPs:
forward and backward, nothing recomputed) and HFU (the FLOPs the kernels execute, what
`train.remat` recomputes included) where the device's peak is known (the NVIDIA H100/H200 datasheet peaks below; CPUs have no reliable
peak, so MFU is "n/a"), and peak memory (process RSS, or CUDA's allocator peak, plus the
planned arena + persistent bytes). Category times are host wall time around each kernel's
ops: exact on the CPU executor; a CUDA executor must synchronise per kernel while profiling
for them to mean GPU time.
"""
from __future__ import annotations

import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from titanc.ir.kernel_family import PROFILE_LABELS
from titanc.runtime.targets.profiler import profiling

__all__ = ["profile_summary", "profile_table", "format_summary", "peak_flops", "device_name",
           "peak_rss_bytes", "StepProfiler", "PEAK_TFLOPS", "format_bytes", "format_count"]

# Dense (no sparsity) peaks in TFLOP/s from NVIDIA's datasheets, per GPU. float32 is the
# CUDA-core rate; "tf32" the tensor-core rate used when torch allows TF32 matmuls; float64 the
# FP64 tensor-core rate. Matched against torch.cuda.get_device_name(), most specific first.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H200 NVL": {"float64": 60.0, "float32": 60.0, "tf32": 417.5, "bfloat16": 835.5,
                 "float16": 835.5},
    "H200": {"float64": 67.0, "float32": 67.0, "tf32": 494.5, "bfloat16": 989.5,
             "float16": 989.5},
    "H100 NVL": {"float64": 60.0, "float32": 60.0, "tf32": 417.5, "bfloat16": 835.5,
                 "float16": 835.5},
    "H100 PCIe": {"float64": 51.0, "float32": 51.0, "tf32": 378.0, "bfloat16": 756.0,
                  "float16": 756.0},
    "H100": {"float64": 67.0, "float32": 67.0, "tf32": 494.5, "bfloat16": 989.5,
             "float16": 989.5},                  # SXM5 (and GH200's GPU)
}


def device_name(target: str = "cpu") -> str:
    """Where a program of `target` runs: the CUDA device name for triton with CUDA, else 'cpu'."""
    import torch

    if target == "triton" and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return "cpu"


def peak_flops(device: str, dtype: str = "float32") -> float | None:
    """The device's dense peak in FLOP/s for `dtype`, or None when unknown (every CPU)."""
    if device == "cpu":
        return None
    key = dtype.removeprefix("torch.")
    if key == "float32":
        import torch
        if torch.backends.cuda.matmul.allow_tf32:
            key = "tf32"
    for name, peaks in PEAK_TFLOPS.items():
        if name.replace(" ", "").lower() in device.replace(" ", "").lower():
            tflops = peaks.get(key)
            return None if tflops is None else tflops * 1e12
    return None


def peak_rss_bytes() -> int:
    """The process's peak resident set size in bytes (0 where `resource` is missing)."""
    try:
        import resource
    except ImportError:
        return 0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


class StepProfiler:
    """Kernel-category time summed over chosen steps only (a trainer's evals stay out):

        sp = StepProfiler()
        with sp.step():
            prog.train_step(tokens)
        print(profile_table(sp, sp.steps, sp.steps * tokens_per_step, sp.wall, peak_rss_bytes()))
    """

    def __init__(self) -> None:
        self.seconds = {c: 0.0 for c in PROFILE_LABELS}
        self.calls = {c: 0 for c in PROFILE_LABELS}
        self.steps = 0
        self.wall = 0.0

    @contextmanager
    def step(self) -> Iterator[None]:
        with profiling() as prof:
            t0 = time.perf_counter()
            yield
            self.wall += time.perf_counter() - t0
        for c in PROFILE_LABELS:
            self.seconds[c] += prof.seconds[c]
            self.calls[c] += prof.calls[c]
        self.steps += 1


def _seconds_calls(prof: Any) -> tuple[dict[str, float], dict[str, int]]:
    if isinstance(prof, Mapping):
        return {c: float(prof.get(c, 0.0)) for c in PROFILE_LABELS}, {}
    seconds = {c: float(prof.seconds.get(c, 0.0)) for c in PROFILE_LABELS}
    calls = {c: int(getattr(prof, "calls", {}).get(c, 0)) for c in PROFILE_LABELS}
    return seconds, calls


def profile_summary(prof: Any, steps: int, tokens: int, seconds: float, peak_bytes: int, *,
                    flops_per_step: float | None = None,
                    model_flops_per_step: float | None = None, device: str = "cpu",
                    dtype: str = "float32", planned_bytes: int | None = None,
                    threads: int | None = None) -> dict[str, Any]:
    """The profile as a dict (what `--json` prints). `prof` is a `Profiler` (or a mapping
    category -> seconds), `tokens` the tokens processed in all `steps`, `seconds` their wall
    time, `peak_bytes` the peak memory to report (RSS or CUDA allocator peak).
    `flops_per_step` is what the kernels execute (`titanc.tools.bench.step_flops`: HFU),
    `model_flops_per_step` the model's (`Compiled.model_flops`: MFU)."""
    secs, calls = _seconds_calls(prof)
    inside = sum(secs.values())
    categories = {c: {"seconds": secs[c], "share": secs[c] / seconds if seconds > 0 else 0.0,
                      "calls_per_step": calls.get(c, 0) / max(steps, 1)}
                  for c in PROFILE_LABELS}
    outside = max(0.0, seconds - inside)
    def per_s(flops: float | None) -> float | None:
        return flops * steps / seconds if flops and seconds > 0 else None

    achieved, model = per_s(flops_per_step), per_s(model_flops_per_step)
    peak = peak_flops(device, dtype)
    return {
        "steps": steps, "tokens": tokens, "seconds": seconds,
        "seconds_per_step": seconds / max(steps, 1),
        "tokens_per_s": tokens / seconds if seconds > 0 else None,
        "categories": categories,
        "outside_kernels_seconds": outside,
        "flops_per_step": flops_per_step, "achieved_flops_per_s": achieved,
        "model_flops_per_step": model_flops_per_step, "model_flops_per_s": model,
        "device": device, "dtype": dtype, "threads": threads,
        "peak_flops_per_s": peak,
        "mfu": model / peak if model is not None and peak else None,
        "hfu": achieved / peak if achieved is not None and peak else None,
        "peak_memory_bytes": peak_bytes, "planned_bytes": planned_bytes,
    }


def profile_table(prof: Any, steps: int, tokens: int, seconds: float, peak_bytes: int,
                  **kwargs: Any) -> str:
    """The profile as a profiler-style text table (arguments as `profile_summary`)."""
    return format_summary(profile_summary(prof, steps, tokens, seconds, peak_bytes, **kwargs))


def format_summary(s: dict[str, Any]) -> str:
    n = s.get("threads")
    where = s["device"] + (f", {n} thread{'s' if n != 1 else ''}" if n else "")
    lines = [f"profile: {s['steps']} steps, {s['tokens']:,} tokens in {s['seconds']:.3f} s "
             f"({where}, {s['dtype']})",
             f"  {'category':<16} {'time':>10} {'share':>7} {'launches/step':>14}"]
    for c, r in s["categories"].items():
        lines.append(f"  {c:<16} {r['seconds']:>8.3f} s {100 * r['share']:>6.1f}% "
                     f"{r['calls_per_step']:>14.0f}")
    out = s["outside_kernels_seconds"]
    lines.append(f"  {'outside kernels':<16} {out:>8.3f} s "
                 f"{100 * out / s['seconds'] if s['seconds'] > 0 else 0:>6.1f}%")
    lines.append(f"  {'total':<16} {s['seconds']:>8.3f} s {100.0:>6.1f}%  "
                 f"({1e3 * s['seconds_per_step']:.1f} ms/step)")
    tps = s["tokens_per_s"]
    lines.append(f"  tokens/s         {tps:,.0f}" if tps is not None else "  tokens/s         n/a")
    if s.get("model_flops_per_step"):
        lines.append(f"  FLOPs/step       {format_count(s['model_flops_per_step'])} model "
                     f"(achieved {format_count(s['model_flops_per_s'])}FLOP/s)")
    if s["flops_per_step"]:
        lines.append(f"  executed/step    {format_count(s['flops_per_step'])} with recompute "
                     f"(achieved {format_count(s['achieved_flops_per_s'])}FLOP/s)")
    if s["mfu"] is not None or s.get("hfu") is not None:
        parts = [f"{100 * s[k]:.2f}% {k.upper()}" for k in ("mfu", "hfu") if s.get(k) is not None]
        lines.append(f"  MFU / HFU        {', '.join(parts)} of {s['device']} "
                     f"{format_count(s['peak_flops_per_s'])}FLOP/s ({s['dtype']})")
    else:
        lines.append(f"  MFU              n/a (no known peak FLOP/s for {s['device']})")
    mem = f"  peak memory      {format_bytes(s['peak_memory_bytes'])}"
    mem += " (CUDA allocator)" if s["device"] != "cpu" else " (process RSS)"
    if s.get("planned_bytes"):
        mem += f"; planned arena + persistent {format_bytes(s['planned_bytes'])}"
    lines.append(mem)
    return "\n".join(lines)


def format_count(n: float | None) -> str:
    """1234567 -> '1.23M' (SI prefixes, three significant digits)."""
    if n is None:
        return "n/a"
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"


def format_bytes(n: float | None) -> str:
    if n is None:
        return "n/a"
    if abs(n) < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if abs(n) < 1024 or unit == "TiB":
            break
    return f"{n:.1f} {unit}"
