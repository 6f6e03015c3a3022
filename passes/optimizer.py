"""The optimizer step as a graph: global-norm clipping and AdamW.

Inputs per parameter `n`: `param.n`, `grad.n` (the accumulated gradient), `opt.m.n`,
`opt.v.n`; scalars `lr`, `step` (1-based, for bias correction) and `grad_scale` (1/accum).
Outputs: `param.n`, `opt.m.n`, `opt.v.n` (the new values) and `grad_norm` (before clipping).
Weight decay is decoupled (p -= lr·wd·p) and applies to matrices only (`ParamSpec.decay`).
"""
from __future__ import annotations

import math
from typing import Any, Sequence

from titanc.ir import Builder, Graph, Value

EPS = 1e-8


def optimizer_graph(params: Sequence[Any], train: Any, dtype: str) -> Graph:
    b = Builder("optimizer")
    beta1, beta2 = train.betas
    ins = {}
    for p in params:
        for kind in ("param", "grad", "opt.m", "opt.v"):
            ins[kind, p.name] = b.input(f"{kind}.{p.name}", p.shape, dtype)
    lr, step, scale = (b.input(n, (), dtype) for n in ("lr", "step", "grad_scale"))
    grads = {p.name: ins["grad", p.name] * scale for p in params}
    sq = [(g * g).sum(range(g.rank)) for g in grads.values()]
    total = sq[0]
    for s in sq[1:]:
        total = total + s
    norm = total.sqrt()                                           # global L2 norm
    if train.grad_clip > 0:
        # clip factor min(1, c / (norm + 1e-6)) = -max(-1, -c / (norm + 1e-6))
        factor = -b.maximum(-(train.grad_clip / (norm + 1e-6)), -1.0)
        grads = {n: g * factor for n, g in grads.items()}
    bc1 = 1.0 - (step * math.log(beta1)).exp()                    # 1 - β1^t
    bc2 = 1.0 - (step * math.log(beta2)).exp()
    outs: list[tuple[str, Value]] = []
    for p in params:
        g, w = grads[p.name], ins["param", p.name]
        m = ins["opt.m", p.name] * beta1 + g * (1.0 - beta1)
        v = ins["opt.v", p.name] * beta2 + g * g * (1.0 - beta2)
        upd = (m / bc1) / ((v / bc2).sqrt() + EPS)
        if p.decay and train.weight_decay > 0:
            w = w - w * (lr * train.weight_decay)
        outs += [(f"param.{p.name}", w - upd * lr), (f"opt.m.{p.name}", m),
                 (f"opt.v.{p.name}", v)]
    outs.append(("grad_norm", norm))
    b.graph.set_outputs([(n, v.id) for n, v in outs])
    return b.graph
