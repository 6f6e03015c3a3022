"""The GPU check: correctness of the triton target, and training-step throughput of titanc
against titans-pytorch and torch.compile of the reference, on one fresh, offline GPU machine.

    python3 benchmarks/gpu_check.py                       # everything, under a 480 s deadline
    python3 benchmarks/gpu_check.py --deadline 300 --only checks,tiny_bf16,peer_tiny
    python3 benchmarks/gpu_check.py --script first_step=benchmarks/first_step.py
    DEV=cpu TRITON_INTERPRET=1 python3 benchmarks/gpu_check.py --toy   # the same paths, here
    python3 benchmarks/gpu_check.py job KIND NAME         # one job (what the run starts)
    python3 benchmarks/gpu_check.py summary               # the table of $OUT/results.jsonl

Run from the checkout's root. Nothing is downloaded: titanc is laid out from the checkout as
pyproject.toml's package-dir says (unless `import titanc` already works), titans-pytorch is
installed from the wheels in .gpu/whl (`pip download` them beforehand, docs/gpu.md).

Every check and every throughput job is its own process, all started at once, so Triton's
one-kernel-at-a-time compiles overlap across the machine's cores; a timed loop first waits for
the host to be quiet (no other job still compiling, at most until 90 s before the deadline: on
the H100, titans-pytorch's eager steps timed during the others' compiles came out 2-3x slow),
then takes a file lock, so one job times on the GPU at a time; at the deadline every job still running is killed, and
each reports how far it got: its `compiled`, `first_step`, `warm` and `result` records in
$OUT/results.jsonl ({"job", "phase", ...} per line). At the end one JSON ($OUT/results.json:
device, jobs, what finished) and a table ($OUT/summary.txt, printed).

Checks (quick sizes; triton vs cpu target, same weights and tokens): a training step (loss and
every parameter after AdamW) in float32 (1e-4), tf32 and bfloat16 (2e-2); decoding token by
token against the parallel forward (1e-3; bfloat16 5e-2). Throughput: tokens/s, MFU (the
model's FLOPs, `Compiled.model_flops`: nothing recomputed) and HFU (the kernels' FLOPs, what
`train.remat` recomputes included), peak CUDA memory of one optimizer step, titanc (one CUDA graph per step) in float32, tf32 and
bfloat16, titans-pytorch's MemoryAsContextTransformer (its default chunking and titanc's
memory semantics, "matched"; float32 and bf16 autocast) and torch.compile of tests/reference,
at tiny.yaml, the CPU benchmark's larger size (benchmarks/train_step.py --size large) and, for
titanc, large_125m.yaml (grad_accum 1: one micro-batch per step; also with memory chunks of 512,
the A/B of the serial chain), titans-pytorch's default there too, and what a user would train
instead: a plain transformer of the size's dimensions under torch.compile with SDPA (the
`dense` jobs, benchmarks/dense_transformer.py). `--script NAME=PATH` adds a job that
runs PATH with $GPU_CHECK_RESULTS (append records there) and $GPU_CHECK_DEADLINE (epoch s).
"""
from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
OUT = Path(os.environ.get("OUT", "/tmp/gpu-out"))
RESULTS = OUT / "results.jsonl"
DEV = os.environ.get("DEV", "cuda")
TOY = json.loads(os.environ.get("GPU_CHECK_TOY", "{}"))   # --toy: every size shrunk

QUICK = {"model.d_model": 16, "model.n_layers": 1, "model.seq_len": 16, "model.vocab_size": 32,
         "model.ffn_hidden": 32, "train.batch_size": 1, "model.memory.chunk_size": 4,
         "model.attention.segment": 8, "model.attention.window": 8, "train.loss_chunk": 0}
TOY_SIZES = {**QUICK, "model.n_layers": 1, "train.batch_size": 1, "train.grad_accum": 1,
             "model.attention.heads": 2, "model.attention.persistent_tokens": 2,
             "model.memory.heads": 2}
BF16 = {"train.dtype": "bfloat16"}
TF32 = {"compile.allow_tf32": True}
LARGE = {"train.grad_accum": 1}        # large_125m: one micro-batch of 8 x 4096 per step

# name: (spec, overrides, kind, tolerance)
CHECKS = {
    "chk_mac_f32": ("tiny.yaml", QUICK, "step", 1e-4),
    "chk_mac_decode": ("tiny.yaml", QUICK, "decode", 1e-3),
    "chk_mac_bf16": ("tiny.yaml", {**QUICK, **BF16}, "step", 2e-2),
    "chk_mac_tf32": ("tiny.yaml", {**QUICK, **TF32}, "step", 2e-2),
    "chk_mac_decode_bf16": ("tiny.yaml", {**QUICK, **BF16}, "decode", 5e-2),
    "chk_lmm_f32": ("tiny_lmm.yaml", QUICK, "step", 1e-4),
    "chk_lmm_bf16": ("tiny_lmm.yaml", {**QUICK, **BF16}, "step", 2e-2),
    "chk_attn_bf16": ("tiny_attn.yaml", {**QUICK, **BF16}, "step", 2e-2),
    "chk_mal_f32": ("tiny_mal.yaml", QUICK, "step", 1e-4),
    "chk_mag_f32": ("tiny_mag.yaml", QUICK, "step", 1e-4),
    # split-K on (JOB_ENV): 32 rows of 16 tokens, the weight gradients over 512 of them
    "chk_mac_f32_split_k": ("tiny.yaml", {**QUICK, "train.batch_size": 32}, "step", 1e-4),
}
# sizes: a spec file of examples/, or "bench_large" (benchmarks/train_step.py's large config)
SIZE_OF = {"tiny": "tiny.yaml", "medium": "bench_large", "large": "large_125m.yaml"}
SIZE_NOTE = {"tiny": "tiny.yaml", "medium": "train_step.py --size large",
             "large": "large_125m.yaml, grad_accum 1"}
