"""The first run on a GPU: does the triton target agree with the cpu target, and how fast is it?

    make venv && make gpu-check                 # or: .venv/bin/python benchmarks/gpu_check.py
    .venv/bin/python benchmarks/gpu_check.py --quick          # small sizes, no throughput table

Runs unattended, nothing downloaded. Checks, each printed PASS/FAIL (exit status 1 if any fail):

  step/float32        one training step of each spec, triton vs cpu target (same initial weights,
                      same tokens), float32 with exact dots: loss and every parameter after the
                      AdamW update within 1e-4 relative (float32 reduction order differs)
  step/float32+tf32   the same with compile.allow_tf32 (tensor cores): within 2e-2
  step/bfloat16       the same with train.dtype bfloat16 (mixed precision, float32 masters):
                      within 2e-2
  decode              the triton program's token-by-token decode equals its own parallel
                      forward (every position's logits), within 1e-3
  decode/bfloat16     the same for a bfloat16 program, within 5e-2 of the largest logit
  throughput          (without --quick) tokens/s, MFU and peak CUDA memory of a training step:
                      titanc (triton, float32, tf32 and bfloat16) vs the eager reference and
                      torch.compile of it (tests/reference), at the benchmark sizes

Each check prints a `# name: {json}` line as it finishes; the throughput table runs after the
first spec's checks; `--budget S` starts nothing past S seconds (reported NOT RUN), so a run
under a time limit still reports what it finished.

Without a CUDA device the same code runs on CPU (triton interpreted) at --quick sizes, which is
how it is exercised in this repository; the throughput table needs CUDA and is skipped.
Prints one JSON object (checks, throughput, device, load average) then a readable table.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import titanc  # noqa: E402
import tests.reference as R  # noqa: E402
from titanc.tools.bench import step_flops  # noqa: E402
from titanc.runtime.diagnostics.timing import device_name, peak_flops  # noqa: E402

SPECS = ("tiny.yaml", "tiny_lmm.yaml", "tiny_attn.yaml")
QUICK = {"model.d_model": 16, "model.n_layers": 1, "model.seq_len": 16, "model.vocab_size": 32,
         "model.ffn_hidden": 32, "train.batch_size": 1, "model.memory.chunk_size": 4,
         "model.attention.segment": 8, "model.attention.window": 8, "train.loss_chunk": 0}


def _compile(spec: str, target: str, over: dict[str, Any]) -> Any:
    prog = titanc.compile(ROOT / "examples" / spec, **{**over, "compile.target": target})
    params = R.init_params(prog.spec.model, seed=3, dtype=torch.float32)
    prog.load_state_dict({f"param.{k}": v for k, v in params.items()}, strict=False)
    return prog


def _tokens(prog: Any, seed: int = 2) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    s = prog.spec
    return torch.randint(0, s.model.vocab_size, (s.train.batch_size, s.model.seq_len + 1),
                         generator=gen)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).abs().max() / max(float(b.abs().max()), 1e-12))


def check_step(spec: str, over: dict[str, Any], tol: float) -> dict[str, Any]:
    progs = {t: _compile(spec, t, over) for t in ("cpu", "triton")}
    toks = _tokens(progs["cpu"])
    loss = {t: p.train_step(toks) for t, p in progs.items()}
    worst = max(_rel(progs["triton"].parameters()[n], p)
                for n, p in progs["cpu"].parameters().items())
    loss_err = abs(loss["triton"] - loss["cpu"]) / max(abs(loss["cpu"]), 1e-12)
    return {"ok": loss_err <= tol and worst <= tol, "loss_cpu": loss["cpu"],
            "loss_triton": loss["triton"], "loss_rel_err": loss_err,
            "param_max_rel_err": worst, "tolerance": tol}


def check_decode(spec: str, over: dict[str, Any], tol: float) -> dict[str, Any]:
    from titanc.runtime.serve.generate import Generator

    prog = _compile(spec, "triton", {**over, "train.batch_size": 1})
    toks = _tokens(prog)
    n = prog.spec.model.seq_len
    want = prog.logits(toks)                         # [1, n, V]
    gen = Generator(prog)
    prompt = max(1, n // 2 + 1)                      # ends mid-chunk
    st, logits = gen.prefill(toks[0, :prompt].tolist())
    rest = [gen.step(st, toks[:, t:t + 1]).clone() for t in range(prompt, n)]
    err = _rel(torch.cat([logits] + rest, 1), want)
    return {"ok": err <= tol, "logits_max_rel_err": err, "tolerance": tol}


def _time(step: Callable[[], Any], steps: int, warmup: int) -> tuple[float, int]:
    cuda = torch.cuda.is_available()
    for _ in range(warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    if cuda:
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() if cuda else 0
    return (time.perf_counter() - t0) / steps, peak


def throughput(spec: str, steps: int, warmup: int) -> list[dict[str, Any]]:
    rows = []
    for label, tf32, dtype in (("titanc triton float32", False, "float32"),
                               ("titanc triton tf32", True, "float32"),
                               ("titanc triton bfloat16", False, "bfloat16")):
        prog = _compile(spec, "triton", {"compile.allow_tf32": tf32, "train.dtype": dtype})
        toks = _tokens(prog)
        sec, peak = _time(lambda: prog.train_step(toks), steps, warmup)
        torch.backends.cuda.matmul.allow_tf32 = tf32   # what peak_flops reads
        fl = peak_flops(device_name("triton"), dtype)
        rows.append({"name": label, "sec_per_step": sec, "tokens_per_s": toks[:, 1:].numel() / sec,
                     "mfu": step_flops(prog.compiled) / sec / fl if fl else None,
                     "peak_cuda_bytes": peak})
    torch.backends.cuda.matmul.allow_tf32 = False
    prog = _compile(spec, "cpu", {})
    s, toks = prog.spec, _tokens(prog)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    for label, compiled in (("eager reference", False), ("torch.compile(reference)", True)):
        params = {k: v.to(dev).requires_grad_(True)
                  for k, v in R.init_params(s.model, 0, torch.float32).items()}
        opt = torch.optim.AdamW(params.values(), lr=s.train.lr, betas=s.train.betas,
                                weight_decay=s.train.weight_decay)
        fn = torch.compile(R.forward_loss) if compiled else R.forward_loss
        t = toks.to(dev)

        def step() -> None:
            loss = fn(params, t, s.model)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(list(params.values()), s.train.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)

        sec, peak = _time(step, steps, warmup)
        fl = peak_flops(device_name("triton"), "float32")
        rows.append({"name": label, "sec_per_step": sec, "tokens_per_s": t[:, 1:].numel() / sec,
                     "mfu": step_flops(prog.compiled) / sec / fl if fl else None,
                     "peak_cuda_bytes": peak})
    return rows


def _throughput_rows(spec: str, steps: int, warmup: int) -> list[dict[str, Any]]:
    """`throughput`, a crash reported as a row (the checks still get printed)."""
    try:
        rows = throughput(spec, steps, warmup)
    except Exception as e:
        rows = [{"name": "throughput", "error": f"{type(e).__name__}: {e}"[:500]}]
    print(f"# throughput: {json.dumps(rows, default=str)}", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, no throughput table")
    ap.add_argument("--specs", default=",".join(SPECS))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--budget", type=float, default=0.0,
                    help="seconds: start no check or throughput run past this (0: no limit); "
                         "what is skipped is reported NOT RUN")
    args = ap.parse_args()
    t_start = time.perf_counter()

    def over_budget() -> bool:
        return bool(args.budget) and time.perf_counter() - t_start > args.budget

    cuda = torch.cuda.is_available()
    over = QUICK if args.quick or not cuda else {}
    checks: dict[str, dict[str, Any]] = {}
    rows: list[dict[str, Any]] = []
    for i, spec in enumerate(args.specs.split(",")):
        if i == 1 and cuda and not args.quick and not over_budget():
            rows = _throughput_rows(SPECS[0], args.steps, args.warmup)
        for name, fn in ((f"{spec} step/float32", lambda: check_step(spec, over, 1e-4)),
                         (f"{spec} decode", lambda: check_decode(spec, over, 1e-3)),
                         (f"{spec} step/bfloat16",
                          lambda: check_step(spec, {**over, "train.dtype": "bfloat16"}, 2e-2)),
                         (f"{spec} step/float32+tf32",
                          lambda: check_step(spec, {**over, "compile.allow_tf32": True}, 2e-2)),
                         (f"{spec} decode/bfloat16",
                          lambda: check_decode(spec, {**over, "train.dtype": "bfloat16"}, 5e-2))):
            if over_budget():
                checks[name] = {"ok": None, "error": "not run: past --budget"}
                continue
            t0 = time.perf_counter()
            try:
                checks[name] = fn()
            except Exception as e:  # a crash is a failed check, reported with the others
                checks[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:500]}
            checks[name]["seconds"] = time.perf_counter() - t0
            print(f"# {name}: {json.dumps(checks[name], default=str)}", flush=True)
    if not rows and cuda and not args.quick and not over_budget():
        rows = _throughput_rows(SPECS[0], args.steps, args.warmup)
    print(json.dumps({"device": device_name("triton"), "cuda": cuda, "checks": checks,
                      "throughput": rows, "loadavg": os.getloadavg()}, default=str))
    for name, c in checks.items():
        status = {True: "PASS", False: "FAIL", None: "NOT RUN"}[c["ok"]]
        detail = c.get("error") or ", ".join(f"{k}={v:.3g}" for k, v in c.items()
                                             if isinstance(v, float))
        print(f"{status:8s} {name:32s} {detail}")
    if rows:
        print(f"\n{'':26s} {'ms/step':>9s} {'tokens/s':>10s} {'MFU':>7s} {'peak MiB':>9s}")
        for r in rows:
            if "error" in r:
                print(f"{r['name']:26s} FAILED: {r['error']}")
                continue
            mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] else "-"
            print(f"{r['name']:26s} {1e3 * r['sec_per_step']:9.2f} {r['tokens_per_s']:10.0f} "
                  f"{mfu:>7s} {r['peak_cuda_bytes'] / 2**20:9.1f}")
    return 0 if all(c["ok"] is not False for c in checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
