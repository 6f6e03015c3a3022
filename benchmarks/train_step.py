"""Training-step time and peak memory: titanc vs the eager reference vs torch.compile of the
reference vs titans-pytorch's MemoryAsContextTransformer, at one matched MAC configuration.

    .venv/bin/python benchmarks/train_step.py            # d_model 64, 2 layers, seq 128, batch 4
    .venv/bin/python benchmarks/train_step.py --quick    # CI size: d_model 32, seq 32, batch 2
    .venv/bin/python benchmarks/train_step.py --size large --only titanc,titans_pytorch_matched
    .venv/bin/python benchmarks/train_step.py --only titanc,eager --rounds 5 --threads 2

A step is forward + backward + gradient clipping (norm 1.0) + AdamW, same hyper-parameters
everywhere (constant learning rate; titanc: warmup 0 over a 1000-step cosine), each framework
with its own initial weights. Every framework runs in its own subprocess (`--worker NAME`),
--rounds times interleaved (other load on a shared machine comes and goes); each run does
--warmup untimed steps, then --steps timed ones, and the table gives the median and the
minimum over all timed steps, plus the median process CPU time per step. torch.compile gets
a fresh inductor cache per invocation: round 1 compiles cold (inside its first warm-up
step, reported), later rounds hit that cache. A run that exceeds --timeout seconds is killed
and reported with the phase it reached.

Peak memory is the worker process's, above its RSS right after its imports:
`peak_rss_delta_bytes` over the whole run (model construction / compilation included:
ru_maxrss) and `steps_peak_rss_delta_bytes` over the timed steps alone (the kernel's VmHWM,
reset before them: what training holds once set up). titanc also reports its planned
activation arena + persistent region.

titans-pytorch runs twice, because its memory "chunk" does not mean titanc's (see NOTES):
`titans_pytorch` (neural_memory_segment_len = chunk: surprise summed per chunk, momentum and
decay per chunk, all gradients at the sequence-start weights; its default style and the
cheapest) and `titans_pytorch_matched` (segment_len 1, batch_size = chunk: per-token
gradients at the chunk-start weights, per-token momentum and decay, weights updated every
chunk, which is titanc's memory update).

Prints JSON (one object: config, notes, results) then a table; the load average is recorded
before and after.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
FRAMEWORKS = ("titanc", "eager", "torch_compile", "titans_pytorch", "titans_pytorch_matched")

NOTES = {
    "titanc": "cpu target: the fused kernel schedule on the arena executor (torch ops over a "
              "static buffer plan)",
    "eager": "tests/reference: token-by-token memory recurrence in Python, inner gradients by "
             "torch.func.vmap(grad), autograd backward",
    "torch_compile": "torch.compile(tests.reference.forward_loss), default inductor backend; "
                     "the compile happens in the first warm-up step",
    "titans_pytorch": "MemoryAsContextTransformer with neural_memory_segment_len = chunk, "
                      "batch_size None (surprise per chunk at the sequence-start weights; "
                      "not titanc's update rule, but its default and cheapest form)",
    "titans_pytorch_matched": "MemoryAsContextTransformer with neural_memory_segment_len 1, "
                              "neural_memory_batch_size = chunk (per-token gradients at chunk-"
                              "start weights, per-token momentum/decay: titanc's update)",
    "titans_pytorch_differences": [
        "hyper-connections off (num_residual_streams=1); longterm memory tokens 0",
        "memory MLP: GELU, not SiLU; no residual LayerNorm wrapper "
        "(mem_model_norm_add_residual=False); per-head initial weights",
        "retrieved memory is added to the residual stream before attention, not prepended as "
        "context [P | h | x] per segment as titanc's mac does; segmented (block-diagonal "
        "causal) attention with persistent tokens, segment = titanc's segment",
        "value residual from layer 1 in every later layer's attention (no switch to turn off)",
        "axial positional embedding added to the tokens (no switch); rotary as titanc",
        "q/k/v: linear + SiLU without titanc's causal depthwise conv and l2norm; separate "
        "retrieve/store RMSNorms; a per-head sigmoid retrieve gate and a head-combining "
        "linear instead of titanc's output gate + W_O",
        "momentum and decay gates per chunk (pooled) in `titans_pytorch`; per token in "
        "`titans_pytorch_matched`; retrieval there reads the weights after the previous "
        "token, titanc the chunk-start weights",
        "FFN: GEGLU with hidden int(4*D*2/3) (titanc: SwiGLU with ffn_hidden); untied LM head",
    ],
}


SIZES = ("quick", "small", "large")


def config(size: str) -> dict[str, Any]:
    """The titanc spec of the matched configuration (block mac, float32) at `size`: quick
    (CI), small (d_model 64, 2 layers, seq 128) or large (d_model 128, 4 layers, seq 256:
    about 16x small's FLOPs per step)."""
    if size == "large":
        model = {"vocab_size": 256, "d_model": 128, "n_layers": 4, "seq_len": 256,
                 "ffn_hidden": 341, "attention": {"heads": 4, "window": 64, "segment": 64,
                                                  "persistent_tokens": 4},
                 "memory": {"heads": 2, "depth": 2, "expansion": 2, "chunk_size": 16}}
        batch = 4
    elif size == "quick":
        model = {"vocab_size": 64, "d_model": 32, "n_layers": 2, "seq_len": 32,
                 "ffn_hidden": 84, "attention": {"heads": 2, "window": 16, "segment": 16,
                                                 "persistent_tokens": 2},
                 "memory": {"heads": 2, "depth": 2, "expansion": 2, "chunk_size": 8}}
        batch = 2
    else:
        model = {"vocab_size": 256, "d_model": 64, "n_layers": 2, "seq_len": 128,
                 "ffn_hidden": 170, "attention": {"heads": 4, "window": 64, "segment": 32,
                                                  "persistent_tokens": 4},
                 "memory": {"heads": 2, "depth": 2, "expansion": 2, "chunk_size": 16}}
        batch = 4
    model.update(block="mac", tie_embeddings=False)
    model["memory"].update(adaptive=True, lr_max=0.01, momentum=0.9, decay=0.01,
                           output_gate=True, conv_kernel=4)
    return {"name": "bench-mac", "model": model,
            "train": {"batch_size": batch, "lr": 1e-3, "warmup": 0, "steps": 1000,
                      "weight_decay": 0.1,
                      "betas": [0.9, 0.95], "grad_clip": 1.0, "dtype": "float32",
                      "remat": "per_layer", "loss_chunk": 1024, "seed": 0},
            "compile": {"target": "cpu"}}


# -- workers (one framework per process) --------------------------------------------------------

def _rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _rss_peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _hwm_reset() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) so `_hwm` measures from now on."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return _rss_peak()