# name: (size, overrides)
TITANC = {
    "tiny_f32": ("tiny", {}),
    "tiny_tf32": ("tiny", TF32),
    "tiny_bf16": ("tiny", BF16),
    "attn_f32": ("tiny_attn.yaml", {}),
    "attn_bf16": ("tiny_attn.yaml", BF16),
    "medium_f32": ("medium", {}),
    "medium_bf16": ("medium", BF16),
    "large_bf16": ("large", {**LARGE, **BF16}),
    # the A/B that isolates the chunk recurrence's serial chain: 8 chunks a sequence, not 64
    "large_bf16_chunk512": ("large", {**LARGE, **BF16, "model.memory.chunk_size": 512}),
    # the memory's chunk groups (compile.chunk_groups: true): each group's chunks recomputed
    # in its backward for a smaller arena (large_125m: 28,162 launches for 21,538, a 1,954
    # MiB arena for 2,085; docs/gpu.md), and with their recompute hoisted out of the backward
    "large_bf16_chunk_groups": ("large", {**LARGE, **BF16, "compile.chunk_groups": True}),
    "large_bf16_hoist": ("large", {**LARGE, **BF16, "compile.chunk_groups": True,
                                   "compile.hoist_groups": True}),
    # the forward chunk scans' gates hoisted out of their host loops (compile.hoist_gates)
    "large_bf16_hoist_gates": ("large", {**LARGE, **BF16, "compile.hoist_gates": True}),
    # the forward chunk scans' reads kept in their serial loops (compile.sink_reads: never):
    # what computing them after the scan over the stacked start states saves
    "large_bf16_reads_in_loop": ("large", {**LARGE, **BF16, "compile.sink_reads": "never"}),
    # every kernel its own launch (no launch groups, docs/gpu.md): what the groups save
    "tiny_bf16_ungrouped": ("tiny", BF16),
    # tiny.yaml saving every activation instead of re-running each layer's segments in the
    # backward: the same math in 296 launches for 510, a 97 MiB bf16 arena for 9 (docs/gpu.md)
    "tiny_bf16_remat_none": ("tiny", {**BF16, "train.remat": "none"}),
    "medium_bf16_remat_none": ("medium", {**BF16, "train.remat": "none"}),
    # a different model: ffn_hidden 176 instead of 172, 16-byte bf16 rows (docs/gpu.md,
    # "unaligned rows"): what the element-by-element loads of the FFN's matmuls cost
    "tiny_bf16_ffn176": ("tiny", {**BF16, "model.ffn_hidden": 176}),
    # split-K on (TITANC_SPLIT_K=1, off by default): the weight gradients over 1,024 tokens
    # in slices (docs/gpu.md): 522 launches for 510, the 61 us group on 24 programs a member
    "tiny_bf16_split_k": ("tiny", BF16),
    "medium_bf16_split_k": ("medium", BF16),
    # the pointwise, reduction and cumsum kernels with the interpreter's blocks on CUDA
    # (TITANC_GPU_BLOCKS=0; docs/gpu_kernels.md): what their GPU blocks save
    "tiny_bf16_interp_blocks": ("tiny", BF16),
    "medium_bf16_interp_blocks": ("medium", BF16),
    # large_125m with its memory scans as one kernel each (TITANC_SCAN_COST=0): 32 programs
    # running 257-2,873 serial tile rounds a chunk, where the cost rule gives them host loops
    # of kernels over the whole chip (codegen/meta.py ROUNDS_PER_LAUNCH; docs/gpu_kernels.md)
    "large_bf16_scan_kernels": ("large", {**LARGE, **BF16}),
    # every memory scan as its host loop (TITANC_SCAN_KERNELS=0) where the rule keeps kernels:
    # what ROUNDS_PER_LAUNCH is measured against at these sizes
    "tiny_bf16_scan_loops": ("tiny", BF16),
    "medium_bf16_scan_loops": ("medium", BF16),
}
# a job's own environment (beyond the harness's)
JOB_ENV = {"tiny_bf16_ungrouped": {"TITANC_GROUP_LAUNCHES": "0"},
           "tiny_bf16_split_k": {"TITANC_SPLIT_K": "1"},
           "chk_mac_f32_split_k": {"TITANC_SPLIT_K": "1"},
           "medium_bf16_split_k": {"TITANC_SPLIT_K": "1"},
           "tiny_bf16_interp_blocks": {"TITANC_GPU_BLOCKS": "0"},
           "medium_bf16_interp_blocks": {"TITANC_GPU_BLOCKS": "0"},
           "large_bf16_scan_kernels": {"TITANC_SCAN_COST": "0"},
           "tiny_bf16_scan_loops": {"TITANC_SCAN_KERNELS": "0"},
           "medium_bf16_scan_loops": {"TITANC_SCAN_KERNELS": "0"}}
