"""Program: a compiled model that trains, evaluates and exposes its state.

Graphs run on the arena executor over their kernel schedule and buffer plan (`cpu`
target), on the same plan with generated Triton kernels (`triton`: on the GPU with CUDA, else
under Triton's interpreter, see `runtime/targets/triton_executor.py`), or on the reference
interpreter (`target: reference`, for debugging). `auto` is `triton` when CUDA is present.
Each compiled graph's executor is bound on first use (`runtime/targets/executors.py`).
Parameters, the gradient accumulator and the AdamW moments are allocated once and bound
into every executor, so tensors handed out by `parameters()` stay live and a steady-state
training step allocates nothing.
"""
from __future__ import annotations

import threading
from typing import Any

import torch

from titanc.bounds import BATCH_SIZE
from titanc.errors import TitancError
from titanc.ir import Interpreter
from titanc.ir.types import DTYPES, dtype_name
from titanc.model.params import init_params

from titanc.runtime.api_checks import check_token_ids
from titanc.runtime.documents import document_inputs
from titanc.runtime.optimizer_step import DeviceStep
from titanc.runtime.state_checks import check_loadable
from titanc.runtime.targets.executors import Executors, resolve_target

Tensor = torch.Tensor


def _views(flat: Tensor, like: dict[str, Tensor]) -> dict[str, Tensor]:
    """Consecutive views of `flat` shaped like the tensors of `like`, in its order."""
    out, at = {}, 0
    for n, t in like.items():
        out[n] = flat[at:at + t.numel()].view(t.shape)
        at += t.numel()
    return out


