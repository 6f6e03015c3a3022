"""The training loop behind `titanc train`: data, steps, metrics, evals, checkpoints, plot.

    summary = run_training(spec, out="runs/tiny", data="notes.txt", steps=500)

A run directory holds
    spec.yaml               the spec as trained (with --data / --steps folded in)
    tokenizer.json          a copy of data.tokenizer when it is a BPE file (not for byte)
    metrics.jsonl           {step, loss, lr, grad_norm, tokens_per_s} per step and
                            {step, eval_loss[, eval_accuracy]} every train.eval_every steps
                            {step, memory: {layers: [...]}} every train.memory_stats_every
                            steps (memory diagnostics, runtime/diagnostics/neural_memory.py; 0 = off)
    checkpoint.safetensors  model + optimizer + step + sampler RNG + spec, written atomically
                            every train.checkpoint_every steps and at the end
    loss.png                training and held-out loss against steps
    .lock                   holds the pid of the trainer using the directory (flock)

Distributed (`dist=`, see runtime/train/distributed.py): train.batch_size is per rank; every rank
draws the same global batch of world·grad_accum·batch_size rows from the shared generator and
reads only its own contiguous part, so the sequence of global batches (and the checkpoint,
which rank 0 writes after gathering ZeRO-1 shards) does not depend on the number of ranks.
Only rank 0 writes the run directory and prints; the logged loss is the mean over ranks and
tokens/s counts the whole job.

Resuming (`resume=RUN`) restores the parameters, the AdamW moments, the step (which drives the
learning-rate schedule) and the sampler's generator, so N steps straight and N/2 + resume +
N/2 give identical parameters. `train.steps` is the total the run trains to, counted from the
start of the run, not from the resume point; the warmup + cosine schedule keeps the span the
checkpoint was trained with (a longer run continues at its final learning rate), unless
`reschedule`. SIGTERM and SIGINT (Ctrl-C) stop at the next step boundary with a checkpoint.

A non-finite loss, gradient norm or held-out loss stops the run with a TitancError, and the
checkpoint on disk is always one a run can continue from: before the state of step k replaces
it, every parameter and AdamW moment must be finite and step k+1 is tried on it, i.e. the
loss and gradients of the batch step k+1 will draw (its first micro-batch; the sampler's
generator is copied, not advanced) must be finite. A state that fails is never written.

The run directory is locked for the whole run (runtime/train/rundir.py): a second trainer into the
same --out fails with an error naming the process that holds it.
"""
from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from collections import defaultdict
from pathlib import Path
from collections.abc import Collection
from typing import Any, Callable

import torch
import yaml

import titanc
from titanc.errors import TitancError, printable
from titanc.model.spec import Spec, load_spec, spec_to_dict

from titanc.runtime.children import StopRequest, stop_on_term
from titanc.runtime.api_checks import first_nonfinite
from titanc.runtime.train.checkpoint import (CHECKPOINT_NAME, RNG_KEY, check_resumable, checkpoint_path,
                         load_checkpoint, remove_stale_temps, restore, save_checkpoint)
from titanc.runtime.data.datasets import SyntheticRecall, TextData, draw, make_data
from titanc.runtime.diagnostics.timing import peak_rss_bytes, profile_table
from titanc.files import write_text_atomic, writing_into
from titanc.runtime.train.rundir import LOCK_NAME, RunDir
from titanc.runtime.train.distributed import Dist, DistributedError, GradReducer
from titanc.runtime.data.tokenizer import (TOKENIZER_FILE, check_same_tokenizer, check_vocab,
                                          load_tokenizer, save_tokenizer)
from titanc.runtime.train.metrics import PLOT_EXTRA, read_metrics, write_loss_plot
from titanc.runtime.lr_schedule import lr_at
from titanc.runtime.train.shard_source import from_shards

__all__ = ["Trainer", "run_training", "write_loss_plot", "read_metrics"]

Tensor = torch.Tensor
# the files a run writes into its directory besides the checkpoint (tokenizer.json: copied, or
# removed for a byte-level run), with their temporaries
RUN_FILES = ("spec.yaml", "metrics.jsonl", "loss.png", TOKENIZER_FILE, "spec.yaml.tmp",
             "metrics.jsonl.tmp", TOKENIZER_FILE + ".tmp")