# name: (size, [(matched, autocast bf16)])
PEER = {
    "peer_tiny": ("tiny", [(False, False), (False, True), (True, False), (True, True)]),
    "peer_medium": ("medium", [(False, False), (False, True), (True, True)]),
    # its default chunking only (what the acceptance compares against; matched is slow)
    "peer_tiny_default": ("tiny", [(False, False), (False, True)]),
    "peer_medium_default": ("medium", [(False, False), (False, True)]),
    # at large_125m's dimensions (bf16 autocast only; it may not fit: the row says so)
    "peer_large_default": ("large", [(False, True)]),
}
# name: (size, torch.compile?)
REF = {"ref_tiny_compile": ("tiny", True), "ref_medium_compile": ("medium", True)}
# what a user would train instead (benchmarks/dense_transformer.py): a plain transformer of the
# size's width, depth, heads, FFN and sequence, causal SDPA over the whole sequence, bf16
# autocast; name: (size, torch.compile?)
DENSE = {"dense_large": ("large", True), "dense_tiny": ("tiny", True)}
GROUPS = {"checks": list(CHECKS), "titanc": list(TITANC), "peer": ["peer_tiny", "peer_medium"],
          "peer_default": ["peer_tiny_default", "peer_medium_default", "peer_large_default"],
          "ref": list(REF), "dense": list(DENSE)}


# -- records ---------------------------------------------------------------------------------------

def emit(job: str, phase: str, **kv: Any) -> None:
    """Append one record {job, phase, t, ...} to results.jsonl (and print it)."""
    line = json.dumps({"job": job, "phase": phase, "t": round(time.time(), 2), **kv},
                      default=str)
    with open(RESULTS, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write(line + "\n")
    print(line, flush=True)


class GpuLock:
    """One timed loop on the GPU at a time (a file lock shared by every job)."""

    def __enter__(self) -> "GpuLock":
        OUT.mkdir(parents=True, exist_ok=True)
        self.f = open(OUT / "gpu.lock", "w")
        t0 = time.perf_counter()
        fcntl.flock(self.f, fcntl.LOCK_EX)
        self.waited = time.perf_counter() - t0
        return self

    def __exit__(self, *a: Any) -> None:
        fcntl.flock(self.f, fcntl.LOCK_UN)
        self.f.close()


# a job has stopped compiling once it reported one of these
_PAST_COMPILE = {"first_step", "warm", "result", "error", "profile"}
QUIET_MARGIN_S = 90.0


def compiling_jobs(me: str) -> list[str]:
    """The jobs still running (the orchestrator's $OUT/running.json) that have not reported a
    first step, a result or an error yet, other than `me` (a job's records may carry its
    name plus a suffix: a peer job's variants)."""
    try:
        alive = json.loads((OUT / "running.json").read_text())
    except (OSError, ValueError):
        return []
    past = set()
    if RESULTS.exists():
        for line in RESULTS.read_text().splitlines():
            r = json.loads(line)
            if r["phase"] in _PAST_COMPILE:
                past.add(r["job"])
    return [n for n in alive if n != me
            and not any(j == n or j.startswith(n + "_") for j in past)]


def quiet_host() -> dict[str, Any]:
    """Wait until no other job is compiling (its compiles load every host core: an eager
    step timed meanwhile is host time, not GPU time), at most until QUIET_MARGIN_S before the
    deadline; {"quiet_wait_s", "host_quiet", and "compiling": the jobs still compiling}."""
    me = os.environ.get("GPU_CHECK_JOB", "")
    until = float(os.environ.get("GPU_CHECK_DEADLINE", "inf")) - QUIET_MARGIN_S
    t0 = time.time()
    busy = compiling_jobs(me)
    while busy and time.time() < until:
        time.sleep(1.0)
        busy = compiling_jobs(me)
    out: dict[str, Any] = {"quiet_wait_s": round(time.time() - t0, 1), "host_quiet": not busy}
    if busy:
        out["compiling"] = busy
    return out


def sync() -> None:
    import torch
    if torch.cuda.is_available() and DEV == "cuda":
        torch.cuda.synchronize()


def timed(step: Callable[[], Any], rounds: int, per_round: int
          ) -> tuple[list[float], dict[str, Any]]:
    """Seconds per step of `rounds` rounds of `per_round` steps (one sync per round: steps
    queue as in training), once the host is quiet and under the GPU lock; and {"lock_wait_s",
    and `quiet_host`'s record}."""
    out = []
    quiet = quiet_host()
    with GpuLock() as lk:
        for _ in range(rounds):
            sync()
            t0 = time.perf_counter()
            for _ in range(per_round):
                step()
            sync()
            out.append((time.perf_counter() - t0) / per_round)
    return out, {"lock_wait_s": round(lk.waited, 1), **quiet}


def peak_mib() -> float | None:
    import torch
    return (round(torch.cuda.max_memory_allocated() / 2**20, 1)
            if torch.cuda.is_available() and DEV == "cuda" else None)


def reset_peak() -> None:
    import torch
    if torch.cuda.is_available() and DEV == "cuda":
        torch.cuda.reset_peak_memory_stats()


def spec_of(size: str, over: dict[str, Any]) -> Any:
    """The validated spec of a size (or an example file), overrides and --toy applied."""
    from titanc.model.spec import load_spec

    name = SIZE_OF.get(size, size)
    if name == "bench_large":
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from train_step import config
        return load_spec(config("large"), {**over, **TOY} or None)
    return load_spec(ROOT / "examples" / name, {**over, **TOY} or None)


def _rel(a: Any, b: Any) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).abs().max() / max(float(b.abs().max()), 1e-12))


