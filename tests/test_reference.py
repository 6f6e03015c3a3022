"""Self-checks of the eager reference (tests/reference), the oracle the compiler is tested against.

Tiny float64 configs (V=32, D=16, L=2, T=16, B=2): loss scale, gradients for every parameter,
a finite-difference check of the whole model, causality for every block, the memory path
actually carrying information, and the memory recurrence against closed forms.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from tests.reference import (
    RefAttention,
    RefMemory,
    RefModelConfig,
    chunk_token_loop,
    forward_logits,
    forward_loss,
    init_params,
    inner_grads,
    param_specs,
)
from tests.reference.attention import swa
from tests.reference.mac import mac_attention
from tests.reference.memory import mem_shapes
from tests.reference.ops import dwconv, layer_params, merge_heads, rope, split_heads

BLOCKS = ("attn", "lmm", "mag", "mal", "mac")
B, T, V = 2, 16, 32
F64 = torch.float64


def make_cfg(block: str, n_layers: int = 2, attention: dict | None = None, **memory) -> RefModelConfig:
    return RefModelConfig(
        vocab_size=V,
        d_model=16,
        n_layers=n_layers,
        block=block,
        seq_len=T,
        attention=RefAttention(**(attention or {})),
        memory=RefMemory(**memory),
    )


def make_tokens(seed: int = 1, batch: int = B, length: int = T + 1) -> torch.Tensor:
    return torch.randint(0, V, (batch, length), generator=torch.Generator().manual_seed(seed))


def leaf_params(cfg: RefModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    return {k: v.requires_grad_(True) for k, v in init_params(cfg, seed).items()}


# --- parameters ---------------------------------------------------------------------------------

COMMON = {"embed", "norm_f", "lm_head", "layers.ffn_norm", "layers.ffn_w1", "layers.ffn_w2", "layers.ffn_w3"}
ATTN = {"layers.attn_wq", "layers.attn_wk", "layers.attn_wv", "layers.attn_wo", "layers.attn_persistent"}
MEM = {
    "layers.mem_norm",
    *(f"layers.mem_w{x}" for x in "qkvo"),
    *(f"layers.mem_conv_{x}" for x in "qkv"),
    *(f"layers.mem_{g}_{x}" for g in ("theta", "eta", "alpha") for x in "wb"),
    "layers.mem_w1",
    "layers.mem_w2",
}
EXPECTED = {
    "attn": COMMON | ATTN | {"layers.attn_norm"},
    "lmm": COMMON | MEM | {"layers.mem_wg"},
    "mag": COMMON | ATTN | MEM | {"layers.mem_wg", "layers.mag_norm_y", "layers.mag_norm_m", "layers.mag_wo"},
    "mal": COMMON | ATTN | MEM | {"layers.mem_wg", "layers.attn_norm"},
    "mac": COMMON | ATTN | MEM,
}


@pytest.mark.parametrize("block", BLOCKS)
def test_parameter_names_follow_the_table(block: str) -> None:
    assert set(init_params(make_cfg(block))) == EXPECTED[block]


def test_parameter_shapes() -> None:
    cfg = make_cfg("mag", depth=3, expansion=2, heads=2)
    p = init_params(cfg)
    L, D, N, d, h = 2, 16, 2, 8, 16
    assert p["layers.mem_w1"].shape == (L, N, h, d)
    assert p["layers.mem_w2"].shape == (L, N, h, h)
    assert p["layers.mem_w3"].shape == (L, N, d, h)
    assert p["layers.mem_conv_q"].shape == (L, D, 4)
    assert p["layers.mem_theta_w"].shape == (L, D, N)
    assert p["layers.mem_alpha_b"].shape == (L, N)
    assert p["layers.attn_persistent"].shape == (L, 2, D)
    assert p["lm_head"].shape == (D, V)
    assert mem_shapes(make_cfg("lmm", depth=1)) == [(d, d)]
    assert init_params(replace(cfg, ffn_hidden=None))["layers.ffn_w1"].shape == (L, D, 8 * round(D / 3))


def test_optional_parameters_disappear() -> None:
    cfg = make_cfg("mal", adaptive=False, output_gate=False, attention={"persistent_tokens": 0})
    names = set(init_params(replace(cfg, tie_embeddings=True)))
    absent = {"lm_head", "layers.mem_wg", "layers.attn_persistent", "layers.mem_eta_w", "layers.mem_eta_b"}
    assert not names & absent


def test_init_is_deterministic_and_well_scaled() -> None:
    cfg = make_cfg("mag")
    a, b, c = init_params(cfg, seed=0), init_params(cfg, seed=0), init_params(cfg, seed=1)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["embed"], c["embed"])
    f32 = init_params(cfg, seed=0, dtype=torch.float32)
    assert all(f32[k].dtype == torch.float32 and torch.equal(f32[k], a[k].float()) for k in a)
    eta, alpha = torch.sigmoid(a["layers.mem_eta_b"]), torch.sigmoid(a["layers.mem_alpha_b"])
    assert ((eta > 0.8) & (eta < 0.95)).all() and ((alpha > 0.02) & (alpha < 0.1)).all()
    assert [n for n, *_ in param_specs(cfg)] == list(a)


# --- loss and gradients ---------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("block", BLOCKS)
def test_loss_is_finite_and_log_v_scale(block: str, tied: bool) -> None:
    cfg = replace(make_cfg(block), tie_embeddings=tied)
    loss = forward_loss(init_params(cfg), make_tokens(), cfg)
    assert loss.dtype == F64 and loss.shape == ()
    assert math.isfinite(loss.item())
    assert 0.5 * math.log(V) < loss.item() < 2.0 * math.log(V)


def test_tied_embeddings_and_constant_gates_run() -> None:
    cfg = replace(make_cfg("lmm", adaptive=False, output_gate=False, depth=1), tie_embeddings=True)
    logits = forward_logits(init_params(cfg), make_tokens()[:, :-1], cfg)
    assert logits.shape == (B, T, V) and torch.isfinite(logits).all()


@pytest.mark.parametrize("block", BLOCKS)
def test_every_parameter_gets_a_gradient(block: str) -> None:
    cfg = make_cfg(block)
    p = leaf_params(cfg)
    forward_loss(p, make_tokens(), cfg).backward()
    for name, x in p.items():
        assert x.grad is not None, name
        assert torch.isfinite(x.grad).all(), name
        assert x.grad.abs().max() > 0, name
    # every layer's slice of a stacked parameter is used, not just layer 0
    assert all(x.grad[-1].abs().max() > 0 for name, x in p.items() if name.startswith("layers."))


@pytest.mark.parametrize("block", BLOCKS)
def test_gradient_matches_central_difference(block: str) -> None:
    # one random direction over all parameters: <grad, dir> vs (L(p + e dir) - L(p - e dir)) / 2e
    cfg = make_cfg(block, chunk_size=2, attention={"segment": 8})
    tok = make_tokens()
    p = leaf_params(cfg)
    forward_loss(p, tok, cfg).backward()
    gen = torch.Generator().manual_seed(7)
    direction = {k: torch.randn(v.shape, generator=gen, dtype=F64) for k, v in p.items()}
    analytic = sum((p[k].grad * direction[k]).sum() for k in p).item()
    eps = 1e-6
    with torch.no_grad():
        plus = forward_loss({k: v + eps * direction[k] for k, v in p.items()}, tok, cfg)
        minus = forward_loss({k: v - eps * direction[k] for k, v in p.items()}, tok, cfg)
    numeric = ((plus - minus) / (2 * eps)).item()
    assert abs(analytic) > 1e-3
    assert numeric == pytest.approx(analytic, rel=1e-6)


# --- causality and the memory path ----------------------------------------------------------------


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("t", [0, 5, 9, 15])
def test_causality(block: str, t: int) -> None:
    cfg = make_cfg(block)
    p = init_params(cfg)
    tok = make_tokens()[:, :-1]
    changed = tok.clone()
    changed[:, t] = (changed[:, t] + 1) % V
    a, b = forward_logits(p, tok, cfg), forward_logits(p, changed, cfg)
    torch.testing.assert_close(a[:, :t], b[:, :t], rtol=0, atol=1e-13)
    assert (a[:, t] - b[:, t]).abs().amax(dim=-1).min() > 1e-8  # the changed position itself reacts


def test_sliding_window_limits_reach() -> None:
    # one attn layer, window 4, no persistent tokens: token 0 is invisible from position 4 on
    cfg = make_cfg("attn", n_layers=1, attention={"window": 4, "persistent_tokens": 0})
    p = init_params(cfg)
    tok = make_tokens()[:, :-1]
    changed = tok.clone()
    changed[:, 0] = (changed[:, 0] + 1) % V
    a, b = forward_logits(p, tok, cfg), forward_logits(p, changed, cfg)
    assert (a[:, :4] - b[:, :4]).abs().max() > 1e-6
    torch.testing.assert_close(a[:, 4:], b[:, 4:], rtol=0, atol=1e-13)


def test_memory_weights_matter() -> None:
    cfg = make_cfg("lmm", chunk_size=4)
    p, tok = init_params(cfg), make_tokens()
    bumped = dict(p, **{"layers.mem_w1": p["layers.mem_w1"] + 0.1})
    assert abs(forward_loss(p, tok, cfg) - forward_loss(bumped, tok, cfg)) > 1e-6


@pytest.mark.parametrize("block", ["lmm", "mac"])
def test_memory_writes_carry_information_across_chunks(block: str) -> None:
    # One layer, constant gates. Token 0 reaches positions >= 8 only through memory writes:
    # the conv reaches 3 steps back, and mac's attention stays inside its 8-token segment.
    # With lr_max = 0 nothing is written (W only decays by a constant), so they are unchanged.
    def effect(lr_max: float) -> float:
        cfg = make_cfg(block, n_layers=1, adaptive=False, lr_max=lr_max, chunk_size=4,
                       attention={"segment": 8})
        p = init_params(cfg)
        tok = make_tokens()[:, :-1]
        changed = tok.clone()
        changed[:, 0] = (changed[:, 0] + 1) % V
        a, b = forward_logits(p, tok, cfg), forward_logits(p, changed, cfg)
        return (a[:, 8:] - b[:, 8:]).abs().max().item()

    assert effect(0.0) < 1e-13
    assert effect(0.5) > 1e-6


def test_chunk_size_changes_the_loss() -> None:
    tok = make_tokens()
    per_token, one_chunk = make_cfg("lmm", chunk_size=1), make_cfg("lmm", chunk_size=T)
    loss_1 = forward_loss(init_params(per_token), tok, per_token)
    loss_T = forward_loss(init_params(one_chunk), tok, one_chunk)
    assert abs(loss_1 - loss_T) > 1e-6


def test_a_single_chunk_reads_only_the_initial_state() -> None:
    # chunk_size = T: every token reads W^(0); the writes are never read, so lr_max is irrelevant
    tok = make_tokens()
    frozen, learning = make_cfg("lmm", chunk_size=T, lr_max=0.0), make_cfg("lmm", chunk_size=T, lr_max=0.5)
    p = init_params(learning)
    assert torch.equal(forward_loss(p, tok, frozen), forward_loss(p, tok, learning))


def test_bad_chunk_size_is_named() -> None:
    cfg = make_cfg("lmm", chunk_size=5)
    with pytest.raises(ValueError, match=r"model.memory.chunk_size: 5 must divide seq_len=16"):
        forward_loss(init_params(cfg), make_tokens(), cfg)
    cfg = make_cfg("mac", chunk_size=3, attention={"segment": 8})
    with pytest.raises(ValueError, match=r"chunk_size: 3 must divide model.attention.segment=8"):
        forward_loss(init_params(cfg), make_tokens(), cfg)


# --- the inner gradient ---------------------------------------------------------------------------


def _random_weights(shapes: list[tuple[int, int]], Bn: int = 2, N: int = 3) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(Bn, N, o, i, generator=gen, dtype=F64) / math.sqrt(i) for o, i in shapes]


def _random_kv(gen: torch.Generator, b: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    # k, v (B=2, N=3, b, d)
    k = torch.randn(2, 3, b, d, generator=gen, dtype=F64)
    v = torch.randn(2, 3, b, d, generator=gen, dtype=F64)
    return k, v


def _explicit_inner_grads(Ws, k, v):
    """docs/semantics.md's explicit backprop: delta_Ld = (2/d)(y - v), g_i = delta_i (x) a_{i-1}."""
    # Ws[i] (B, N, O, I), k/v (B, N, b, C) -> (B, N, b, O, I)
    def silu(z: torch.Tensor) -> torch.Tensor:
        return z * torch.sigmoid(z)

    def dsilu(z: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(z) * (1 + z * (1 - torch.sigmoid(z)))

    a, zs, acts = k, [], [k]
    for i, W in enumerate(Ws):
        z = torch.einsum("bnoi,bnti->bnto", W, a)
        zs.append(z)
        a = silu(z) if i < len(Ws) - 1 else z
        acts.append(a)
    delta = (2 / k.shape[-1]) * (a - v)
    grads = [None] * len(Ws)
    for i in reversed(range(len(Ws))):
        grads[i] = torch.einsum("bnto,bnti->bntoi", delta, acts[i])
        if i > 0:
            delta = torch.einsum("bnoi,bnto->bnti", Ws[i], delta) * dsilu(zs[i - 1])
    return grads


def test_inner_grad_depth1_is_the_closed_formula() -> None:
    d, b = 8, 5
    (W,) = _random_weights([(d, d)])
    gen = torch.Generator().manual_seed(1)
    k, v = _random_kv(gen, b, d)
    (g,) = inner_grads([W], k, v)  # (B, N, b, d, d)
    resid = torch.einsum("bnoi,bnti->bnto", W, k) - v  # W k - v
    expected = (2 / d) * torch.einsum("bnto,bnti->bntoi", resid, k)  # (2/d)(Wk - v) (x) k
    torch.testing.assert_close(g, expected, rtol=0, atol=1e-14)


def test_inner_grad_matches_explicit_backprop_depth3() -> None:
    d, h, b = 8, 16, 4
    Ws = _random_weights([(h, d), (h, h), (d, h)])
    gen = torch.Generator().manual_seed(2)
    k, v = _random_kv(gen, b, d)
    for got, want in zip(inner_grads(Ws, k, v), _explicit_inner_grads(Ws, k, v)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-13)


def test_outer_gradient_flows_through_the_inner_gradient() -> None:
    # d/d(W, k, v) of <R, g(W, k, v)>: torch.func.grad under outer autograd vs the explicit formula
    d, h, b = 8, 16, 4
    gen = torch.Generator().manual_seed(3)
    base = _random_weights([(h, d), (d, h)])
    k0, v0 = _random_kv(gen, b, d)
    R = [torch.randn(2, 3, b, *w.shape[2:], generator=gen, dtype=F64) for w in base]

    def outer_grads(fn):
        Ws = [w.clone().requires_grad_(True) for w in base]
        k, v = k0.clone().requires_grad_(True), v0.clone().requires_grad_(True)
        sum((r * g).sum() for r, g in zip(R, fn(Ws, k, v))).backward()
        return [x.grad for x in (*Ws, k, v)]

    for got, want in zip(outer_grads(inner_grads), outer_grads(_explicit_inner_grads)):
        assert want.abs().max() > 0
        torch.testing.assert_close(got, want, rtol=0, atol=1e-13)


# --- the chunk recurrence against docs/semantics.md's closed form ----------------------------------------


def test_chunk_token_loop_matches_closed_form() -> None:
    Bn, N, b, shapes = 2, 3, 8, [(16, 8), (8, 16)]
    gen = torch.Generator().manual_seed(4)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=F64)

    W0 = [rnd(Bn, N, o, i) for o, i in shapes]
    S0 = [rnd(Bn, N, o, i) for o, i in shapes]
    g = [rnd(Bn, N, b, o, i) for o, i in shapes]
    theta = 0.5 * torch.rand(Bn, N, b, generator=gen, dtype=F64)
    eta = 0.7 + 0.3 * torch.rand(Bn, N, b, generator=gen, dtype=F64)
    alpha = 0.2 * torch.rand(Bn, N, b, generator=gen, dtype=F64)

    W, S = chunk_token_loop(W0, S0, g, theta, eta, alpha)

    # E_t = prod_{s<=t} eta_s, D_t = prod_{s<=t} (1 - alpha_s), ratios taken in log space
    logE, logD = eta.log().cumsum(-1), torch.log1p(-alpha).cumsum(-1)  # (B, N, b)
    E_b, D_b = logE[..., -1:].exp(), logD[..., -1:].exp()  # (B, N, 1)
    coef_S = (logD[..., -1:] + logE - logD).exp().sum(-1)  # sum_t D_b E_t / D_t   (B, N)
    # w_u = theta_u sum_{t>=u} (D_b / D_t)(E_t / E_u)
    ratio = (logD[..., -1:] - logD + logE)[..., None, :] - logE[..., :, None]  # (B, N, u, t)
    upper = torch.ones(b, b, dtype=torch.bool).triu()  # t >= u
    w = theta * (ratio.exp() * upper).sum(-1)  # (B, N, u)
    s_w = theta * (logE[..., -1:] - logE).exp()  # theta_u E_b / E_u   (B, N, u)
    for i in range(len(shapes)):
        W_closed = (D_b[..., None] * W0[i] + coef_S[..., None, None] * S0[i]
                    - torch.einsum("bnu,bnuoi->bnoi", w, g[i]))
        S_closed = E_b[..., None] * S0[i] - torch.einsum("bnu,bnuoi->bnoi", s_w, g[i])
        torch.testing.assert_close(W[i], W_closed, rtol=0, atol=1e-12)
        torch.testing.assert_close(S[i], S_closed, rtol=0, atol=1e-12)


