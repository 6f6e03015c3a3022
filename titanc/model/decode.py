"""Serving graphs: a step over n new tokens given each layer's state, and the chunk write.

Decoding reproduces the training forward exactly (docs/semantics.md): memory is written only
when a chunk completes, so a token reads the state at its chunk's start. The step graph
reads the state and returns what changed; the host (`runtime/serve/generate.py`) keeps ring
buffers and pending chunk items and calls the write graph when a chunk completes, so every
shape here is static and the state per sequence is constant in context length.

Per-layer state (stacked over layers, leading L):
    W{i}, S{i}        (B, Nm, out, in)    memory weights and momentum     memory blocks
    Wseg{i}           (B, Nm, out, in)    weights at the segment start    mac
    conv_q/k/v        (B, K-1, D)         conv histories (mac: of ŷ, reset per segment)
    conv_hq           (B, K-1, D)         history of the x̂ query conv      mac
    k_cache, v_cache  (B, H, W, e)        sliding-window ring buffer      attn, mag, mal
    hk, hv, uk, uv    (B, H, S, e)        keys/values of the segment      mac
Host inputs: tokens (B, n); rope_cos/rope_sin (B, n, e/2) at each token's position (mac: its
position in the segment); attn_bias (B, n, keys) additive visibility of every key.
"""
from __future__ import annotations

from typing import Any

from titanc.ir import Builder, Graph, Value, dtype_name

from titanc.model.attention import attention
from titanc.model.blocks import Residuals, block, lmm_output, mac_input, mac_output
from titanc.model.frontend import lm_logits
from titanc.model.neural_memory import chunk_write, inner_ln, mlp, post_norm, project
from titanc.model.nn import merge_heads, rotate
from titanc.model.objective import objective_of
from titanc.model.params import memory_shapes, param_specs
from titanc.model.spec import ModelSpec, Spec


