"""The attn, lmm, mag and mal blocks of docs/semantics.md (mac is in mac.py).

Each block takes one layer's parameters (the `layers.` prefix stripped, layer axis sliced)
and the residual stream x (B, T, D), and returns the updated stream; `doc` (B, T) int, when
given, is each token's document start (docs/semantics.md "Documents"). Every block ends with
x += FFN(rmsnorm(x, ffn_norm)).

Ein notation: B batch, T time, D model width.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .attention import swa
from .memory import lmm
from .ops import ffn, rmsnorm


def attn_block(p: dict[str, Tensor], x: Tensor, cfg, doc: Tensor | None = None) -> Tensor:
    x = x + swa(p, rmsnorm(x, p["attn_norm"]), cfg, doc)  # (B, T, D)
    return x + ffn(p, rmsnorm(x, p["ffn_norm"]))


def lmm_block(p: dict[str, Tensor], x: Tensor, cfg, doc: Tensor | None = None) -> Tensor:
    x = x + lmm(p, rmsnorm(x, p["mem_norm"]), cfg, doc)  # (B, T, D)
    return x + ffn(p, rmsnorm(x, p["ffn_norm"]))


def mag_block(p: dict[str, Tensor], x: Tensor, cfg, doc: Tensor | None = None) -> Tensor:
    """Memory as gate: attention and memory read the same normed input; the memory gates the
    attention (memory.gate: memory) or the attention gates the memory (attention)."""
    u = rmsnorm(x, p["mem_norm"])  # (B, T, D)
    y = rmsnorm(swa(p, u, cfg, doc), p["mag_norm_y"])  # (B, T, D)
    m = rmsnorm(lmm(p, u, cfg, doc), p["mag_norm_m"])  # (B, T, D)
    o = y * torch.sigmoid(m) if cfg.memory.gate == "memory" else torch.sigmoid(y) * m
    x = x + o @ p["mag_wo"]
    return x + ffn(p, rmsnorm(x, p["ffn_norm"]))


def mal_block(p: dict[str, Tensor], x: Tensor, cfg, doc: Tensor | None = None) -> Tensor:
    """Memory as layer: memory, then attention, each with its own residual."""
    x = x + lmm(p, rmsnorm(x, p["mem_norm"]), cfg, doc)  # (B, T, D)
    x = x + swa(p, rmsnorm(x, p["attn_norm"]), cfg, doc)  # (B, T, D)
    return x + ffn(p, rmsnorm(x, p["ffn_norm"]))