# --- primitives against independent formulations ----------------------------------------------------


def test_dwconv_matches_grouped_conv1d() -> None:
    gen = torch.Generator().manual_seed(5)
    u, w = torch.randn(2, 9, 6, generator=gen, dtype=F64), torch.randn(6, 4, generator=gen, dtype=F64)
    # conv1d is cross-correlation: out[t] = sum_j w[j] in[t + j]; left-pad K-1 zeros for causality
    x = torch.nn.functional.pad(u.transpose(1, 2), (3, 0))  # (B, D, K-1+T)
    expected = torch.nn.functional.conv1d(x, w[:, None, :], groups=6).transpose(1, 2)
    torch.testing.assert_close(dwconv(u, w), expected, rtol=0, atol=1e-14)


def _naive_attention(q, keys, values, visible_keys):
    """Per query: softmax(q.k / sqrt(C)) over the keys listed by visible_keys(i), looped in python."""
    # q (H, T, C); keys/values (H, S, C)
    out = torch.zeros_like(q)
    for h in range(q.shape[0]):
        for i in range(q.shape[1]):
            js = visible_keys(i)
            scores = torch.stack([q[h, i] @ keys[h, j] for j in js]) / math.sqrt(q.shape[-1])
            out[h, i] = sum(wj * values[h, j] for wj, j in zip(scores.softmax(0), js))
    return out


