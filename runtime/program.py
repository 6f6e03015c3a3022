"""Program: a compiled model that trains, evaluates and exposes its state.

Graphs run on the arena executor over their kernel schedule and memory plan (`cpu`
target), on the same plan with generated Triton kernels (`triton`: on the GPU with CUDA, else
under Triton's interpreter, see `runtime/triton_executor.py`), or on the reference
interpreter (`target: reference`, for debugging). `auto` is `triton` when CUDA is present.
Parameters, the gradient accumulator and the AdamW moments are allocated once and bound
into every executor, so tensors handed out by `parameters()` stay live and a steady-state
training step allocates nothing.
"""
from __future__ import annotations

from typing import Any

import torch

from titanc.errors import TitancError
from titanc.ir import Graph, Interpreter
from titanc.ir.types import DTYPES, dtype_name
from titanc.params import init_params

from .schedule import lr_at

Tensor = torch.Tensor


def _resolve_target(target: str) -> str:
    """auto -> triton with CUDA, else the torch executor ('cpu')."""
    if target == "auto":
        return "triton" if torch.cuda.is_available() else "cpu"
    return target


def _executor_class(target: str) -> Any:
    """The executor of a target (the triton one is imported only when used: importing it
    selects Triton's interpreter when no CUDA device is present)."""
    if target == "triton":
        from .triton_executor import TritonExecutor
        return TritonExecutor
    from .executor import ArenaExecutor
    return ArenaExecutor


