"""Data-parallel training on torch.distributed: one flat gradient buffer, bucketed reductions,
ZeRO-1 optimizer sharding.

    dist = init_from_env(spec)                # under torchrun / `titanc train --nproc N`
    prog.reducer = GradReducer(prog, dist)    # Program.train_step then hands it the step

A Program keeps its parameters, gradient accumulator and AdamW moments in four flat buffers
of `prog.numel` elements, in parameter order (runtime/program.py). So

- plain data parallelism (`train.zero: 0`) is one all-reduce per bucket of `train.bucket_mb`
  over the flat gradient, then every rank runs the compiled optimizer on identical gradients;
- ZeRO-1 (`train.zero: 1`) reduces every bucket only to the rank that owns it (`dist.reduce`
  to the owner of each piece of a bucket cut at shard boundaries: a reduce-scatter that gloo
  also runs), each rank updates its contiguous shard [lo, hi) of the flat parameters and AdamW
  moments (AdamW written over the flat range, the same arithmetic as passes/optimizer.py, the
  global gradient norm from one all-reduce of the shards' squared sums), then the parameters
  are all-gathered. A rank holds only its shard of the moments (the Program's full moment
  buffers are dropped); `gather_state` binds full ones, gathered from every rank, for a
  checkpoint and `release_state` drops them again, so a checkpoint holds the full state and
  does not depend on the world size.

Buckets are cut from the end of the flat buffer (the last layers' gradients first, as they
come out of the backward) and launched asynchronously as soon as the last micro-batch has
added its gradients to them: the reduction of one bucket overlaps the accumulation of the
next. (The backward itself is one compiled graph run, so the reduction cannot start inside
it; see README, "Distributed training".)

Gradients are averaged over ranks: with a per-rank batch B, W ranks compute the gradient of
the mean loss over the global batch of W·B rows, as one rank with batch W·B would.
"""
from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as tdist

from titanc.config import current
from titanc.errors import DistributedError, TitancError
from titanc.model.params import param_specs
from titanc.runtime.lr_schedule import lr_at

__all__ = ["Dist", "DistributedError", "GradReducer", "init_from_env", "backend_for",
           "shutdown"]

Tensor = torch.Tensor
EPS = 1e-8                          # AdamW epsilon, as passes/optimizer.py


@dataclass(frozen=True)
class Dist:
    rank: int
    world: int
    local_rank: int
    backend: str
    timeout_s: float

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def backend_for(spec: Any) -> str:
    """nccl when the program runs on CUDA, else gloo."""
    from titanc.runtime.targets.executors import resolve_target
    return "nccl" if resolve_target(spec.compile.target) == "triton" \
        and torch.cuda.is_available() else "gloo"


def init_from_env(spec: Any) -> Dist:
    """Join the process group torchrun (or `titanc train --nproc`) describes in the environment
    (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); collectives time out after
    train.dist_timeout_s."""
    env = current().torchrun
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in env]
    if missing:
        raise TitancError(f"distributed training needs {', '.join(missing)} in the environment; "
                          f"launch with torchrun or titanc train --nproc N")
    backend = backend_for(spec)
    local_rank = int(env.get("LOCAL_RANK", "0"))
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    timeout = spec.train.dist_timeout_s
    if not tdist.is_initialized():
        try:
            tdist.init_process_group(backend, timeout=timedelta(seconds=timeout))
        except Exception as exc:  # noqa: BLE001 -- rendezvous failures come in many types
            raise DistributedError(f"rank {env['RANK']}: could not join the process "
                                   f"group at {env['MASTER_ADDR']}:"
                                   f"{env['MASTER_PORT']}: {_first_line(exc)}") from None
    return Dist(tdist.get_rank(), tdist.get_world_size(), local_rank, backend, timeout)


def shutdown() -> None:
    if tdist.is_initialized():
        tdist.destroy_process_group()


def _first_line(exc: BaseException) -> str:
    """The gist of a backend error: its first sentence, without gloo's source location."""
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    text = re.sub(r"^\[[^\]]*\]\s*", "", text)          # "[.../pair.cc:537] Read error ..."
    return text.split(". ")[0].rstrip(".")


