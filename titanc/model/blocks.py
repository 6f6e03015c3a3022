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
from titanc.model.spec import ModelSpec

from titanc.model.attention import mac_attention, swa
from titanc.model.documents import local
from titanc.model.neural_memory import (batched, initial_state, inner_ln, memory_scan, project,
                                        read_initial, retrieve)
from titanc.model.nn import dwconv, ffn, merge_heads, rmsnorm
from titanc.model.objective import objective_of

Params = dict[str, Value]

# remat per_segment, train.remat_rows 0: the MAC scans run on groups of the fewest sequences
# whose segment [rows, S, D] reaches this many float32 bytes (1 MiB): splitting the batch
# shrinks the backward's working set, but below this size the launches of more, smaller
# groups cost more time than the memory is worth
ROW_GROUP_BYTES = 2**20


class Mixers(Protocol):
    """The token mixers a block is composed of, on a normalised input u (B, T, D) -> (B, T, D).
    Training implements them over the whole sequence (`Parallel`), decoding over n new tokens
    given each layer's state (`decode._Step`); `block` composes them the same way for both."""

    def swa(self, u: Value) -> Value: ...

    def lmm(self, u: Value) -> Value: ...

    def mac(self, u: Value) -> Value: ...

    def mac_residual(self, x: Value) -> Value: ...

    def ffn_residual(self, x: Value) -> Value: ...


class Residuals:
    """The residual steps of a layer over its whole input: x + MAC(rmsnorm(x)) and
    x + SwiGLU(rmsnorm(x)). `Parallel` under `train.remat: per_segment` overrides them to run
    one segment at a time."""
    p: Params

    def mac_residual(self, x: Value) -> Value:
        return x + self.mac(rmsnorm(x, self.p["mem_norm"]))  # type: ignore[attr-defined]

    def ffn_residual(self, x: Value) -> Value:
        p = self.p
        return x + ffn(rmsnorm(x, p["ffn_norm"]), p["ffn_w1"], p["ffn_w3"], p["ffn_w2"])


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
        mem = rmsnorm(mx.lmm(u), p["mag_norm_m"])
        x = x + gated(y, mem, m) @ p["mag_wo"]
    elif kind == "mal":
        x = x + mx.lmm(rmsnorm(x, p["mem_norm"]))
        x = x + mx.swa(rmsnorm(x, p["attn_norm"]))
    else:
        x = mx.mac_residual(x)
    return mx.ffn_residual(x)


def doc_conv(doc: Value | None):
    """The causal conv for `project`: None (zero history) without documents, else one whose
    history resets at each token's document start `doc` (B, T) in the input's positions."""
    return None if doc is None else (lambda x, w, _: dwconv(x, w, doc))


def lmm_output(y: Value, u: Value, p: Params) -> Value:
    """LMM(u) = (y ⊙ silu(u W_G)) W_O from the retrieved y (B, T, D) (no gate without W_G)."""
    if "mem_wg" in p:
        y = y * (u @ p["mem_wg"]).silu()
    return y @ p["mem_wo"]


def mac_input(y: Value, u: Value, p: Params, m: ModelSpec) -> Value:
    """What MAC writes into its memory: the attention output ỹ itself (the paper), ŷ =
    rmsnorm(ỹ) (`memory.mac_write: attention_norm`), or the segment input u
    (`memory.mac_write: input`)."""
    write = m.memory.mac_write
    if write == "attention":
        return y
    return rmsnorm(y, p["mac_norm"]) if write == "attention_norm" else u


def gated(y: Value, r: Value, m: ModelSpec) -> Value:
    """The paper's y ⊗ M of mac and mag: the attention output y gated by the memory's r,
    y ⊙ σ(r), or with `memory.gate: attention` the memory's r gated by y, σ(y) ⊙ r."""
    return y * r.sigmoid() if m.memory.gate == "memory" else y.sigmoid() * r


def mac_output(y: Value, r: Value, h: Value, p: Params, m: ModelSpec) -> Value:
    """MAC's output (ỹ ⊗ r) W_O (`gated`): attention output ỹ and memory read r; with
    `memory.mac_read: residual` the segment-start read h is added before W_O."""
    o = gated(y, r, m)
    return (o + h if m.memory.mac_read == "residual" else o) @ p["mem_wo"]