class Program:
    def __init__(self, compiled: Any):
        from titanc.runtime.capacity import check_fits

        self.compiled = compiled
        self.spec = compiled.spec
        # the masters' dtype: float32 under train.dtype bfloat16 (mixed precision)
        self.dtype = DTYPES[dtype_name(self.spec.train.master_dtype)]
        self.batch_size = self.spec.train.batch_size
        self.seq_len = self.spec.model.seq_len
        self._interp = Interpreter()
        self.target = resolve_target(self.spec.compile.target)
        self.executors = Executors(self, self.target)   # one per compiled graph, bound lazily
        self.device = self.executors.device             # where state lives
        check_fits(compiled.planned_bytes(), self.spec, str(self.device))
        init = init_params(self.spec.model, self.spec.train.seed, self.dtype)
        # parameters, the gradient accumulator and the AdamW moments each live in one flat
        # buffer, in parameter order (`flat`): data parallelism reduces the gradients as one
        # tensor and ZeRO-1 shards all four by one contiguous range
        self.numel = sum(t.numel() for t in init.values())
        self.flat = {k: torch.zeros(self.numel, dtype=self.dtype, device=self.device)
                     for k in ("param", "grad", "opt.m", "opt.v")}
        # `params`, `grad_acc`, `grad_tmp`, `opt_m`, `opt_v`: per-parameter views of them, what
        # the executors bind (runtime/targets/executors.py `Executors.bind`)
        self.params = _views(self.flat["param"], init)
        for n, t in init.items():
            self.params[n].copy_(t)
        self.grad_acc = _views(self.flat["grad"], init)
        self.accum = self.spec.train.grad_accum
        # micro-batch gradients: straight into the accumulator when there is one micro-batch,
        # else into one flat buffer that a single add accumulates per micro-batch
        self.grad_flat_tmp = (torch.zeros(self.numel, dtype=self.dtype, device=self.device)
                               if self.accum > 1 else self.flat["grad"])
        self.grad_tmp = _views(self.grad_flat_tmp, init)
        self.stepper = DeviceStep(self)   # the optimizer step's device state (`advance`)
        self.opt_m = _views(self.flat["opt.m"], init)
        self.opt_v = _views(self.flat["opt.v"], init)
        self.reducer: Any = None        # set by a distributed run (runtime/train/distributed.py)
        self._token_range = torch.zeros(2, dtype=torch.int64)   # check_token_ids' min, max
        self.step = 0
        self._last: dict[str, Any] = {}
        # one call at a time: every graph's executor runs in one arena, whose outputs the next
        # call overwrites, so two threads would read each other's results (`run_graph`'s
        # callers hold it while they read them)
        self.lock = threading.RLock()
        self.by_batch: dict[int, Any] = {self.batch_size: compiled}   # compiles by rows

    # -- state ----------------------------------------------------------------------------------
    def parameters(self) -> dict[str, Tensor]:
        return dict(self.params)

    def bind_moments(self, m: Tensor | None, v: Tensor | None) -> None:
        """Replace the flat AdamW moment buffers (`numel` elements each), or drop them (None):
        under ZeRO-1 a rank keeps only its shard, and binds full buffers to checkpoint."""
        for key, flat in (("opt.m", m), ("opt.v", v)):
            self.flat[key] = flat
        self.opt_m = None if m is None else _views(m, self.params)
        self.opt_v = None if v is None else _views(v, self.params)

    def state_dict(self) -> dict[str, Tensor]:
        """The parameters, AdamW moments (`param.*`, `opt.m.*`, `opt.v.*`: the program's own
        tensors, not copies) and `opt.step`."""
        if self.opt_m is None:
            raise TitancError("state_dict: the AdamW moments are sharded over ranks (ZeRO-1); "
                              "gather them first (bind_moments with full buffers)")
        sd = {f"param.{n}": t for n, t in self.params.items()}
        sd.update({f"opt.m.{n}": t for n, t in self.opt_m.items()})
        sd.update({f"opt.v.{n}": t for n, t in self.opt_v.items()})
        sd["opt.step"] = torch.tensor(self.step, dtype=torch.int64)
        return sd

    def load_state_dict(self, sd: dict[str, Tensor], strict: bool = True) -> dict[str, list[str]]:
        """Copy matching tensors in place. Returns {'new': [...], 'unused': [...]}: names this
        program has that `sd` lacks (kept at their fresh initialisation) and names of `sd` this
        program does not use. `strict` refuses any difference; a shape mismatch, a tensor that
        is not floating point or holds a NaN or an inf, and an `opt.step` that is not an
        integer >= 0 always fail, before anything is copied."""
        mine = self.state_dict()
        new, unused, step = check_loadable(sd, mine, strict)
        with torch.no_grad(), self.lock:
            for k, t in sd.items():
                if k in mine and k != "opt.step":
                    mine[k].copy_(t.to(mine[k].dtype))
        if step is not None:
            self.step = step
        return {"new": new, "unused": unused}

    def storages(self) -> list[Tensor]:
        """Every tensor storage this program and its executors own (for allocation probes)."""
        own = [*(t for t in self.flat.values() if t is not None), self.grad_flat_tmp,
               self._token_range, *self.stepper.storages()]
        return own + self.executors.storages()

    # -- running --------------------------------------------------------------------------------
    def _graphs(self, batch: int) -> Any:
        """The compiled program (titanc.compiler.Compiled) at `batch` rows."""
        if batch not in self.by_batch:
            self.by_batch[batch] = self.compiled.for_batch(batch)
        return self.by_batch[batch]

    def graph(self, kind: str, batch: int, n: int = 1) -> Any:
        """The compiled graph of `kind` (titanc.compiler.GRAPH_KINDS) at `batch` rows."""
        return self._graphs(BATCH_SIZE.check(batch, "batch")).graph(kind, n)

    def _check_tokens(self, tokens: Tensor) -> Tensor:
        if not isinstance(tokens, Tensor):
            raise TitancError(f"tokens must be an int64 tensor, got {type(tokens).__name__}")
        if tokens.dim() != 2 or tokens.shape[1] != self.seq_len + 1 or tokens.shape[0] == 0:
            raise TitancError(f"tokens must be int64 [batch >= 1, seq_len + 1 = "
                              f"{self.seq_len + 1}], got {list(tokens.shape)}")
        check_token_ids(tokens, self.spec.model.vocab_size, scratch=self._token_range)
        return tokens.to(torch.int64)

    def run_graph(self, cg: Any, inputs: dict[str, Tensor]) -> dict[str, Tensor]:
        """Run a compiled graph (titanc.compiler.CompiledGraph): on the arena executor of its
        plan, bound to this program's parameters and buffers, or, for `target: reference`, its
        graph on the interpreter. The outputs are the executor's own buffers, which the next
        call overwrites: callers hold `lock` while they read them (the serving decoder)."""
        with torch.no_grad():
            if self.target == "reference":
                return self._interp(cg.graph, inputs)
            ex = self.executors.of(cg)
            return ex.run({k: v for k, v in inputs.items() if k not in ex.bound})

    def loss(self, tokens: Tensor, docs: dict[str, Tensor] | None = None) -> float:
        with self.lock:
            tokens = self._check_tokens(tokens)
            cg = self.graph("forward", tokens.shape[0])
            extra = document_inputs(self.spec, self.dtype, tokens, docs)
            return float(self.run_graph(cg, {"tokens": tokens, **extra, **self.params})["loss"])

    def _forward_output(self, tokens: Tensor, output: str,
                        docs: dict[str, Tensor] | None = None) -> Tensor:
        """A copy of graph output `output`: the executor's own buffer is the next call's."""
        with self.lock:
            tokens = self._check_tokens(tokens)
            cg = self.graph(output, tokens.shape[0])
            extra = document_inputs(self.spec, self.dtype, tokens, docs, loss=False)
            return self.run_graph(cg, {"tokens": tokens, **extra, **self.params})[output].clone()

    def logits(self, tokens: Tensor, docs: dict[str, Tensor] | None = None) -> Tensor:
        """Next-token logits [B, T, V] for tokens [B, T+1] (the last column is ignored)."""
        return self._forward_output(tokens, "logits", docs)

    def logprobs(self, tokens: Tensor, docs: dict[str, Tensor] | None = None) -> Tensor:
        """log p(tokens[:, t+1] | tokens[:, :t+1]) as [B, T], through the chunked LM head."""
        return self._forward_output(tokens, "logprobs", docs)

    def grads(self, tokens: Tensor, docs: dict[str, Tensor] | None = None
              ) -> tuple[float, dict[str, Tensor]]:
        """Loss and gradients of one batch (copies: the program's buffers stay private)."""
        with self.lock:
            loss, g = self.grads_in_place(tokens, docs)
            return loss, {n: t.clone() for n, t in g.items()}

    def grads_in_place(self, tokens: Tensor, docs: dict[str, Tensor] | None = None
                       ) -> tuple[float, dict[str, Tensor]]:
        """`grads` without the copies: the gradients are the program's own buffers, valid
        until its next call (the trainer's evaluation of a held-out batch)."""
        tokens = self._check_tokens(tokens)
        cg = self.graph("training", tokens.shape[0])
        extra = document_inputs(self.spec, self.dtype, tokens, docs)
        out = self.run_graph(cg, {"tokens": tokens, **extra, **self.params})
        return float(out["loss"]), {n: out[f"grad.{n}"] for n in self.params}

    def train_step(self, tokens: Tensor, docs: dict[str, Tensor] | None = None) -> float:
        """One optimizer step on `grad_accum` micro-batches of `batch_size` rows each
        (tokens: [grad_accum·batch_size, seq_len+1]; `docs`: `data.documents`' doc_start and
        loss_mask rows, as `loss`). Returns the mean micro-batch loss, which reads it back from
        the device; `advance` is the same step reading nothing back."""
        with self.lock:
            self.advance(tokens, docs)
            return self.last["loss"]

    @property
    def last(self) -> dict[str, float]:
        """The last step's {loss, lr, grad_norm} as floats (reads the device: a sync)."""
        return {k: float(v) for k, v in self._last.items()}

    def advance(self, tokens: Tensor, docs: dict[str, Tensor] | None = None) -> None:
        """One optimizer step that reads nothing back to the host: every micro-batch, the
        gradient accumulation, the clip and AdamW, with lr and step updated on the device;
        the loss and the gradient norm stay there (`last` reads them). On CUDA with
        `compile.cuda_graphs` the whole step is one CUDA graph, captured at the second call
        and replayed after (the first compiles the kernels)."""
        with self.lock:
            self._advance(tokens, docs)

    def _advance(self, tokens: Tensor, docs: dict[str, Tensor] | None) -> None:
        tokens = self._check_tokens(tokens)
        if tokens.shape[0] != self.accum * self.batch_size:
            raise TitancError(f"train_step needs {self.accum}·{self.batch_size} rows "
                              f"(train.grad_accum·train.batch_size), got {tokens.shape[0]}")
        extra = document_inputs(self.spec, self.dtype, tokens, docs)
        if self.reducer is not None:                 # data parallelism: its own step
            self._last = self.reducer.step(tokens, extra)
            self.stepper.synced = -1                 # the device counter did not advance
        else:
            self._last = self.stepper.run(self.step, tokens, extra)
        self.step += 1

    def run_micro_batch(self, cg: Any, micro: dict[str, Tensor]) -> dict[str, Tensor]:
        """The training graph `cg` on one micro-batch of a step (the executor's own outputs);
        its gradients land in the micro-batch gradient buffer (`grad_flat_tmp`)."""
        if self.target == "reference":               # the interpreter returns new tensors
            out = self.run_graph(cg, {**micro, **self.params})
            for n, t in self.grad_tmp.items():
                t.copy_(out[f"grad.{n}"])
            return out
        return self.executors.of(cg).run(micro)

    def optimizer_graph(self, scalars: dict[str, Tensor]) -> Tensor:
        """The compiled optimizer graph over every parameter at the device `scalars` (lr, step,
        grad_scale); returns the gradient norm as a device tensor."""
        inputs = dict(scalars)
        for n in self.params:
            inputs[f"param.{n}"] = self.params[n]
            inputs[f"grad.{n}"] = self.grad_acc[n]
            inputs[f"opt.m.{n}"] = self.opt_m[n]
            inputs[f"opt.v.{n}"] = self.opt_v[n]
        out = self.run_graph(self.compiled.graph("optimizer"), inputs)
        for n in self.params:                       # the executor updates in place
            for dst, key in ((self.params[n], f"param.{n}"), (self.opt_m[n], f"opt.m.{n}"),
                             (self.opt_v[n], f"opt.v.{n}")):
                if out[key].data_ptr() != dst.data_ptr():
                    dst.copy_(out[key])
        return out["grad_norm"]

    def accumulate_grads(self, tokens: Tensor, extra: dict[str, Tensor]) -> list[float]:
        """The gradients of a step's `grad_accum` micro-batches summed into the flat gradient
        accumulator, for a step finished elsewhere (the distributed step,
        runtime/train/distributed.py); their losses, read back to the host."""
        losses, B = [], self.batch_size
        for i in range(self.accum):
            loss, _ = self.grads_in_place(tokens[i * B:(i + 1) * B],
                                  {k: v[i * B:(i + 1) * B] for k, v in extra.items()})
            losses.append(loss)
            if self.accum > 1:
                (self.flat["grad"].copy_ if i == 0 else self.flat["grad"].add_)(
                    self.grad_flat_tmp)
        return losses

    def optimizer_update(self, lr: float, step: int) -> float:
        """The compiled optimizer over the accumulated gradients at the host's `lr` and
        1-based `step`; returns the gradient norm (a host read)."""
        scalars = self.stepper.scalars
        for k, v in (("lr", lr), ("step", float(step))):
            scalars[k].fill_(v)
        return float(self.optimizer_graph(scalars))