def _mb_elements(mb: float, itemsize: int) -> int:
    return max(1, int(mb * 2**20) // itemsize)


class GradReducer:
    """Reduces `prog`'s flat gradient over the ranks of `dist` and, under ZeRO-1, runs the
    sharded AdamW step. `comm_seconds` is the time spent waiting for collectives."""

    def __init__(self, prog: Any, dist: Dist):
        self.prog, self.dist = prog, dist
        train = prog.spec.train
        self.zero = train.zero == 1 and dist.world > 1
        n, w = prog.numel, dist.world
        self.shard = -(-n // w)                                  # elements per rank (ceil)
        self.bounds = [(min(r * self.shard, n), min((r + 1) * self.shard, n)) for r in range(w)]
        self.lo, self.hi = self.bounds[dist.rank]
        size = _mb_elements(train.bucket_mb, prog.flat["grad"].element_size())
        self.buckets = [(max(0, hi - size), hi) for hi in range(n, 0, -size)]   # last first
        # parameter ranges in the flat buffer, and where each bucket becomes final
        self.ranges, at = {}, 0
        for name, t in prog.parameters().items():
            self.ranges[name] = (at, at + t.numel())
            at += t.numel()
        decay = {p.name: p.decay for p in param_specs(prog.spec.model)}
        self.decay_ranges = [(max(a, self.lo) - self.lo, min(b, self.hi) - self.lo)
                             for name, (a, b) in self.ranges.items()
                             if decay.get(name, True) and min(b, self.hi) > max(a, self.lo)]
        self._pending: list[Any] = []
        self._launched = 0
        self.comm_seconds = 0.0
        if self.zero:
            self._gather = torch.zeros(self.shard * w, dtype=prog.dtype, device=prog.device)
            self.m = prog.flat["opt.m"][self.lo:self.hi].clone()      # this rank's moments
            self.v = prog.flat["opt.v"][self.lo:self.hi].clone()
            prog.bind_moments(None, None)

    # -- the step -------------------------------------------------------------------------------
    def step(self, tokens: Tensor, extra: dict[str, Tensor]) -> dict[str, Any]:
        """One optimizer step of the program under data parallelism (`Program.advance` hands
        it here when `prog.reducer` is set): the gradient buckets are launched as the last
        micro-batch's gradients land, reduced over ranks, and the loss is averaged over ranks
        (host values: the collectives synchronise anyway). Returns the step's {loss, lr,
        grad_norm}."""
        prog = self.prog
        self.start()
        losses = prog.accumulate_grads(tokens, extra)
        for n in reversed(self.ranges):              # last layers first, as a backward emits
            self.ready(self.ranges[n][0])
        self.wait()                                  # the mean gradient over ranks
        lr = lr_at(prog.step, prog.spec.train)
        if self.zero:
            grad_norm = self.adamw(lr, prog.step + 1, 1.0 / prog.accum)
        else:
            grad_norm = prog.optimizer_update(lr, prog.step + 1)
        return {"loss": self.mean(sum(losses) / len(losses)), "lr": lr, "grad_norm": grad_norm}

    # -- reduction ------------------------------------------------------------------------------
    def start(self) -> None:
        """A new optimizer step: no bucket is launched yet."""
        self._pending, self._launched = [], 0

    def ready(self, lowest: int) -> None:
        """Every gradient element at flat index >= `lowest` is final: launch the buckets that
        lie entirely above it (asynchronously)."""
        while self._launched < len(self.buckets) and self.buckets[self._launched][0] >= lowest:
            self._launch(*self.buckets[self._launched])
            self._launched += 1

    def _launch(self, lo: int, hi: int) -> None:
        grad = self.prog.flat["grad"]
        t0 = time.perf_counter()
        try:
            if not self.zero:
                self._pending.append(tdist.all_reduce(grad[lo:hi], async_op=True))
                return
            for owner, (a, b) in enumerate(self.bounds):      # the bucket, cut per owner
                a, b = max(a, lo), min(b, hi)
                if b > a:
                    self._pending.append(tdist.reduce(grad[a:b], dst=owner, async_op=True))
        except Exception as exc:  # noqa: BLE001
            raise self._failed("reducing gradients", exc) from None
        finally:
            self.comm_seconds += time.perf_counter() - t0

    def wait(self) -> None:
        """Launch what is left, wait for every bucket, and average: afterwards the flat
        gradient (ZeRO-1: this rank's shard of it) is the mean over ranks."""
        self.ready(0)
        t0 = time.perf_counter()
        try:
            for work in self._pending:
                work.wait()
        except Exception as exc:  # noqa: BLE001
            raise self._failed("reducing gradients", exc) from None
        finally:
            self.comm_seconds += time.perf_counter() - t0
        self._pending = []
        grad = self.prog.flat["grad"]
        (grad[self.lo:self.hi] if self.zero else grad).div_(self.dist.world)

    def mean(self, value: float) -> float:
        """`value` averaged over ranks (the logged loss)."""
        t = torch.tensor([value], dtype=torch.float64, device=self.prog.device)
        self._all_reduce(t, "averaging the loss")
        return float(t) / self.dist.world

    def count(self, flag: bool, what: str) -> int:
        """How many ranks passed `flag` true (every rank calls it: a synchronisation point)."""
        t = torch.tensor([1.0 if flag else 0.0], dtype=torch.float64, device=self.prog.device)
        self._all_reduce(t, what)
        return round(float(t))

    def _all_reduce(self, t: Tensor, what: str) -> None:
        t0 = time.perf_counter()
        try:
            tdist.all_reduce(t)
        except Exception as exc:  # noqa: BLE001
            raise self._failed(what, exc) from None
        finally:
            self.comm_seconds += time.perf_counter() - t0

    # -- ZeRO-1 ---------------------------------------------------------------------------------
    def adamw(self, lr: float, step: int, grad_scale: float) -> float:
        """AdamW with global-norm clipping on this rank's shard (passes/optimizer.py's
        arithmetic, operation for operation), then an all-gather of the parameters. Returns the
        global gradient norm before clipping."""
        train, p = self.prog.spec.train, self.prog.flat
        lo, hi = self.lo, self.hi
        g = p["grad"][lo:hi].mul_(grad_scale)
        sq = (g * g).sum().reshape(1)                           # this shard's squared sum
        self._all_reduce(sq, "the gradient norm")
        norm = float(sq.sqrt())
        if train.grad_clip > 0:
            g.mul_(-max(-(train.grad_clip / (norm + 1e-6)), -1.0))
        beta1, beta2 = train.betas
        bc1 = 1.0 - math.exp(step * math.log(beta1))
        bc2 = 1.0 - math.exp(step * math.log(beta2))
        m, v, w = self.m, self.v, p["param"][lo:hi]
        m.mul_(beta1).add_(g * (1.0 - beta1))
        v.mul_(beta2).add_(g * g * (1.0 - beta2))
        upd = (m / bc1) / ((v / bc2).sqrt() + EPS)
        if train.weight_decay > 0:
            for a, b in self.decay_ranges:
                w[a:b].sub_(w[a:b] * (lr * train.weight_decay))
        w.sub_(upd * lr)
        self._all_gather(self.prog.flat["param"], w, "gathering parameters")
        return norm

    def _all_gather(self, flat: Tensor, shard: Tensor, what: str) -> None:
        """Every rank's `shard` (its range [lo, hi) of a flat buffer) into `flat` on every rank."""
        mine = self._gather[self.dist.rank * self.shard:(self.dist.rank + 1) * self.shard]
        mine[:self.hi - self.lo].copy_(shard)
        t0 = time.perf_counter()
        try:
            tdist.all_gather(list(self._gather.split(self.shard)), mine.clone())
        except Exception as exc:  # noqa: BLE001
            raise self._failed(what, exc) from None
        finally:
            self.comm_seconds += time.perf_counter() - t0
        flat.copy_(self._gather[:self.prog.numel])

    def gather_state(self) -> None:
        """ZeRO-1: bind full AdamW moments, gathered from every rank's shard, into the program
        (for a checkpoint; `release_state` drops them)."""
        if self.zero:
            full = [torch.empty(self.prog.numel, dtype=self.prog.dtype, device=self.prog.device)
                    for _ in range(2)]
            for flat, shard in zip(full, (self.m, self.v)):
                self._all_gather(flat, shard, "gathering optimizer state")
            self.prog.bind_moments(*full)

    def release_state(self) -> None:
        if self.zero:
            self.prog.bind_moments(None, None)

    def _failed(self, what: str, exc: BaseException) -> DistributedError:
        return DistributedError(
            f"rank {self.dist.rank}: {what} at step {self.prog.step + 1} failed: another rank "
            f"stopped or did not answer within train.dist_timeout_s={self.dist.timeout_s:g} s "
            f"({_first_line(exc)})")