class Program:
    def __init__(self, compiled: Any):
        self.compiled = compiled
        self.spec = compiled.spec
        self.dtype = DTYPES[dtype_name(self.spec.train.dtype)]
        self.batch_size = self.spec.train.batch_size
        self.seq_len = self.spec.model.seq_len
        self._interp = Interpreter()
        self.target = _resolve_target(self.spec.compile.target)
        self._executor_cls = None if self.target == "reference" else _executor_class(self.target)
        self.device = getattr(self._executor_cls, "device", "cpu")   # where state lives
        self._executor_options = ({"cuda_graphs": self.spec.compile.cuda_graphs,
                                   "allow_tf32": self.spec.compile.allow_tf32}
                                  if self.target == "triton" else {})
        self._executors: dict[Any, Any] = {}
        self._params = {n: t.to(self.device) for n, t in
                        init_params(self.spec.model, self.spec.train.seed, self.dtype).items()}
        self._grad_acc = {n: torch.zeros_like(t) for n, t in self._params.items()}
        self._grad_tmp = {n: torch.zeros_like(t) for n, t in self._params.items()}
        self._scalars = {k: torch.zeros((), dtype=self.dtype, device=self.device)
                         for k in ("lr", "step", "grad_scale")}
        self._m = {n: torch.zeros_like(t) for n, t in self._params.items()}
        self._v = {n: torch.zeros_like(t) for n, t in self._params.items()}
        self.step = 0
        self.last: dict[str, float] = {}
        self._by_batch: dict[int, Any] = {self.batch_size: compiled}
        self._extra: dict[tuple[str, int], Graph] = {}

    # -- state ----------------------------------------------------------------------------------
    def parameters(self) -> dict[str, Tensor]:
        return dict(self._params)

    def state_dict(self) -> dict[str, Tensor]:
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
        own = [t for d in (self._params, self._grad_acc, self._grad_tmp, self._m, self._v,
                           self._scalars) for t in d.values()]
        return own + [t for ex in self._executors.values() for t in ex.storages()]

    # -- running --------------------------------------------------------------------------------
    def _graphs(self, batch: int) -> Any:
        if batch not in self._by_batch:
            from titanc.compiler import compile_graphs
            self._by_batch[batch] = compile_graphs(self.spec, batch=batch, verify_each=False)
        return self._by_batch[batch]

    def _check_tokens(self, tokens: Tensor) -> Tensor:
        if tokens.dim() != 2 or tokens.shape[1] != self.seq_len + 1:
            raise TitancError(f"tokens must be int64 [batch, seq_len + 1 = {self.seq_len + 1}], "
                              f"got {list(tokens.shape)}")
        return tokens.to(torch.int64)

    def _run(self, g: Graph, inputs: dict[str, Tensor], plan: Any = None) -> dict[str, Tensor]:
        """Run a graph: on the arena executor (bound to this program's parameters and
        buffers) or, for `target: reference`, on the interpreter."""
        with torch.no_grad():
            if self.target == "reference":
                return self._interp(g, inputs)
            ex = self._executors.get(id(g))
            if ex is None:
                ex = self._executors[id(g)] = self._bind(g, plan)
            return ex.run({k: v for k, v in inputs.items() if k not in ex.bound})

    def _bind(self, g: Graph, plan: Any) -> Any:
        from .executor import executor_for

        names = set(g.input_names()) | {n for n, _ in g.outputs}
        bound: dict[str, Tensor] = {}
        for n, t in self._params.items():
            for alias in (n, f"param.{n}"):
                if alias in names:
                    bound[alias] = t
            if f"grad.{n}" in names:
                bound[f"grad.{n}"] = self._grad_acc[n] if g is self.compiled.optimizer \
                    else self._grad_tmp[n]
            if f"opt.m.{n}" in names:
                bound[f"opt.m.{n}"], bound[f"opt.v.{n}"] = self._m[n], self._v[n]
        if plan is not None:
            return self._executor_cls(plan, bound, **self._executor_options)
        return executor_for(g, set(bound) | {n for n in names if n.startswith("state.")}, bound,
                            cls=self._executor_cls, **self._executor_options)

    def loss(self, tokens: Tensor) -> float:
        tokens = self._check_tokens(tokens)
        c = self._graphs(tokens.shape[0])
        return float(self._run(c.forward, {"tokens": tokens, **self._params})["loss"])

    def _forward_output(self, tokens: Tensor, output: str) -> Tensor:
        tokens = self._check_tokens(tokens)
        key = (output, tokens.shape[0])
        if key not in self._extra:
            from titanc.frontend import lower_forward
            self._extra[key] = lower_forward(self.spec, batch=tokens.shape[0], output=output)
        return self._run(self._extra[key], {"tokens": tokens, **self._params})[output]

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
        c = self._graphs(tokens.shape[0])
        out = self._run(c.grad, {"tokens": tokens, **self._params}, c.plans.get("training"))
        return float(out["loss"]), {n: out[f"grad.{n}"] for n in self._params}

    def train_step(self, tokens: Tensor) -> float:
        """One optimizer step on `grad_accum` micro-batches of `batch_size` rows each
        (tokens: [grad_accum·batch_size, seq_len+1]). Returns the mean micro-batch loss."""
        tokens = self._check_tokens(tokens)
        accum = self.spec.train.grad_accum
        if tokens.shape[0] != accum * self.batch_size:
            raise TitancError(f"train_step needs {accum}·{self.batch_size} rows "
                              f"(train.grad_accum·train.batch_size), got {tokens.shape[0]}")
        for t in self._grad_acc.values():
            t.zero_()
        losses = []
        for micro in tokens.split(self.batch_size):
            loss, g = self._grads(micro)
            losses.append(loss)
            for n, t in g.items():
                self._grad_acc[n].add_(t)
        lr = lr_at(self.step, self.spec.train)
        for k, v in (("lr", lr), ("step", float(self.step + 1)), ("grad_scale", 1.0 / accum)):
            self._scalars[k].fill_(v)
        inputs = dict(self._scalars)
        for n in self._params:
            inputs[f"param.{n}"] = self._params[n]
            inputs[f"grad.{n}"] = self._grad_acc[n]
            inputs[f"opt.m.{n}"] = self._m[n]
            inputs[f"opt.v.{n}"] = self._v[n]
        out = self._run(self.compiled.optimizer, inputs, self.compiled.plans.get("optimizer"))
        with torch.no_grad():
            for n in self._params:                   # the executor updates in place
                for dst, key in ((self._params[n], f"param.{n}"), (self._m[n], f"opt.m.{n}"),
                                 (self._v[n], f"opt.v.{n}")):
                    if out[key].data_ptr() != dst.data_ptr():
                        dst.copy_(out[key])
        self.step += 1
        loss = sum(losses) / len(losses)
        self.last = {"loss": loss, "lr": lr, "grad_norm": float(out["grad_norm"])}
        return loss
