"""The five block kinds (docs/semantics.md "Blocks"); each maps x (B, T, D) to x (B, T, D).

`p` holds one layer's parameters by short name (`attn_wq`, `mem_w1`, ...).
"""
from __future__ import annotations

import re
from typing import Any, Callable

from titanc.ir import Builder, Value

from .attention import mac_attention, swa
from .memory import initial_state, memory_scan, project, retrieve
from .nn import ffn, merge_heads, rmsnorm

Params = dict[str, Value]


def lmm(b: Builder, u: Value, p: Params, m: Any) -> Value:
    """LMM(u) = (y ⊙ silu(u W_G)) W_O, y retrieved at chunk-start memory states."""
    mem = m.memory
    st = project(b, u, p, mem)
    ws, ss = initial_state(b, p, mem.depth, u.shape[0])
    _, _, y = memory_scan(b, ws, ss, st, mem.chunk_size, st.q)
    y = merge_heads(y)                                            # (B, T, D)
    if "mem_wg" in p:
        y = y * (u @ p["mem_wg"]).silu()
    return y @ p["mem_wo"]


def _swa(b: Builder, u: Value, p: Params, m: Any) -> Value:
    return swa(b, u, p, m.attention.heads, m.attention.window)


def block_attn(b: Builder, x: Value, p: Params, m: Any) -> Value:
    return x + _swa(b, rmsnorm(x, p["attn_norm"]), p, m)


def block_lmm(b: Builder, x: Value, p: Params, m: Any) -> Value:
    return x + lmm(b, rmsnorm(x, p["mem_norm"]), p, m)


def block_mag(b: Builder, x: Value, p: Params, m: Any) -> Value:
    u = rmsnorm(x, p["mem_norm"])
    y = rmsnorm(_swa(b, u, p, m), p["mag_norm_y"])
    g = rmsnorm(lmm(b, u, p, m), p["mag_norm_m"]).sigmoid()
    return x + (y * g) @ p["mag_wo"]


def block_mal(b: Builder, x: Value, p: Params, m: Any) -> Value:
    x = x + lmm(b, rmsnorm(x, p["mem_norm"]), p, m)
    return x + _swa(b, rmsnorm(x, p["attn_norm"]), p, m)


def block_mac(b: Builder, x: Value, p: Params, m: Any) -> Value:
    """Memory as context: a scan over segments carrying the memory state."""
    mem, att = m.memory, m.attention
    B, T, D = x.shape
    S, nm, depth = att.segment, mem.heads, mem.depth
    n_seg, e = T // S, D // nm
    u = rmsnorm(x, p["mem_norm"])
    hq = project(b, u, p, mem, want="q").q                        # (B, Nm, T, e), full-seq conv
    ws, ss = initial_state(b, p, depth, B)
    u_seg = u.reshape(B, n_seg, S, D).permute(1, 0, 2, 3)         # (nS, B, S, D)
    hq_seg = hq.reshape(B, nm, n_seg, S, e).permute(2, 0, 1, 3, 4)   # (nS, B, Nm, S, e)
    # loop-invariant weights the segment body reads (the memory's W⁽⁰⁾ enters as the carry)
    keys = sorted(k for k in p if k.startswith(("attn_", "mem_")) and k != "mem_norm"
                  and not re.fullmatch(r"mem_w\d+", k))

    def body(bb: Builder, carry: list[Value], xs: list[Value], consts: list[Value]):
        pp = dict(zip(keys, consts))
        w, s = carry[:depth], carry[depth:]
        u_s, hq_s = xs
        h = merge_heads(retrieve(bb, w, hq_s))                    # (B, S, D), read only
        y = mac_attention(bb, u_s, h, pp, att.heads)              # ỹ (B, S, D)
        st = project(bb, y, pp, mem)                              # segment-local conv history
        w2, s2, r = memory_scan(bb, w, s, st, mem.chunk_size, st.q)
        return w2 + s2, [(y * merge_heads(r).sigmoid()) @ pp["mem_wo"]]

    names = [f"W{i}" for i in range(1, depth + 1)] + [f"S{i}" for i in range(1, depth + 1)]
    _, (out,) = b.scan(body, ws + ss, [u_seg, hq_seg], [p[k] for k in keys], length=n_seg,
                       name="mac_segment", names=names + ["u", "hq"] + keys,
                       role="segment")
    x = x + out.permute(1, 0, 2, 3).reshape(B, T, D)
    return x


BLOCKS: dict[str, Callable[[Builder, Value, Params, Any], Value]] = {
    "attn": block_attn, "lmm": block_lmm, "mag": block_mag, "mal": block_mal, "mac": block_mac,
}


def block(b: Builder, x: Value, p: Params, m: Any) -> Value:
    """One layer: the block kind's mixer, then the SwiGLU FFN."""
    x = BLOCKS[m.block](b, x, p, m)
    return x + ffn(rmsnorm(x, p["ffn_norm"]), p["ffn_w1"], p["ffn_w3"], p["ffn_w2"])
