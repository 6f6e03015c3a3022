"""`titanc bench`: compile a spec, run warm-up and profiled training steps on random tokens and
print the profile summary (`runtime/diagnostics/timing.py` says what each figure means);
`titanc bench --predict h100|h200`: no step runs, the cost model predicts one on that GPU from
the lowered program (`titanc.tools.cost_model.predict`, docs/cost_model.md)."""
from __future__ import annotations

import os
import time
from typing import Any

from titanc.errors import printable
from titanc.runtime.diagnostics.timing import (StepProfiler, device_name, format_summary, peak_rss_bytes,
                                    profile_summary)

__all__ = ["run_bench", "bench_table", "predict_bench", "predict_table", "step_flops"]


def step_flops(compiled: Any) -> int:
    """FLOPs one optimizer step executes: the training schedule's top-level kernels (a scan
    counts its body times its length) per micro-batch, times grad_accum, plus the
    optimizer's. What `train.remat` recomputes counts (HFU); the model's own FLOPs, for MFU,
    are `Compiled.model_flops()`."""
    accum = int(getattr(compiled.spec.train, "grad_accum", 1))
    train = sum(k.flops for k in compiled.schedules["training"].kernels)
    opt = sum(k.flops for k in compiled.schedules["optimizer"].kernels)
    return accum * train + opt


# -- titanc bench ----------------------------------------------------------------------------

def run_bench(spec: Any, steps: int = 5, warmup: int = 1, threads: int | None = None,
              seed: int = 0) -> dict[str, Any]:
    """Compile `spec`, run `warmup` unprofiled training steps and `steps` profiled ones on
    random tokens; returns the `profile_summary` dict plus compile and warm-up times."""
    import torch

    import titanc
    from titanc.passes.buffer_plan import buffer_report

    threads = threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    t0 = time.perf_counter()
    prog = titanc.compile(spec)
    compile_s = time.perf_counter() - t0
    s = prog.spec
    rows = s.train.grad_accum * s.train.batch_size
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, s.model.vocab_size, (rows, s.model.seq_len + 1), generator=gen)
    t0 = time.perf_counter()
    for _ in range(warmup):
        prog.train_step(tokens)
    warmup_s = time.perf_counter() - t0
    device = device_name(prog.target)
    if device != "cpu":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    prof = StepProfiler()
    for _ in range(steps):
        with prof.step():
            prog.train_step(tokens)
            if device != "cpu":
                torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() if device != "cpu" else peak_rss_bytes()
    mem = buffer_report(prog.compiled.plans["training"], s.model.vocab_size)
    summary = profile_summary(
        prof, steps, steps * rows * s.model.seq_len, prof.wall, peak,
        flops_per_step=step_flops(prog.compiled),
        model_flops_per_step=prog.compiled.model_flops(), device=device,
        dtype=str(s.train.dtype), planned_bytes=mem["arena_bytes"] + mem["persistent_bytes"],
        threads=threads if device == "cpu" else None)
    summary.update(name=s.name, compile_seconds=compile_s, warmup_steps=warmup,
                   warmup_seconds=warmup_s, loss=prog.last.get("loss"), memory=mem,
                   cpus=os.cpu_count(), load_average=load)
    return summary


def bench_table(result: dict[str, Any]) -> str:
    head = (f"{printable(result['name'])}: compiled in {result['compile_seconds']:.2f} s, "
            f"{result['warmup_steps']} warm-up steps in {result['warmup_seconds']:.2f} s, "
            f"loss {result['loss']:.4f}")
    text = head + "\n" + format_summary(result)
    load, cpus, threads = result.get("load_average"), result.get("cpus"), result.get("threads")
    if load is not None and cpus and threads and threads > 1 and load + threads > cpus:
        text += (f"\nnote: load average {load:.1f} on {cpus} CPUs before the run: with "
                 f"{threads} threads every small op can wait at a thread barrier for a busy "
                 f"core; compare with --threads 1")
    return text


# -- titanc bench --predict ------------------------------------------------------------------

def predict_bench(spec: Any, device: str) -> dict[str, Any]:
    """The cost model's training step of `spec` on `device` (h100, h200): inside one CUDA
    graph (as the triton target runs it) and launch by launch without one."""
    from titanc.compiler import compile_graphs
    from titanc.tools.cost_model import predict

    c = compile_graphs(spec)
    tokens = c.spec.train.grad_accum * c.spec.train.batch_size * c.spec.model.seq_len
    graph = predict(c, device)
    eager = predict(c, device, graph=False)
    return {"name": c.spec.name, "device": device, "tokens_per_step": tokens,
            "model_flops": c.model_flops(), "step_flops": step_flops(c),
            "graph": graph, "eager": eager,
            "tokens_per_s": tokens / graph["seconds"] if graph["seconds"] else None}


def predict_table(result: dict[str, Any]) -> str:
    from titanc.runtime.diagnostics.timing import PEAK_TFLOPS
    from titanc.tools.cost_model import DATASHEET, prediction_table

    g = result["graph"]
    peak = PEAK_TFLOPS[DATASHEET[result["device"]]["name"]].get(g["dtype"])
    mfu = (f", MFU {100 * result['model_flops'] / g['seconds'] / (peak * 1e12):.2f}%"
           if peak and g["seconds"] else "")
    return (f"{printable(result['name'])}: {result['tokens_per_step']:,} tokens a step, "
            f"predicted {1e3 * g['seconds']:.3f} ms a step in one CUDA graph "
            f"({1e3 * result['eager']['seconds']:.3f} ms without){mfu}\n"
            + prediction_table(g))
