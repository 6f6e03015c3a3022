"""Tier (e)/(b): the IR (reference interpreter) computes exactly the eager reference model.

Forward loss to 1e-10 and every gradient to rtol 1e-8, float64, identical parameters, for
every block kind and chunk sizes 1, interior and the whole sequence (or segment).
"""
from __future__ import annotations

import pytest

import tests.reference as R
from tests.helpers import BLOCKS, assert_gradients_match_reference, tiny_spec, tokens
from titanc.model.frontend import lower_forward
from titanc.ir import interpret


def _cases():
    for block in BLOCKS:
        whole = 8 if block == "mac" else 16          # mac chunks live inside 8-token segments
        for chunk in (1, 4, whole):
            yield block, chunk


@pytest.mark.parametrize("block,chunk", list(_cases()))
def test_forward_and_gradients_match_reference(block: str, chunk: int) -> None:
    spec = tiny_spec(**{"model.block": block, "model.memory.chunk_size": chunk})
    params = R.init_params(spec.model, seed=1)
    toks = tokens(spec)
    ref_loss = assert_gradients_match_reference(spec, params, toks)
    g = lower_forward(spec)
    assert abs(float(interpret(g, {"tokens": toks, **params})["loss"]) - float(ref_loss)) < 1e-10


def test_chunk_size_changes_the_model() -> None:
    """Guard against a parity test that passes because memory does nothing."""
    losses = []
    for chunk in (1, 16):
        spec = tiny_spec(**{"model.memory.chunk_size": chunk})
        params = R.init_params(spec.model, seed=1)
        losses.append(float(interpret(lower_forward(spec), {"tokens": tokens(spec), **params})["loss"]))
    assert abs(losses[0] - losses[1]) > 1e-4


@pytest.mark.parametrize("block", ["lmm", "mac"])
def test_non_adaptive_and_depth_one_match(block: str) -> None:
    spec = tiny_spec(**{"model.block": block, "model.memory.adaptive": False,
                        "model.memory.depth": 1, "model.memory.output_gate": False,
                        "model.tie_embeddings": False, "model.attention.persistent_tokens": 0})
    params = R.init_params(spec.model, seed=2)
    toks = tokens(spec, seed=3)
    ref = float(R.forward_loss(params, toks, spec.model))
    got = float(interpret(lower_forward(spec), {"tokens": toks, **params})["loss"])
    assert abs(got - ref) < 1e-10


@pytest.mark.parametrize("block", ["lmm", "mac", "mag"])
def test_qk_activation_none_matches(block: str) -> None:
    """`memory.qk_activation: none` (q, k = l2norm(dwconv(u W)), no silu): loss and gradients
    match the reference, and it is a different model from the silu default."""
    spec = tiny_spec(**{"model.block": block, "model.memory.qk_activation": "none"})
    params = R.init_params(spec.model, seed=4)
    toks = tokens(spec, seed=5)
    ref = assert_gradients_match_reference(spec, params, toks)
    silu = tiny_spec(**{"model.block": block})
    other = float(interpret(lower_forward(silu), {"tokens": toks, **params})["loss"])
    assert abs(other - float(ref)) > 1e-6


@pytest.mark.parametrize("block,adaptive,options", [
    ("lmm", True, {"momentum_form": "ema"}), ("mal", True, {"momentum_form": "ema"}),
    ("lmm", False, {"momentum_form": "ema"}), ("lmm", True, {"decay_max": 0.2}),
    ("mag", True, {"momentum_form": "ema", "decay_max": 0.2})])
def test_write_options_match(block: str, adaptive: bool, options: dict) -> None:
    """`memory.momentum_form: ema` (S_t = η S_{t-1} - (1 - η) θ g_t) and `memory.decay_max`
    (α = decay_max σ(·)): loss and gradients match the reference in float64, adaptive gates
    or constants, and each is a different model from the defaults."""
    over = {"model.block": block, "model.memory.adaptive": adaptive}
    spec = tiny_spec(**over, **{f"model.memory.{k}": v for k, v in options.items()})
    params = R.init_params(spec.model, seed=6)
    toks = tokens(spec, seed=7)
    ref = assert_gradients_match_reference(spec, params, toks)
    default = tiny_spec(**over)
    other = float(interpret(lower_forward(default), {"tokens": toks, **params})["loss"])
    assert abs(other - float(ref)) > 1e-6


@pytest.mark.parametrize("block,options", [
    ("mac", {"mac_write": "attention_norm"}),
    ("mac", {"mac_write": "attention_norm", "mac_read": "residual"}),
    ("mac", {"mac_write": "input", "mac_read": "context"}),
    ("mac", {"mac_write": "attention", "mac_read": "residual"}),
    ("mac", {"mac_write": "input", "mac_read": "residual"}),
    ("mac", {"gate": "attention"}),
    ("mac", {"mac_write": "input", "gate": "attention"}),
    ("mag", {"gate": "attention"})])
def test_block_options_match(block: str, options: dict[str, str]) -> None:
    """The options that depart from the paper's block (docs/semantics.md): mac's
    `memory.mac_write: attention_norm` (the memory written with rmsnorm(ỹ, mac_norm)) and
    `input` (written with u_s), and `memory.mac_read: residual`
    (the segment-start read h also on the output), and `memory.gate: attention` (mac, mag:
    the attention output's σ gates the memory's read): loss and gradients match the reference, and each
    is a different model from the default."""
    spec = tiny_spec(**{"model.block": block,
                        **{f"model.memory.{k}": v for k, v in options.items()}})
    params = R.init_params(spec.model, seed=6)
    toks = tokens(spec, seed=7)
    ref = assert_gradients_match_reference(spec, params, toks)
    default = tiny_spec(**{"model.block": block})
    pp = R.init_params(default.model, seed=6)
    other = float(interpret(lower_forward(default), {"tokens": toks, **pp})["loss"])
    assert abs(other - float(ref)) > 1e-6
