"""Program: a compiled model that trains, evaluates and exposes its state.

Graphs run on the arena executor over their kernel schedule and buffer plan (`cpu`
target), on the same plan with generated Triton kernels (`triton`: on the GPU with CUDA, else
under Triton's interpreter, see `runtime/targets/triton_executor.py`), or on the reference
interpreter (`target: reference`, for debugging). `auto` is `triton` when CUDA is present.
Parameters, the gradient accumulator and the AdamW moments are allocated once and bound
into every executor, so tensors handed out by `parameters()` stay live and a steady-state
training step allocates nothing.
"""
from __future__ import annotations

from typing import Any

import torch

from titanc.errors import TitancError
from titanc.ir import Interpreter
from titanc.ir.types import DTYPES, dtype_name
from titanc.model.params import init_params

from titanc.runtime.train.lr_schedule import lr_at

Tensor = torch.Tensor


def resolve_target(target: str) -> str:
    """auto -> triton with CUDA, else the torch executor ('cpu')."""
    if target == "auto":
        return "triton" if torch.cuda.is_available() else "cpu"
    return target


def _executor_class(target: str) -> Any:
    """The executor of a target (the triton one is imported only when used: importing it
    selects Triton's interpreter when no CUDA device is present)."""
    if target == "triton":
        from titanc.runtime.targets.triton_executor import TritonExecutor
        return TritonExecutor
    from titanc.runtime.targets.executor import ArenaExecutor
    return ArenaExecutor


