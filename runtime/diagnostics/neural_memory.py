"""Memory diagnostics: what the neural memory does on one batch, per layer.

    stats = memory_stats(prog, tokens)
    # {"layers": [{"inner_loss_before": 0.41, "inner_loss_after": 0.12, "w_norm": 5.6,
    #              "s_norm": 0.8, "theta": 0.93, "eta": 0.89, "alpha": 0.011,
    #              "chunk_loss_before": [...], "chunk_loss_after": [...]}, ...]}

The compiled forward graph (the `logits` kind) runs on the IR interpreter, which is watched
at every iteration of each memory scan (role `memory`; docs/semantics.md, "Neural memory"):
its inputs are the chunk-start state (W_1..W_Ld, S_1..S_Ld) and the chunk's streams (q, k, v,
θ, log η, log(1 − α)), its outputs the state after the write. Per chunk: the inner loss
ℓ(M(k; W), v) of the declared `memory.objective` (titanc/model/objective.py: its own value
graph, evaluated here; M is `memory.inner`'s model, the scan's last two constants w, b for
ln_residual), averaged over the chunk's tokens, at the state before the write and
after it (a write that helps lowers it), the Frobenius norms of W and S (per batch row and
head, summed over the memory MLP's layers, averaged), the root mean square of the written
values v (the scale the inner loss is measured in: a growing loss with a steady v_rms is a
write that does not contract, one that grows with v_rms is a growing target), and the mean
gates θ, η, α. The iteration of the scan
of role `layer` says which layer a chunk belongs to; MAC's chunks (inside its segment scan)
are seen the same way. Nothing here changes what the compiled program computes: it is a
second, slower look at the same graph, for `train.memory_stats_every` (metrics.jsonl) and
benchmarks/recall_distance.py.
"""
from __future__ import annotations

from typing import Any

import torch

from titanc.ir import Graph, Interpreter, dtype_name
from titanc.ir.ops import Op
from titanc.model.objective import LN_EPS, Objective, loss_graph, objective_of
from titanc.runtime.documents import document_inputs

Tensor = torch.Tensor


def _mlp(ws: list[Tensor], x: Tensor) -> Tensor:
    """M(x; W) for x (B, Nm, t, e), W_i (B, Nm, out, in): silu between layers, none after."""
    for i, w in enumerate(ws):
        x = torch.einsum("bnoi,bnti->bnto", w, x)
        if i < len(ws) - 1:
            x = torch.nn.functional.silu(x)
    return x


def _model(ws: list[Tensor], x: Tensor, ln: list[Tensor]) -> Tensor:
    """The inner model at x: `_mlp`, or with ln = [w, b] (Nm, e) x + w ⊙ LN(W x) + b."""
    y = _mlp(ws, x)
    if not ln:
        return y
    w, b = (t.reshape(1, *t.shape[:1], 1, t.shape[-1]) for t in ln)
    mean = y.mean(-1, keepdim=True)
    var = (y - mean).pow(2).mean(-1, keepdim=True)
    return x + w * (y - mean) * (var + LN_EPS).rsqrt() + b


def _norm(ts: list[Tensor]) -> float:
    """Frobenius norm over the MLP's layers, per (batch row, head), averaged."""
    sq = sum(t.pow(2).sum((-2, -1)) for t in ts)
    return float(sq.sqrt().mean())


