"""Model: embed -> L blocks -> rmsnorm -> LM head (optionally tied) -> mean next-token CE.

Ein notation: B batch, T time, D model width, V vocab.
"""

from __future__ import annotations

from typing import Callable

from torch import Tensor

from .blocks import attn_block, lmm_block, mag_block, mal_block
from .mac import mac_block
from .ops import layer_params, rmsnorm
from .params import MEMORY_BLOCKS

BLOCK_FNS: dict[str, Callable[..., Tensor]] = {
    "attn": attn_block,
    "lmm": lmm_block,
    "mag": mag_block,
    "mal": mal_block,
    "mac": mac_block,
}


def check_config(cfg, T: int) -> None:
    """Raise ValueError naming the setting to change when the shapes do not fit together."""
    if cfg.block not in BLOCK_FNS:
        raise ValueError(f"model.block: {cfg.block!r} is not one of {', '.join(BLOCK_FNS)}")
    D = cfg.d_model
    if cfg.block != "lmm" and D % cfg.attention.heads:
        raise ValueError(f"model.attention.heads: {cfg.attention.heads} must divide model.d_model={D}")
    if cfg.block in MEMORY_BLOCKS:
        b = cfg.memory.chunk_size
        if D % cfg.memory.heads:
            raise ValueError(f"model.memory.heads: {cfg.memory.heads} must divide model.d_model={D}")
        if cfg.block == "mac":
            S = cfg.attention.segment
            if T % S:
                raise ValueError(f"model.attention.segment: {S} must divide seq_len={T}")
            if S % b:
                raise ValueError(f"model.memory.chunk_size: {b} must divide model.attention.segment={S}")
        elif T % b:
            raise ValueError(f"model.memory.chunk_size: {b} must divide seq_len={T}")


def forward_logits(params: dict[str, Tensor], tokens_in: Tensor, cfg, doc: Tensor | None = None) -> Tensor:
    """`doc` (B, T) int, when given: each token's document start in its row (docs/semantics.md
    "Documents"): memory, convs and attention reset there."""
    # tokens_in (B, T) int64 -> logits (B, T, V)
    check_config(cfg, tokens_in.shape[1])
    x = params["embed"][tokens_in]  # (B, T, D)
    for l in range(cfg.n_layers):
        x = BLOCK_FNS[cfg.block](layer_params(params, l), x, cfg, doc)  # (B, T, D)
    head = params["embed"].T if cfg.tie_embeddings else params["lm_head"]  # (D, V)
    return rmsnorm(x, params["norm_f"]) @ head  # (B, T, V)


def forward_loss(params: dict[str, Tensor], tokens: Tensor, cfg, doc: Tensor | None = None) -> Tensor:
    """Mean over all B*T positions of logsumexp(logits) - logits[target]."""
    # tokens (B, T+1) int64
    logits = forward_logits(params, tokens[:, :-1], cfg, doc)  # (B, T, V)
    target = tokens[:, 1:]  # (B, T)
    picked = logits.gather(-1, target[..., None])[..., 0]  # (B, T)
    return (logits.logsumexp(-1) - picked).mean()
