"""Neural long-term memory `LMM` of docs/semantics.md, as the token-by-token recurrence.

Every inner gradient g_t is taken by `torch.func.grad` of the per-token inner loss
(vmapped over batch, head and token), never by a hand-written formula, and the writes run
token by token -- the closed form is what the compiler uses, so the reference must not.
`torch.func.grad` builds its graph with create_graph semantics, so the outer loss
differentiates through g like any other expression.

Ein notation: B batch, N memory heads, T time, b chunk length, C = D / N head width,
O / I output / input width of one memory weight W_i (O, I), D model width.
A memory state is a pair of lists (W, S) of (B, N, O, I) tensors, one entry per MLP layer.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor
from torch.func import grad, vmap

from .ops import dwconv, l2norm, merge_heads, silu, split_heads

State = tuple[list[Tensor], list[Tensor]]


def mem_shapes(cfg) -> list[tuple[int, int]]:
    """(out_i, in_i) of W_1 .. W_Ld: depth 1 is [dv, d]; deeper is [h, d], [h, h]..., [dv, h]
    (dv = memory.value_width, else d)."""
    d = cfg.d_model // cfg.memory.heads
    dv = getattr(cfg.memory, "value_width", None) or d
    h = int(cfg.memory.expansion * d)
    depth = cfg.memory.depth
    if depth == 1:
        return [(dv, d)]
    return [(h, d)] + [(h, h)] * (depth - 2) + [(dv, h)]


def mem_apply(Ws: list[Tensor] | tuple[Tensor, ...], x: Tensor) -> Tensor:
    """M(x; W) = W_Ld phi(... phi(W_1 x)), phi = silu, no biases."""
    # Ws[i] (..., O, I), x (..., T, I) or a single vector (I,)
    a = x
    for i, W in enumerate(Ws):
        z = a @ W.transpose(-1, -2)  # (..., T, O)
        a = silu(z) if i < len(Ws) - 1 else z
    return a


Rho = Callable[[Tensor], Tensor]


def l2(r: Tensor) -> Tensor:
    return r.pow(2)


def objective(mem) -> Rho:
    """rho(r), the per-channel inner objective of the residual r = M(k) - v that
    `memory.objective` names (docs/semantics.md, "Inner objective"): l2 r^2; huber r^2 within
    delta, 2 delta |r| - delta^2 beyond; lp (r^2 + 1e-6)^(p/2)."""
    kind = getattr(mem, "objective", "l2")
    if kind == "huber":
        d = 1.0 if mem.huber_delta is None else float(mem.huber_delta)
        return lambda r: torch.where(r.abs() <= d, r.pow(2), 2 * d * r.abs() - d * d)
    if kind == "lp":
        p = 3.0 if mem.lp_p is None else float(mem.lp_p)
        return lambda r: (r.pow(2) + 1e-6).pow(p / 2)
    assert kind == "l2", kind
    return l2


LN_EPS = 1e-6  # memory.inner ln_residual's layer norm


def layer_norm(x: Tensor) -> Tensor:
    """(x - mean) / sqrt(var + LN_EPS) over the last axis, no affine (torch's layer_norm)."""
    return torch.nn.functional.layer_norm(x, x.shape[-1:], eps=LN_EPS)


def inner_loss(Ws: tuple[Tensor, ...], k: Tensor, v: Tensor, rho: Rho = l2,
               ln: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """l_t(W) = mean_c rho(M(k_t; W) - v_t)_c for one token of one head (rho: `objective`);
    with `ln` (w, b) the inner model is k + w * layer_norm(W k) + b (memory.inner ln_residual)."""
    # Ws[i] (O, I), k (C,), v (C,), ln (C,) each
    y = mem_apply(Ws, k)
    if ln is not None:
        y = k + ln[0] * layer_norm(y) + ln[1]
    return rho(y - v).mean()


def inner_grads(Ws: list[Tensor], k: Tensor, v: Tensor, rho: Rho = l2,
                ln: tuple[Tensor, Tensor] | None = None) -> list[Tensor]:
    """Per-token gradients dl_t/dW_i, all at the same weights Ws (the chunk start); `ln`
    (w, b), each (N, C): the inner model of `inner_loss`."""
    # Ws[i] (B, N, O, I), k/v (B, N, b, C) -> g[i] (B, N, b, O, I)
    def loss(Ws, k, v, ln):
        return inner_loss(Ws, k, v, rho, ln)

    per_token = vmap(grad(loss), in_dims=(None, 0, 0, None))  # over b
    per_head = vmap(per_token, in_dims=(0, 0, 0, None if ln is None else 0))  # over N
    per_batch = vmap(per_head, in_dims=(0, 0, 0, None))  # over B
    return list(per_batch(tuple(Ws), k, v, ln))


def chunk_token_loop(
    W: list[Tensor], S: list[Tensor], g: list[Tensor], theta: Tensor, eta: Tensor | None,
    alpha: Tensor,
) -> State:
    """Run one chunk's writes: S_t = eta_t S_{t-1} - theta_t g_t, W_t = (1 - alpha_t) W_{t-1} + S_t;
    without momentum (eta None, S = []) W_t = (1 - alpha_t) W_{t-1} - theta_t g_t."""
    # W[i], S[i] (B, N, O, I); g[i] (B, N, b, O, I); theta/eta/alpha (B, N, b)
    for t in range(theta.shape[2]):
        th = theta[:, :, t, None, None]  # (B, N, 1, 1)
        keep = 1 - alpha[:, :, t, None, None]
        if eta is None:
            W = [keep * w - th * gi[:, :, t] for w, gi in zip(W, g)]
            continue
        et = eta[:, :, t, None, None]
        S = [et * s - th * gi[:, :, t] for s, gi in zip(S, g)]
        W = [keep * w + s for w, s in zip(W, S)]
    return W, S


def memory_scan(
    state: State, q: Tensor, k: Tensor, v: Tensor, theta: Tensor, eta: Tensor, alpha: Tensor, chunk: int,
    doc: Tensor | None = None, init: State | None = None, rho: Rho = l2, mem=None,
    ln: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, State]:
    """Read then write, chunk by chunk. Returns y_t = M(q_t; W at t's chunk start) and the end state.

    `doc` (B, T) int: each token's document start in q's positions (negative: before it).
    A token whose document starts inside its chunk (doc >= the chunk start) reads, and takes
    its inner gradient at, `init` (W^(0), 0) instead of the chunk-start state; the token loop
    resets the state to `init` before each document's first token. `rho`: the inner objective
    (`objective`). `mem` (the memory config; None: the defaults): `read: after_write` reads
    after the chunk's writes; `decay_order: before_grad` (chunks of one token) decays W first
    and takes the gradient there; eta None: no momentum. `ln` (w, b) (N, C): writes fit
    k + w layer_norm(W k) + b (memory.inner ln_residual; no `doc`), and `post_norm` reads
    y + w layer_norm(y) + b."""
    # q/k/v (B, N, T, C); theta/eta/alpha (B, N, T)
    W, S = state
    T = q.shape[2]
    ys = []
    for c0 in range(0, T, chunk):
        sl = slice(c0, c0 + chunk)
        y = mem_apply(W, q[:, :, sl])  # (B, N, b, C)  read at chunk start
        a = alpha[:, :, sl]
        if getattr(mem, "decay_order", "after_grad") == "before_grad":
            assert chunk == 1  # the gradient at the decayed state (1 - alpha_t) W_{t-1}
            W = [(1 - a)[..., None] * w for w in W]
            a = torch.zeros_like(a)
        g = inner_grads(W, k[:, :, sl], v[:, :, sl], rho, ln)  # (B, N, b, O, I) per layer
        et = None if eta is None else eta[:, :, sl]
        if doc is None:
            W, S = chunk_token_loop(W, S, g, theta[:, :, sl], et, a)
            if getattr(mem, "read", "before_write") == "after_write":
                y = mem_apply(W, q[:, :, sl])  # read after the chunk's (the token's) write
        else:
            W0 = init[0]
            fresh = (doc[:, sl] >= c0)[:, None, :]  # (B, 1, b): the document began in this chunk
            y = torch.where(fresh[..., None], mem_apply(W0, q[:, :, sl]), y)
            g0 = inner_grads(W0, k[:, :, sl], v[:, :, sl], rho)
            g = [torch.where(fresh[..., None, None], a, b) for a, b in zip(g0, g)]
            for t in range(c0, min(c0 + chunk, T)):
                reset = (doc[:, t] == t)[:, None, None, None]  # (B, 1, 1, 1): a document's first token
                W = [torch.where(reset, w0, w) for w0, w in zip(W0, W)]
                S = [torch.where(reset, torch.zeros_like(s), s) for s in S]
                u = slice(t, t + 1)
                W, S = chunk_token_loop(W, S, [gi[:, :, u.start - c0 : u.start - c0 + 1] for gi in g],
                                        theta[:, :, u], eta[:, :, u], alpha[:, :, u])
        ys.append(y)
    y = torch.cat(ys, dim=2)  # (B, N, T, C)
    if getattr(mem, "post_norm", False):
        y = y + ln[0][:, None] * layer_norm(y) + ln[1][:, None]
    return y, (W, S)


def scan_chunk(mem) -> int:
    """The chunk the reference scans with: memory.chunk_size, or 1 for a depth-1 memory
    without momentum under l2, whose chunks are exact (docs/semantics.md, "Memory family")."""
    linear = (mem.depth == 1 and mem.momentum_form == "none"
              and getattr(mem, "objective", "l2") == "l2" and getattr(mem, "inner", "mlp") == "mlp")
    return 1 if linear else mem.chunk_size


def initial_state(p: dict[str, Tensor], B: int, cfg) -> State:
    """W^(0) = mem_w{i} broadcast over the batch, S^(0) = 0."""
    W = [p[f"mem_w{i + 1}"].expand(B, -1, -1, -1) for i in range(cfg.memory.depth)]  # (B, N, O, I)
    S = [] if cfg.memory.momentum_form == "none" else [torch.zeros_like(w) for w in W]
    return W, S


def project(u: Tensor, w: Tensor, conv: Tensor, heads: int, normalize: bool,
            activate: bool = True, doc: Tensor | None = None) -> Tensor:
    """[l2norm]([silu](dwconv(u w, conv))) split into heads (`doc`: as `dwconv`'s)."""
    # u (B, T, D) -> (B, N, T, C)
    x = dwconv(u @ w, conv, doc)
    x = split_heads(silu(x) if activate else x, heads)
    return l2norm(x) if normalize else x


def projections(p: dict[str, Tensor], u: Tensor, cfg,
                doc: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """q(u), k(u), v(u), each (B, N, T, C); conv history is zero before u's first position
    (and before each token's document start `doc`)."""
    N = cfg.memory.heads
    act = cfg.memory.qk_activation == "silu"  # 'none': q, k are l2norm(dwconv(u w)) alone
    q = project(u, p["mem_wq"], p["mem_conv_q"], N, normalize=True, activate=act, doc=doc)
    k = project(u, p["mem_wk"], p["mem_conv_k"], N, normalize=True, activate=act, doc=doc)
    v = project(u, p["mem_wv"], p["mem_conv_v"], N, normalize=False, doc=doc)
    return q, k, v


def gates(p: dict[str, Tensor], u: Tensor, cfg) -> tuple[Tensor, Tensor | None, Tensor]:
    """theta (learning rate, times 1 - eta under momentum_form 'ema'), eta (momentum; None
    under momentum_form 'none'), alpha (decay), each (B, N, T). A gate named in
    `memory.fixed` is its constant (theta lr_max, eta momentum, alpha decay); decay_form
    'mamba2' is alpha = 1 - exp(-exp(A) softplus(x))."""
    m = cfg.memory
    B, T, _ = u.shape
    shape = (B, m.heads, T)
    ema = m.momentum_form == "ema"  # S_t = eta S_{t-1} - (1 - eta) theta g_t
    fixed = getattr(m, "fixed", ()) if m.adaptive else ("theta", "eta", "alpha")

    def learned(name: str) -> Tensor:  # (B, N, T)
        return (u @ p[f"mem_{name}_w"] + p[f"mem_{name}_b"]).transpose(1, 2)

    def const(value: float) -> Tensor:
        return torch.full(shape, float(value), dtype=u.dtype)

    theta = const(m.lr_max) if "theta" in fixed else m.lr_max * torch.sigmoid(learned("theta"))
    if m.momentum_form == "none":
        eta = None
    else:
        eta = const(m.momentum) if "eta" in fixed else torch.sigmoid(learned("eta"))
    if "alpha" in fixed:
        alpha = const(m.decay)
    elif getattr(m, "decay_form", "sigmoid") == "mamba2":
        A = p["mem_alpha_a"][:, None]  # (N, 1)
        alpha = 1 - torch.exp(-torch.exp(A) * torch.nn.functional.softplus(learned("alpha")))
    else:
        alpha = m.decay_max * torch.sigmoid(learned("alpha"))
    if ema:
        theta = theta * (1 - eta)
    return theta, eta, alpha


def lmm(p: dict[str, Tensor], u: Tensor, cfg, doc: Tensor | None = None) -> Tensor:
    """LMM(u) = (y * silu(u W_G)) W_O (output gate) or y W_O, memory written from u itself
    (`doc` (B, T): each token's document start; the state resets at each)."""
    # u (B, T, D)
    q, k, v = projections(p, u, cfg, doc)  # (B, N, T, C)
    theta, eta, alpha = gates(p, u, cfg)  # (B, N, T)
    init = initial_state(p, u.shape[0], cfg)
    inner = getattr(cfg.memory, "inner", "mlp") == "ln_residual"
    ln = (p["mem_ln_w"], p["mem_ln_b"]) if inner else None
    y, _ = memory_scan(init, q, k, v, theta, eta, alpha, scan_chunk(cfg.memory), doc, init,
                       objective(cfg.memory), cfg.memory, ln)
    y = merge_heads(y)  # (B, T, D)
    if cfg.memory.output_gate:
        y = y * silu(u @ p["mem_wg"])
    return y @ p["mem_wo"]  # (B, T, D)