# -- checks ----------------------------------------------------------------------------------------

def _compile(spec: str, target: str, over: dict[str, Any]) -> Any:
    import torch
    import titanc
    import tests.reference as R

    prog = titanc.compile(ROOT / "examples" / spec, **{**over, "compile.target": target})
    params = R.init_params(prog.spec.model, seed=3, dtype=torch.float32)
    prog.load_state_dict({f"param.{k}": v for k, v in params.items()}, strict=False)
    return prog


def _tokens(spec: Any, rows: int | None = None, seed: int = 2) -> Any:
    import torch
    gen = torch.Generator().manual_seed(seed)
    rows = rows or spec.train.batch_size * spec.train.grad_accum
    return torch.randint(0, spec.model.vocab_size, (rows, spec.model.seq_len + 1), generator=gen)


def check_step(spec: str, over: dict[str, Any], tol: float) -> dict[str, Any]:
    """One training step on the triton and the cpu target from the same weights and tokens:
    the loss and every parameter after the update within `tol` relative."""
    progs = {t: _compile(spec, t, over) for t in ("cpu", "triton")}
    toks = _tokens(progs["cpu"].spec)
    loss = {t: p.train_step(toks) for t, p in progs.items()}
    worst = max(_rel(progs["triton"].parameters()[n], p)
                for n, p in progs["cpu"].parameters().items())
    loss_err = abs(loss["triton"] - loss["cpu"]) / max(abs(loss["cpu"]), 1e-12)
    return {"ok": loss_err <= tol and worst <= tol, "loss_cpu": loss["cpu"],
            "loss_triton": loss["triton"], "loss_rel_err": loss_err,
            "param_max_rel_err": worst, "tolerance": tol}