def check_token_ids(tokens: Tensor, vocab_size: int, what: str = "tokens",
                    scratch: Tensor | None = None) -> None:
    """Token ids are integers in [0, vocab_size): a float or bool tensor would be truncated
    into ids silently, and an id out of range fails deep inside torch. `scratch`, an int64
    tensor of 2 elements, holds the min and max of int64 tokens without allocating."""
    if tokens.dtype == torch.bool or tokens.is_floating_point() or tokens.is_complex():
        raise TitancError(f"{what} must hold integer token ids, got a {tokens.dtype} tensor; "
                          f"convert with .long() only if the values are ids")
    if tokens.numel():
        if (scratch is not None and tokens.dtype == scratch.dtype and tokens.dim() == 2
                and tokens.device == scratch.device):
            torch.amin(tokens, dim=(0, 1), out=scratch[0])
            torch.amax(tokens, dim=(0, 1), out=scratch[1])
            lo, hi = scratch.tolist()
        else:
            lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            raise TitancError(f"{what}: id {bad} is outside the vocabulary [0, {vocab_size}) "
                              f"of model.vocab_size={vocab_size}")


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
        self._executor_cls = None if self.target == "reference" else _executor_class(self.target)
        self.device = getattr(self._executor_cls, "device", "cpu")   # where state lives
        self._executor_options = ({"cuda_graphs": self.spec.compile.cuda_graphs,
                                   "allow_tf32": self.spec.compile.allow_tf32}
                                  if self.target == "triton" else {})
        self._executors: dict[Any, Any] = {}
        check_fits(compiled.planned_bytes(), self.spec, str(self.device))
        init = init_params(self.spec.model, self.spec.train.seed, self.dtype)
        # parameters, the gradient accumulator and the AdamW moments each live in one flat
        # buffer, in parameter order (`flat`): data parallelism reduces the gradients as one
        # tensor and ZeRO-1 shards all four by one contiguous range
        self.numel = sum(t.numel() for t in init.values())
        self.flat = {k: torch.zeros(self.numel, dtype=self.dtype, device=self.device)
                     for k in ("param", "grad", "opt.m", "opt.v")}
        self._params = _views(self.flat["param"], init)
        for n, t in init.items():
            self._params[n].copy_(t)
        self._grad_acc = _views(self.flat["grad"], init)
        self._grad_tmp = {n: torch.zeros_like(t) for n, t in self._params.items()}
        self._scalars = {k: torch.zeros((), dtype=self.dtype, device=self.device)
                         for k in ("lr", "step", "grad_scale")}
        self._m = _views(self.flat["opt.m"], init)
        self._v = _views(self.flat["opt.v"], init)
        self.reducer: Any = None        # set by a distributed run (runtime/train/distributed.py)
        self._token_range = torch.zeros(2, dtype=torch.int64)   # check_token_ids' min, max
        self.step = 0
        self.last: dict[str, float] = {}
        self._by_batch: dict[int, Any] = {self.batch_size: compiled}

    # -- state ----------------------------------------------------------------------------------
    def parameters(self) -> dict[str, Tensor]:
        return dict(self._params)

    def bind_moments(self, m: Tensor | None, v: Tensor | None) -> None:
        """Replace the flat AdamW moment buffers (`numel` elements each), or drop them (None):
        under ZeRO-1 a rank keeps only its shard, and binds full buffers to checkpoint."""
        for key, flat in (("opt.m", m), ("opt.v", v)):
            self.flat[key] = flat
        self._m = None if m is None else _views(m, self._params)
        self._v = None if v is None else _views(v, self._params)

    def state_dict(self) -> dict[str, Tensor]:
        assert self._m is not None, "AdamW moments are sharded (ZeRO-1): gather them first"
        sd = {f"param.{n}": t for n, t in self._params.items()}
        sd.update({f"opt.m.{n}": t for n, t in self._m.items()})
        sd.update({f"opt.v.{n}": t for n, t in self._v.items()})
        sd["opt.step"] = torch.tensor(self.step, dtype=torch.int64)
        return sd

    def load_state_dict(self, sd: dict[str, Tensor], strict: bool = True) -> dict[str, list[str]]:
        """Copy matching tensors in place. Returns {'new': [...], 'unused': [...]}: names this
        program has that `sd` lacks (kept at their fresh initialisation) and names of `sd` this
        program does not use. `strict` refuses any difference; a shape mismatch always fails."""
        mine = self.state_dict()
        new = sorted(k for k in mine if k not in sd and k != "opt.step")
        unused = sorted(k for k in sd if k not in mine)
        for k, t in sd.items():
            if k in mine and k != "opt.step" and tuple(t.shape) != tuple(mine[k].shape):
                raise TitancError(f"checkpoint tensor {k} has shape {list(t.shape)}, "
                                  f"the spec needs {list(mine[k].shape)}")
        if strict and (new or unused):
            raise TitancError(f"checkpoint does not match the spec (--strict): "
                              f"missing {new[:5]}, unexpected {unused[:5]}")
        with torch.no_grad():
            for k, t in sd.items():
                if k in mine and k != "opt.step":
                    mine[k].copy_(t.to(mine[k].dtype))
        if "opt.step" in sd:
            self.step = int(sd["opt.step"])
        return {"new": new, "unused": unused}

    def storages(self) -> list[Tensor]:
        """Every tensor storage this program and its executors own (for allocation probes)."""
        own = [*(t for t in self.flat.values() if t is not None), *self._grad_tmp.values(),
               *self._scalars.values(), self._token_range]
        return own + [t for ex in self._executors.values() for t in ex.storages()]

    # -- running --------------------------------------------------------------------------------
    def _graphs(self, batch: int) -> Any:
        """The compiled program (titanc.compiler.Compiled) at `batch` rows."""
        if batch not in self._by_batch:
            self._by_batch[batch] = self.compiled.for_batch(batch)
        return self._by_batch[batch]

    def graph(self, kind: str, batch: int, n: int = 1) -> Any:
        """The compiled graph of `kind` (titanc.compiler.GRAPH_KINDS) at `batch` rows."""
        return self._graphs(batch).graph(kind, n)

    def _check_tokens(self, tokens: Tensor) -> Tensor:
        if not isinstance(tokens, Tensor):
            raise TitancError(f"tokens must be an int64 tensor, got {type(tokens).__name__}")
        if tokens.dim() != 2 or tokens.shape[1] != self.seq_len + 1:
            raise TitancError(f"tokens must be int64 [batch, seq_len + 1 = {self.seq_len + 1}], "
                              f"got {list(tokens.shape)}")
        check_token_ids(tokens, self.spec.model.vocab_size, scratch=self._token_range)
        return tokens.to(torch.int64)

    def _run(self, cg: Any, inputs: dict[str, Tensor]) -> dict[str, Tensor]:
        """Run a compiled graph (titanc.compiler.CompiledGraph): on the arena executor of its
        plan, bound to this program's parameters and buffers, or, for `target: reference`, its
        graph on the interpreter."""
        with torch.no_grad():
            if self.target == "reference":
                return self._interp(cg.graph, inputs)
            ex = self._executors.get(id(cg))
            if ex is None:
                ex = self._executors[id(cg)] = self._bind(cg)
            return ex.run({k: v for k, v in inputs.items() if k not in ex.bound})

    def _bind(self, cg: Any) -> Any:
        g = cg.graph
        names = set(g.input_names()) | {n for n, _ in g.outputs}
        bound: dict[str, Tensor] = {}
        for n, t in self._params.items():
            for alias in (n, f"param.{n}"):
                if alias in names:
                    bound[alias] = t
            if f"grad.{n}" in names:
                bound[f"grad.{n}"] = self._grad_acc[n] if cg.kind == "optimizer" \
                    else self._grad_tmp[n]
            if f"opt.m.{n}" in names:
                bound[f"opt.m.{n}"], bound[f"opt.v.{n}"] = self._m[n], self._v[n]
        return self._executor_cls(cg.plan, bound, **self._executor_options)

    def loss(self, tokens: Tensor) -> float:
        tokens = self._check_tokens(tokens)
        cg = self.graph("forward", tokens.shape[0])
        return float(self._run(cg, {"tokens": tokens, **self._params})["loss"])

    def _forward_output(self, tokens: Tensor, output: str) -> Tensor:
        tokens = self._check_tokens(tokens)
        cg = self.graph(output, tokens.shape[0])
        return self._run(cg, {"tokens": tokens, **self._params})[output]

    def logits(self, tokens: Tensor) -> Tensor:
        """Next-token logits [B, T, V] for tokens [B, T+1] (the last column is ignored)."""
        return self._forward_output(tokens, "logits")

    def logprobs(self, tokens: Tensor) -> Tensor:
        """log p(tokens[:, t+1] | tokens[:, :t+1]) as [B, T], through the chunked LM head."""
        return self._forward_output(tokens, "logprobs")

    def grads(self, tokens: Tensor) -> tuple[float, dict[str, Tensor]]:
        """Loss and gradients of one batch (copies: the program's buffers stay private)."""
        loss, g = self._grads(tokens)
        return loss, {n: t.clone() for n, t in g.items()}

    def _grads(self, tokens: Tensor) -> tuple[float, dict[str, Tensor]]:
        tokens = self._check_tokens(tokens)
        cg = self.graph("training", tokens.shape[0])
        out = self._run(cg, {"tokens": tokens, **self._params})
        return float(out["loss"]), {n: out[f"grad.{n}"] for n in self._params}

    def train_step(self, tokens: Tensor) -> float:
        """One optimizer step on `grad_accum` micro-batches of `batch_size` rows each
        (tokens: [grad_accum·batch_size, seq_len+1]). Returns the mean micro-batch loss."""
        tokens = self._check_tokens(tokens)
        accum = self.spec.train.grad_accum
        if tokens.shape[0] != accum * self.batch_size:
            raise TitancError(f"train_step needs {accum}·{self.batch_size} rows "
                              f"(train.grad_accum·train.batch_size), got {tokens.shape[0]}")
        self.flat["grad"].zero_()
        reducer = self.reducer
        if reducer is not None:
            reducer.start()
        micros = tokens.split(self.batch_size)
        losses = []
        for i, micro in enumerate(micros):
            loss, g = self._grads(micro)
            losses.append(loss)
            final = reducer is not None and i == len(micros) - 1
            for n in reversed(g):                    # last layers first, as a backward emits
                self._grad_acc[n].add_(g[n])
                if final:                            # launch the buckets now final
                    reducer.ready(reducer.ranges[n][0])
        if reducer is not None:
            reducer.wait()                           # the mean gradient over ranks
        lr = lr_at(self.step, self.spec.train)
        if reducer is not None and reducer.zero:
            grad_norm = reducer.adamw(lr, self.step + 1, 1.0 / accum)
        else:
            grad_norm = self._optimizer_step(lr, accum)
        self.step += 1
        loss = sum(losses) / len(losses)
        if reducer is not None:
            loss = reducer.mean(loss)
        self.last = {"loss": loss, "lr": lr, "grad_norm": grad_norm}
        return loss

    def _optimizer_step(self, lr: float, accum: int) -> float:
        """The compiled optimizer graph over every parameter; returns the gradient norm."""
        for k, v in (("lr", lr), ("step", float(self.step + 1)), ("grad_scale", 1.0 / accum)):
            self._scalars[k].fill_(v)
        inputs = dict(self._scalars)
        for n in self._params:
            inputs[f"param.{n}"] = self._params[n]
            inputs[f"grad.{n}"] = self._grad_acc[n]
            inputs[f"opt.m.{n}"] = self._m[n]
            inputs[f"opt.v.{n}"] = self._v[n]
        out = self._run(self.compiled.graph("optimizer"), inputs)
        with torch.no_grad():
            for n in self._params:                   # the executor updates in place
                for dst, key in ((self._params[n], f"param.{n}"), (self._m[n], f"opt.m.{n}"),
                                 (self._v[n], f"opt.v.{n}")):
                    if out[key].data_ptr() != dst.data_ptr():
                        dst.copy_(out[key])
        return float(out["grad_norm"])
