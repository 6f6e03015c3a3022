"""The five block kinds (docs/semantics.md "Blocks"), defined once for training and decoding.

`block(mixers, x, p, m)` composes a layer from its token mixers (sliding-window attention,
the long-term memory, memory as context) and the FFN; `Parallel` implements the mixers over a
training sequence, `decode._Step` over new tokens given a layer's state. `p` holds one layer's
parameters by short name (`attn_wq`, `mem_w1`, ...).
"""
from __future__ import annotations

import re
from typing import Protocol

from titanc.ir import Builder, Value
from titanc.spec import ModelSpec

from .attention import mac_attention, swa
from .memory import initial_state, memory_scan, project, retrieve
from .nn import ffn, merge_heads, rmsnorm

Params = dict[str, Value]


class Mixers(Protocol):
    """The token mixers a block is composed of, on a normalised input u (B, T, D) -> (B, T, D).
    Training implements them over the whole sequence (`Parallel`), decoding over n new tokens
    given each layer's state (`decode._Step`); `block` composes them the same way for both."""

    def swa(self, u: Value) -> Value: ...

    def lmm(self, u: Value) -> Value: ...

    def mac(self, u: Value) -> Value: ...


def block(mx: Mixers, x: Value, p: Params, m: ModelSpec) -> Value:
    """One layer of kind `m.block` (docs/semantics.md "Blocks"): its mixers with their norms,
    residuals and gates, then the SwiGLU FFN."""
    kind = m.block
    if kind == "attn":
        x = x + mx.swa(rmsnorm(x, p["attn_norm"]))
    elif kind == "lmm":
        x = x + mx.lmm(rmsnorm(x, p["mem_norm"]))
    elif kind == "mag":
        u = rmsnorm(x, p["mem_norm"])
        y = rmsnorm(mx.swa(u), p["mag_norm_y"])
        g = rmsnorm(mx.lmm(u), p["mag_norm_m"]).sigmoid()
        x = x + (y * g) @ p["mag_wo"]
    elif kind == "mal":
        x = x + mx.lmm(rmsnorm(x, p["mem_norm"]))
        x = x + mx.swa(rmsnorm(x, p["attn_norm"]))
    else:
        x = x + mx.mac(rmsnorm(x, p["mem_norm"]))
    return x + ffn(rmsnorm(x, p["ffn_norm"]), p["ffn_w1"], p["ffn_w3"], p["ffn_w2"])


def lmm_output(y: Value, u: Value, p: Params) -> Value:
    """LMM(u) = (y ⊙ silu(u W_G)) W_O from the retrieved y (B, T, D) (no gate without W_G)."""
    if "mem_wg" in p:
        y = y * (u @ p["mem_wg"]).silu()
    return y @ p["mem_wo"]


def mac_output(y: Value, r: Value, p: Params) -> Value:
    """MAC's output (ỹ ⊙ σ(r)) W_O: attention output ỹ gated by the memory read r."""
    return (y * r.sigmoid()) @ p["mem_wo"]


class Parallel:
    """The mixers over a whole training sequence (B, T, D)."""

    def __init__(self, b: Builder, p: Params, m: ModelSpec):
        self.b, self.p, self.m = b, p, m

    def swa(self, u: Value) -> Value:
        return swa(self.b, u, self.p, self.m.attention.heads, self.m.attention.window)

    def lmm(self, u: Value) -> Value:
        """LMM(u) = (y ⊙ silu(u W_G)) W_O, y retrieved at chunk-start memory states."""
        b, p, mem = self.b, self.p, self.m.memory
        st = project(b, u, p, mem)
        ws, ss = initial_state(b, p, mem.depth, u.shape[0])
        _, _, y = memory_scan(b, ws, ss, st, mem.chunk_size, st.q)
        return lmm_output(merge_heads(y), u, p)                 # y (B, T, D)

    def mac(self, u: Value) -> Value:
        """Memory as context: a scan over segments carrying the memory state."""
        b, p, m = self.b, self.p, self.m
        mem, att = m.memory, m.attention
        B, T, D = u.shape
        S, nm, depth = att.segment, mem.heads, mem.depth
        n_seg, e = T // S, D // nm
        hq = project(b, u, p, mem, want="q").q                    # (B, Nm, T, e), full-seq conv
        ws, ss = initial_state(b, p, depth, B)
        u_seg = u.reshape(B, n_seg, S, D).permute(1, 0, 2, 3)     # (nS, B, S, D)
        hq_seg = hq.reshape(B, nm, n_seg, S, e).permute(2, 0, 1, 3, 4)   # (nS, B, Nm, S, e)
        # loop-invariant weights the segment body reads (W⁽⁰⁾ enters as the carry)
        keys = sorted(k for k in p if k.startswith(("attn_", "mem_", "mac_")) and k != "mem_norm"
                      and not re.fullmatch(r"mem_w\d+", k))

        def body(bb: Builder, carry: list[Value], xs: list[Value], consts: list[Value]):
            pp = dict(zip(keys, consts))
            w, s = carry[:depth], carry[depth:]
            u_s, hq_s = xs
            h = merge_heads(retrieve(bb, w, hq_s))                # (B, S, D), read only
            y = mac_attention(bb, u_s, h, pp, att.heads)          # ỹ (B, S, D)
            yn = rmsnorm(y, pp["mac_norm"])                       # ŷ: the memory's input
            st = project(bb, yn, pp, mem)                         # segment-local conv history
            w2, s2, r = memory_scan(bb, w, s, st, mem.chunk_size, st.q)
            return w2 + s2, [mac_output(y, merge_heads(r), pp)]

        names = [f"W{i}" for i in range(1, depth + 1)] + [f"S{i}" for i in range(1, depth + 1)]
        _, (out,) = b.scan(body, ws + ss, [u_seg, hq_seg], [p[k] for k in keys], length=n_seg,
                           name="mac_segment", names=names + ["u", "hq"] + keys,
                           role="segment")
        return out.permute(1, 0, 2, 3).reshape(B, T, D)
