"""fused_adamw: the optimizer graph -> one ADAMW pattern op (one multi-tensor launch).

    param.p', opt.m.p', opt.v.p' (every p), grad_norm  =  clip + AdamW per parameter
      ->  ITEMs of ADAMW(param.*, grad.*, opt.m.*, opt.v.*, lr, step, grad_scale)

The optimizer graph (`passes/optimizer.py`) is some 15 nodes per parameter plus the norm; as
generic kernels it is a sum-of-squares reduction and an update per parameter. As one op, the
cpu target runs a handful of in-place ATen calls over the flat parameter region and the triton
target two launches (`adamw_multi.py.jinja`: partial sums of grad², then the update, which
finishes the norm on the device).

The match is structural and exact: the pass lowers the direct optimizer graph for the same
inputs and hyper-parameters, runs it through the passes `g` went through (`before`), and
rewrites only when the printed graphs are identical; otherwise it returns `g` unchanged
(`TITANC_DEBUG=2` says so). Precondition: `g` verifies. Postcondition: same outputs, same
values (the op's reference is the same arithmetic, ir/adamw.py).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable, ClassVar

from titanc.ir import Graph, Op, format_graph

from titanc.config import debug_level
from titanc.passes.optimizer import EPS, optimizer_graph


@dataclass(frozen=True)
class FusedAdamW:
    """Optimizer graph -> ADAMW. Pre: `g` verifies and is the optimizer graph of parameters
    with weight decay flags `decay` (in input order) after the passes `before`. Post: the same
    outputs from one ADAMW node, or `g` itself when it is not that graph."""
    decay: tuple[bool, ...]
    betas: tuple[float, float]
    weight_decay: float
    clip: float
    before: tuple[Callable[[Graph], Graph], ...] = ()
    name: ClassVar[str] = "fused_adamw"

    def __call__(self, g: Graph) -> Graph:
        names = [n[len("param."):] for n in g.input_names() if n.startswith("param.")]
        types = g.input_types()
        if len(names) != len(self.decay) or not names:
            return self._refuse(g, f"{len(names)} parameters, {len(self.decay)} decay flags")
        params = [SimpleNamespace(name=n, shape=types[f"param.{n}"].shape, decay=d)
                  for n, d in zip(names, self.decay)]
        train = SimpleNamespace(betas=self.betas, grad_clip=self.clip,
                                weight_decay=self.weight_decay)
        dtype = types[f"param.{names[0]}"].dtype
        want = optimizer_graph(params, train, dtype)
        for p in self.before:
            want = p(want)
        if format_graph(want) != format_graph(g):
            return self._refuse(g, "the graph is not the direct optimizer graph")
        return _fused(g, names, self)

    def _refuse(self, g: Graph, why: str) -> Graph:
        if debug_level() >= 2:
            print(f"[titanc] fused_adamw {g.name}: left as is: {why}", file=sys.stderr)
        return g


def _fused(g: Graph, names: list[str], p: FusedAdamW) -> Graph:
    out = Graph(g.name)
    env = {g.node(i).attr("name"): out.add_like(g.node(i)) for i in g.inputs}
    ins = [env[f"{kind}.{n}"] for kind in ("param", "grad", "opt.m", "opt.v") for n in names]
    ins += [env["lr"], env["step"], env["grad_scale"]]
    attrs: dict[str, Any] = {"n": len(names), "beta1": p.betas[0], "beta2": p.betas[1],
                             "eps": EPS, "weight_decay": p.weight_decay, "clip": p.clip,
                             "decay": tuple(p.decay)}
    op = out.add(Op.ADAMW, ins, attrs)
    n = len(names)
    results = {f"{kind}.{name}": k * n + j for k, kind in enumerate(("param", "opt.m", "opt.v"))
               for j, name in enumerate(names)}
    results["grad_norm"] = 3 * n
    out.set_outputs([(name, out.add(Op.ITEM, (op,), {"index": results[name]}))
                     for name, _ in g.outputs])
    return out
