"""The parameter table of a model (names and shapes per docs/semantics.md) and its init.

Each parameter draws from its own generator seeded by (seed, name), so adding a parameter
to a spec never changes how the others initialise: a checkpoint upgraded into a larger spec
gets its new tensors exactly as a fresh model would.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Any

import torch
from titanc.model.spec import ModelSpec


@dataclass(frozen=True, slots=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    init: str = "normal"       # normal | ones | zeros | const
    std: float = 0.02
    value: float = 0.0
    decay: bool = True         # AdamW weight decay (matrices only)


def _logit(p: float) -> float:
    return math.log(p / (1.0 - p))


def memory_shapes(d: int, depth: int, expansion: int, dv: int | None = None
                  ) -> list[tuple[int, int]]:
    """(out, in) of each memory MLP layer W_1..W_depth; dv the value width (None: d)."""
    dv = dv or d
    if depth == 1:
        return [(dv, d)]
    h = expansion * d
    return [(h, d)] + [(h, h)] * (depth - 2) + [(dv, h)]


def _softplus_inv(y: float) -> float:
    return math.log(math.expm1(y))


def param_specs(m: ModelSpec) -> list[ParamSpec]:
    D, V, L, F = m.d_model, m.vocab_size, m.n_layers, m.ffn
    att, mem = m.attention, m.memory
    block = m.block
    out_std = 0.02 / math.sqrt(2 * L)
    ps = [ParamSpec("embed", (V, D), std=0.02), ParamSpec("norm_f", (D,), "ones", decay=False)]
    if not m.tie_embeddings:
        ps.append(ParamSpec("lm_head", (D, V), std=0.02))

    def lay(name: str, shape: tuple[int, ...], **kw: Any) -> None:
        ps.append(ParamSpec(f"layers.{name}", (L,) + shape, **kw))

    def norm(name: str) -> None:
        lay(name, (D,), init="ones", decay=False)

    if block in ("attn", "mal"):
        norm("attn_norm")
    if m.kind.attention:
        for w in ("wq", "wk", "wv"):
            lay(f"attn_{w}", (D, D))
        lay("attn_wo", (D, D), std=out_std)
        if att.persistent_tokens > 0:
            lay("attn_persistent", (att.persistent_tokens, D), std=0.02, decay=False)
    if m.kind.memory:
        nm, d, K = mem.heads, D // mem.heads, mem.conv_kernel
        V = nm * m.mem_value_dim                # the values' width (D unless value_width)
        norm("mem_norm")
        for w in ("wq", "wk", "wv"):
            lay(f"mem_{w}", (D, V if w == "wv" else D))
        lay("mem_wo", (V, D), std=out_std)
        for c in ("q", "k", "v"):
            # identity-like start: the newest tap carries the signal, older taps are small
            lay(f"mem_conv_{c}", (V if c == "v" else D, K), std=0.1, decay=False)
        if mem.output_gate and block != "mac":
            lay("mem_wg", (D, V))
        if mem.adaptive:
            decay = max(mem.decay, 1e-4)
            alpha = (_softplus_inv(-math.log1p(-decay)) if mem.decay_form == "mamba2"
                     else _logit(decay / mem.decay_max))   # α starts at memory.decay
            for gate, bias in (("theta", 0.0), ("eta", _logit(mem.momentum)), ("alpha", alpha)):
                if gate in mem.fixed or (gate == "eta" and mem.momentum_form == "none"):
                    continue
                lay(f"mem_{gate}_w", (D, nm), init="zeros", decay=False)
                lay(f"mem_{gate}_b", (nm,), init="const", value=bias, decay=False)
            if mem.decay_form == "mamba2":      # A of α = 1 − exp(−e^A softplus(x))
                lay("mem_alpha_a", (nm,), init="zeros", decay=False)
        for i, (o, n) in enumerate(memory_shapes(d, mem.depth, mem.expansion,
                                                 m.mem_value_dim), 1):
            lay(f"mem_w{i}", (nm, o, n), std=1.0 / math.sqrt(n), decay=False)
        if mem.inner == "ln_residual":          # w, b of x + w ⊙ LN(W x) + b, per head
            lay("mem_ln_w", (nm, d), init="ones", decay=False)
            lay("mem_ln_b", (nm, d), init="zeros", decay=False)
    if block == "mac" and mem.mac_write == "attention_norm":
        norm("mac_norm")           # ŷ = rmsnorm(ỹ): the memory's input (an option)
    if block == "mag":
        norm("mag_norm_y")
        norm("mag_norm_m")
        lay("mag_wo", (D, D), std=out_std)
    norm("ffn_norm")
    lay("ffn_w1", (D, F))
    lay("ffn_w3", (D, F))
    lay("ffn_w2", (F, D), std=out_std)
    return ps


def init_param(p: ParamSpec, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    if p.init == "ones":
        return torch.ones(p.shape, dtype=dtype)
    if p.init == "zeros":
        return torch.zeros(p.shape, dtype=dtype)
    if p.init == "const":
        return torch.full(p.shape, p.value, dtype=dtype)
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(p.name.encode())) % 2**63)
    t = torch.randn(p.shape, generator=gen, dtype=torch.float64) * p.std
    if p.name.startswith("layers.mem_conv_"):
        t[..., -1] += 1.0  # newest tap ≈ 1: the conv starts close to the identity
    return t.to(dtype)


def init_params(m: ModelSpec, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    return {p.name: init_param(p, seed, dtype) for p in param_specs(m)}


def param_count(m: ModelSpec) -> int:
    n = 0
    for p in param_specs(m):
        k = 1
        for s in p.shape:
            k *= s
        n += k
    return n