def _emit(**event: Any) -> None:
    print(json.dumps(event), flush=True)


def _torch_setup(threads: int) -> Any:
    import torch
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    return torch


def _tokens(torch: Any, spec: dict[str, Any]) -> Any:
    m = spec["model"]
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, m["vocab_size"], (spec["train"]["batch_size"], m["seq_len"] + 1),
                         generator=gen)


def _adamw_step(torch: Any, params: list[Any], opt: Any, loss_fn: Callable[[], Any],
                clip: float) -> float:
    loss = loss_fn()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def _make_titanc(torch: Any, spec: dict[str, Any]) -> tuple[Callable[[], float], dict]:
    import titanc
    from titanc.passes.buffer_plan import buffer_report

    prog = titanc.compile(spec)
    toks = _tokens(torch, spec)
    mem = buffer_report(prog.compiled.plans["training"], spec["model"]["vocab_size"])
    n = sum(t.numel() for t in prog.parameters().values())
    return (lambda: prog.train_step(toks)), {
        "parameters": n, "planned_bytes": mem["arena_bytes"] + mem["persistent_bytes"],
        "planned_arena_bytes": mem["arena_bytes"], "planned_persistent_bytes":
        mem["persistent_bytes"]}


def _reference(torch: Any, spec: dict[str, Any],
               compiled: bool) -> tuple[Callable[[], float], dict]:
    sys.path.insert(0, str(ROOT))
    import tests.reference as R
    from titanc.model.spec import load_spec

    s = load_spec(spec)
    params = {k: v.requires_grad_(True) for k, v in
              R.init_params(s.model, 0, torch.float32).items()}
    t = spec["train"]
    opt = torch.optim.AdamW(params.values(), lr=t["lr"], betas=tuple(t["betas"]),
                            weight_decay=t["weight_decay"])
    toks = _tokens(torch, spec)
    fn = torch.compile(R.forward_loss) if compiled else R.forward_loss
    plist = list(params.values())
    return (lambda: _adamw_step(torch, plist, opt, lambda: fn(params, toks, s.model),
                                t["grad_clip"])), {"parameters": sum(p.numel() for p in plist)}


