"""A Program's optimizer step on the device, reading nothing back to the host: every
micro-batch's gradients summed into the accumulator, the clip and AdamW of the compiled
optimizer graph, lr and step updated on the device (`LrTable`, a device step counter), the
loss and the gradient norm left there. On CUDA with `compile.cuda_graphs` the whole step is
one CUDA graph, captured at the second step and replayed after (the first compiles the
kernels)."""
from __future__ import annotations

from typing import Any

import torch

from titanc.runtime.lr_schedule import LrTable, lr_at

Tensor = torch.Tensor


class DeviceStep:
    """The device state and work of `prog`'s optimizer step (runtime/program.py `Program`):
    its scalars, lr table, step counter and input buffers, and the captured step."""

    def __init__(self, prog: Any) -> None:
        self.prog = prog
        dtype, device = prog.dtype, prog.device
        # the optimizer's scalars live on the device and are updated there: `step` (1-based)
        # from a device step counter, `lr` gathered from the schedule's table at that step
        self.scalars = {k: torch.zeros((), dtype=dtype, device=device)
                        for k in ("lr", "step", "grad_scale")}
        self.scalars["grad_scale"].fill_(1.0 / prog.accum)
        self.lr_table = LrTable(prog.spec.train, dtype, device)
        self.step_index = torch.zeros(1, dtype=torch.int64, device=device)
        self.synced = 0                    # the host step the device counter holds
        # what a step leaves on the device, read only when asked (`Program.last`)
        self.loss = torch.zeros((), dtype=dtype, device=device)
        self.grad_norm: Tensor | float = 0.0
        self.tokens_dev: Tensor | None = None      # the step's tokens, where the graph reads them
        self.extra_dev: dict[str, Tensor] = {}     # its document inputs, likewise
        self.graph: Any = None                     # the captured optimizer step (CUDA)
        self.eager = 0
        # on CUDA the whole optimizer step is one captured graph
        self.capture = (prog.target == "triton" and prog.device == "cuda"
                        and prog.spec.compile.cuda_graphs is not False)

    def storages(self) -> list[Tensor]:
        own = [*self.scalars.values(), *self.lr_table.storages(), self.step_index, self.loss]
        own += [self.tokens_dev] if self.tokens_dev is not None else []
        return own + list(self.extra_dev.values())

    def run(self, step: int, tokens: Tensor, extra: dict[str, Tensor]) -> dict[str, Any]:
        """Optimizer step `step` (0-based) on checked `tokens` and document inputs `extra`;
        returns its {loss, lr, grad_norm}, the loss and norm as device tensors."""
        if step != self.synced:                      # set from outside (a checkpoint)
            self.step_index.fill_(step)
        self.lr_table.hold(step)
        device = self.prog.device
        if device != "cpu":                          # one copy in, where the graph reads it
            if self.tokens_dev is None or self.tokens_dev.shape != tokens.shape:
                self.tokens_dev, self.graph = torch.empty_like(tokens, device=device), None
            self.tokens_dev.copy_(tokens, non_blocking=True)
            tokens = self.tokens_dev
            extra = self._inputs_on_device(extra)
        with torch.no_grad():
            if self.graph is not None:
                self.graph.replay()
            elif self.capture and self.eager >= 1:
                self.graph = torch.cuda.CUDAGraph()
                torch.cuda.synchronize()             # once, at capture
                with torch.cuda.graph(self.graph):
                    self._device_step(tokens, extra)
                self.graph.replay()
            else:
                self._device_step(tokens, extra)
                self.eager += 1
        self.synced = step + 1
        return {"loss": self.loss, "lr": lr_at(step, self.prog.spec.train),
                "grad_norm": self.grad_norm}

    def _inputs_on_device(self, extra: dict[str, Tensor]) -> dict[str, Tensor]:
        """The document inputs copied into fixed device buffers (what a captured step reads);
        a new shape drops the captured graph."""
        for k, v in extra.items():
            buf = self.extra_dev.get(k)
            if buf is None or buf.shape != v.shape:
                self.extra_dev[k], self.graph = torch.empty_like(v, device=self.prog.device), None
            self.extra_dev[k].copy_(v, non_blocking=True)
        return {k: self.extra_dev[k] for k in extra}

    def _device_step(self, tokens: Tensor, extra: dict[str, Tensor]) -> None:
        """The device work of one optimizer step (what the CUDA graph captures): the
        micro-batches' gradients summed into the accumulator, the mean loss into `loss`, the
        scalars, the optimizer graph, the step counter."""
        prog = self.prog
        B, accum = prog.batch_size, prog.accum
        cg = prog.graph("training", B)
        for i in range(accum):
            micro = {"tokens": tokens[i * B:(i + 1) * B],
                     **{k: v[i * B:(i + 1) * B] for k, v in extra.items()}}
            out = prog.run_micro_batch(cg, micro)
            if accum == 1:
                self.loss.copy_(out["loss"])
            elif i == 0:
                prog.flat["grad"].copy_(prog.grad_flat_tmp)
                self.loss.copy_(out["loss"])
            else:
                prog.flat["grad"].add_(prog.grad_flat_tmp)
                self.loss.add_(out["loss"])
        if accum > 1:
            self.loss.mul_(1.0 / accum)
        self.lr_table.gather(self.step_index, self.scalars["lr"].view(1))
        torch.add(self.step_index, 1, out=self.scalars["step"].view(1))
        self.grad_norm = prog.optimizer_graph(self.scalars)
        self.step_index.add_(1)
