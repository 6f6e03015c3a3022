"""Every parameter of docs/semantics.md's table for a config, randomly but sensibly scaled.

Scales (std of the normal draw): linear `[.., in, out]` weights 1/sqrt(in); norms
1 + 0.1 N(0,1); depthwise conv 0.5; gate weights 0.1; gate biases logit(0.9) for eta,
logit(0.05) for alpha, 0 for theta, each plus 0.1 N(0,1) so that heads differ; memory
weights `[.., out, in]` 1/sqrt(in); persistent tokens N(0, 1); the embedding N(0, 1), or
1/sqrt(D) when tied (it is then also the LM head: N(0, 1) would give logits of size ~D).
Values are drawn in float64 from one seeded torch.Generator in table order, then cast, so
a float32 set is the float64 set rounded.

Ein notation: L layers, V vocab, D model width, F FFN hidden, P persistent tokens,
N memory heads, K conv taps, O / I out / in width of a memory weight.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .memory import mem_shapes

ATTN_BLOCKS = ("attn", "mag", "mal", "mac")
MEMORY_BLOCKS = ("lmm", "mag", "mal", "mac")
BLOCKS = ("attn", "lmm", "mag", "mal", "mac")


def _logit(p: float) -> float:
    return math.log(p / (1 - p))


def ffn_width(cfg) -> int:
    """F = ffn_hidden, or when that is None the nearest multiple of 8 to 8/3 * d_model (at least 8)."""
    if cfg.ffn_hidden is not None:
        return cfg.ffn_hidden
    return max(8, 8 * round(cfg.d_model / 3))


def lin(fan_in: int) -> float:
    """Std of a linear weight: N(0, 1/in)."""
    return 1.0 / math.sqrt(fan_in)


def param_specs(cfg) -> list[tuple[str, tuple[int, ...], float, float]]:
    """(name, shape, mean, std) for every parameter, in table order."""
    if cfg.block not in BLOCKS:
        raise ValueError(f"model.block: {cfg.block!r} is not one of {', '.join(BLOCKS)}")
    V, D, L, F = cfg.vocab_size, cfg.d_model, cfg.n_layers, ffn_width(cfg)
    specs: list[tuple[str, tuple[int, ...], float, float]] = [
        # tied: the embedding doubles as the LM head, so it gets the head's 1/sqrt(D) scale
        ("embed", (V, D), 0.0, lin(D) if cfg.tie_embeddings else 1.0),
        ("norm_f", (D,), 1.0, 0.1),
    ]
    if not cfg.tie_embeddings:
        specs.append(("lm_head", (D, V), 0.0, lin(D)))
    specs += [
        ("layers.ffn_norm", (L, D), 1.0, 0.1),
        ("layers.ffn_w1", (L, D, F), 0.0, lin(D)),
        ("layers.ffn_w3", (L, D, F), 0.0, lin(D)),
        ("layers.ffn_w2", (L, F, D), 0.0, lin(F)),
    ]
    if cfg.block in ("attn", "mal"):
        specs.append(("layers.attn_norm", (L, D), 1.0, 0.1))
    if cfg.block in ATTN_BLOCKS:
        specs += [(f"layers.attn_w{x}", (L, D, D), 0.0, lin(D)) for x in "qkvo"]
        P = cfg.attention.persistent_tokens
        if P > 0:
            specs.append(("layers.attn_persistent", (L, P, D), 0.0, 1.0))
    if cfg.block in MEMORY_BLOCKS:
        m = cfg.memory
        N, K = m.heads, m.conv_kernel
        Dv = N * (getattr(m, "value_width", None) or D // N)  # the values' width
        specs.append(("layers.mem_norm", (L, D), 1.0, 0.1))
        specs += [(f"layers.mem_w{x}", (L, D, Dv if x == "v" else D), 0.0, lin(D)) for x in "qkv"]
        specs.append(("layers.mem_wo", (L, Dv, D), 0.0, lin(Dv)))
        specs += [(f"layers.mem_conv_{x}", (L, Dv if x == "v" else D, K), 0.0, 0.5) for x in "qkv"]
        if cfg.block != "mac" and m.output_gate:
            specs.append(("layers.mem_wg", (L, D, Dv), 0.0, lin(D)))
        if m.adaptive:
            # the learned gates: not those in memory.fixed, no eta without momentum
            learned = [x for x in ("theta", "eta", "alpha") if x not in getattr(m, "fixed", ())
                       and not (x == "eta" and m.momentum_form == "none")]
            specs += [(f"layers.mem_{x}_w", (L, D, N), 0.0, 0.1) for x in learned]
            bias = {"theta": 0.0, "eta": _logit(0.9), "alpha": _logit(0.05)}
            specs += [(f"layers.mem_{x}_b", (L, N), bias[x], 0.1) for x in learned]
            if getattr(m, "decay_form", "sigmoid") == "mamba2":
                specs.append(("layers.mem_alpha_a", (L, N), 0.0, 0.1))  # A of the mamba2 decay
        for i, (o, n_in) in enumerate(mem_shapes(cfg)):
            specs.append((f"layers.mem_w{i + 1}", (L, N, o, n_in), 0.0, lin(n_in)))
        if getattr(m, "inner", "mlp") == "ln_residual":  # w, b of k + w LN(W k) + b, per head
            specs += [("layers.mem_ln_w", (L, N, D // N), 1.0, 0.1),
                      ("layers.mem_ln_b", (L, N, D // N), 0.0, 0.1)]
    if cfg.block == "mac" and cfg.memory.mac_write == "attention_norm":
        specs.append(("layers.mac_norm", (L, D), 1.0, 0.1))
    if cfg.block == "mag":
        specs += [
            ("layers.mag_norm_y", (L, D), 1.0, 0.1),
            ("layers.mag_norm_m", (L, D), 1.0, 0.1),
            ("layers.mag_wo", (L, D, D), 0.0, lin(D)),
        ]
    return specs


def init_params(cfg, seed: int = 0, dtype: torch.dtype = torch.float64) -> dict[str, Tensor]:
    """Deterministic (by seed) random parameters, each a fresh leaf tensor of `dtype`."""
    g = torch.Generator().manual_seed(seed)
    params = {}
    for name, shape, mean, std in param_specs(cfg):
        x = mean + std * torch.randn(shape, generator=g, dtype=torch.float64)
        params[name] = x.to(dtype)
    return params
