"""Building blocks shared by every block kind, written against the IR builder.

Einsum letters used throughout the frontend:
    b batch   t, s sequence positions   d model width   h, n heads   e head width
    u token in a memory chunk   o, i memory-weight out/in axes   v vocab   f ffn hidden
"""
from __future__ import annotations

from titanc.ir import Builder, Value

from titanc.model.documents import conv_tap

EPS = 1e-6


def rmsnorm(x: Value, w: Value) -> Value:
    # (..., D) -> (..., D)
    return x * ((x * x).mean((-1,), keepdim=True) + EPS).rsqrt() * w


def l2norm(x: Value) -> Value:
    # normalise the last (head) axis
    return x * ((x * x).sum((-1,), keepdim=True) + EPS).rsqrt()


def dwconv(x: Value, w: Value, doc: Value | None = None) -> Value:
    """Causal depthwise conv, zero history: out[:, t, c] = Σ_j w[c, j] x[:, t-(K-1)+j, c].
    `doc` (B, T): each token's document start in x's positions; a tap reading a position
    before it reads 0 (`documents.conv_tap`)."""
    B, T, C = x.shape
    K = w.shape[1]
    xp = x.pad(1, K - 1, 0)                                       # (B, T+K-1, C)
    out = None
    for j in range(K):
        term = xp.slice(1, j, j + T) * w.slice(1, j, j + 1).reshape(C)
        if doc is not None and j < K - 1:
            term = term * conv_tap(doc, K - 1 - j)
        out = term if out is None else out + term
    return out


def log_sigmoid(z: Value) -> Value:
    """log σ(z) = −max(−z, 0) − log(1 + exp(−|z|)): finite for any z (log(sigmoid) is −inf
    once σ(z) underflows)."""
    b = z.b
    absz = b.maximum(z, -z)
    return -b.maximum(-z, 0.0) - ((-absz).exp() + 1.0).log()


def split_heads(x: Value, heads: int) -> Value:
    # (B, T, D) -> (B, H, T, e)
    B, T, D = x.shape
    return x.reshape(B, T, heads, D // heads).permute(0, 2, 1, 3)


def merge_heads(x: Value) -> Value:
    # (B, H, T, e) -> (B, T, H·e)
    B, H, T, E = x.shape
    return x.permute(0, 2, 1, 3).reshape(B, T, H * E)


def rope(b: Builder, x: Value, start: int = 0) -> Value:
    """Rotate-half RoPE at positions start.. along axis -2 of x (…, T, e)."""
    T, half = x.shape[-2], x.shape[-1] // 2
    return rotate(b, x, b.rope("cos", start, T, half, x.dtype), b.rope("sin", start, T, half, x.dtype))


def rotate(b: Builder, x: Value, cos: Value, sin: Value) -> Value:
    """RoPE with given tables broadcastable to (…, T, e/2): [x1 cos − x2 sin ‖ x2 cos + x1 sin].

    Written over the whole width, x ⊙ [cos ‖ cos] + [x2 ‖ x1] ⊙ [sin ‖ sin] ⊙ [−1 ‖ 1], so
    every CONCAT is of views of x or of the tables (read in place by the one kernel computing
    the result) and no kernel concatenates computed halves; the same values bit for bit
    ((x2 sin)·(−1) + x1 cos is x1 cos − x2 sin exactly)."""
    E = x.shape[-1]
    half = E // 2
    x1, x2 = x.slice(-1, 0, half), x.slice(-1, half, E)
    sign = b.concat([b.full(-1.0, (half,), x.dtype), b.full(1.0, (half,), x.dtype)], -1)
    swapped = b.concat([x2, x1], -1) * b.concat([sin, sin], -1) * sign
    return x * b.concat([cos, cos], -1) + swapped


def softmax_last(x: Value) -> Value:
    m = x.amax((-1,), keepdim=True)
    e = (x - m).exp()
    return e / e.sum((-1,), keepdim=True)


def ffn(u: Value, w1: Value, w3: Value, w2: Value) -> Value:
    # SwiGLU: (silu(u W1) ⊙ u W3) W2
    return ((u @ w1).silu() * (u @ w3)) @ w2