def check_decode(spec: str, over: dict[str, Any], tol: float) -> dict[str, Any]:
    """Token-by-token decoding of the triton program equals its own parallel forward."""
    import torch
    from titanc.runtime.serve.generate import Generator

    prog = _compile(spec, "triton", {**over, "train.batch_size": 1})
    toks = _tokens(prog.spec, rows=1)
    n = prog.spec.model.seq_len
    want = prog.logits(toks)                         # [1, n, V]
    gen = Generator(prog)
    prompt = max(1, n // 2 + 1)                      # ends mid-chunk
    st, logits = gen.prefill(toks[0, :prompt].tolist())
    rest = [gen.step(st, toks[:, t:t + 1]).clone() for t in range(prompt, n)]
    err = _rel(torch.cat([logits] + rest, 1), want)
    return {"ok": err <= tol, "logits_max_rel_err": err, "tolerance": tol}


def run_check(name: str) -> None:
    spec, over, kind, tol = CHECKS[name]
    t0 = time.perf_counter()
    r = check_step(spec, over, tol) if kind == "step" else check_decode(spec, over, tol)
    emit(name, "result", seconds=round(time.perf_counter() - t0, 1), **r)


# -- throughput ------------------------------------------------------------------------------------

def _rounds(size: str = "") -> tuple[int, int]:
    """(rounds, steps per round) of a timed loop: fewer at large_125m, whose step takes
    seconds while its kernels are slow (a loop must end before the deadline)."""
    return (2, 1) if TOY else (3, 1) if size == "large" else (5, 10)


def run_titanc(name: str) -> None:
    """titanc on the triton target: compile, first step (cold kernels), warm-up (the second
    step captures the CUDA graph), then timed steps; each phase reported as it ends."""
    import torch
    import titanc
    from titanc.tools.bench import step_flops
    from titanc.runtime.diagnostics.timing import device_name, peak_flops

    size, over = TITANC[name]
    spec = spec_of(size, {**over, "compile.target": "triton"})
    t0 = time.perf_counter()
    prog = titanc.compile(spec)
    toks = _tokens(prog.spec)
    ntok = prog.spec.train.grad_accum * prog.spec.train.batch_size * prog.spec.model.seq_len
    emit(name, "compiled", compile_s=round(time.perf_counter() - t0, 1), tokens_per_step=ntok,
         size=SIZE_NOTE.get(size, size), layers=prog.spec.model.n_layers,
         dtype=prog.spec.train.dtype, tf32=bool(prog.spec.compile.allow_tf32))
    t0 = time.perf_counter()
    prog.advance(toks)
    loss0 = prog.last["loss"]
    emit(name, "first_step", first_step_s=round(time.perf_counter() - t0, 1), loss=loss0)
    t0 = time.perf_counter()
    for _ in range(2):
        prog.advance(toks)
    sync()
    emit(name, "warm", warm2_s=round(time.perf_counter() - t0, 3),
         cuda_graph=prog.stepper.graph is not None)
    t0 = time.perf_counter()
    n_host = 2 if TOY or size == "large" else 20
    for _ in range(n_host):                          # what the host spends per step (queued)
        prog.advance(toks)
    host_us = 1e6 * (time.perf_counter() - t0) / n_host
    reset_peak()
    rounds, per = _rounds(size)
    times, waits = timed(lambda: prog.advance(toks), rounds, per)
    med = statistics.median(times)
    torch.backends.cuda.matmul.allow_tf32 = bool(prog.spec.compile.allow_tf32)
    fl = peak_flops(device_name("triton"), str(prog.spec.train.dtype))
    flops = step_flops(prog.compiled)                 # executed, recompute included: HFU
    model = prog.compiled.model_flops()              # forward + backward, none recomputed: MFU
    launches = sum(getattr(ex, "launches_per_run", lambda: 0)()
                   for ex in prog.executors.by_graph.values())
    emit(name, "result", ms_median=round(1e3 * med, 4), ms_min=round(1e3 * min(times), 4),
         tokens_per_s=round(ntok / med), step_gflop=round(flops / 1e9, 3),
         model_gflop=round(model / 1e9, 3), mfu=(model / med / fl) if fl else None,
         hfu=(flops / med / fl) if fl else None, peak_cuda_mib=peak_mib(),
         loss_first=loss0, loss_after=prog.last["loss"], host_us_per_step=round(host_us, 1),
         launches_per_step=launches, **waits, **predicted(prog.compiled))


def predicted(compiled: Any) -> dict[str, Any]:
    """The cost model's step of this job's program on this device (`titanc.tools.cost_model`;
    the job's own environment is the config it lowers with): `predicted_ms` and per profile
    category, printed beside what was measured (`table`); the H100's constants on a device
    the model has none for (the toy run's CPU). Every GPU call re-fits the model
    (benchmarks/cost_fit.py reads the call once it is in benchmarks/results)."""
    from titanc.runtime.diagnostics.timing import device_name
    from titanc.tools import cost_model

    key = cost_model.device_key(device_name("triton")) or "h100"
    p = cost_model.predict(compiled, key)
    return {"predicted_device": key, "predicted_ms": round(1e3 * p["seconds"], 4),
            "predicted_launches": p["launches"],
            "predicted_categories": {c: round(1e3 * v["seconds"], 4)
                                     for c, v in p["categories"].items()}}


def _titans_model(torch: Any, s: Any, matched: bool) -> Any:
    from titans_pytorch import MemoryAsContextTransformer
    m = s.model
    att, mem = m.attention, m.memory
    D = m.d_model
    model = MemoryAsContextTransformer(
        num_tokens=m.vocab_size, dim=D, depth=m.n_layers, segment_len=att.segment,
        num_persist_mem_tokens=att.persistent_tokens, num_longterm_mem_tokens=0,
        neural_memory_segment_len=1 if matched else mem.chunk_size,
        neural_memory_batch_size=mem.chunk_size if matched else None,
        dim_head=D // att.heads, heads=att.heads, ff_mult=4, num_residual_streams=1,
        neural_memory_kwargs=dict(
            heads=mem.heads, dim_head=D // mem.heads, momentum=True,
            mem_model_norm_add_residual=False, default_step_transform_max_lr=mem.lr_max,
            activation=torch.nn.SiLU(),
            default_model_kwargs=dict(depth=mem.depth, expansion_factor=float(mem.expansion))))
    for p in model.parameters():
        p.data = p.data.clone()
    return model.to(DEV)


def _adamw_loop(torch: Any, params: list[Any], s: Any, loss_fn: Callable[[], Any],
                bf16: bool) -> Callable[[], Any]:
    opt = torch.optim.AdamW(params, lr=s.train.lr, betas=tuple(s.train.betas),
                            weight_decay=s.train.weight_decay)

    def step() -> Any:
        with torch.autocast("cuda" if DEV == "cuda" else "cpu", dtype=torch.bfloat16,
                            enabled=bf16):
            loss = loss_fn()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, s.train.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return step


def _time_torch(job: str, step: Callable[[], Any], ntok: int, flops: float | None = None,
                peak: float | None = None, loop: str = "", **extra: Any) -> None:
    """First step, two warm-up steps, then the timed loop (`_rounds(loop)`); with the step's
    model `flops` and the device's `peak`, its MFU."""
    t0 = time.perf_counter()
    loss0 = float(step().detach())
    emit(job, "first_step", first_step_s=round(time.perf_counter() - t0, 1), loss=loss0)
    for _ in range(2):
        step()
    reset_peak()
    rounds, per = _rounds(loop)
    times, waits = timed(step, rounds, per)
    med = statistics.median(times)
    if flops:
        extra.update(model_gflop=round(flops / 1e9, 3), mfu=flops / med / peak if peak else None)
    emit(job, "result", ms_median=round(1e3 * med, 4), ms_min=round(1e3 * min(times), 4),
         tokens_per_s=round(ntok / med), peak_cuda_mib=peak_mib(), loss_first=loss0,
         tokens_per_step=ntok, **waits, **extra)


def run_peer(name: str) -> None:
    """titans-pytorch 0.5.5 at the size's config, each variant in turn (one process)."""
    import torch
    size, variants = PEER[name]
    s = spec_of(size, {})
    ntok = s.train.batch_size * s.model.seq_len
    for matched, bf16 in variants:
        job = f"{name}_{'matched' if matched else 'default'}_{'bf16' if bf16 else 'f32'}"
        try:
            torch.manual_seed(0)
            model = _titans_model(torch, s, matched)
            toks = _tokens(s, rows=s.train.batch_size).to(DEV)
            step = _adamw_loop(torch, list(model.parameters()), s,
                               lambda: model(toks, return_loss=True), bf16)
            _time_torch(job, step, ntok, loop=size, size=SIZE_NOTE[size],
                        layers=s.model.n_layers,
                        parameters=sum(p.numel() for p in model.parameters()))
            del model, step
            if DEV == "cuda":
                torch.cuda.empty_cache()
        except Exception as e:
            emit(job, "error", error=f"{type(e).__name__}: {e}"[:600])


def run_ref(name: str) -> None:
    """tests/reference (the eager float32 model), under torch.compile or not."""
    import torch
    import tests.reference as R
    size, compiled = REF[name]
    s = spec_of(size, {})
    params = {k: v.to(DEV).requires_grad_(True)
              for k, v in R.init_params(s.model, 0, torch.float32).items()}
    fn = torch.compile(R.forward_loss) if compiled else R.forward_loss
    toks = _tokens(s, rows=s.train.batch_size).to(DEV)
    step = _adamw_loop(torch, list(params.values()), s, lambda: fn(params, toks, s.model), False)
    _time_torch(name, step, s.train.batch_size * s.model.seq_len, size=SIZE_NOTE[size])


def run_dense(name: str) -> None:
    """benchmarks/dense_transformer.py at the size's dimensions: compile (the first step),
    warm-up, timed steps; MFU from its `model_flops` (counted as titanc counts its own)."""
    from titanc.runtime.diagnostics.timing import device_name, peak_flops

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import dense_transformer as dt

    size, compiled = DENSE[name]
    s = spec_of(size, LARGE if size == "large" else {})
    step, model, B = dt.make_step(s, DEV, compiled, True)
    fl = peak_flops(device_name("triton"), "bfloat16") if DEV == "cuda" else None
    _time_torch(name, step, B * s.model.seq_len, loop=size, size=SIZE_NOTE[size],
                layers=s.model.n_layers, parameters=sum(p.numel() for p in model.parameters()),
                flops=dt.model_flops(dt.Dims.of(s), B), peak=fl)


def run_script(name: str, path: str) -> None:
    """An added job: `path` run with the results file and the deadline in its environment."""
    r = subprocess.run([sys.executable, str(ROOT / path)], cwd=ROOT)
    if r.returncode:
        emit(name, "error", error=f"{path} exited with {r.returncode}")


# -- the run ---------------------------------------------------------------------------------------

def _site(tmp: Path) -> dict[str, str]:
    """PYTHONPATH entries for the jobs: titanc laid out from the checkout (package-dir) unless
    it imports already (GPU_CHECK_LAYOUT=1 lays it out anyway); titans-pytorch installed from
    .gpu/whl (once)."""
    # the checkout last: its titanc/ folder is not the package (package-dir maps the rest in)
    paths = [x for x in os.environ.get("PYTHONPATH", "").split(os.pathsep) if x] + [str(ROOT)]
    probe = subprocess.run([sys.executable, "-c", "import titanc"], capture_output=True,
                           cwd="/")
    if probe.returncode or os.environ.get("GPU_CHECK_LAYOUT"):
        site = tmp / "site"
        shutil.rmtree(site, ignore_errors=True)
        shutil.copytree(ROOT / "titanc", site / "titanc")
        for p in ("ir", "passes", "codegen", "runtime"):
            shutil.copytree(ROOT / p, site / "titanc" / p)
        paths.insert(0, str(site))
    peer = tmp / "peer"
    wheels = sorted((ROOT / ".gpu" / "whl").glob("*.whl"))
    if wheels and not peer.exists():
        r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index",
                            "--no-deps", "--no-compile", "--target", str(peer),
                            *map(str, wheels)], capture_output=True, text=True)
        if r.returncode:
            print(f"peer wheels failed: {r.stderr[-300:]}", flush=True)
    return {"titanc": os.pathsep.join(paths),
            "peer": os.pathsep.join([str(peer), *paths]) if peer.exists() else ""}