class _Watcher(Interpreter):
    """The interpreter, with the scans of role `layer` and `memory` observed."""

    def __init__(self, objective: Objective, depth: int, ln_residual: bool = False) -> None:
        super().__init__()
        self.depth = depth
        self.ln_residual = ln_residual
        self.layer = 0
        self.chunks: list[tuple[int, dict[str, float]]] = []
        self.objective = objective
        self._loss: dict[tuple, Graph] = {}

    def inner_loss(self, yhat: Tensor, v: Tensor) -> float:
        """The objective's ℓ per token (its graph on the interpreter), averaged."""
        key = (tuple(yhat.shape), yhat.dtype)
        if key not in self._loss:
            self._loss[key] = loss_graph(self.objective, yhat.shape, dtype_name(yhat.dtype))
        (loss,) = Interpreter().run(self._loss[key], [yhat, v])
        return float(loss.mean())

    def _eval(self, node: Any, args: list[Any]) -> Any:
        if node.op is Op.SCAN and node.attr_dict.get("role") in ("layer", "memory"):
            return self._watched_scan(node, args)
        return super()._eval(node, args)

    def _watched_scan(self, node: Any, args: list[Any]) -> tuple[Tensor, ...]:
        a = node.attr_dict
        nc, nx, body = a["n_carry"], a["n_xs"], a["body"]
        carries, xs, consts = list(args[:nc]), args[nc:nc + nx], list(args[nc + nx:])
        ys: list[list[Tensor]] = []
        for t in range(a["length"]):
            if a.get("role") == "layer":
                self.layer = t
            x_t = [x[t] for x in xs]
            outs = self.run(body, carries + x_t + consts)
            if a.get("role") == "memory":
                self._record(carries, x_t, outs[:nc], consts[-2:] if self.ln_residual else [])
            carries = outs[:nc]
            ys.append(outs[nc:])
        stacked = [torch.stack([y[k] for y in ys]) for k in range(len(body.outputs) - nc)]
        return tuple(carries) + tuple(stacked)

    def _record(self, before: list[Tensor], x: list[Tensor], after: list[Tensor],
                ln: list[Tensor]) -> None:
        depth = self.depth
        momentum = len(before) > depth                # memory.momentum_form: none has no S, no η
        _, k, v, theta = x[:4]                        # (data.documents adds the starts)
        log_eta, log_keep = (x[4], x[5]) if momentum else (None, x[4])
        w0, w1, s1 = before[:depth], after[:depth], after[depth:]
        self.chunks.append((self.layer, {
            "loss_before": self.inner_loss(_model(w0, k, ln), v),
            "loss_after": self.inner_loss(_model(w1, k, ln), v),
            "w_norm": _norm(w1), "s_norm": _norm(s1) if momentum else 0.0,
            "v_rms": float(v.pow(2).mean().sqrt()),
            "theta": float(theta.mean()),
            "eta": float(log_eta.exp().mean()) if momentum else 0.0,
            "alpha": float(1 - log_keep.exp().mean()),
        }))


def memory_stats(prog: Any, tokens: Tensor) -> dict[str, Any]:
    """Per-layer memory diagnostics of `prog` (a Program) on `tokens` [B, T+1] (see above).
    Returns {"layers": []} for a model without memory (block attn)."""
    spec = prog.spec
    g = prog.graph("logits", tokens.shape[0]).graph     # the compiled forward, logits out
    mem = spec.model.memory
    watcher = _Watcher(objective_of(mem), mem.depth, mem.inner == "ln_residual")
    inputs = {"tokens": tokens.to(torch.int64).cpu(),
              **document_inputs(spec, prog.dtype, tokens, None, loss=False),   # data.documents: one per row
              **{n: t.detach().cpu() for n, t in prog.parameters().items()}}
    with torch.no_grad():
        watcher(g, inputs)
    layers = []
    for layer in range(spec.model.n_layers):
        rows = [r for lay, r in watcher.chunks if lay == layer]
        if not rows:
            continue
        mean = {k: round(sum(r[k] for r in rows) / len(rows), 5) for k in rows[0]}
        layers.append({
            "inner_loss_before": mean["loss_before"], "inner_loss_after": mean["loss_after"],
            "w_norm": mean["w_norm"], "s_norm": mean["s_norm"], "v_rms": mean["v_rms"],
            "theta": mean["theta"],
            "eta": mean["eta"], "alpha": mean["alpha"],
            "chunk_loss_before": [round(r["loss_before"], 5) for r in rows],
            "chunk_loss_after": [round(r["loss_after"], 5) for r in rows],
        })
    return {"layers": layers}
