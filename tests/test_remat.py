"""Remat policies and the chunked loss change memory, never values (float64, 1e-10)."""
from __future__ import annotations

import pytest
import torch

import tests.reference as R
from tests.helpers import BLOCKS, tiny_spec, tokens
from titanc.compiler import compile_graphs
from titanc.ir import Graph, Op, interpret, largest_tensor_bytes
from titanc.passes.chunked_loss import ChunkedLoss
from titanc.passes.remat import Policy, mincut_saves, saved_bytes
from titanc.model.frontend import lower_forward

SETTINGS = [
    {"train.remat": "none", "train.loss_chunk": 0},
    {"train.remat": "per_layer", "train.loss_chunk": 0},
    {"train.remat": "per_layer", "train.loss_chunk": 8},
    {"train.remat": "per_segment", "train.remat_rows": 1, "train.loss_chunk": 8},
    {"train.remat": "budget", "train.remat_budget_mb": 0.3, "train.loss_chunk": 5},
    {"train.remat": "budget", "train.remat_budget_mb": 0.001, "train.loss_chunk": 32},
]


# attn in `make test`, the rest slow: MAC's policies are checked in the fast tier by
# test_linear_cross_entropy's parity (the default per_layer, loss and every gradient against
# the float64 reference), test_remat_segment (per_segment against no remat) and
# test_remat_group (groups against per_layer and per_segment)
@pytest.mark.parametrize("block", [b if b == "attn" else pytest.param(b, marks=pytest.mark.slow)
                                   for b in BLOCKS])
def test_loss_and_gradients_identical_across_policies(block: str) -> None:
    base = {"model.block": block, "model.seq_len": 32, "model.memory.chunk_size": 2,
            "model.attention.segment": 16}
    results = []
    for extra in SETTINGS:
        spec = tiny_spec(**base, **extra)
        params = R.init_params(spec.model, seed=7)
        out = interpret(compile_graphs(spec).grad, {"tokens": tokens(spec), **params})
        results.append(out)
    for other in results[1:]:
        for k, v in results[0].items():
            torch.testing.assert_close(other[k], v, rtol=1e-10, atol=1e-12)


def test_budget_picks_policies_by_size() -> None:
    spec = tiny_spec(**{"model.block": "mag"})
    fwd = compile_graphs(spec).forward
    sizes = {m: saved_bytes(fwd, p) for m, p in [
        ("save_all", Policy("save_all")), ("mincut", Policy("mincut", True)),
        ("mincut_all", Policy("mincut", False)), ("recompute", Policy("recompute"))]}
    assert sizes["save_all"] > sizes["mincut"] >= sizes["mincut_all"] > sizes["recompute"]
    for budget, want in [(1e9, "save_all"), (sizes["mincut"] / 2**20, "mincut"),
                         (1e-6, "recompute")]:
        c = compile_graphs(tiny_spec(**{"model.block": "mag", "train.remat": "budget",
                                        "train.remat_budget_mb": budget}))
        assert c.policy.mode == want


def test_mincut_keeps_matmuls_unless_allowed() -> None:
    spec = tiny_spec(**{"model.block": "attn"})
    fwd = compile_graphs(spec).forward
    layer = next(n.attr("body") for n in fwd if n.op is Op.SCAN)
    saved = mincut_saves(layer, ban_matmul=True)
    # every einsum whose result some VJP needs is either saved or feeds only saved values
    assert any(layer.node(i).op is Op.EINSUM for i in saved)
    assert len(mincut_saves(layer, ban_matmul=False)) >= 1


def test_chunked_loss_bounds_logits() -> None:
    spec = tiny_spec(**{"model.block": "attn", "model.vocab_size": 512,
                        "model.attention.persistent_tokens": 0})
    g = lower_forward(spec)
    chunked = ChunkedLoss(4)(g)
    biggest = max(n.type.numel for n in _walk(chunked) if not isinstance(n.type, tuple)
                  and n.type.shape and n.type.shape[-1] == 512 and n.op is not Op.INPUT)
    assert biggest == 4 * 512
    params = R.init_params(spec.model, seed=1)
    ins = {"tokens": tokens(spec), **params}
    assert abs(float(interpret(g, ins)["loss"] - interpret(chunked, ins)["loss"])) < 1e-12


def _walk(g: Graph):
    for n in g:
        yield n
        if n.op is Op.SCAN:
            yield from _walk(n.attr("body"))


def _forward_chunk_scans(g: Graph) -> int:
    """Forward memory chunk scans in g and every body nested in it (backward scans excluded)."""
    n = 0
    for node in g:
        if node.op is Op.SCAN:
            body = node.attr("body")
            n += node.attr("role") == "memory" and not body.name.endswith("_bwd")
            n += _forward_chunk_scans(body)
    return n


@pytest.mark.parametrize("block", ["mac", "lmm"])
def test_per_layer_runs_each_layer_once_more_in_the_backward(block: str) -> None:
    """per_layer's backward re-runs a layer's forward once and saves, in that re-run, what the
    scans nested in it (a MAC layer's segments, the memory's chunks) need for their own
    backward: the chunk recurrence's forward appears twice in the training graph (the
    forward, the re-run), not a third time inside the segment backward; the values are those
    of the policy that re-runs every nested body (float64, 1e-10)."""
    from titanc.passes.autodiff import grad_graph
    spec = tiny_spec(**{"model.block": block, "model.seq_len": 32, "model.memory.chunk_size": 2,
                        "model.attention.segment": 16, "train.loss_chunk": 0})
    c = compile_graphs(spec)
    assert c.policy == Policy("recompute", replay="mincut")
    fwd = c.graph("forward").graph
    wrt = [p.name for p in c.params]
    once = grad_graph(fwd, wrt, policy=c.policy)
    thrice = grad_graph(fwd, wrt, policy=Policy("recompute"))
    assert _forward_chunk_scans(once) == 2
    assert _forward_chunk_scans(thrice) == (3 if block == "mac" else 2)
    feed = {"tokens": tokens(spec), **R.init_params(spec.model, seed=3)}
    a, b = interpret(once, feed), interpret(thrice, feed)
    for k, v in b.items():
        torch.testing.assert_close(a[k], v, rtol=1e-10, atol=1e-12)