class Parallel(Residuals):
    """The mixers over a whole training sequence (B, T, D). `segmented` (`train.remat:
    per_segment`): the FFN (with its norm and residual) runs as a scan over chunks of B·S
    token rows, MAC's norm, memory-query projection and residual move into its segment scan,
    and the MAC runs on groups of `rows` sequences (`train.remat_rows`, 0: auto), so a
    layer's backward recomputes one segment of one group at a time and no whole-sequence
    intermediate of them is live across the segment scan. `doc` (B, T): each token's
    document start (`data.documents`, titanc/model/documents.py); MAC then runs unsegmented."""

    def __init__(self, b: Builder, p: Params, m: ModelSpec, segmented: bool = False,
                 rows: int = 0, doc: Value | None = None):
        self.b, self.p, self.m, self.segmented, self.rows = b, p, m, segmented, rows
        self.doc = doc

    def _rows_per_group(self, B: int, S: int, D: int) -> int:
        """Sequences per MAC group: `rows` (train.remat_rows), or the fewest whose segment
        reaches ROW_GROUP_BYTES; always a divisor of B."""
        want = self.rows or next((r for r in range(1, B + 1)
                                  if B % r == 0 and r * S * D * 4 >= ROW_GROUP_BYTES), B)
        return max(r for r in range(1, min(want, B) + 1) if B % r == 0)

    def _segments(self, T: int) -> int:
        """Segments per sequence when running segmented, else 1."""
        S = self.m.attention.segment
        return T // S if self.segmented and T % S == 0 else 1

    def ffn_residual(self, x: Value) -> Value:
        B, T, D = x.shape
        n = self._segments(T)
        if n == 1:
            return super().ffn_residual(x)
        keys = ["ffn_norm", "ffn_w1", "ffn_w2", "ffn_w3"]

        def body(bb: Builder, carry: list[Value], xs: list[Value], consts: list[Value]):
            pp = dict(zip(keys, consts))
            x_c = xs[0]                                           # (B·T/n, D) token rows
            return [], [x_c + ffn(rmsnorm(x_c, pp["ffn_norm"]), pp["ffn_w1"], pp["ffn_w3"],
                                  pp["ffn_w2"])]

        _, (y,) = self.b.scan(body, [], [x.reshape(n, B * T // n, D)],
                              [self.p[k] for k in keys], length=n, name="ffn_chunk",
                              names=["x"] + keys, role="loop")
        return y.reshape(B, T, D)

    def mac_residual(self, x: Value) -> Value:
        """x + MAC(rmsnorm(x)); segmented: `rows` sequences at a time (a scan over groups of
        batch rows, each the segment scan of `mac(segmented=True)`), so the segment
        backward's recomputed values and its saved memory states are one group's."""
        K, S = self.m.memory.conv_kernel, self.m.attention.segment
        B, T, D = x.shape
        if self._segments(T) == 1 or K - 1 > S or self.doc is not None:
            return super().mac_residual(x)
        r = self._rows_per_group(B, S, D)
        if r == B:
            return self.mac(x, segmented=True)
        keys = sorted(k for k in self.p if k.startswith(("attn_", "mem_", "mac_")))

        def rows(bb: Builder, carry: list[Value], xs: list[Value], consts: list[Value]):
            sub = Parallel(bb, dict(zip(keys, consts)), self.m, self.segmented, self.rows)
            return [], [sub.mac(xs[0], segmented=True)]

        _, (y,) = self.b.scan(rows, [], [x.reshape(B // r, r, T, D)], [self.p[k] for k in keys],
                              length=B // r, name="mac_rows", names=["x"] + keys, role="loop")
        return y.reshape(B, T, D)

    def swa(self, u: Value) -> Value:
        return swa(self.b, u, self.p, self.m.attention.heads, self.m.attention.window, self.doc)

    def _w0(self, p: Params) -> list[Value]:
        return [p[f"mem_w{i}"] for i in range(1, self.m.memory.depth + 1)]

    def lmm(self, u: Value) -> Value:
        """LMM(u) = (y ⊙ silu(u W_G)) W_O, y retrieved at chunk-start memory states."""
        b, p, mem, doc = self.b, self.p, self.m.memory, self.doc
        st = project(b, u, p, mem, conv=doc_conv(doc))
        docs = None if doc is None else (local(doc, mem.chunk_size), self._w0(p))
        ws, ss = initial_state(b, p, mem.depth, u.shape[0], mem.momentum_form != "none")
        _, _, y = memory_scan(b, ws, ss, st, mem.chunk_size, st.q, docs, objective_of(mem),
                              mem, inner_ln(p, mem))
        return lmm_output(merge_heads(y), u, p)                 # y (B, T, D)

    def mac(self, u: Value, segmented: bool = False) -> Value:
        """Memory as context: a scan over segments carrying the memory state. `segmented`:
        u is the raw layer input x; each segment normalises its tokens, projects its memory
        queries (the causal conv reading the previous segment's last K-1 tokens, passed as a
        per-segment slice) and returns x_s + MAC, i.e. the layer's residual."""
        b, p, m = self.b, self.p, self.m
        mem, att = m.memory, m.attention
        B, T, D = u.shape
        S, nm, depth, K = att.segment, mem.heads, mem.depth, mem.conv_kernel
        n_seg, e = T // S, D // nm
        ws, ss = initial_state(b, p, depth, B, mem.momentum_form != "none")
        u_seg = u.reshape(B, n_seg, S, D).permute(1, 0, 2, 3)     # (nS, B, S, D)
        if segmented:
            xs = [u_seg]
            if K > 1:   # the previous segment's last K-1 tokens (zeros before the first): the
                        # conv history of each segment's memory queries
                last = u.reshape(B, n_seg, S, D).slice(2, S - K + 1, S)      # (B, nS, K-1, D)
                xs.append(last.pad(1, 1, 0).slice(1, 0, n_seg).permute(1, 0, 2, 3))
        else:
            doc = self.doc
            hq = project(b, u, p, mem, want="q", conv=doc_conv(doc)).q   # (B, Nm, T, e)
            xs = [u_seg, hq.reshape(B, nm, n_seg, S, e).permute(2, 0, 1, 3, 4)]  # (nS,B,Nm,S,e)
            if doc is not None:   # document starts relative to the segment and to the chunk
                xs += [local(doc, S).reshape(B, n_seg, S).permute(1, 0, 2),
                       local(doc, mem.chunk_size).reshape(B, n_seg, S).permute(1, 0, 2)]
        # loop-invariant weights the segment body reads (W⁽⁰⁾ enters as the carry, and with
        # documents as constants too: a document's start state)
        keys = sorted(k for k in p if k.startswith(("attn_", "mem_", "mac_"))
                      and (segmented or k != "mem_norm")
                      and (self.doc is not None or not re.fullmatch(r"mem_w\d+", k)))

        def body(bb: Builder, carry: list[Value], xs: list[Value], consts: list[Value]):
            pp = dict(zip(keys, consts))
            w, s = carry[:depth], carry[depth:]
            if segmented:
                x_s = xs[0]
                u_s = rmsnorm(x_s, pp["mem_norm"])
                u_h = bb.concat([rmsnorm(xs[1], pp["mem_norm"]), u_s], 1) if K > 1 else u_s
                hq_s = project(bb, u_h, pp, mem, want="q").q.slice(2, K - 1, K - 1 + S)
            else:
                u_s, hq_s = xs[:2]
            # documents: starts relative to the segment and to the chunk (else None)
            seg_lo, chunk_lo = xs[2:] if self.doc is not None else (None, None)
            hr = retrieve(bb, w, hq_s)                            # read only
            if seg_lo is not None:  # a token whose document began in the segment reads W⁽⁰⁾
                w0 = batched(self._w0(pp), hq_s.shape[0])
                hr = read_initial(bb, hr, w0, hq_s, seg_lo)
            h = merge_heads(hr)                                   # (B, S, D)
            y = mac_attention(bb, u_s, h, pp, att.heads, seg_lo)  # ỹ (B, S, D)
            yn = mac_input(y, u_s, pp, m)                         # what the memory writes
            st = project(bb, yn, pp, mem, conv=doc_conv(seg_lo))  # segment-local conv history
            docs = None if seg_lo is None else (chunk_lo, self._w0(pp))
            w2, s2, r = memory_scan(bb, w, s, st, mem.chunk_size, st.q, docs, objective_of(mem),
                                    mem)
            out = mac_output(y, merge_heads(r), h, pp, m)
            return w2 + s2, [x_s + out if segmented else out]

        names = [f"W{i}" for i in range(1, depth + 1)] + [f"S{i}" for i in range(1, len(ss) + 1)]
        xnames = (["x", "x_prev"][:len(xs)]) if segmented else \
            ["u", "hq", "doc_segment", "doc_chunk"][:len(xs)]
        _, (out,) = b.scan(body, ws + ss, xs, [p[k] for k in keys], length=n_seg,
                           name="mac_segment", names=names + xnames + keys, role="segment")
        return out.permute(1, 0, 2, 3).reshape(B, T, D)