EVAL_SEED_OFFSET = 1_000_003   # eval batches come from their own generator, reset every eval


class Trainer:
    """One training run into `out`. Everything that can fail on bad input (the data, the
    checkpoint, the run directory) is checked in `__init__`, before anything is written.

    `until` stops the run early at that step (checkpointed there) while the learning-rate
    schedule still spans train.steps: a run cut short, as if interrupted. Resumed with a
    train.steps other than the checkpoint's, the run trains to the new total while the schedule
    keeps the checkpoint's span (past its end, its final learning rate); `reschedule` spreads
    the warmup + cosine over the new total instead. `explicit`: the dotted spec fields the user
    set on the command line, which a shard header may not replace (runtime/train/shard_source.py).
    `log` receives the human-readable lines (default: stdout, without tearing the progress
    bar)."""

    def __init__(self, spec: Spec | str | os.PathLike, out: str | os.PathLike, *,
                 data: str | None = None, steps: int | None = None,
                 resume: str | os.PathLike | None = None, strict: bool = False,
                 profile: bool = False, until: int | None = None, progress: bool = True,
                 log: Callable[[str], None] | None = None, dist: Dist | None = None,
                 reschedule: bool = False, explicit: Collection[str] = ()):
        overrides: dict[str, Any] = {}
        if data is not None:
            overrides["data.source"] = data
        if steps is not None:
            overrides["train.steps"] = steps
        if not isinstance(spec, Spec) or overrides:
            spec = load_spec(spec, overrides)
        spec, self.notes = from_shards(spec, explicit)
        self.notes = [self.notes] if self.notes else []
        if not os.fspath(out):           # Path("") would be the current directory
            raise TitancError("--out is empty; pass a directory for the run")
        self.out = Path(out)
        self.profile = profile
        self.dist = dist
        self.main = dist is None or dist.is_main      # writes the run directory, prints
        self.progress = progress and self.main
        self.log = (log or _write_line) if self.main else (lambda _: None)
        self.tokenizer = load_tokenizer(spec)      # data.tokenizer; copied into the run
        check_vocab(spec, self.tokenizer)
        self.data = make_data(spec)
        self.resume_path: Path | None = None
        self.restored: dict[str, Any] | None = None
        target, start = spec.train.steps, 0
        if resume is not None:  # check the checkpoint before paying for a compile
            tensors, meta = self._load_resume(resume)
            spec = self._keep_schedule(spec, meta, reschedule)
            check_resumable(tensors, meta, spec, strict=strict, path=self.resume_path)
            start = meta["step"]
        self.spec = spec
        self.until = target if until is None else min(until, target)
        if until is not None and start >= self.until and until < target:
            raise TitancError(f"--until {until}: the checkpoint is already at step {start}; "
                              f"pass --until N with N > {start}, or leave --until out")
        if start >= self.until:
            raise TitancError(
                f"the checkpoint is at step {start} and train.steps is {target}: "
                f"nothing to train; pass --steps N with a total N > {start}")
        self._check_out_dir(probe_lock=self.main)  # rank 0 holds the lock of a distributed run
        self.prog = titanc.compile(spec)
        self.gen = torch.Generator().manual_seed(spec.train.seed)
        if resume is not None:
            self._restore(tensors, meta, strict)
        self.rows = spec.train.grad_accum * spec.train.batch_size          # this rank's
        world = dist.world if dist else 1
        self.global_rows = world * self.rows
        self.my_rows = slice(dist.rank * self.rows, (dist.rank + 1) * self.rows) if dist else None
        self.tokens_per_step = self.global_rows * spec.model.seq_len       # the whole job's
        self.reducer = GradReducer(self.prog, dist) if dist else None
        self.prog.reducer = self.reducer
        self.ckpt = self.out / CHECKPOINT_NAME
        self.metrics_path = self.out / "metrics.jsonl"
        self.last_ckpt_step: int | None = start if self._resuming_in_place else None
        self.times: dict[str, float] = defaultdict(float)
        self.name = printable(spec.name, 60)       # the spec name as it may reach a terminal
        self._stop = StopRequest()                 # set by SIGTERM or SIGINT while run() runs

    def _load_resume(self, resume: str | os.PathLike) -> tuple[dict[str, Any], dict[str, Any]]:
        """The checkpoint's tensors and metadata, with a sampler state and this tokenizer."""
        self.resume_path = checkpoint_path(resume)
        tensors, meta = load_checkpoint(self.resume_path)
        if RNG_KEY not in tensors:
            raise TitancError(f"{self.resume_path} has no sampler state ({RNG_KEY}); it "
                              f"cannot be resumed bit for bit")
        check_same_tokenizer(self.tokenizer, meta["extra"].get("tokenizer_hash"),
                             self.resume_path)
        return tensors, meta

    def _keep_schedule(self, spec: Spec, meta: dict[str, Any], reschedule: bool) -> Spec:
        """`spec` with the checkpoint's train.steps as the schedule's span (unless
        `reschedule`), so a longer or shorter run continues the learning rate it had."""
        theirs = (meta.get("spec") or {}).get("train", {}).get("steps")
        if reschedule or not isinstance(theirs, int) or theirs == spec.train.steps:
            return spec
        kept = load_spec(spec, {"train.steps": theirs})
        end = lr_at(max(theirs, kept.train.warmup), kept.train)
        after = (f"then {end:.3g} to step {spec.train.steps}" if spec.train.steps > theirs
                 else f"stopping at step {spec.train.steps}")
        self.notes.append(
            f"train.steps {spec.train.steps}: the learning-rate schedule keeps the "
            f"checkpoint's {theirs} steps (warmup + cosine, {after}); --reschedule spreads "
            f"it over {spec.train.steps} steps instead (the learning rate rises again)")
        return kept

    def _restore(self, tensors: dict[str, Any], meta: dict[str, Any], strict: bool) -> None:
        self.restored = restore(self.prog, tensors, meta, strict=strict, path=self.resume_path)
        try:
            self.gen.set_state(tensors[RNG_KEY])
        except (RuntimeError, TypeError):   # wrong size or dtype
            raise TitancError(f"{self.resume_path}: its sampler state {RNG_KEY} is damaged "
                              f"({list(tensors[RNG_KEY].shape)}, {tensors[RNG_KEY].dtype}); "
                              f"it cannot be resumed bit for bit") from None

    # -- setup ----------------------------------------------------------------------------------
    @property
    def _resuming_in_place(self) -> bool:
        return (self.resume_path is not None
                and self.resume_path.resolve() == (self.out / CHECKPOINT_NAME).resolve())

    def _check_out_dir(self, probe_lock: bool = True) -> None:
        if self.out.exists() and not self.out.is_dir():
            raise TitancError(f"--out {self.out} is a file; pass a directory for the run")
        if probe_lock and self.out.is_dir() and (self.out / LOCK_NAME).exists():
            RunDir(self.out).acquire().release()   # in use by another trainer: say so now
        ckpt = self.out / CHECKPOINT_NAME
        if ckpt.exists() and not self._resuming_in_place:
            raise TitancError(f"--out {self.out} already holds a run ({ckpt}); continue it with "
                              f"--resume {self.out} or choose another --out")
        # a directory no trainer made (no .lock): the files a run writes (or, tokenizer.json,
        # removes) there are someone else's, never to be overwritten
        if (self.out.is_dir() and not self._resuming_in_place
                and not os.path.lexists(self.out / LOCK_NAME)):
            theirs = [n for n in RUN_FILES if os.path.lexists(self.out / n)]
            if theirs:
                raise TitancError(
                    f"--out {self.out} is not a titanc run directory and holds "
                    f"{', '.join(theirs)}, which a run would overwrite; choose a new or empty "
                    f"directory for --out, or move those files away")

    def _start_metrics(self) -> None:
        """Fresh run: an empty metrics.jsonl. Resume: keep the history up to the restored step
        (dropping lines a crashed run wrote after its last checkpoint)."""
        history: list[dict[str, Any]] = []
        if self.resume_path is not None:
            history = [m for m in read_metrics(self.resume_path.parent / "metrics.jsonl")
                       if m["step"] <= self.prog.step]
        write_text_atomic(self.metrics_path, "".join(json.dumps(m) + "\n" for m in history))

    # -- pieces ---------------------------------------------------------------------------------
    def _write(self, record: dict[str, Any]) -> None:
        if self._metrics is None:                 # not rank 0
            return
        self._metrics.write(json.dumps(record) + "\n")
        self._metrics.flush()
        if self._tb is not None:                  # train.tensorboard
            self._tb.write(record)

    def evaluate(self) -> dict[str, float]:
        """Mean held-out loss over train.eval_batches batches (the same batches every time);
        for synthetic:recall also the recall accuracy, when the program exposes logits."""
        if hasattr(self.data, "has_split") and not self.data.has_split("val"):
            return {}
        gen = torch.Generator().manual_seed(self.spec.train.seed + EVAL_SEED_OFFSET)
        total, kept, accs = 0.0, 0.0, []
        for _ in range(self.spec.train.eval_batches):
            tokens, docs = draw(self.data, self.spec, self.spec.train.batch_size, "val", gen)
            # a batch's loss is the mean over the targets it keeps (with data.documents, its
            # loss mask): weighted by them, every kept target of the evaluation counts once
            n = 1.0 if docs is None else float(docs["loss_mask"].sum())
            if n:
                total += self.prog.loss(tokens, docs) * n
                kept += n
            if isinstance(self.data, SyntheticRecall) and hasattr(self.prog, "logits"):
                accs.append(self.data.accuracy(self.prog, tokens))
        if not kept:               # said once: the summary then has no held-out loss
            if not getattr(self, "_said_all_masked", False):
                self._said_all_masked = True
                self.log(f"no held-out loss: every target of the {self.spec.train.eval_batches}"
                         " evaluation batches is masked (data.documents' loss mask); raise "
                         "train.eval_batches or use longer documents")
            return {}
        out = {"eval_loss": total / kept}
        if accs:
            out["eval_accuracy"] = sum(accs) / len(accs)
        return out

    def _probe_next_step(self) -> None:
        """Loss and gradient norm of the batch the next step would draw (its first
        micro-batch; the sampler's generator is not advanced) must be finite."""
        gen = torch.Generator()
        gen.set_state(self.gen.get_state())
        # as step() draws it: this rank's rows of the next global batch
        tokens, docs = draw(self.data, self.spec, self.global_rows, "train", gen,
                            rows=self.my_rows)
        first = slice(0, self.spec.train.batch_size)
        docs = {k: v[first] for k, v in docs.items()} if docs else None
        loss, grads = self.prog.grads_in_place(tokens[first], docs)   # its own buffers: no copies
        norm = math.sqrt(sum(float(g.double().square().sum()) for g in grads.values()))
        for what, value in (("the next batch's loss", loss), ("its gradient norm", norm)):
            if not math.isfinite(value):
                raise self._nonfinite(f"{what} after the update", value)

    def _memory_stats(self) -> None:
        """One record {step, memory: {layers: [...]}} of memory diagnostics on the first
        held-out batch (runtime/diagnostics/neural_memory.py)."""
        from titanc.runtime.diagnostics.neural_memory import memory_stats

        gen = torch.Generator().manual_seed(self.spec.train.seed + EVAL_SEED_OFFSET)
        split = "val" if not hasattr(self.data, "has_split") or self.data.has_split("val") \
            else "train"
        tokens = self.data.batch(self.spec.train.batch_size, split, gen)
        self._write({"step": self.prog.step, "memory": memory_stats(self.prog, tokens)})

    def _checkpoint(self) -> None:
        """Write the state of this step once it is proven good (see the module docstring)."""
        if self.reducer is not None:
            self.reducer.gather_state()           # ZeRO-1: every shard's moments
        try:
            failure: TitancError | None = None
            try:
                if self.prog.step > self._start_step:
                    self._checked_last()          # the steps since the last log
                bad = first_nonfinite(self.prog.state_dict())
                if bad is not None:
                    raise self._nonfinite(f"{bad} after the update", "not finite")
                self._probe_next_step()
            except DistributedError:
                raise
            except TitancError as exc:
                failure = exc
            if self.reducer is not None:          # each rank tried its own rows of the next
                #                                   batch: rank 0 writes only if all passed
                failed = self.reducer.count(failure is not None, "checking the checkpoint")
                if failure is None and failed:
                    failure = self._nonfinite(
                        f"the next batch's loss or gradient norm on {failed} other "
                        f"rank{'s' if failed > 1 else ''}", "not finite")
            if failure is not None:
                raise failure
            if self.main:
                save_checkpoint(self.ckpt, self.prog, self.gen.get_state(),
                                extra={"data": self.spec.data.source,
                                       "tokenizer_hash": self.tokenizer.hash,
                                       "tokens_seen": self.prog.step * self.tokens_per_step})
                self._write_spec()                # the spec this checkpoint was trained with
            if self.reducer is not None:          # every rank waits for rank 0's write (a
                #                                   rank 0 that failed makes this fail): only
                #                                   a written checkpoint is the last one
                self.reducer.count(True, "writing the checkpoint")
        finally:
            if self.reducer is not None:
                self.reducer.release_state()
        self.last_ckpt_step = self.prog.step

    def _write_spec(self) -> None:
        """spec.yaml: the spec as trained. A run resumed in place with another model (an
        upgrade) writes it with its first checkpoint, so a run stopped before that keeps the
        spec.yaml its checkpoint was trained with (generate, serve and eval check the pair)."""
        write_text_atomic(self.out / "spec.yaml", yaml.safe_dump(
            spec_to_dict(self.spec), sort_keys=False, default_flow_style=None))

    def _nonfinite(self, what: str, value: float) -> TitancError:
        step, lr = self.prog.step, self.prog.last.get("lr", self.spec.train.lr)
        if self.last_ckpt_step is None:
            kept = ("no good checkpoint was written before it (train.checkpoint_every="
                    f"{self.spec.train.checkpoint_every})")
            then = "train again"
        else:
            kept = f"the last good checkpoint (step {self.last_ckpt_step}) is kept in {self.ckpt}"
            then = f"continue with --resume {self.out}"
        memory = (f", or lower model.memory.lr_max ({self.spec.model.memory.lr_max:.3g}: the "
                  "memory's inner step)" if self.spec.model.block != "attn" else "")
        return TitancError(f"step {step}: {what} is {value}; {kept}; lower train.lr (the lr "
                           f"was {lr:.3g}) or raise train.warmup{memory}, then {then}")

    # -- the loop -------------------------------------------------------------------------------
    def step(self) -> dict[str, float] | None:
        """One optimizer step on the next training batch. Nothing is read back from the
        device except on a logging step (every train.log_every steps and the last one): then
        the loss and the gradient norm are checked, written to metrics.jsonl and returned
        (prog.last, with tokens/s over the steps since the previous log); else None."""
        t0 = time.perf_counter()
        tokens, docs = draw(self.data, self.spec, self.global_rows, "train", self.gen,
                            rows=self.my_rows)
        t1 = time.perf_counter()
        comm0 = self.reducer.comm_seconds if self.reducer else 0.0
        self.prog.advance(tokens, docs)
        t2 = time.perf_counter()
        comm = (self.reducer.comm_seconds - comm0) if self.reducer else 0.0
        self.times["data"] += t1 - t0
        self.times["train_step"] += t2 - t1 - comm
        if self.reducer is not None:
            self.times["communication"] += comm
        if not self._due(self.spec.train.log_every):
            return None
        last = self._checked_last()
        now = time.perf_counter()
        since, self._log_mark = self._log_mark, (self.prog.step, now)
        steps = self.prog.step - since[0]
        last["tokens_per_s"] = steps * self.tokens_per_step / max(now - since[1], 1e-9)
        self._write({"step": self.prog.step,
                     **{k: last[k] for k in ("loss", "lr", "grad_norm", "tokens_per_s")}})
        return last

    def _checked_last(self) -> dict[str, float]:
        """The last step's loss, lr and gradient norm (read from the device), finite."""
        last = dict(self.prog.last)
        for what in ("loss", "grad_norm"):  # the loss first: it is what users watch
            if not math.isfinite(last[what]):
                raise self._nonfinite(what, last[what])
        return last

    def _kept(self) -> str:
        return (f"the last checkpoint (step {self.last_ckpt_step}) is in {self.ckpt}; continue "
                f"with --resume {self.out}" if self.last_ckpt_step is not None
                else "no checkpoint was written yet")

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
        if not self.main:                          # rank 0 locks and writes the directory
            return self._run()
        # SIGTERM (a scheduler, `kill`) or SIGINT (Ctrl-C) to a single process: the step in
        # flight finishes, is checkpointed, and the run stops with one line (summary
        # "stopped"); a second one exits at once; ranks stop with their job
        with RunDir(self.out), writing_into(self.out), \
                stop_on_term(enabled=self.dist is None,
                             signals=(signal.SIGTERM, signal.SIGINT)) as self._stop:
            self._check_out_dir(probe_lock=False)  # again, under the lock: another run may
            #                                        have finished meanwhile
            remove_stale_temps(self.ckpt, keep_live=False)   # the lock: no one else saves here
            return self._run()

    def _run(self) -> dict[str, Any]:
        spec, prog = self.spec, self.prog
        if self.main:
            if not self._resuming_in_place:   # in place: the spec.yaml of the checkpoint on
                self._write_spec()            # disk stays until a checkpoint replaces it
            save_tokenizer(self.tokenizer, self.out)
            self._start_metrics()
        self._report_start()
        start_step, t_start = prog.step, time.perf_counter()
        self._start_step = start_step
        self._log_mark = (start_step, time.perf_counter())
        last: dict[str, float] = {}
        evals: dict[str, float] = {}
        bar = _progress(self.until, start_step, self.name, enabled=self.progress)
        from titanc.integrations.tensorboard import open_tensorboard
        self._tb = open_tensorboard(spec, self.out, start_step) if self.main else None
        self._metrics = open(self.metrics_path, "a") if self.main else None
        from titanc.runtime.targets.profiler import profiling
        profiler = profiling() if self.profile else None
        self._kernel_profile = profiler.__enter__() if profiler else None
        try:
            while prog.step < self.until:
                logged = self.step()
                bar.update(1)
                if logged is not None:
                    last = logged
                    bar.set_postfix(loss=f"{last['loss']:.4f}",
                                    tok_s=f"{last['tokens_per_s']:,.0f}",
                                    threads=torch.get_num_threads(), refresh=False)
                if self._due(spec.train.eval_every):
                    evals = self._timed("eval", self.evaluate)
                    if evals and not math.isfinite(evals["eval_loss"]):
                        raise self._nonfinite("the held-out loss", evals["eval_loss"])
                    if evals:
                        self._write({"step": prog.step, **evals})
                        self.log(f"step {prog.step}: " + ", ".join(
                            f"{k} {v:.4f}" for k, v in evals.items()))
                every = spec.train.memory_stats_every
                if every and spec.model.has_memory and self._due(every):
                    self._timed("eval", self._memory_stats)
                if self._due(spec.train.checkpoint_every):
                    self._timed("checkpoint", self._checkpoint)
                if self._stop.signum is not None:     # SIGTERM, SIGINT: stop, checkpointed
                    if self.last_ckpt_step != prog.step:
                        self._timed("checkpoint", self._checkpoint)
                    bar.close()
                    self.log(f"stopped by {self._stop.name} after step {prog.step}; "
                             f"{self._kept()}")
                    break
        except KeyboardInterrupt:
            bar.close()
            self.log(f"interrupted after step {prog.step}; {self._kept()}")
            raise
        except DistributedError as exc:
            raise DistributedError(f"{exc}; {self._kept()}") from None
        finally:
            if profiler:
                profiler.__exit__(None, None, None)
            bar.close()
            if self._tb is not None:
                self._tb.close()
            if self._metrics is not None:
                self._metrics.close()
                self._timed("plot", self._plot)
        return self._summary(start_step, time.perf_counter() - t_start, last, evals)

    def _summary(self, start_step: int, seconds: float, last: dict[str, float],
                 evals: dict[str, float]) -> dict[str, Any]:
        """The run's summary (see run_training); the last line unless a signal stopped it."""
        prog = self.prog
        steps_run = prog.step - start_step
        train_seconds = (self.times["train_step"] + self.times["data"]
                         + self.times.get("communication", 0.0))
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
        if self._stop.signum is None:              # stopped: its one line is printed
            self._report_end(summary)
        else:
            summary["stopped"] = self._stop.name
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
        for note in self.notes:
            self.log(f"note: {note}")
        ranks = (f" on {self.dist.world} ranks ({self.dist.backend}"
                 f"{', ZeRO-1' if self.reducer.zero else ''})" if self.dist else "")
        self.log(f"training {self.name} on {printable(self.data.description)}{ranks}: steps "
                 f"{self.prog.step + 1}..{self.until} of {spec.train.steps}, "
                 f"{self.global_rows}x{spec.model.seq_len} tokens per step, "
                 f"{_threads(torch.get_num_threads())} -> {printable(str(self.out))}")

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
        prof["peak_rss_bytes"] = peak_rss_bytes()
        if torch.cuda.is_available():
            prof["peak_cuda_bytes"] = torch.cuda.max_memory_allocated()
        steps = max(1, self.prog.step - self._start_step)
        self.log(profile_table(self._kernel_profile, steps, steps * self.tokens_per_step,
                               self.times["train_step"], prof["peak_rss_bytes"],
                               dtype=str(self.spec.train.dtype),
                               threads=torch.get_num_threads()))
        self.log("time per phase of the run:")
        rows = dict(self.times)
        rows["other"] = max(0.0, seconds - sum(rows.values()))
        for k, v in rows.items():
            self.log(f"  {k:<13} {v:8.2f} s  {100 * v / max(seconds, 1e-9):5.1f}%")
        self.log(f"  peak memory   {prof['peak_rss_bytes'] / 2**20:8.1f} MiB (process RSS)")
        return prof

    def _plot(self) -> None:
        baseline = (self.data.unigram_entropy("val") if isinstance(self.data, TextData)
                    else None)
        try:
            if not write_loss_plot(self.metrics_path, self.out / "loss.png", title=self.name,
                                   baseline=baseline):
                self.log(f"note: no loss.png: matplotlib is not installed ({PLOT_EXTRA})")
        except Exception as exc:  # a plot must never hide the run's own outcome
            self.log(f"note: could not write {self.out / 'loss.png'}: {exc}")


