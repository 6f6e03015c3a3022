"""The training loop behind `titanc train`: data, steps, metrics, evals, checkpoints, plot.

    summary = run_training(spec, out="runs/tiny", data="notes.txt", steps=500)

A run directory holds
    spec.yaml               the spec as trained (with --data / --steps folded in)
    tokenizer.json          a copy of data.tokenizer when it is a BPE file (not for byte)
    metrics.jsonl           {step, loss, lr, grad_norm, tokens_per_s} per step and
                            {step, eval_loss[, eval_accuracy]} every train.eval_every steps
                            {step, memory: {layers: [...]}} every train.memory_stats_every
                            steps (memory diagnostics, runtime/memory_stats.py; 0 = off)
    checkpoint.safetensors  model + optimizer + step + sampler RNG + spec, written atomically
                            every train.checkpoint_every steps and at the end
    loss.png                training and held-out loss against steps

Resuming (`resume=RUN`) restores the parameters, the AdamW moments, the step (which drives the
learning-rate schedule) and the sampler's generator, so N steps straight and N/2 + resume +
N/2 give identical parameters. `train.steps` is the total the schedule spans, counted from
the start of the run, not from the resume point.

A non-finite loss or gradient norm stops the run with a TitancError; checkpoints are only
written after finite steps, so the last one on disk is good.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import torch
import yaml

import titanc
from titanc.errors import TitancError
from titanc.spec import Spec, load_spec, spec_to_dict

from .checkpoint import (CHECKPOINT_NAME, RNG_KEY, check_resumable, checkpoint_path,
                         load_checkpoint, restore, save_checkpoint)
from .data import SyntheticRecall, TextData, make_data
from .tokenizer import check_same_tokenizer, check_vocab, load_tokenizer, save_tokenizer

__all__ = ["Trainer", "run_training", "write_loss_plot", "read_metrics"]

Tensor = torch.Tensor
EVAL_SEED_OFFSET = 1_000_003   # eval batches come from their own generator, reset every eval


class Trainer:
    """One training run into `out`. Everything that can fail on bad input (the data, the
    checkpoint, the run directory) is checked in `__init__`, before anything is written.

    `until` stops the run early at that step (checkpointed there) while the learning-rate
    schedule still spans train.steps: a run cut short, as if interrupted. `log` receives the
    human-readable lines (default: stdout, without tearing the progress bar)."""

    def __init__(self, spec: Spec | str | os.PathLike, out: str | os.PathLike, *,
                 data: str | None = None, steps: int | None = None,
                 resume: str | os.PathLike | None = None, strict: bool = False,
                 profile: bool = False, until: int | None = None, progress: bool = True,
                 log: Callable[[str], None] | None = None):
        overrides: dict[str, Any] = {}
        if data is not None:
            overrides["data.source"] = data
        if steps is not None:
            overrides["train.steps"] = steps
        if not isinstance(spec, Spec) or overrides:
            spec = load_spec(spec, overrides)
        self.spec = spec
        self.out = Path(out)
        self.profile = profile
        self.progress = progress
        self.log = log or _write_line
        self.tokenizer = load_tokenizer(spec)      # data.tokenizer; copied into the run
        check_vocab(spec, self.tokenizer)
        self.data = make_data(spec)
        self.resume_path: Path | None = None
        self.restored: dict[str, Any] | None = None
        self.until = spec.train.steps if until is None else min(until, spec.train.steps)
        start = 0
        if resume is not None:  # check the checkpoint before paying for a compile
            self.resume_path = checkpoint_path(resume)
            tensors, meta = load_checkpoint(self.resume_path)
            if RNG_KEY not in tensors:
                raise TitancError(f"{self.resume_path} has no sampler state ({RNG_KEY}); it "
                                  f"cannot be resumed bit for bit")
            check_resumable(tensors, meta, spec, strict=strict, path=self.resume_path)
            check_same_tokenizer(self.tokenizer, meta["extra"].get("tokenizer_hash"),
                                 self.resume_path)
            start = meta["step"]
        if start >= self.until:
            raise TitancError(
                f"the checkpoint is at step {start} and train.steps is {spec.train.steps}: "
                f"nothing to train; pass --steps N with a total N > {start}")
        self._check_out_dir()
        self.prog = titanc.compile(spec)
        self.gen = torch.Generator().manual_seed(spec.train.seed)
        if resume is not None:
            self.restored = restore(self.prog, tensors, meta, strict=strict,
                                    path=self.resume_path)
            self.gen.set_state(tensors[RNG_KEY])
        self.rows = spec.train.grad_accum * spec.train.batch_size
        self.tokens_per_step = self.rows * spec.model.seq_len
        self.ckpt = self.out / CHECKPOINT_NAME
        self.metrics_path = self.out / "metrics.jsonl"
        self.last_ckpt_step: int | None = start if self._resuming_in_place else None
        self.times: dict[str, float] = defaultdict(float)

    # -- setup ----------------------------------------------------------------------------------
    @property
    def _resuming_in_place(self) -> bool:
        return (self.resume_path is not None
                and self.resume_path.resolve() == (self.out / CHECKPOINT_NAME).resolve())

    def _check_out_dir(self) -> None:
        if self.out.exists() and not self.out.is_dir():
            raise TitancError(f"--out {self.out} is a file; pass a directory for the run")
        ckpt = self.out / CHECKPOINT_NAME
        if ckpt.exists() and not self._resuming_in_place:
            raise TitancError(f"--out {self.out} already holds a run ({ckpt}); continue it with "
                              f"--resume {self.out} or choose another --out")

    def _start_metrics(self) -> None:
        """Fresh run: an empty metrics.jsonl. Resume: keep the history up to the restored step
        (dropping lines a crashed run wrote after its last checkpoint)."""
        history: list[dict[str, Any]] = []
        if self.resume_path is not None:
            history = [m for m in read_metrics(self.resume_path.parent / "metrics.jsonl")
                       if m.get("step", 0) <= self.prog.step]
        tmp = self.metrics_path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(m) + "\n" for m in history))
        os.replace(tmp, self.metrics_path)

    # -- pieces ---------------------------------------------------------------------------------
    def _write(self, record: dict[str, Any]) -> None:
        self._metrics.write(json.dumps(record) + "\n")
        self._metrics.flush()

    def evaluate(self) -> dict[str, float]:
        """Mean held-out loss over train.eval_batches batches (the same batches every time);
        for synthetic:recall also the recall accuracy, when the program exposes logits."""
        if hasattr(self.data, "has_split") and not self.data.has_split("val"):
            return {}
        gen = torch.Generator().manual_seed(self.spec.train.seed + EVAL_SEED_OFFSET)
        losses, accs = [], []
        for _ in range(self.spec.train.eval_batches):
            tokens = self.data.batch(self.spec.train.batch_size, "val", gen)
            losses.append(self.prog.loss(tokens))
            if isinstance(self.data, SyntheticRecall) and hasattr(self.prog, "logits"):
                accs.append(self.data.accuracy(self.prog, tokens))
        out = {"eval_loss": sum(losses) / len(losses)}
        if accs:
            out["eval_accuracy"] = sum(accs) / len(accs)
        return out

    def _memory_stats(self) -> None:
        """One record {step, memory: {layers: [...]}} of memory diagnostics on the first
        held-out batch (runtime/memory_stats.py)."""
        from .memory_stats import memory_stats

        gen = torch.Generator().manual_seed(self.spec.train.seed + EVAL_SEED_OFFSET)
        split = "val" if not hasattr(self.data, "has_split") or self.data.has_split("val") \
            else "train"
        tokens = self.data.batch(self.spec.train.batch_size, split, gen)
        self._write({"step": self.prog.step, "memory": memory_stats(self.prog, tokens)})

    def _checkpoint(self) -> None:
        save_checkpoint(self.ckpt, self.prog, self.gen.get_state(),
                        extra={"data": self.spec.data.source,
                               "tokenizer_hash": self.tokenizer.hash,
                               "tokens_seen": self.prog.step * self.tokens_per_step})
        self.last_ckpt_step = self.prog.step

    def _nonfinite(self, what: str, value: float) -> TitancError:
        step, lr = self.prog.step, self.prog.last.get("lr", self.spec.train.lr)
        if self.last_ckpt_step is None:
            kept = ("no checkpoint was written before it (train.checkpoint_every="
                    f"{self.spec.train.checkpoint_every})")
            then = "train again"
        else:
            kept = f"the last good checkpoint (step {self.last_ckpt_step}) is kept in {self.ckpt}"
            then = f"continue with --resume {self.out}"
        return TitancError(f"step {step}: {what} is {value}; {kept}; lower train.lr (the lr "
                           f"was {lr:.3g}) or raise train.warmup, then {then}")

    # -- the loop -------------------------------------------------------------------------------
    def step(self) -> dict[str, float]:
        """One optimizer step on the next training batch; logs it and returns prog.last."""
        t0 = time.perf_counter()
        tokens = self.data.batch(self.rows, "train", self.gen)
        t1 = time.perf_counter()
        self.prog.train_step(tokens)
        t2 = time.perf_counter()
        self.times["data"] += t1 - t0
        self.times["train_step"] += t2 - t1
        last = dict(self.prog.last)
        for what in ("loss", "grad_norm"):  # the loss first: it is what users watch
            if not math.isfinite(last[what]):
                raise self._nonfinite(what, last[what])
        last["tokens_per_s"] = self.tokens_per_step / max(t2 - t0, 1e-9)
        self._write({"step": self.prog.step,
                     **{k: last[k] for k in ("loss", "lr", "grad_norm", "tokens_per_s")}})
        return last

    def _due(self, every: int) -> bool:
        return bool(every and self.prog.step % every == 0) or self.prog.step == self.until

    def _timed(self, phase: str, fn: Callable[[], Any]) -> Any:
        t0 = time.perf_counter()
        try:
            return fn()
        finally:
            self.times[phase] += time.perf_counter() - t0

    def run(self) -> dict[str, Any]:
        """Train from the current step to `until`; returns the summary (see run_training)."""
        spec, prog = self.spec, self.prog
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "spec.yaml").write_text(
            yaml.safe_dump(spec_to_dict(spec), sort_keys=False, default_flow_style=None))
        save_tokenizer(self.tokenizer, self.out)
        self._start_metrics()
        self._report_start()
        start_step, t_start = prog.step, time.perf_counter()
        self._start_step = start_step
        last: dict[str, float] = {}
        evals: dict[str, float] = {}
        bar = _progress(self.until, start_step, spec.name, enabled=self.progress)
        self._metrics = open(self.metrics_path, "a")
        from .executor import profiling
        profiler = profiling() if self.profile else None
        self._kernel_profile = profiler.__enter__() if profiler else None
        try:
            while prog.step < self.until:
                last = self.step()
                bar.update(1)
                bar.set_postfix(loss=f"{last['loss']:.4f}", tok_s=f"{last['tokens_per_s']:,.0f}",
                                refresh=False)
                if self._due(spec.train.eval_every):
                    evals = self._timed("eval", self.evaluate)
                    if evals:
                        self._write({"step": prog.step, **evals})
                        self.log(f"step {prog.step}: " + ", ".join(
                            f"{k} {v:.4f}" for k, v in evals.items()))
                every = spec.train.memory_stats_every
                if every and spec.model.has_memory and self._due(every):
                    self._timed("eval", self._memory_stats)
                if self._due(spec.train.checkpoint_every):
                    self._timed("checkpoint", self._checkpoint)
        except KeyboardInterrupt:
            bar.close()
            kept = (f"the last checkpoint (step {self.last_ckpt_step}) is in {self.ckpt}; continue "
                    f"with --resume {self.out}" if self.last_ckpt_step is not None
                    else "no checkpoint was written yet")
            self.log(f"interrupted after step {prog.step}; {kept}")
            raise
        finally:
            if profiler:
                profiler.__exit__(None, None, None)
            bar.close()
            self._metrics.close()
            self._timed("plot", self._plot)
        seconds = time.perf_counter() - t_start
        steps_run = prog.step - start_step
        train_seconds = self.times["train_step"] + self.times["data"]
        summary: dict[str, Any] = {
            "out": str(self.out), "steps": prog.step, "steps_run": steps_run,
            "loss": last.get("loss"), "eval_loss": evals.get("eval_loss"),
            "eval_accuracy": evals.get("eval_accuracy"), "seconds": seconds,
            "tokens_per_s": steps_run * self.tokens_per_step / max(train_seconds, 1e-9),
            "new_parameters": (self.restored or {}).get("new", []),
        }
        if isinstance(self.data, TextData):
            summary["unigram_loss"] = self.data.unigram_entropy("val")
        if self.profile:
            summary["profile"] = self._profile(seconds)
        self._report_end(summary)
        return summary

    # -- reporting ------------------------------------------------------------------------------
    def _report_start(self) -> None:
        spec, r = self.spec, self.restored
        if r is not None:
            self.log(f"resumed {self.resume_path} at step {r['step']}")
            for field, old, new in r["model_changes"] + r["train_changes"]:
                self.log(f"  {field}: {old!r} in the checkpoint, {new!r} now")
            if r["new"]:
                self.log(f"  new parameters (fresh initialisation): {', '.join(r['new'])}")
        self.log(f"training {spec.name} on {self.data.description}: steps {self.prog.step + 1}"
                 f"..{self.until} of {spec.train.steps}, {self.rows}x{spec.model.seq_len} "
                 f"tokens per step -> {self.out}")

    def _report_end(self, s: dict[str, Any]) -> None:
        parts = [f"step {s['steps']}", f"loss {s['loss']:.4f}"]
        if s["eval_loss"] is not None:
            parts.append(f"held-out loss {s['eval_loss']:.4f}")
        if "unigram_loss" in s:
            parts.append(f"unigram baseline {s['unigram_loss']:.4f}")
        if s["eval_accuracy"] is not None:
            parts.append(f"recall accuracy {s['eval_accuracy']:.3f}")
        parts.append(f"{s['tokens_per_s']:,.0f} tokens/s")
        self.log("done: " + ", ".join(parts) + f" ({s['seconds']:.1f} s)")

    def _profile(self, seconds: float) -> dict[str, Any]:
        prof: dict[str, Any] = {k: round(v, 4) for k, v in self.times.items()}
        prof["peak_rss_bytes"] = _peak_rss_bytes()
        if torch.cuda.is_available():
            prof["peak_cuda_bytes"] = torch.cuda.max_memory_allocated()
        from titanc.bench import profile_table
        steps = max(1, self.prog.step - self._start_step)
        self.log(profile_table(self._kernel_profile, steps, steps * self.tokens_per_step,
                               self.times["train_step"], prof["peak_rss_bytes"],
                               dtype=str(self.spec.train.dtype),
                               threads=torch.get_num_threads()))
        self.log("time per phase of the run:")
        rows = dict(self.times)
        rows["other"] = max(0.0, seconds - sum(rows.values()))
        for k, v in rows.items():
            self.log(f"  {k:<12} {v:8.2f} s  {100 * v / max(seconds, 1e-9):5.1f}%")
        self.log(f"  peak memory  {prof['peak_rss_bytes'] / 2**20:8.1f} MiB (process RSS)")
        return prof

    def _plot(self) -> None:
        baseline = (self.data.unigram_entropy("val") if isinstance(self.data, TextData)
                    else None)
        try:
            write_loss_plot(self.metrics_path, self.out / "loss.png", title=self.spec.name,
                            baseline=baseline)
        except Exception as exc:  # a plot must never hide the run's own outcome
            self.log(f"note: could not write {self.out / 'loss.png'}: {exc}")


def _peak_rss_bytes() -> int:
    try:
        import resource
    except ImportError:  # not POSIX
        return 0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # bytes on macOS, KiB on Linux


def _write_line(msg: str) -> None:
    """Print to stdout without tearing a progress bar that is on screen."""
    from tqdm import tqdm
    tqdm.write(msg, file=sys.stdout)


def _progress(total: int, initial: int, desc: str, enabled: bool) -> Any:
    from tqdm import tqdm
    return tqdm(total=total, initial=initial, desc=desc, unit="step", disable=not enabled,
                dynamic_ncols=True, file=sys.stderr, mininterval=0.5)


# ---------------------------------------------------------------------------------- metrics


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl ([] when it does not exist; a torn last line is skipped)."""
    p = Path(path)
    if not p.exists():
        return []
    out = []
    for line in p.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def write_loss_plot(metrics: str | os.PathLike, png: str | os.PathLike, title: str = "",
                    baseline: float | None = None) -> bool:
    """Plot training and held-out loss from `metrics` into `png`. Returns False (and writes
    nothing) when matplotlib is not installed."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return False
    records = read_metrics(metrics)
    train = [(m["step"], m["loss"]) for m in records if "loss" in m]
    evals = [(m["step"], m["eval_loss"]) for m in records if "eval_loss" in m]
    fig = Figure(figsize=(6, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    if train:
        ax.plot(*zip(*train), label="train loss", lw=1)
    if evals:
        ax.plot(*zip(*evals), "o-", label="held-out loss", ms=3)
    if baseline is not None:
        ax.axhline(baseline, color="gray", ls="--", lw=1, label="unigram baseline")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if train or evals or baseline is not None:
        ax.legend()
    fig.tight_layout()
    fig.savefig(os.fspath(png))
    return True


def run_training(spec: Spec | str | os.PathLike, out: str | os.PathLike, data: str | None = None,
                 steps: int | None = None, resume: str | os.PathLike | None = None,
                 strict: bool = False, profile: bool = False, **kwargs: Any) -> dict[str, Any]:
    """Train `spec` into the run directory `out` (see the module docstring); returns a summary
    {out, steps, steps_run, loss, eval_loss, eval_accuracy, seconds, tokens_per_s,
    new_parameters[, unigram_loss][, profile]}. Extra keyword arguments go to `Trainer`."""
    return Trainer(spec, out, data=data, steps=steps, resume=resume, strict=strict,
                   profile=profile, **kwargs).run()
