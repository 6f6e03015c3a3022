"""Neural long-term memory (LMM) lowering, per docs/semantics.md.

Ein notation: b batch, n memory head, u/t token within a chunk, e head width (d),
o/i out/in axes of a memory weight matrix, c chunk index.

The memory is a scan over chunks carrying (W_1..W_L, S_1..S_L), each (B, Nm, out, in).
Inside a chunk every inner gradient is taken at the chunk-start weights and the per-token
momentum/decay recurrences are applied in closed form (log-space cumulative sums). The
update is emitted in its *direct* form, a weighted sum over the chunk of per-token outer
products (B, Nm, b, out, in); the `aggregate` pass turns it into one contraction. A linear
memory (`MemorySpec.linear`: depth 1, no momentum, l2) is instead written exactly, token by
token inside the chunk, in the WY form (`chunk_update_linear`); docs/semantics.md, "Memory
family", names the knobs `chunk_write` and `memory_scan` follow.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from titanc.ir import Builder, Value
from titanc.ir.elementwise import silu_grad

from titanc.model.documents import gt, positions
from titanc.model.nn import dwconv, l2norm, log_sigmoid
from titanc.model.objective import LN_EPS, Objective, loss_graph
from titanc.model.spec import MemorySpec
from titanc.passes.autodiff import derivative

L2 = Objective()               # the default inner objective (docs/semantics.md)
LnParams = tuple[Value, Value]  # w, b (Nm, e) of x + w ⊙ LN(W x) + b


@dataclass(frozen=True)
class MemStreams:
    """Per-token memory inputs, heads split: q/k/v (B, Nm, T, e); gates (B, Nm, T)."""
    q: Value | None
    k: Value | None
    v: Value | None
    theta: Value | None
    log_eta: Value | None
    log_keep: Value | None      # log(1 − α)


def _heads(x: Value, nm: int) -> Value:
    # (B, T, D) -> (B, Nm, T, e)
    B, T, D = x.shape
    return x.reshape(B, T, nm, D // nm).permute(0, 2, 1, 3)


def project(b: Builder, u: Value, p: dict[str, Value], mem: MemorySpec, want: str = "qkvg",
            conv: Callable[[Value, Value, str], Value] | None = None) -> MemStreams:
    """Projections of u (B, T, D): l2norm(silu(dwconv(u W))) for q, k (no silu with
    `memory.qk_activation: none`); silu(dwconv(u W)) for v;
    gates θ, log η, log(1 − α). `want` picks which of q, k, v, g(ates) to build; `conv`
    replaces the zero-history conv (decoding passes one that reads a history)."""
    nm = mem.heads
    B, T, D = u.shape
    conv = conv or (lambda x, w, name: dwconv(x, w))

    def stream(name: str, norm: bool) -> Value:
        x = conv(u @ p[f"mem_w{name}"], p[f"mem_conv_{name}"], name)  # (B, T, D)
        if not norm or mem.qk_activation == "silu":   # v always; q, k unless 'none'
            x = x.silu()
        if norm:                                  # l2norm over each head's e channels
            x = l2norm(x.reshape(B, T, nm, D // nm)).reshape(B, T, D)
        return _heads(x, nm)

    q = stream("q", True) if "q" in want else None
    k = stream("k", True) if "k" in want else None
    v = stream("v", False) if "v" in want else None
    theta = log_eta = log_keep = None
    if "g" in want:
        theta, log_eta, log_keep = gates(b, u, p, mem)
    return MemStreams(q, k, v, theta, log_eta, log_keep)


def gates(b: Builder, u: Value, p: dict[str, Value], mem: MemorySpec
          ) -> tuple[Value, Value | None, Value]:
    """θ, log η (None with `momentum_form: none`), log(1 − α), each (B, Nm, T). A gate in
    `memory.fixed` (or every gate, when not adaptive) is its constant."""
    nm = mem.heads
    B, T, D = u.shape
    none = mem.momentum_form == "none"

    def const(value: float) -> Value:
        return b.full(value, (), u.dtype).expand(B, nm, T)

    if not mem.adaptive:
        theta = const(mem.lr_max * (1.0 - mem.momentum if mem.momentum_form == "ema" else 1.0))
        log_eta = None if none else const(math.log(mem.momentum))
        return theta, log_eta, const(math.log(1.0 - mem.decay))

    def gate(name: str) -> Value:                  # (B, T, Nm) -> (B, Nm, T)
        return (u @ p[f"mem_{name}_w"] + p[f"mem_{name}_b"]).permute(0, 2, 1)

    theta = const(mem.lr_max) if "theta" in mem.fixed else gate("theta").sigmoid() * mem.lr_max
    eta = log_eta = None                            # no momentum: no η
    if not none and "eta" in mem.fixed:
        log_eta = const(math.log(mem.momentum))
    elif not none:
        eta = gate("eta")
        log_eta = log_sigmoid(eta)
    if "alpha" in mem.fixed:
        log_keep = const(math.log(1.0 - mem.decay))
    elif mem.decay_form == "mamba2":                # log(1 − α) = −e^A softplus(x) = e^A log σ(−x)
        a = p["mem_alpha_a"].exp().reshape(1, nm, 1)
        log_keep = log_sigmoid(-gate("alpha")) * a
    elif mem.decay_max < 1.0:                       # α = decay_max σ(x)
        log_keep = (1.0 - gate("alpha").sigmoid() * mem.decay_max).log()
    else:
        log_keep = log_sigmoid(-gate("alpha"))
    if mem.momentum_form == "ema":                  # θ (1 - η): 1 - σ(x) = σ(-x)
        theta = theta * (const(1.0 - mem.momentum) if eta is None else (-eta).sigmoid())
    return theta, log_eta, log_keep


def mlp(b: Builder, ws: list[Value], x: Value) -> tuple[Value, list[Value], list[Value]]:
    """M(x; W) batched over tokens: x (B, Nm, t, i). Returns output, pre-activations z_i and
    layer inputs a_{i-1}."""
    zs, acts = [], []
    a = x
    for i, w in enumerate(ws):
        acts.append(a)
        z = b.einsum("bnoi,bnti->bnto", w, a)
        zs.append(z)
        a = z.silu() if i < len(ws) - 1 else z
    return a, zs, acts


def inner_ln(p: dict[str, Value], mem: MemorySpec) -> LnParams | None:
    """(w, b) of the inner model x + w ⊙ LN(W x) + b (`memory.inner: ln_residual`), else None."""
    return (p["mem_ln_w"], p["mem_ln_b"]) if mem.inner == "ln_residual" else None


def layer_norm(x: Value) -> tuple[Value, Value]:
    """x̂ = (x − μ)/σ over the last axis and 1/σ, σ = sqrt(var + LN_EPS), var biased."""
    c = x - x.mean((-1,), keepdim=True)
    rstd = ((c * c).mean((-1,), keepdim=True) + LN_EPS).rsqrt()
    return c * rstd, rstd


def _per_head(x: Value) -> Value:
    # (Nm, e) -> (1, Nm, 1, e)
    Nm, E = x.shape
    return x.reshape(1, Nm, 1, E)


def post_norm(y: Value, ln: LnParams) -> Value:
    """The read y (B, Nm, t, e) as y + w ⊙ LN(y) + b (`memory.post_norm`, fla's Titans)."""
    yhat, _ = layer_norm(y)
    return y + yhat * _per_head(ln[0]) + _per_head(ln[1])


def _ln_residual_grads(b: Builder, w: Value, k: Value, v: Value, ln: LnParams,
                       obj: Objective) -> list[Value]:
    """Per-token gradient of ℓ(ŷ, v), ŷ = k + w ⊙ x̂ + b, x̂ = LN(z), z = W k, at W (B, Nm, e, e):
    with δ = w ⊙ ∂ℓ/∂ŷ the layer norm's backward is ∂ℓ/∂z = (δ − mean δ − x̂ mean(δ x̂))/σ
    and the gradient (∂ℓ/∂z) ⊗ k, (B, Nm, u, e, e)."""
    z = b.einsum("bnoi,bnti->bnto", w, k)                         # (B, Nm, u, e)
    zhat, rstd = layer_norm(z)
    gain = _per_head(ln[0])
    delta = output_grad(b, k + zhat * gain + _per_head(ln[1]), v, obj) * gain
    dz = (delta - delta.mean((-1,), keepdim=True)
          - zhat * (delta * zhat).mean((-1,), keepdim=True)) * rstd
    return [b.einsum("bnuo,bnui->bnuoi", dz, k)]


def initial_state(b: Builder, p: dict[str, Value], depth: int, B: int, momentum: bool = True
                  ) -> tuple[list[Value], list[Value]]:
    """(W⁽⁰⁾, S⁽⁰⁾ = 0) broadcast over the batch; no S without momentum."""
    ws, ss = [], []
    for i in range(1, depth + 1):
        w0 = p[f"mem_w{i}"]                                       # (Nm, o, i)
        shape = (B,) + w0.shape
        ws.append(w0.reshape(1, *w0.shape).expand(*shape))
        if momentum:
            ss.append(b.full(0.0, shape, w0.dtype))
    return ws, ss


def output_grad(b: Builder, yhat: Value, v: Value, obj: Objective) -> Value:
    """∂ℓ_u/∂ŷ_u per token (B, Nm, u, e) of the inner objective `obj`: autodiff of its value
    (`objective.loss_graph`) inlined here; ℓ2 by its closed form (2/e)(ŷ − v), the same
    numbers (tests/unit/model/test_objective.py) in the graph ℓ2 always had."""
    if obj.kind == "l2":
        return (yhat - v) * (2.0 / yhat.shape[-1])
    d = derivative(loss_graph(obj, yhat.shape, yhat.dtype, total=True), "yhat")
    return b.inline(d, {"yhat": yhat, "v": v})["grad.yhat"]


def _inner_grads(b: Builder, ws: list[Value], k: Value, v: Value,
                 obj: Objective = L2, ln: LnParams | None = None) -> list[Value]:
    """Per-token inner gradients of the objective `obj` at the weights ws, direct form:
    g_u = δ_u ⊗ a_u per layer, (B, Nm, u, o, i); δ at the output is ∂ℓ/∂ŷ
    (`output_grad`), the MLP's backward is the same for every objective. `ln`: the inner
    model is k + w ⊙ LN(W k) + b instead (`_ln_residual_grads`)."""
    if ln is not None:
        return _ln_residual_grads(b, ws[0], k, v, ln, obj)
    yhat, zs, acts = mlp(b, ws, k)
    delta = output_grad(b, yhat, v, obj)                          # ∂ℓ/∂ŷ, (B, Nm, u, e)
    grads: list[Value] = [None] * len(ws)                         # type: ignore[list-item]
    for i in range(len(ws) - 1, -1, -1):
        grads[i] = b.einsum("bnuo,bnui->bnuoi", delta, acts[i])
        if i > 0:
            delta = b.einsum("bnoi,bnuo->bnui", ws[i], delta) * silu_grad(zs[i - 1])
    return grads


def chunk_update(b: Builder, ws: list[Value], ss: list[Value], k: Value, v: Value,
                 theta: Value, log_eta: Value, log_keep: Value,
                 obj: Objective = L2, ln: LnParams | None = None
                 ) -> tuple[list[Value], list[Value]]:
    """One chunk's write of the objective `obj` (`ln`: of the inner model `_inner_grads`
    names). k, v (B, Nm, u, e); gates (B, Nm, u). Returns new (W, S)."""
    B, Nm, U, E = k.shape
    grads = _inner_grads(b, ws, k, v, obj, ln)
    # closed form of the per-token recurrences, in log space (products underflow)
    lE = log_eta.cumsum(-1)                                       # log E_t, (B, Nm, u)
    lD = log_keep.cumsum(-1)                                      # log D_t
    lE_b, lD_b = lE.slice(-1, U - 1, U), lD.slice(-1, U - 1, U)   # (B, Nm, 1)
    e_t = lD_b - lD + lE                                          # log(D_b E_t / D_t)
    causal = b.mask(U, 0, [("causal", U, None)], k.dtype)         # [t, u]: 0 if u ≤ t
    pair = (e_t.reshape(B, Nm, U, 1) - lE.reshape(B, Nm, 1, U) + causal).exp()   # [t, u]
    w_u = theta * pair.sum((-2,))                                 # weight of g_u in W
    s_u = theta * (lE_b - lE).exp()                               # weight of g_u in S
    coef_s = e_t.exp().sum((-1,)).reshape(B, Nm, 1, 1)            # Σ_t D_b E_t / D_t
    decay_w = lD_b.exp().reshape(B, Nm, 1, 1)                     # D_b
    keep_s = lE_b.exp().reshape(B, Nm, 1, 1)                      # E_b
    new_w, new_s = [], []
    for w, s, g in zip(ws, ss, grads):
        wsum = (g * w_u.reshape(B, Nm, U, 1, 1)).sum((2,))        # Σ_u w_u g_u
        ssum = (g * s_u.reshape(B, Nm, U, 1, 1)).sum((2,))        # Σ_u θ_u (E_b/E_u) g_u
        new_w.append(w * decay_w + s * coef_s - wsum)
        new_s.append(s * keep_s - ssum)
    return new_w, new_s


def chunk_update_docs(b: Builder, ws: list[Value], ss: list[Value], w0s: list[Value],
                      k: Value, v: Value, theta: Value, log_eta: Value, log_keep: Value,
                      lo: Value, obj: Objective = L2) -> tuple[list[Value], list[Value]]:
    """`chunk_update` with documents: lo (B, Nm, u) is each token's document start relative to
    the chunk start (< 0: the document began before the chunk). Token by token the state
    resets to (W⁽⁰⁾, 0) before each document's first token; a token whose document began in
    the chunk takes its gradient at W⁽⁰⁾. In closed form, only the chunk's last document
    reaches the end state:

        W' = c·(D_b W + Σ_t D_b E_t/D_t S) + (D_b/D_{s−1}) [s in chunk] W⁽⁰⁾ − Σ_{u≥s} w_u g_u
        S' = c·E_b S − Σ_{u≥s} θ_u (E_b/E_u) g_u

    with s the last document's first token, c = 1 if it began before the chunk (else 0), and
    w_u summing over t ≥ u in the same document only. Every masked factor is ≤ 1 before the
    mask, so the masks multiply (0/1) and nothing overflows."""
    B, Nm, U, E = k.shape
    fresh = gt(lo, -0.5)                                          # (B, Nm, u) began in chunk
    g_c = _inner_grads(b, ws, k, v, obj)                          # at the chunk-start state
    g_0 = _inner_grads(b, w0s, k, v, obj)                         # at W⁽⁰⁾
    lE = log_eta.cumsum(-1)
    lD = log_keep.cumsum(-1)
    lE_b, lD_b = lE.slice(-1, U - 1, U), lD.slice(-1, U - 1, U)
    e_t = lD_b - lD + lE
    idx = positions(lo, U)                                        # local token index (u,)
    lo_b = lo.slice(-1, U - 1, U)                                 # (B, Nm, 1) last document
    last = gt(idx.reshape(1, 1, U) + 0.5, lo_b)                   # (B, Nm, u) in it
    first = gt(lo, idx.reshape(1, 1, U) - 0.5)                    # a document's first token
    carry = (1.0 - gt(lo_b, -0.5)).reshape(B, Nm, 1, 1)           # c
    same = gt(idx.reshape(1, 1, 1, U) + 0.5, lo.reshape(B, Nm, U, 1))   # [t, u]: u ≥ start_t
    causal = b.mask(U, 0, [("causal", U, None)], k.dtype)
    pair = (e_t.reshape(B, Nm, U, 1) - lE.reshape(B, Nm, 1, U) + causal).exp() * same \
        * last.reshape(B, Nm, U, 1)
    w_u = theta * pair.sum((-2,))
    s_u = theta * (lE_b - lE).exp() * last
    coef_s = e_t.exp().sum((-1,)).reshape(B, Nm, 1, 1) * carry
    decay_w = lD_b.exp().reshape(B, Nm, 1, 1) * carry
    keep_s = lE_b.exp().reshape(B, Nm, 1, 1) * carry
    coef_0 = ((lD_b - lD + log_keep).exp() * first * last).sum((-1,)).reshape(B, Nm, 1, 1)
    new_w, new_s = [], []
    for w, s, w0, gc, g0 in zip(ws, ss, w0s, g_c, g_0):
        def weighted(weight: Value) -> Value:                     # Σ_u weight_u g_u
            wc = (weight * (1.0 - fresh)).reshape(B, Nm, U, 1, 1)
            w_0 = (weight * fresh).reshape(B, Nm, U, 1, 1)
            return (gc * wc).sum((2,)) + (g0 * w_0).sum((2,))
        new_w.append(w * decay_w + s * coef_s + w0 * coef_0 - weighted(w_u))
        new_s.append(s * keep_s - weighted(s_u))
    return new_w, new_s


def _chunked(x: Value, n_chunks: int) -> Value:
    # (B, Nm, T, ...) -> (C, B, Nm, b, ...)
    B, Nm, T = x.shape[:3]
    rest = x.shape[3:]
    y = x.reshape(B, Nm, n_chunks, T // n_chunks, *rest)
    return y.permute(2, 0, 1, *range(3, y.rank))


def _unchunked(y: Value) -> Value:
    # (C, B, Nm, b, e) -> (B, Nm, C·b, e)
    C, B, Nm, U, E = y.shape
    return y.permute(1, 2, 0, 3, 4).reshape(B, Nm, C * U, E)


def chunk_update_plain(b: Builder, ws: list[Value], k: Value, v: Value, theta: Value,
                       log_keep: Value, obj: Objective = L2, ln: LnParams | None = None
                       ) -> list[Value]:
    """One chunk's write without momentum (`memory.momentum_form: none`): token by token
    W_t = (1 − α_t) W_{t−1} − θ_t g_t, in closed form W' = D_b W − Σ_u θ_u (D_b/D_u) g_u."""
    B, Nm, U, E = k.shape
    grads = _inner_grads(b, ws, k, v, obj, ln)
    lD = log_keep.cumsum(-1)                                      # log D_t, (B, Nm, u)
    lD_b = lD.slice(-1, U - 1, U)                                 # (B, Nm, 1)
    w_u = theta * (lD_b - lD).exp()                               # weight of g_u in W
    decay_w = lD_b.exp().reshape(B, Nm, 1, 1)                     # D_b
    return [w * decay_w - (g * w_u.reshape(B, Nm, U, 1, 1)).sum((2,)) for w, g in zip(ws, grads)]


def chunk_update_linear(b: Builder, w: Value, k: Value, v: Value, q: Value | None,
                        theta: Value, log_keep: Value, mem: MemorySpec
                        ) -> tuple[Value, Value | None]:
    """The exact chunk of a linear memory (`MemorySpec.linear`: one layer W (B, Nm, dv, dk),
    no momentum, l2), token by token within the chunk in the WY form fla uses. With
    β_t = θ_t·2/dv, γ_t = 1 − α_t and ρ_t = γ_t (decay_order before_grad) or 1 (after_grad),

        W_t = γ_t W_{t−1} + δ_t k_tᵀ,   δ_t = β_t (v_t − ρ_t W_{t−1} k_t)

    so with D_t = Π_{s≤t} γ_s from the chunk start and P_t = ρ_t D_{t−1}, the δ solve one
    unit lower-triangular system (I + A) Δ = R,

        A[t, s] = β_t (k_t·k_s) P_t/D_s  (s < t),   R_t = β_t (v_t − P_t W_0 k_t),

    whose inverse is Σ_{j<b} (−A)^j (A is nilpotent), formed as Π_i (I + (−A)^{2^i}) in
    ⌈log2 b⌉ squarings. Then W' = D_b W_0 + Σ_s (D_b/D_s) δ_s k_sᵀ and the reads
    y_t = W_t q_t (after_write) or W_{t−1} q_t (before_write) are
    D W_0 q_t + Σ_s (D/D_s)(k_s·q_t) δ_s over s ≤ t (s < t). Every ratio is ≤ 1 where the
    masks keep it (log space, as `chunk_update`). Returns W' and the reads (None if q is)."""
    B, Nm, U, dk = k.shape
    dv = v.shape[-1]
    beta = theta * (2.0 / dv)                                     # (B, Nm, u)
    lD = log_keep.cumsum(-1)                                      # log D_t
    lP = lD if mem.decay_order == "before_grad" else lD - log_keep   # log P_t
    causal = b.mask(U, 0, [("causal", U, None)], k.dtype)         # [t, s]: 0 if s ≤ t
    eye = b.mask(U, 0, [("causal", U, 1)], k.dtype).exp()         # [t, s]: 1 if s = t
    strict = b.mask(U, -1, [("causal", U, None)], k.dtype)       # [t, s]: 0 if s < t

    def ratio(l_t: Value, mask: Value) -> Value:                  # exp(l_t − lD_s), masked
        return (l_t.reshape(B, Nm, U, 1) - lD.reshape(B, Nm, 1, U) + mask).exp()

    kk = b.einsum("bnti,bnsi->bnts", k, k)                        # (B, Nm, u, u)
    A = kk * ratio(lP, strict) * beta.reshape(B, Nm, U, 1)
    wk = b.einsum("bnoi,bnti->bnto", w, k)                        # W_0 k_t, (B, Nm, u, dv)
    R = (v - wk * lP.exp().reshape(B, Nm, U, 1)) * beta.reshape(B, Nm, U, 1)
    inv = eye - A                                                 # Σ_j (−A)^j, j < 2^i
    power = -A
    for _ in range(1, max(1, math.ceil(math.log2(U)))):
        power = b.einsum("bnts,bnsr->bntr", power, power)
        inv = b.einsum("bnts,bnsr->bntr", inv, eye + power)
    delta = b.einsum("bnts,bnso->bnto", inv, R)                   # δ_t, (B, Nm, u, dv)
    lD_b = lD.slice(-1, U - 1, U)                                 # (B, Nm, 1)
    tail = delta * (lD_b - lD).exp().reshape(B, Nm, U, 1)         # (D_b/D_s) δ_s
    new_w = w * lD_b.exp().reshape(B, Nm, 1, 1) + b.einsum("bnso,bnsi->bnoi", tail, k)
    if q is None:
        return new_w, None
    after = mem.read == "after_write"
    lR, mask = (lD, causal) if after else (lD - log_keep, strict)  # log D_t or log D_{t−1}
    qk = b.einsum("bnti,bnsi->bnts", q, k)
    wq = b.einsum("bnoi,bnti->bnto", w, q)
    y = wq * lR.exp().reshape(B, Nm, U, 1) + b.einsum("bnts,bnso->bnto",
                                                      qk * ratio(lR, mask), delta)
    return new_w, y


def chunk_write(b: Builder, ws: list[Value], ss: list[Value], k: Value, v: Value,
                theta: Value, log_eta: Value | None, log_keep: Value, obj: Objective = L2,
                mem: MemorySpec | None = None, ln: LnParams | None = None
                ) -> tuple[list[Value], list[Value]]:
    """One chunk's write under the memory's write rule: `chunk_update`, or without momentum
    (log_eta None) `chunk_update_plain`; with `memory.decay_order: before_grad` (chunks of
    one token) the gradient is taken at the decayed (1 − α_t) W_{t−1}, which then takes no
    further decay. `ln` (`inner_ln`): the inner model k + w ⊙ LN(W k) + b."""
    if mem is not None and mem.linear:
        new_w, _ = chunk_update_linear(b, ws[0], k, v, None, theta, log_keep, mem)
        return [new_w], []
    if mem is not None and mem.decay_order == "before_grad":
        B, Nm, U = theta.shape
        assert U == 1, "decay_order before_grad writes chunks of one token"
        keep = log_keep.exp().reshape(B, Nm, 1, 1)                # 1 − α_t
        ws = [w * keep for w in ws]
        log_keep = b.full(0.0, (), log_keep.dtype).expand(B, Nm, U)
    if log_eta is None:
        return chunk_update_plain(b, ws, k, v, theta, log_keep, obj, ln), []
    return chunk_update(b, ws, ss, k, v, theta, log_eta, log_keep, obj, ln)


def memory_scan(b: Builder, ws: list[Value], ss: list[Value], st: MemStreams, chunk: int,
                read: Value | None, docs: tuple[Value, list[Value]] | None = None,
                obj: Objective = L2, mem: MemorySpec | None = None, ln: LnParams | None = None
                ) -> tuple[list[Value], list[Value], Value]:
    """Scan over chunks of `chunk` tokens: retrieve `read` (B, Nm, T, e) at chunk-start state,
    then write k, v. Returns final W, S and the retrievals (B, Nm, T, e). `docs` (lo, W⁽⁰⁾):
    lo (B, T) each token's document start relative to its chunk's start (`documents.local`),
    W⁽⁰⁾ the memory's initial weights (Nm, o, i); the state resets at each document start
    (`chunk_update_docs`) and a token whose document began in its chunk reads W⁽⁰⁾. `obj`:
    the inner objective the writes descend. `mem`: the write rule's knobs (`chunk_write`) and
    `memory.read: after_write` (the read after the chunk's write; chunks of one token); None
    is the default rule. Without momentum (st.log_eta None) ss is [] and so is the S returned.
    `ln` (`inner_ln`; no docs): the writes fit k + w ⊙ LN(W k) + b, and with
    `memory.post_norm` the reads become y + w ⊙ LN(y) + b (`post_norm`)."""
    T = st.k.shape[2]
    n = T // chunk
    L = len(ws)
    momentum = st.log_eta is not None
    after = mem is not None and mem.read == "after_write"
    streams = [("q", read), ("k", st.k), ("v", st.v), ("theta", st.theta),
               ("log_eta", st.log_eta), ("log_keep", st.log_keep)]
    streams = [(name, x) for name, x in streams if x is not None or name != "log_eta"]
    xs = [_chunked(x, n) for _, x in streams]
    names = [f"W{i}" for i in range(1, L + 1)] + [f"S{i}" for i in range(1, len(ss) + 1)]
    names += [name for name, _ in streams]
    consts: list[Value] = []
    if docs is not None:
        lo, w0s = docs
        B, Nm = st.k.shape[:2]
        xs.append(_chunked(lo.reshape(B, 1, T).expand(B, Nm, T), n))
        consts = list(w0s)
        names += ["doc_start"] + [f"W0_{i}" for i in range(1, L + 1)]
    if ln is not None:
        assert docs is None, "memory.inner: ln_residual has no document path"
        consts = list(ln)
        names += ["ln_w", "ln_b"]

    def body(bb: Builder, carry: list[Value], x: list[Value], k0: list[Value]):
        w, s = carry[:L], carry[L:]
        q, k, v, th = x[:4]
        le, lk = (x[4], x[5]) if momentum else (None, x[4])
        rest = x[6:] if momentum else x[5:]
        lnb = None if ln is None else (k0[0], k0[1])
        if docs is None and mem is not None and mem.linear:        # exact chunks, reads inside
            w2, y = chunk_update_linear(bb, w[0], k, v, q, th, lk, mem)
            return [w2], [y]
        if docs is None:
            if after:                                             # read after this chunk's write
                w2, s2 = chunk_write(bb, w, s, k, v, th, le, lk, obj, mem, lnb)
                y, _, _ = mlp(bb, w2, q)
                return w2 + s2, [y]
            y, _, _ = mlp(bb, w, q)                               # read before this chunk's write
            w2, s2 = chunk_write(bb, w, s, k, v, th, le, lk, obj, mem, lnb)
            return w2 + s2, [y]
        y, _, _ = mlp(bb, w, q)
        w0 = batched(k0, q.shape[0])
        y = read_initial(bb, y, w0, q, rest[0])
        w2, s2 = chunk_update_docs(bb, w, s, w0, k, v, th, le, lk, rest[0], obj)
        return w2 + s2, [y]

    carry, ys = b.scan(body, ws + ss, xs, consts, length=n, name="memory_chunk", names=names,
                       role="memory")
    y = _unchunked(ys[0])
    if mem is not None and mem.post_norm:
        assert ln is not None, "memory.post_norm needs the inner model's w, b"
        y = post_norm(y, ln)
    return carry[:L], carry[L:], y


def batched(w0s: list[Value], B: int) -> list[Value]:
    """Initial weights W⁽⁰⁾ (Nm, o, i) broadcast to the state's (B, Nm, o, i)."""
    return [w.reshape(1, *w.shape).expand(B, *w.shape) for w in w0s]


def read_initial(b: Builder, y: Value, w0s: list[Value], q: Value, lo: Value) -> Value:
    """The read y (B, Nm, t, e), replaced by M(q; W⁽⁰⁾) at the tokens whose document began
    inside their chunk or segment (lo (B, Nm or 1, t) >= 0, `documents.local`)."""
    B, Nm, U, _ = q.shape
    fresh = gt(lo, -0.5).reshape(B, lo.shape[1] if lo.rank == 3 else 1, U, 1)
    return y + (retrieve(b, w0s, q) - y) * fresh


def retrieve(b: Builder, ws: list[Value], q: Value) -> Value:
    y, _, _ = mlp(b, ws, q)
    return y