def _threads(n: int) -> str:
    return f"{n} thread" + ("" if n == 1 else "s")


def _write_line(msg: str) -> None:
    """Print to stdout without tearing a progress bar that is on screen."""
    from tqdm import tqdm
    tqdm.write(msg, file=sys.stdout)


def _progress(total: int, initial: int, desc: str, enabled: bool) -> Any:
    from tqdm import tqdm
    return tqdm(total=total, initial=initial, desc=desc, unit="step", disable=not enabled,
                dynamic_ncols=True, file=sys.stderr, mininterval=0.5)


def run_training(spec: Spec | str | os.PathLike, out: str | os.PathLike, data: str | None = None,
                 steps: int | None = None, resume: str | os.PathLike | None = None,
                 strict: bool = False, profile: bool = False, **kwargs: Any) -> dict[str, Any]:
    """Train `spec` into the run directory `out` (see the module docstring); returns a summary
    {out, steps, steps_run, loss, eval_loss, eval_accuracy, seconds, tokens_per_s,
    new_parameters[, unigram_loss][, profile][, stopped: "SIGTERM" | "SIGINT" when a signal
    stopped it at a step boundary]}. Extra keyword arguments go to `Trainer`."""
    return Trainer(spec, out, data=data, steps=steps, resume=resume, strict=strict,
                   profile=profile, **kwargs).run()
