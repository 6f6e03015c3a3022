"""Memory as context (`mac`): segment scan with memory state carried across segments.

Per segment s of S tokens (docs/semantics.md, block `mac`, steps 1-4):
  1. h   = M(q(u)_s; state at segment start)         q(u) over the whole sequence
  2. ỹ   = attention of u_s over [persistent ‖ h ‖ u_s], local RoPE, causal, no window
  3. write ỹ into memory chunk by chunk (segment-local conv); r = read of q(ỹ) at chunk
     start
  4. x_s += (ỹ * sigmoid(r)) W_O
Options (docs/semantics.md): memory.mac_write attention_norm writes rmsnorm(ỹ, mac_norm)
and input writes u_s instead of ỹ (step 3);
memory.mac_read residual adds h in step 4: x_s += (ỹ * sigmoid(r) + h) W_O.

Ein notation: B batch, T time, S segment length, D model width, H attention heads,
N memory heads, C per-head width, P persistent tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .attention import attend, persistent_kv, same_document
from .memory import (gates, initial_state, mem_apply, memory_scan, objective, project,
                     projections, scan_chunk)
from .ops import ffn, merge_heads, rmsnorm, rope, split_heads


def mac_attention(p: dict[str, Tensor], us: Tensor, h: Tensor, cfg, doc: Tensor | None = None) -> Tensor:
    """Attention of u_s over [persistent ‖ h ‖ u_s]: query i sees all P, and h_j, u_j for j <= i
    (and j >= doc[i], `doc` (B, S) each query's document start in local positions)."""
    # us (B, S, D), h (B, S, D)
    B, S, D = us.shape
    H = cfg.attention.heads
    pos = torch.arange(S)  # local positions
    # with documents: positions from the later of the segment's and the document's start
    rel = pos if doc is None else pos - doc.clamp(min=0)
    q = rope(split_heads(us @ p["attn_wq"], H), rel)  # (B, H, S, C)
    k = torch.cat(
        [rope(split_heads(h @ p["attn_wk"], H), rel), rope(split_heads(us @ p["attn_wk"], H), rel)], dim=2
    )  # (B, H, 2S, C)
    v = torch.cat([split_heads(h @ p["attn_wv"], H), split_heads(us @ p["attn_wv"], H)], dim=2)
    causal = pos[None, :] <= pos[:, None]  # (S, S)
    causal = same_document(causal, doc)  # (S, S) or (B, 1, S, S)
    visible = torch.cat([causal, causal], dim=-1)  # (.., S, 2S)
    pkv = persistent_kv(p, B, H)
    if pkv is not None:
        k = torch.cat([pkv[0], k], dim=2)  # (B, H, P+2S, C)
        v = torch.cat([pkv[1], v], dim=2)
        ones = torch.ones(*visible.shape[:-1], pkv[0].shape[2], dtype=torch.bool)
        visible = torch.cat([ones, visible], dim=-1)
    return merge_heads(attend(q, k, v, visible)) @ p["attn_wo"]  # (B, S, D)


def mac_block(p: dict[str, Tensor], x: Tensor, cfg, doc: Tensor | None = None) -> Tensor:
    """Scan the segments in order; (W, S) after segment s is the state segment s+1 starts from.

    `doc` (B, T): each token's document start. A token whose document starts inside its
    segment reads h at W^(0); attention, convs and the memory writes reset at a start."""
    B, T, D = x.shape
    seg = cfg.attention.segment
    N = cfg.memory.heads
    u = rmsnorm(x, p["mem_norm"])  # (B, T, D)
    hq = project(u, p["mem_wq"], p["mem_conv_q"], N, normalize=True,
                 activate=cfg.memory.qk_activation == "silu", doc=doc)  # (B, N, T, C), conv crosses segments
    init = initial_state(p, B, cfg)
    state = init
    outs = []
    for s0 in range(0, T, seg):
        sl = slice(s0, s0 + seg)
        W, _ = state
        hr = mem_apply(W, hq[:, :, sl])  # (B, N, S, C)  read only
        local = None if doc is None else doc[:, sl] - s0  # document starts in segment positions
        if local is not None:
            hr = torch.where((local >= 0)[:, None, :, None], mem_apply(init[0], hq[:, :, sl]), hr)
        h = merge_heads(hr)  # (B, S, D)
        yt = mac_attention(p, u[:, sl], h, cfg, local)  # (B, S, D)
        if cfg.memory.mac_write == "attention":
            yn = yt  # the paper: the memory writes the attention output itself
        elif cfg.memory.mac_write == "attention_norm":
            yn = rmsnorm(yt, p["mac_norm"])  # an option: the attention output normalised
        else:
            yn = u[:, sl]  # memory.mac_write: input -- the segment's normalised input
        q, k, v = projections(p, yn, cfg, local)  # (B, N, S, C), conv history zero at segment start
        theta, eta, alpha = gates(p, yn, cfg)  # (B, N, S)
        r, state = memory_scan(state, q, k, v, theta, eta, alpha, scan_chunk(cfg.memory),
                               local, init, objective(cfg.memory), cfg.memory)  # (B, N, S, C)
        r = merge_heads(r)  # (B, S, D)
        o = yt * torch.sigmoid(r) if cfg.memory.gate == "memory" else torch.sigmoid(yt) * r
        if cfg.memory.mac_read == "residual":
            o = o + h  # the segment-start read also on the output, not only as context
        outs.append(o @ p["mem_wo"])  # (B, S, D)
    x = x + torch.cat(outs, dim=1)  # (B, T, D)
    return x + ffn(p, rmsnorm(x, p["ffn_norm"]))