def _titans(torch: Any, spec: dict[str, Any], matched: bool) -> tuple[Callable[[], float], dict]:
    from titans_pytorch import MemoryAsContextTransformer

    m, t = spec["model"], spec["train"]
    mem, att = m["memory"], m["attention"]
    D = m["d_model"]
    model = MemoryAsContextTransformer(
        num_tokens=m["vocab_size"], dim=D, depth=m["n_layers"], segment_len=att["segment"],
        num_persist_mem_tokens=att["persistent_tokens"], num_longterm_mem_tokens=0,
        neural_memory_segment_len=1 if matched else mem["chunk_size"],
        neural_memory_batch_size=mem["chunk_size"] if matched else None,
        dim_head=D // att["heads"], heads=att["heads"], ff_mult=4, num_residual_streams=1,
        neural_memory_kwargs=dict(
            heads=mem["heads"], dim_head=D // mem["heads"], momentum=True,
            mem_model_norm_add_residual=False, default_step_transform_max_lr=mem["lr_max"],
            activation=torch.nn.SiLU(),
            default_model_kwargs=dict(depth=mem["depth"],
                                      expansion_factor=float(mem["expansion"]))))
    for p in model.parameters():       # per-head memory weights are expanded views; AdamW's
        p.data = p.data.clone()        # in-place update needs real storage
    opt = torch.optim.AdamW(model.parameters(), lr=t["lr"], betas=tuple(t["betas"]),
                            weight_decay=t["weight_decay"])
    toks = _tokens(torch, spec)
    plist = list(model.parameters())
    return (lambda: _adamw_step(torch, plist, opt, lambda: model(toks, return_loss=True),
                                t["grad_clip"])), {"parameters": sum(p.numel() for p in plist)}


def worker(name: str, spec: dict[str, Any], steps: int, warmup: int, threads: int) -> None:
    """Run one framework and print JSON events; the last line is {"event": "result", ...}."""
    torch = _torch_setup(threads)
    if name == "titanc":
        import titanc  # noqa: F401  (imports before the baseline)
    elif name in ("eager", "torch_compile"):
        import tests.reference  # noqa: F401
    else:
        import titans_pytorch  # noqa: F401
    base_now, base_peak = _rss_now(), _rss_peak()
    t0 = time.perf_counter()
    if name == "titanc":
        step, info = _make_titanc(torch, spec)
    elif name in ("eager", "torch_compile"):
        step, info = _reference(torch, spec, compiled=name == "torch_compile")
    else:
        step, info = _titans(torch, spec, matched=name == "titans_pytorch_matched")
    setup = time.perf_counter() - t0
    _emit(event="setup", seconds=setup)
    warm = []
    for i in range(warmup):
        t0 = time.perf_counter()
        step()
        warm.append(time.perf_counter() - t0)
        _emit(event="warmup", step=i, seconds=warm[-1])
    steady = _hwm_reset()                 # peak RSS of the timed steps alone
    times, cpu, losses = [], [], []
    for i in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        losses.append(step())
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        _emit(event="step", step=i, seconds=times[-1])
    _emit(event="result", framework=name, status="ok", setup_seconds=setup,
          warmup_seconds=warm, step_seconds=times, median_step_seconds=statistics.median(times),
          step_cpu_seconds=cpu, median_step_cpu_seconds=statistics.median(cpu),
          tokens_per_s=spec["train"]["batch_size"] * spec["model"]["seq_len"]
          / statistics.median(times), first_loss=losses[0], last_loss=losses[-1],
          peak_rss_delta_bytes=max(_rss_peak() - base_now, 0), baseline_rss_bytes=base_now,
          steps_peak_rss_delta_bytes=max(_hwm() - base_now, 0) if steady else None,
          baseline_peak_rss_bytes=base_peak, threads=threads, **info)


