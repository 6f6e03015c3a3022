"""The memory family's spec knobs (docs/semantics.md, "Memory family"; issue 52): tier (b)/(e)
float64 parity of the IR (reference interpreter) with the eager reference, loss and every
gradient, and of token-by-token decoding with the parallel forward; tier (d) their refusals.

Each knob is tested where it changes the model: `memory.read: after_write`,
`memory.momentum_form: none`, `memory.fixed`, `memory.decay_order: before_grad`,
`memory.decay_form: mamba2`, `memory.value_width`, `memory.inner: ln_residual` and
`memory.post_norm`."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # read when kernels are decorated: set first

import pytest  # noqa: E402
import torch  # noqa: E402

import tests.reference as R  # noqa: E402
import titanc  # noqa: E402
from tests.helpers import (TINY, assert_decodes_like_forward,  # noqa: E402
                           assert_gradients_match_reference, tiny_spec, tokens)
from titanc.errors import SpecError  # noqa: E402
from titanc.ir import interpret  # noqa: E402
from titanc.model.frontend import lower_forward  # noqa: E402
from titanc.runtime.diagnostics.neural_memory import memory_stats  # noqa: E402

DELTANET = {"momentum_form": "none", "fixed": ["alpha"], "decay": 0.0, "read": "after_write",
            "chunk_size": 1, "depth": 1}
GATED = {"momentum_form": "none", "decay_order": "before_grad", "decay_form": "mamba2",
         "read": "after_write", "chunk_size": 1, "depth": 1}
TITANS = {"inner": "ln_residual", "post_norm": True, "read": "after_write", "chunk_size": 1,
          "depth": 1}                                  # examples/titans_fla.yaml's memory

CASES = [
    ("lmm", DELTANET),
    ("lmm", {**DELTANET, "chunk_size": 4, "read": "before_write"}),     # exact chunks (WY)
    ("lmm", {**GATED, "value_width": 16}),
    ("mal", {"momentum_form": "none"}),                      # chunked, depth 2
    ("mag", {"read": "after_write", "chunk_size": 1}),       # with momentum
    ("mac", {"decay_order": "before_grad", "chunk_size": 1, "fixed": ["eta", "theta"]}),
    ("mac", {**GATED, "chunk_size": 4}),                                  # exact chunks (WY)
    ("lmm", {"decay_form": "mamba2", "momentum_form": "ema", "value_width": 4, "fixed": ["theta"]}),
    ("lmm", TITANS),
    ("mal", {"inner": "ln_residual", "depth": 1, "momentum_form": "none"}),   # chunks of 4
    ("mag", {"inner": "ln_residual", "depth": 1, "objective": "huber"}),       # with momentum
]


SMALL = {"model.n_layers": 1, "model.seq_len": 8, "model.attention.segment": 4,
         "model.attention.window": 4, "train.batch_size": 1}   # a cheap model: the knobs are per layer


def _spec(block: str, options: dict):
    return tiny_spec(**{"model.block": block, **SMALL,
                        **{f"model.memory.{k}": v for k, v in options.items()}})


@pytest.mark.parametrize("block,options", CASES)
def test_knobs_match_reference(block: str, options: dict) -> None:
    """Loss to 1e-10 and every gradient to rtol 1e-8 against the eager reference, and the
    knobs make a different model from the defaults."""
    spec = _spec(block, options)
    params = R.init_params(spec.model, seed=6)
    toks = tokens(spec, seed=7)
    ref = assert_gradients_match_reference(spec, params, toks)
    plain = {k: v for k, v in options.items() if k in ("chunk_size", "depth")}
    base = _spec(block, plain)
    base_params = R.init_params(base.model, seed=6)
    other = float(R.forward_loss(base_params, toks, base.model))
    assert abs(other - float(ref)) > 1e-6


@pytest.mark.parametrize("options,message", [
    ({"read": "after_write"}, "model.memory.read: after_write needs model.memory.chunk_size: 1 "
                              "(is 4) unless the memory is linear (depth 1, momentum_form none, "
                              "objective l2: its chunks are exact)"),
    ({"decay_order": "before_grad", "momentum_form": "none"},
     "model.memory.decay_order: before_grad needs model.memory.chunk_size: 1 (is 4) unless the "
     "memory is linear (depth 1, momentum_form none, objective l2: its chunks are exact)"),
    ({"fixed": ["alpha", "alpha"]}, "model.memory.fixed: ['alpha', 'alpha'] names a gate twice"),
    ({"fixed": ["beta"]}, "model.memory.fixed[0]: 'beta' must be one of theta, eta, alpha"),
    ({"fixed": ["eta"], "momentum_form": "none"},
     "model.memory.fixed: eta does not exist with memory.momentum_form: none (no momentum); "
     "remove it"),
    ({"fixed": ["theta"], "adaptive": False},
     "model.memory.fixed: every gate is fixed with memory.adaptive: false; remove "
     "memory.fixed or set memory.adaptive: true"),
    ({"decay_form": "mamba2", "fixed": ["alpha"]},
     "model.memory.decay_form: mamba2 parameterises a learned α; it needs memory.adaptive: "
     "true and alpha not in memory.fixed"),
    ({"inner": "ln_residual"},
     "model.memory.inner: ln_residual (x + w ⊙ LN(W x) + b) needs memory.depth: 1, values of "
     "the key width and block lmm, mag or mal (is depth 2, value width 8, key width 8, "
     "block lmm)"),
    ({"post_norm": True}, "model.memory.post_norm: true uses the inner model's w, b; it needs "
                          "model.memory.inner: ln_residual"),
])
def test_refusals(options: dict, message: str) -> None:
    with pytest.raises(SpecError) as e:
        _spec("lmm", options)
    assert str(e.value) == message


def test_value_width_refused_for_mac_and_documents_refused() -> None:
    with pytest.raises(SpecError, match="model.memory.value_width: 8 applies to blocks lmm"):
        _spec("mac", {"value_width": 8})
    with pytest.raises(SpecError, match="data.documents: true is not implemented with "
                                        "model.memory.momentum_form: none"):
        tiny_spec(**{"model.memory.momentum_form": "none", "data.documents": True})


@pytest.mark.parametrize("block,options", [
    ("lmm", {**GATED, "value_width": 16, "chunk_size": 4}),
    ("lmm", TITANS),
    ("mal", {"inner": "ln_residual", "depth": 1, "momentum_form": "none", "post_norm": True}),
])
def test_decoding_matches_parallel_forward(block: str, options: dict) -> None:
    """Prefill then token-by-token decoding equals the reference's parallel forward (float64):
    the step reads after its own write where `read: after_write` says so, a memory without
    momentum keeps no S state, and the write graph (chunks of 4 for mal) fits the inner
    model `memory.inner` names."""
    over = {"model.block": block, **SMALL,
            **{f"model.memory.{k}": v for k, v in options.items()}}
    prog = titanc.compile(TINY, **over)
    params = R.init_params(prog.spec.model, seed=3)
    prog.load_state_dict({f"param.{k}": v for k, v in params.items()}, strict=False)
    toks = tokens(prog.spec, 1, seed=2)
    st = assert_decodes_like_forward(prog, params, toks, 5)
    assert ("S1" in st.tensors) == (options.get("momentum_form") != "none")
    layer = memory_stats(prog, toks)["layers"][0]           # the diagnostics without S or η
    no_momentum = options.get("momentum_form") == "none"
    assert (layer["s_norm"] == 0.0 and layer["eta"] == 0.0) == no_momentum
    assert layer["inner_loss_after"] < layer["inner_loss_before"]


@pytest.mark.slow   # the interpreted triton target: about 100 s for the two on 2 CPU cores
@pytest.mark.parametrize("block,options", [
    ("lmm", {**GATED, "value_width": 16, "chunk_size": 4}),
    ("mal", {"momentum_form": "none"}),
    ("lmm", {"inner": "ln_residual", "post_norm": True, "depth": 1}),
])
def test_targets_agree(block: str, options: dict) -> None:
    """The cpu and the (interpreted) triton target compute the reference's loss and the same
    gradients (float64, 1e-10): Gated DeltaNet's knobs in exact chunks of 4 (the WY form), a
    chunked depth-2 write without momentum (its aggregated contraction), and fla's Titans
    inner model and post-norm in chunks of 4 with momentum."""
    over = {"model.block": block, **SMALL, **{f"model.memory.{k}": v for k, v in options.items()}}
    progs = [titanc.compile(TINY, **over, **{"compile.target": t}) for t in ("cpu", "triton")]
    params = R.init_params(progs[0].spec.model, seed=4)
    toks = tokens(progs[0].spec, seed=5)
    ref = float(R.forward_loss(params, toks, progs[0].spec.model))
    got = []
    for prog in progs:
        prog.load_state_dict({f"param.{k}": v for k, v in params.items()}, strict=False)
        got.append(prog.grads(toks))
    for loss, _ in got:
        assert abs(loss - ref) < 1e-10
    for k, g in got[0][1].items():
        torch.testing.assert_close(got[1][1][k], g, rtol=1e-10, atol=1e-10,
                                   msg=lambda m: f"grad of {k}: {m}")


@pytest.mark.parametrize("options", [DELTANET, GATED])
def test_chunk_size_is_a_speed_knob_for_linear_memories(options: dict) -> None:
    """A linear memory (depth 1, no momentum, l2) is the token-by-token memory at every chunk
    size (the exact WY chunk): the loss at chunks of 1, 4 and 8 tokens agrees to 1e-12."""
    losses = []
    for chunk in (1, 4, 8):
        spec = _spec("lmm", {**options, "chunk_size": chunk})
        params = R.init_params(spec.model, seed=8)
        losses.append(float(interpret(lower_forward(spec),
                                      {"tokens": tokens(spec, seed=9), **params})["loss"]))
    assert max(losses) - min(losses) < 1e-12