def orchestrate(args: argparse.Namespace) -> int:
    t_start = time.time()
    OUT.mkdir(parents=True, exist_ok=True)
    RESULTS.unlink(missing_ok=True)
    logs = OUT / "logs"
    logs.mkdir(exist_ok=True)
    names: list[str] = []
    for item in (args.only.split(",") if args.only else list(GROUPS)):
        names += GROUPS.get(item, [item])
    scripts = dict(s.split("=", 1) for s in args.script)
    names += list(scripts)
    paths = _site(Path(os.environ.get("GPU_CHECK_TMP", "/tmp/gpu-check")))   # not under $OUT
    env = {**os.environ, "OUT": str(OUT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "GPU_CHECK_RESULTS": str(RESULTS), "GPU_CHECK_DEADLINE": str(t_start + args.deadline)}
    if args.toy:
        env.update(GPU_CHECK_TOY=json.dumps(TOY_SIZES), DEV="cpu", TRITON_INTERPRET="1")
    procs: dict[str, tuple[subprocess.Popen, Any]] = {}
    for name in names:
        kind = next((k for k, v in GROUPS.items() if name in v), "script" if name in scripts
                    else None)
        kind = "peer" if kind == "peer_default" else kind
        if kind is None:
            print(f"gpu_check: unknown job {name} (jobs: {', '.join(sum(GROUPS.values(), []))})")
            return 2
        if kind == "peer" and not paths["peer"]:
            emit(name, "error", error="no titans-pytorch wheels in .gpu/whl (docs/gpu.md)")
            continue
        cmd = [sys.executable, str(Path(__file__).resolve()), "job", kind, name]
        if kind == "script":
            cmd.append(scripts[name])
        log = open(logs / f"{name}.log", "w")
        job_env = {**env, "PYTHONPATH": paths["peer" if kind == "peer" else "titanc"],
                   "GPU_CHECK_JOB": name, **JOB_ENV.get(name, {})}
        if kind in ("ref", "dense"):         # inductor's compile workers would take every core
            job_env["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
        procs[name] = (subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                        env=job_env), log)
    ended: dict[str, Any] = {}
    while len(ended) < len(procs) and time.time() - t_start < args.deadline:
        for name, (p, _) in procs.items():
            if name not in ended and p.poll() is not None:
                ended[name] = {"rc": p.returncode, "at_s": round(time.time() - t_start, 1)}
                print(f"# {name} rc={p.returncode} at {ended[name]['at_s']} s", flush=True)
        # the jobs a timed loop waits for (`quiet_host`); an added script profiles, untimed
        running = [n for n in procs if n not in ended and n not in scripts]
        (OUT / "running.tmp").write_text(json.dumps(running))
        os.replace(OUT / "running.tmp", OUT / "running.json")
        time.sleep(1)
    for name, (p, log) in procs.items():
        if name not in ended:
            p.kill()
            p.wait()
            ended[name] = {"rc": "killed at the deadline", "at_s": round(time.time() - t_start)}
        log.close()
    report = summary_json(ended, time.time() - t_start, args.deadline)
    (OUT / "results.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    text = table(report)
    (OUT / "summary.txt").write_text(text)
    print(json.dumps({k: report[k] for k in ("device", "seconds", "deadline_s")}))
    print(text)
    return 0 if all(r.get("ok") is not False for r in report["jobs"].values()) else 1


def _records() -> dict[str, dict[str, Any]]:
    last: dict[str, dict[str, Any]] = {}
    if RESULTS.exists():
        for line in RESULTS.read_text().splitlines():
            r = json.loads(line)
            last.setdefault(r["job"], {}).update(r)
    return last


def summary_json(ended: dict[str, Any], seconds: float, deadline: float) -> dict[str, Any]:
    import platform
    device = "cpu"
    try:
        import torch
        if torch.cuda.is_available() and DEV == "cuda":
            device = torch.cuda.get_device_name()
    except Exception:
        pass
    return {"device": device, "host": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M"),
            "seconds": round(seconds, 1), "deadline_s": deadline, "toy": bool(TOY) or None,
            "processes": ended, "jobs": _records(), "loadavg": os.getloadavg()}


def table(report: dict[str, Any]) -> str:
    """The readable table: checks, then throughput rows with their progress."""
    lines = [f"{report['device']}, {report['date']}, {report['seconds']} s "
             f"(deadline {report['deadline_s']} s)", ""]
    jobs = report["jobs"]
    for name, r in sorted(jobs.items()):
        if "ok" in r:
            status = "PASS" if r["ok"] else "FAIL"
            lines.append(f"{status:5s} {name:28s} " + ", ".join(
                f"{k}={v:.3g}" for k, v in r.items() if isinstance(v, float) and k != "t"))
    lines += ["", f"{'job':34s} {'tokens/step':>11s} {'ms/step':>9s} {'tokens/s':>10s} "
                  f"{'MFU':>6s} {'peak MiB':>9s}  notes"]
    for name, r in sorted(jobs.items()):
        if "ok" in r or r["phase"] == "profile":
            continue
        notes = [str(r[k]) for k in ("size",) if k in r]
        if "layers" in r:
            notes.append(f"{r['layers']} layers")
        for k, unit in (("compile_s", "s compile"), ("first_step_s", "s first step"),
                        ("host_us_per_step", "us host/step"), ("launches_per_step", "launches")):
            if r.get(k) is not None:
                notes.append(f"{r[k]} {unit}")
        if r.get("hfu"):
            notes.append(f"HFU {100 * r['hfu']:.2f}% (recompute counted)")
        if r.get("host_quiet") is False:
            notes.append(f"timed while {len(r.get('compiling', []))} jobs compiled")
        if r["phase"] == "error":
            notes.append("ERROR " + str(r.get("error"))[:160])
        elif r["phase"] != "result":
            notes.append(f"reached {r['phase']} only")
        if "ms_median" in r:
            mfu = f"{100 * r['mfu']:.2f}%" if r.get("mfu") else "-"
            lines.append(f"{name:34s} {r.get('tokens_per_step', '-'):>11} "
                         f"{r['ms_median']:9.3f} {r['tokens_per_s']:10,} {mfu:>6s} "
                         f"{r.get('peak_cuda_mib') or '-':>9}  {', '.join(notes)}")
        else:
            lines.append(f"{name:34s} {r.get('tokens_per_step', '-'):>11} {'-':>9s} {'-':>10s} "
                         f"{'-':>6s} {'-':>9s}  {', '.join(notes)}")
    lines += prediction_lines(jobs)
    profiled = [(n, r) for n, r in sorted(jobs.items()) if r["phase"] == "profile"]
    if profiled:                     # benchmarks/gpu_profile.py: no CUDA graph, profiled
        lines += ["", f"{'profiled step (no CUDA graph)':34s} {'kernels':>8s} {'kernel us':>10s} "
                      f"{'wall us':>9s}  top kernels (us/step)"]
        for n, r in profiled:
            top = "; ".join(f"{t['kernel'][:40]} {t['us_per_step']}" for t in r["top"][:3])
            lines.append(f"{n:34s} {r['kernels_per_step']:8} {r['kernel_us_per_step']:10} "
                         f"{r['eager_wall_us_per_step']:9}  {top}")
        scans = [(n, s) for n, r in profiled for s in r.get("scans", [])]
        if scans:                    # what a scan kernel's serial tile round costs
            lines += ["", f"{'scan kernel':54s} {'grid':>5s} {'rounds':>6s} {'iters':>5s} "
                          f"{'per step':>8s} {'us/step':>9s} {'us/round':>8s}"]
            lines += [f"{(n + ' ' + s['kernel'].removeprefix('titanc_tem_fused_'))[:54]:54s} "
                      f"{s['grid']:5} {s['rounds']:6} {s['iterations']:5} {s['per_step']:8} "
                      f"{s['us_per_step']:9} {s['us_per_round']:8}" for n, s in scans]
    silent = [n for n in report.get("processes", {}) if n not in jobs
               and not any(j.startswith(n + "_") for j in jobs)]
    if silent:
        lines += ["", "no record (killed before its first phase, or crashed):"]
        lines += [f"  {n}: {report['processes'][n]}" for n in silent]
    return "\n".join(lines) + "\n"


def prediction_lines(jobs: dict[str, Any]) -> list[str]:
    """The cost model beside the measurement: per titanc job its predicted step and error,
    and per profile category predicted ms against measured (where the call profiled the job:
    each category's share of the profile's kernel time times the measured step;
    `titanc.tools.cost_model.measured_categories`)."""
    from titanc.tools.cost_model import measured_categories

    rows = [(n, r) for n, r in sorted(jobs.items()) if "predicted_ms" in r and "ms_median" in r]
    if not rows:
        return []
    out = ["", f"{'cost model, this program':34s} {'device':>6s} {'measured':>9s} "
               f"{'predicted':>9s} {'error':>7s}  per category: predicted / measured ms"]
    for n, r in rows:
        prof = jobs.get(f"profile_{n}")
        meas = measured_categories(prof, r["ms_median"]) if prof else {}
        cats = dict(r["predicted_categories"])
        cats.update({c: cats.get(c, 0.0) for c in meas})
        per = "; ".join(f"{c} {v:.3f}" + (f" / {meas[c]:.3f}" if c in meas else "")
                        for c, v in cats.items())
        err = 100 * (r["predicted_ms"] / r["ms_median"] - 1)
        out.append(f"{n:34s} {r['predicted_device']:>6s} {r['ms_median']:9.3f} "
                   f"{r['predicted_ms']:9.3f} {err:6.1f}%  {per}")
    return out


def run_job(kind: str, name: str, extra: list[str]) -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    sys.path.append(str(ROOT))              # after the laid-out site: ROOT/titanc is not the package
    try:
        if kind == "script":
            run_script(name, extra[0])
        else:
            {"checks": run_check, "titanc": run_titanc, "peer": run_peer,
             "ref": run_ref, "dense": run_dense}[kind](name)
    except Exception as e:
        emit(name, "error", error=f"{type(e).__name__}: {e}"[:800],
             trace=traceback.format_exc()[-1500:])
        return 1
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["job"]:
        return run_job(argv[1], argv[2], argv[3:])
    if argv[:1] == ["summary"]:
        print(table(summary_json({}, 0.0, 0.0)))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--deadline", type=float, default=480.0,
                    help="seconds after which every job still running is killed")
    ap.add_argument("--only", default=None,
                    help="comma-separated groups (checks, titanc, peer, ref) or job names")
    ap.add_argument("--script", action="append", default=[], metavar="NAME=PATH",
                    help="an added job: run PATH (records appended to $GPU_CHECK_RESULTS)")
    ap.add_argument("--toy", action="store_true",
                    help="every size shrunk, on CPU with Triton's interpreter (a dry run)")
    return orchestrate(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