def run_worker(name: str, spec: dict[str, Any], args: argparse.Namespace,
               cache_dir: str) -> dict[str, Any]:
    """One worker process; its result event, or {status: timeout | error, reached, ...}."""
    cmd = [sys.executable, __file__, "--worker", name, "--spec", json.dumps(spec),
           "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--threads", str(args.threads)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(args.threads),
           "TORCHINDUCTOR_CACHE_DIR": cache_dir}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                              env=env, cwd=ROOT)
        out, err, code = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err, code = "", None
    events = []
    for line in out.splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            continue
    if events and events[-1].get("event") == "result":
        return events[-1]
    reached = events[-1] if events else {"event": "import"}
    status = "timeout" if code is None else "error"
    res = {"framework": name, "status": status, "wall_seconds": time.perf_counter() - t0,
           "reached": reached}
    if status == "error":
        tail = [l for l in err.strip().splitlines() if l.strip()]
        res["error"] = tail[-1][:400] if tail else f"exit status {code}"
    return res


def combine(name: str, rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Pool the rounds of one framework: median and min over every timed step, the largest
    memory, the first round's warm-up (torch.compile's cold compile) and losses."""
    ok = [r for r in rounds if r["status"] == "ok"]
    if not ok:
        return {**rounds[0], "rounds": len(rounds)}
    steps = [t for r in ok for t in r["step_seconds"]]
    cpu = [t for r in ok for t in r["step_cpu_seconds"]]
    first = ok[0]
    tokens = first["tokens_per_s"] * first["median_step_seconds"]
    peak = [r["steps_peak_rss_delta_bytes"] for r in ok]
    return {
        "framework": name, "status": "ok", "rounds": len(ok),
        "failed_rounds": [r for r in rounds if r["status"] != "ok"],
        "parameters": first["parameters"], "threads": first["threads"],
        "step_seconds": [r["step_seconds"] for r in ok],
        "median_step_seconds": statistics.median(steps), "min_step_seconds": min(steps),
        "median_step_cpu_seconds": statistics.median(cpu),
        "tokens_per_s": tokens / statistics.median(steps),
        "setup_seconds": [r["setup_seconds"] for r in ok],
        "warmup_seconds": [r["warmup_seconds"] for r in ok],
        "peak_rss_delta_bytes": max(r["peak_rss_delta_bytes"] for r in ok),
        "steps_peak_rss_delta_bytes": None if None in peak else max(peak),
        "first_loss": first["first_loss"], "last_loss": first["last_loss"],
        **{k: first[k] for k in ("planned_bytes", "planned_arena_bytes",
                                 "planned_persistent_bytes") if k in first},
    }


def _mib(n: int | None) -> str:
    return f"{n / 2**20:>6.1f} MiB" if n is not None else f"{'n/a':>10}"


def table(results: list[dict[str, Any]]) -> str:
    ok = {r["framework"]: r for r in results if r["status"] == "ok"}
    base = ok.get("titanc")
    head = (f"{'framework':<23} {'params':>7} {'median':>9} {'min':>9} {'CPU/step':>9} "
            f"{'tokens/s':>8} {'vs titanc':>10} {'peak RSS +':>11} {'in steps':>10}  "
            f"{'loss':>15}")
    lines = [head, "-" * len(head)]
    for r in results:
        name = r["framework"]
        if r["status"] != "ok":
            why = r.get("error") or f"reached {r['reached'].get('event')} " \
                                    f"{r['reached'].get('step', '')}".strip()
            lines.append(f"{name:<23} {r['status']} after {r['wall_seconds']:.0f} s: {why}")
            continue
        t, tmin = r["median_step_seconds"], r["min_step_seconds"]
        ratio = "-"
        if base and name != "titanc":
            ratio = f"{t / base['median_step_seconds']:.2f}/{tmin / base['min_step_seconds']:.2f}"
        lines.append(f"{name:<23} {r['parameters']:>7,} {1e3 * t:>6.1f} ms {1e3 * tmin:>6.1f} ms "
                     f"{1e3 * r['median_step_cpu_seconds']:>6.1f} ms {r['tokens_per_s']:>8,.0f} "
                     f"{ratio:>10} {_mib(r['peak_rss_delta_bytes']):>11} "
                     f"{_mib(r.get('steps_peak_rss_delta_bytes'))}  "
                     f"{r['first_loss']:.3f}->{r['last_loss']:.3f}")
        if name == "torch_compile":
            cold = r["warmup_seconds"][0][0] if r["warmup_seconds"][0] else None
            warm = [w[0] for w in r["warmup_seconds"][1:] if w]
            if cold is not None:
                lines[-1] += f"  [compile+1st step: cold {cold:.1f} s"
                lines[-1] += f", cached {min(warm):.1f} s]" if warm else "]"
    if base:
        lines.append(f"titanc planned memory: arena {base['planned_arena_bytes'] / 2**20:.2f} MiB "
                     f"+ persistent {base['planned_persistent_bytes'] / 2**20:.2f} MiB")
    lines.append("median/min over every timed step of every round; 'vs titanc' = the "
                 "framework's step time / titanc's, by median/min (>1: titanc faster); "
                 "'peak RSS +' = peak RSS above the post-import baseline over a whole run, "
                 "'in steps' = over the timed steps only; loss = first->last timed step")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="CI-sized config and step counts "
                    "(the same as --size quick)")
    ap.add_argument("--size", choices=SIZES, default="small",
                    help="model size: quick (CI), small (default: d_model 64, 2 layers, seq 128, "
                         "batch 4), large (d_model 128, 4 layers, seq 256, batch 4)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 5; quick 2)")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 2; quick 1)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="runs of every framework, interleaved (default 3; quick 1): on a "
                         "shared machine other load comes and goes")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads per worker (default 1: on a shared machine more "
                         "threads than free cores make every small op wait at a barrier)")
    ap.add_argument("--timeout", type=float, default=None,
                    help="seconds per worker run (default 1200; quick 300)")
    ap.add_argument("--only", default=None,
                    help=f"comma-separated subset of {','.join(FRAMEWORKS)} (default: all; "
                         f"--quick leaves out torch_compile, whose compile of the unrolled token "
                         f"loop takes minutes even at the quick size)")
    ap.add_argument("--remat", default="per_layer", choices=("none", "per_layer", "per_segment"),
                    help="titanc's train.remat (default per_layer)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--spec", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.size = "quick"
    args.quick = args.size == "quick"
    args.steps = args.steps or (2 if args.quick else 5)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.timeout = args.timeout or (300.0 if args.quick else 1200.0)
    if args.worker:
        worker(args.worker, json.loads(args.spec), args.steps, args.warmup, args.threads)
        return
    spec = config(args.size)
    spec["train"]["remat"] = args.remat
    default = [n for n in FRAMEWORKS if not (args.quick and n == "torch_compile")]
    names = [n for n in args.only.split(",") if n] if args.only else default
    unknown = [n for n in names if n not in FRAMEWORKS]
    if unknown:
        ap.error(f"--only: unknown {', '.join(unknown)}; choose from {', '.join(FRAMEWORKS)}")
    load0 = os.getloadavg()
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory(prefix="titanc-bench-inductor-") as cache:
        for k in range(args.rounds):          # round 1 compiles cold; later rounds hit its cache
            for n in names:
                if k and runs[n] and runs[n][0]["status"] == "timeout":
                    continue                  # a cold timeout would only repeat
                runs[n].append(run_worker(n, spec, args, cache))
    results = [combine(n, runs[n]) for n in names]
    out = {"benchmark": "train_step", "config": spec, "threads": args.threads,
           "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds,
           "cpus": os.cpu_count(), "load_average_before": load0,
           "load_average_after": os.getloadavg(), "notes": NOTES, "results": results}
    print(json.dumps(out, indent=2))
    print()
    print(table(results))


if __name__ == "__main__":
    main()