def state_shapes(m: ModelSpec, B: int) -> dict[str, tuple[int, ...]]:
    """Per-layer state tensors (without the leading L axis)."""
    D, att, mem, kind = m.d_model, m.attention, m.memory, m.kind
    out: dict[str, tuple[int, ...]] = {}
    if kind.memory:
        shapes = memory_shapes(D // mem.heads, mem.depth, mem.expansion, m.mem_value_dim)
        for i, (o, n) in enumerate(shapes, 1):
            out[f"W{i}"] = (B, mem.heads, o, n)
            if mem.momentum_form != "none":
                out[f"S{i}"] = (B, mem.heads, o, n)
            if kind.segment:
                out[f"Wseg{i}"] = (B, mem.heads, o, n)
        if mem.conv_kernel > 1:
            for c in ("q", "k", "v") + (("hq",) if kind.segment else ()):
                width = mem.heads * m.mem_value_dim if c == "v" else D
                out[f"conv_{c}"] = (B, mem.conv_kernel - 1, width)
    H, e = att.heads, D // att.heads
    if kind.window:
        out["k_cache"] = out["v_cache"] = (B, H, att.window, e)
    if kind.segment:
        for c in ("hk", "hv", "uk", "uv"):
            out[c] = (B, H, att.segment, e)
    return out


def n_keys(m: ModelSpec, n: int) -> int:
    """Keys each query of an n-token step sees (the width of attn_bias)."""
    P = m.attention.persistent_tokens
    if m.kind.segment:
        return P + 2 * (m.attention.segment + n)
    return P + m.attention.window + n


class _Step(Residuals):
    """The block mixers (`blocks.Mixers`) over n new tokens given one layer's state: emits the
    step and collects the state updates it returns."""

    def __init__(self, b: Builder, p: dict[str, Value], st: dict[str, Value], host: dict[str, Value],
                 m: ModelSpec):
        self.b, self.p, self.st, self.host, self.m = b, p, st, host, m
        self.new: dict[str, Value] = {}

    def conv(self, x: Value, w: Value, name: str) -> Value:
        """Causal depthwise conv continuing the history `conv_<name>`."""
        B, n, C = x.shape
        K = w.shape[1]
        if K == 1:
            return x * w.reshape(C)
        full = self.b.concat([self.st[f"conv_{name}"], x], 1)    # (B, K-1+n, C)
        out = None
        for j in range(K):
            term = full.slice(1, j, j + n) * w.slice(1, j, j + 1).reshape(C)
            out = term if out is None else out + term
        self.new[f"conv_{name}"] = full.slice(1, n, n + K - 1)
        return out

    def rope(self, x: Value) -> Value:
        B, H, n, e = x.shape
        cos = self.host["rope_cos"].reshape(B, 1, n, e // 2)
        sin = self.host["rope_sin"].reshape(B, 1, n, e // 2)
        return rotate(self.b, x, cos, sin)

    def attend(self, u: Value, sources: list[Value], caches: list[tuple[str, str]]) -> Value:
        """`attention.attention` with each source's cached keys and values (the state
        tensors named in `caches`) as its history, the host's bias and RoPE tables; each
        source's new keys/values are returned as `<k name>_new`, `<v name>_new`."""
        n = u.shape[1]
        bias = self.host["attn_bias"]
        bias = bias.reshape(u.shape[0], 1, n, bias.shape[-1])
        history = [(self.st[k], self.st[v]) for k, v in caches]
        out, new = attention(self.b, u, self.p, self.m.attention.heads, sources,
                             lambda P: bias, self.rope, history)
        for (kn, vn), (k, v) in zip(caches, new):
            self.new[f"{kn.removesuffix('_cache')}_new"] = k
            self.new[f"{vn.removesuffix('_cache')}_new"] = v
        return out

    def swa(self, u: Value) -> Value:
        return self.attend(u, [u], [("k_cache", "v_cache")])

    def memory_read_write(self, u: Value, weights: list[Value]) -> tuple[Value, Any]:
        """Retrieve with the current (chunk-start) weights; hand the write items to the host.
        With `memory.read: after_write` (chunks of one token, so n = 1) the read is at the
        state after this token's write, which the step computes for the read alone: the
        host still writes the state through the write graph."""
        mem = self.m.memory
        st = project(self.b, u, self.p, mem, conv=self.conv)
        ln = inner_ln(self.p, mem)
        if mem.read == "after_write":
            ss = self.weights("S") if st.log_eta is not None else []
            weights, _ = chunk_write(self.b, weights, ss, st.k, st.v, st.theta, st.log_eta,
                                     st.log_keep, objective_of(mem), mem, ln)
        y, _, _ = mlp(self.b, weights, st.q)
        if mem.post_norm:
            y = post_norm(y, ln)
        for k, v in (("mk", st.k), ("mv", st.v), ("theta", st.theta),
                     ("log_eta", st.log_eta), ("log_keep", st.log_keep)):
            if v is not None:
                self.new[k] = v
        return merge_heads(y), st

    def weights(self, prefix: str) -> list[Value]:
        return [self.st[f"{prefix}{i}"] for i in range(1, self.m.memory.depth + 1)]

    def lmm(self, u: Value) -> Value:
        """LMM(u) read at the chunk-start weights W; the write items go to the host."""
        y, _ = self.memory_read_write(u, self.weights("W"))
        return lmm_output(y, u, self.p)

    def mac(self, u: Value) -> Value:
        m, p, b = self.m, self.p, self.b
        hq = project(b, u, p, m.memory, want="q",
                     conv=lambda x, w, name: self.conv(x, w, "hq")).q
        h, _, _ = mlp(b, self.weights("Wseg"), hq)                # read at the segment start
        h = merge_heads(h)
        y = self.attend(u, [h, u], [("hk", "hv"), ("uk", "uv")])  # ỹ (B, n, D)
        r, _ = self.memory_read_write(mac_input(y, u, p, m), self.weights("W"))
        return mac_output(y, r, h, p, m)


def lower_step(spec: Spec, batch: int, n: int, dtype: str | None = None) -> Graph:
    """Logits (B, n, V) of n new tokens, and each layer's state updates (`new.<name>`)."""
    m = spec.model
    dt = dtype_name(dtype or spec.train.master_dtype)
    b = Builder("step")
    tokens = b.input("tokens", (batch, n), "i64")
    params = {ps.name: b.input(ps.name, ps.shape, dt) for ps in param_specs(m)}
    shapes = state_shapes(m, batch)
    states = {k: b.input(f"state.{k}", (m.n_layers,) + s, dt) for k, s in sorted(shapes.items())}
    host: dict[str, Value] = {}
    if m.kind.attention:
        half = m.d_model // m.attention.heads // 2
        host["rope_cos"] = b.input("rope_cos", (batch, n, half), dt)
        host["rope_sin"] = b.input("rope_sin", (batch, n, half), dt)
        host["attn_bias"] = b.input("attn_bias", (batch, n, n_keys(m, n)), dt)
    layer_names = sorted(k for k in params if k.startswith("layers."))
    short = [k.removeprefix("layers.") for k in layer_names]
    st_names = sorted(states)
    host_names = sorted(host)
    out_names: list[str] = []

    def body(bb: Builder, carry: list[Value], xs: list[Value], consts: list[Value]):
        p = dict(zip(short, xs[: len(short)]))
        st = dict(zip(st_names, xs[len(short):]))
        step = _Step(bb, p, st, dict(zip(host_names, consts)), m)
        x = block(step, carry[0], p, m)
        out_names[:] = sorted(step.new)
        return [x], [step.new[k] for k in out_names]

    x = b.take(params["embed"], tokens)                           # (B, n, D)
    (x,), ys = b.scan(body, [x], [params[k] for k in layer_names] + [states[k] for k in st_names],
                      [host[k] for k in host_names], length=m.n_layers, name="layer_step", role="layer",
                      names=["x"] + short + [f"state.{k}" for k in st_names] + host_names)
    logits = lm_logits(b, x, params, m.tie_embeddings)
    b.graph.set_outputs([("logits", logits.id)] + [(f"new.{k}", y.id) for k, y in zip(out_names, ys)])
    return b.graph


def lower_write(spec: Spec, batch: int, dtype: str | None = None) -> Graph:
    """Apply one completed chunk of pending items to (W, S), where mask (B,) is 1."""
    m, mem = spec.model, spec.model.memory
    dt = dtype_name(dtype or spec.train.master_dtype)
    b = Builder("write")
    shapes = state_shapes(m, batch)
    L, depth, U = m.n_layers, mem.depth, mem.write_chunk
    ws = [b.input(f"state.W{i}", (L,) + shapes[f"W{i}"], dt) for i in range(1, depth + 1)]
    momentum = mem.momentum_form != "none"
    n_s = depth if momentum else 0
    ss = [b.input(f"state.S{i}", (L,) + shapes[f"S{i}"], dt) for i in range(1, n_s + 1)]
    nm, e = mem.heads, m.d_model // mem.heads
    pend = {k: b.input(f"pending.{k}", (L, batch, nm, U, w), dt)
            for k, w in (("mk", e), ("mv", m.mem_value_dim))}
    gate_names = ("theta", "log_eta", "log_keep") if momentum else ("theta", "log_keep")
    pend.update({k: b.input(f"pending.{k}", (L, batch, nm, U), dt) for k in gate_names})
    mask = b.input("mask", (batch,), dt).reshape(batch, 1, 1, 1)
    names = ["mk", "mv", *gate_names]
    # the inner model's w, b (memory.inner: ln_residual), parameters bound by name
    lns = [b.input(f"layers.mem_ln_{x}", (L, nm, e), dt)
           for x in ("w", "b")] if mem.inner == "ln_residual" else []

    def body(bb: Builder, carry: list[Value], xs: list[Value], consts: list[Value]):
        w, s = xs[:depth], xs[depth:depth + n_s]
        items = dict(zip(names, xs[depth + n_s:depth + n_s + len(names)]))
        ln = tuple(xs[depth + n_s + len(names):]) or None
        w2, s2 = chunk_write(bb, w, s, items["mk"], items["mv"], items["theta"],
                             items.get("log_eta"), items["log_keep"], objective_of(mem), mem, ln)
        msk = consts[0]
        return [], [a + (c - a) * msk for a, c in zip(w + s, w2 + s2)]

    _, ys = b.scan(body, [], ws + ss + [pend[k] for k in names] + lns, [mask], length=L,
                   name="write_layer", role="memory")
    outs = [(f"state.W{i}", ys[i - 1].id) for i in range(1, depth + 1)]
    outs += [(f"state.S{i}", ys[depth + i - 1].id) for i in range(1, n_s + 1)]
    b.graph.set_outputs(outs)
    return b.graph
