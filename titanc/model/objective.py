"""The memory's inner objective ℓ(ŷ, v): what each write descends (docs/semantics.md,
"Inner objective").

    obj = objective_of(spec.model.memory)             # Objective("huber", delta=0.5)
    g = loss_graph(obj, (B, Nm, U, e), "f64")          # inputs yhat, v -> per-token loss

One record per objective: ρ, the per-channel value of the residual r = ŷ − v as an IR
expression; a token's loss is ℓ = mean_c ρ(r_c). Only the value is written here. The lowering
(`titanc/model/neural_memory.py`) takes ∂ℓ/∂ŷ from the IR's autodiff of `loss_graph`
(`titanc.passes.autodiff.derivative`), and the memory diagnostics evaluate the same graph, so
a new objective is one record. ℓ2 also carries its closed-form derivative (2/e)(ŷ − v): the
default's graphs stay what they were before objectives were a choice, and a test checks the
closed form against autodiff of its value.

    l2      ρ(r) = r²                                      (the Titans paper)
    huber   ρ(r) = r² for |r| ≤ δ, 2δ|r| − δ² beyond      (ℓ2 inside δ, linear outside)
    lp      ρ(r) = (r² + ε)^(p/2), ε = LP_EPS              (MIRAS's ℓp attentional bias)

Huber is written through c = clamp(r, −δ, δ) as ρ = c (2r − c), ℓp through exp and log;
both have a gradient everywhere and a second derivative the outer backward can take.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from titanc.ir import Builder, Graph, Value

from titanc.model.spec import MemorySpec

__all__ = ["Objective", "OBJECTIVES", "LP_EPS", "objective_of", "loss_graph", "token_loss"]

LP_EPS = 1e-6                 # ℓp's smoothing: (r² + ε)^(p/2) is differentiable at r = 0
HUBER_DELTA = 1.0             # memory.huber_delta when the spec leaves it out
LP_P = 3.0                    # memory.lp_p when the spec leaves it out (MIRAS's Moneta)
LN_EPS = 1e-6                 # the layer norm of the inner model ln_residual (fla's Titans)


@dataclass(frozen=True)
class Objective:
    """An inner objective and its parameters (`delta` for huber, `p` for lp)."""
    kind: str = "l2"
    delta: float = HUBER_DELTA
    p: float = LP_P


def _clamp(r: Value, lim: float) -> Value:
    # min(max(r, −lim), lim), with min(a, lim) = −max(−a, −lim)
    return -r.b.maximum(-r.b.maximum(r, -lim), -lim)


def _l2(r: Value, o: Objective) -> Value:
    return r * r


def _huber(r: Value, o: Objective) -> Value:
    c = _clamp(r, o.delta)                       # = r inside δ, ±δ beyond
    return c * (r * 2.0 - c)                     # r² inside; 2δ|r| − δ² beyond


def _lp(r: Value, o: Objective) -> Value:
    return ((r * r + LP_EPS).log() * (o.p / 2.0)).exp()     # (r² + ε)^(p/2)


# kind -> ρ(r), the per-channel value of the residual
OBJECTIVES: dict[str, Callable[[Value, Objective], Value]] = {
    "l2": _l2,
    "huber": _huber,
    "lp": _lp,
}


def objective_of(mem: MemorySpec) -> Objective:
    """The objective a memory spec declares (its parameters' defaults filled in)."""
    return Objective(mem.objective,
                     HUBER_DELTA if mem.huber_delta is None else mem.huber_delta,
                     LP_P if mem.lp_p is None else mem.lp_p)


def token_loss(yhat: Value, v: Value, obj: Objective) -> Value:
    """ℓ per token: mean_c ρ(ŷ − v)_c over the last axis, (..., e) -> (...)."""
    return OBJECTIVES[obj.kind](yhat - v, obj).mean((-1,))


def loss_graph(obj: Objective, shape: tuple[int, ...], dtype: str, total: bool = False) -> Graph:
    """Inputs `yhat`, `v` of `shape` (..., e); output `loss`: ℓ per token (shape[:-1]), or
    its sum over every token with `total` (a scalar, what autodiff differentiates: each
    token's ℓ reads only its own ŷ, so ∂Σℓ/∂ŷ_t = ∂ℓ_t/∂ŷ_t)."""
    b = Builder(f"objective_{obj.kind}")
    yhat, v = b.input("yhat", shape, dtype), b.input("v", shape, dtype)
    loss = token_loss(yhat, v, obj)
    if total:
        loss = loss.sum(tuple(range(loss.rank)))
    b.graph.set_outputs([("loss", loss.id)])
    return b.graph