def test_attention_masks_match_explicit_key_lists() -> None:
    Tn, Pn, H, W = 6, 2, 2, 3
    cfg = make_cfg("mac", attention={"window": W, "persistent_tokens": Pn, "heads": H})
    p = layer_params(init_params(cfg), 0)
    gen = torch.Generator().manual_seed(6)
    u = torch.randn(1, Tn, 16, generator=gen, dtype=F64)
    hmem = torch.randn(1, Tn, 16, generator=gen, dtype=F64)
    pos = torch.arange(Tn)

    def heads(x: torch.Tensor) -> torch.Tensor:
        return split_heads(x, H)[0]  # (1, T, D) -> (H, T, C)

    def out_proj(o: torch.Tensor) -> torch.Tensor:
        return merge_heads(o[None]) @ p["attn_wo"]  # (H, T, C) -> (1, T, D)

    q = rope(heads(u @ p["attn_wq"]), pos)
    persistent = p["attn_persistent"][None]  # (1, P, D)
    pk, pv = heads(persistent @ p["attn_wk"]), heads(persistent @ p["attn_wv"])

    # SWA: keys [persistent ‖ u]; query i sees all P and u_j for i - W < j <= i
    keys = torch.cat([pk, rope(heads(u @ p["attn_wk"]), pos)], 1)
    values = torch.cat([pv, heads(u @ p["attn_wv"])], 1)

    def swa_keys(i: int) -> list[int]:
        return [*range(Pn), *(Pn + j for j in range(max(0, i - W + 1), i + 1))]

    want = out_proj(_naive_attention(q, keys, values, swa_keys))
    torch.testing.assert_close(swa(p, u, cfg), want, rtol=0, atol=1e-13)

    # MAC: keys [persistent ‖ h ‖ u], rope at local positions; query i sees all P and h_j, u_j for j <= i
    keys = torch.cat([pk, rope(heads(hmem @ p["attn_wk"]), pos), rope(heads(u @ p["attn_wk"]), pos)], 1)
    values = torch.cat([pv, heads(hmem @ p["attn_wv"]), heads(u @ p["attn_wv"])], 1)

    def mac_keys(i: int) -> list[int]:
        return [*range(Pn), *(Pn + j for j in range(i + 1)), *(Pn + Tn + j for j in range(i + 1))]

    want = out_proj(_naive_attention(q, keys, values, mac_keys))
    torch.testing.assert_close(mac_attention(p, u, hmem, cfg), want, rtol=0, atol=1e-13)
