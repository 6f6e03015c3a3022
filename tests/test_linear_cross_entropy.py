"""The fused linear cross-entropy pattern (passes/linear_cross_entropy.py) and its kernels.

(b) the op's reference semantics and VJP against torch's cross-entropy; (c) structure: the
loss of every block kind compiles to LINEAR_CROSS_ENTROPY(_BWD), rendered from
cross_entropy.py.jinja, and no planned buffer (nor the cpu kernel's scratch) holds more than
one [rows, vocab] tile of logits; (e) parity, float64: loss and gradients of every block kind
on the cpu target against tests/reference, with several row blocks and vocabulary tiles; the
interpreted triton target equals the cpu target; logits and logprobs (the same LM head) are
unchanged.
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
import torch.nn.functional as F

import tests.reference as R
from tests.helpers import BLOCKS, graphs_nested as _walk, plans_nested as _plans, tiny_spec, \
    tokens
from titanc.codegen.lower.dispatch import render_kernel
from titanc.compiler import compile_graphs
from titanc.ir import Builder, Graph, Op, interpret
from titanc.passes.autodiff import grad_graph
from titanc.passes.linear_cross_entropy import LinearCrossEntropy
from titanc.passes.buffer_plan import holds_logits
from titanc.runtime.targets import pattern_kernels
from titanc.runtime.targets.executor import ArenaExecutor
from titanc.runtime.targets.triton_executor import TritonExecutor

LCE = (Op.LINEAR_CROSS_ENTROPY, Op.LINEAR_CROSS_ENTROPY_BWD)


def _reference(spec, seed: int = 1):
    params = R.init_params(spec.model, seed=seed)
    toks = tokens(spec)
    leaf = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    loss = R.forward_loss(leaf, toks, spec.model)
    loss.backward()
    grads = {k: p.grad if p.grad is not None else torch.zeros_like(p) for k, p in leaf.items()}
    return params, toks, float(loss.detach()), grads


# --- the op ---------------------------------------------------------------------------------------

def _loss_graph(layout: str, rows: int = 6, d: int = 5, vocab: int = 11) -> Graph:
    b = Builder("lce")
    h = b.input("h", (1, rows, d), "f64")
    head = b.input("head", (vocab, d) if layout == "vd" else (d, vocab), "f64")
    tg = b.input("targets", (1, rows), "i64")
    z = b.einsum("btd,vd->btv" if layout == "vd" else "btd,dv->btv", h, head)
    m = z.amax((-1,), keepdim=True)
    lse = (z - m).exp().sum((-1,)).log() + m.reshape(1, rows)
    b.graph.set_outputs([("loss", (lse - b.take_along(z, tg)).mean((0, 1)).id)])
    return b.graph


@pytest.mark.parametrize("layout", ["vd", "dv"])
def test_op_and_its_vjp_match_torch_cross_entropy(layout: str) -> None:
    g = _loss_graph(layout)
    fused = LinearCrossEntropy(4)(g)
    assert [n.op for n in fused].count(Op.LINEAR_CROSS_ENTROPY) == 1
    assert not any(n.op is Op.EINSUM for n in fused)           # the logits are gone
    gen = torch.Generator().manual_seed(0)
    xs = {"h": torch.randn(1, 6, 5, generator=gen, dtype=torch.float64),
          "head": torch.randn(*g.node(g.inputs[1]).type.shape, generator=gen,
                              dtype=torch.float64),
          "targets": torch.randint(0, 11, (1, 6), generator=gen)}
    h, head = (xs[k].clone().requires_grad_(True) for k in ("h", "head"))
    logits = h[0] @ (head.t() if layout == "vd" else head)
    want = F.cross_entropy(logits, xs["targets"][0])
    want.backward()
    got = interpret(grad_graph(fused, ["h", "head"]), xs)
    assert abs(float(got["loss"]) - float(want)) < 1e-13
    torch.testing.assert_close(got["grad.h"], h.grad, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(got["grad.head"], head.grad, rtol=1e-12, atol=1e-14)


def test_pass_refuses_when_the_logits_are_read_elsewhere() -> None:
    g = _loss_graph("vd")
    z = next(n for n in g if n.op is Op.EINSUM)
    g.set_outputs([*g.outputs, ("logits", z.id)])
    assert LinearCrossEntropy(4)(g) is g


# --- structure ------------------------------------------------------------------------------------

@pytest.mark.parametrize("block", BLOCKS)
def test_loss_of_every_block_kind_is_the_fused_op(block: str) -> None:
    spec = tiny_spec(**{"model.block": block})
    c = compile_graphs(spec)
    V = spec.model.vocab_size
    for kind, want in (("forward", {"cross_entropy"}),
                       ("training", {"cross_entropy", "cross_entropy_bwd"})):
        cg = c.graphs[kind]
        assert not [n for g in _walk(cg.graph) for n in g if n.op is Op.TAKE_ALONG], kind
        families = set()
        for plan in _plans(cg.plan):
            g = plan.schedule.graph
            for k in plan.schedule.kernels:
                if any(g.node(n).op in LCE for n in k.nodes):
                    families.add(render_kernel(g, k, dtype="float64").family)
            for buf in plan.buffers:                           # no logits buffer at all
                assert not holds_logits(g, buf.value, V), (kind, buf)
        assert families == want, kind


def test_cpu_kernel_scratch_holds_one_logits_tile(monkeypatch) -> None:
    """The cpu kernels allocate one [chunk, VOCAB_TILE] logits tile (plus [chunk, d] and
    [VOCAB_TILE, d] products and row vectors), never [rows, vocab]: their scratch grows with
    the tile, not with the rows or the vocabulary."""
    spec = tiny_spec(**{"model.vocab_size": 96, "train.loss_chunk": 8, "model.block": "attn"})
    monkeypatch.setattr(pattern_kernels, "VOCAB_TILE", 16)
    c = compile_graphs(spec)
    rows, d = spec.train.batch_size * spec.model.seq_len, spec.model.d_model
    peak: dict[str, int] = {}
    real = pattern_kernels.tmp

    def spy(b, like, *shape):
        if len(shape) == 2 and shape[1] > 1:                   # a tile
            peak["tile"] = max(peak.get("tile", 0), shape[0] * shape[1])
            assert shape in ((8, 16), (8, d), (16, d)), shape
        return real(b, like, *shape)

    monkeypatch.setattr(pattern_kernels, "tmp", spy)
    for kind in ("forward", "training"):
        ArenaExecutor(c.plans[kind])
    assert 0 < peak["tile"] <= 16 * max(8, d) < rows * 96


# --- parity ---------------------------------------------------------------------------------------

# the head does not depend on the block: MAC tied and MAG untied (every block both ways in
# `make test-all`)
HEAD_CASES = [pytest.param(b, t, marks=[] if (b, t) in (("mac", True), ("mag", False))
                           else [pytest.mark.slow])
              for t in (True, False) for b in BLOCKS]


@pytest.mark.parametrize("block,tied", HEAD_CASES)
def test_cpu_target_matches_reference(block: str, tied: bool, monkeypatch) -> None:
    """Row blocks of 5 (ragged: 32 rows) and vocabulary tiles of 12 (ragged: 32 entries), so
    the online log-sum-exp and the tiled backward are exercised."""
    monkeypatch.setattr(pattern_kernels, "VOCAB_TILE", 12)
    spec = tiny_spec(**{"model.block": block, "model.tie_embeddings": tied,
                        "train.loss_chunk": 5})
    params, toks, ref, grads = _reference(spec)
    c = compile_graphs(spec)
    got = ArenaExecutor(c.plans["training"]).run({"tokens": toks, **params})
    assert abs(float(got["loss"]) - ref) < 1e-10
    for name, want in grads.items():
        torch.testing.assert_close(got[f"grad.{name}"], want, rtol=1e-8, atol=1e-12,
                                   msg=lambda m: f"grad of {name}: {m}")
    fwd = ArenaExecutor(c.plans["forward"]).run({"tokens": toks, **params})
    assert abs(float(fwd["loss"]) - ref) < 1e-10


@pytest.mark.parametrize("tied", [True, False])
def test_interpreted_triton_matches_cpu_target(tied: bool) -> None:
    spec = tiny_spec(**{"model.block": "attn", "model.tie_embeddings": tied,
                        "model.n_layers": 1})
    params, toks = R.init_params(spec.model, seed=2), tokens(spec, seed=1)
    c = compile_graphs(spec)
    for kind in ("forward", "training"):
        want = ArenaExecutor(c.plans[kind]).run({"tokens": toks, **params})
        got = TritonExecutor(c.plans[kind]).run({"tokens": toks, **params})
        for name, ref in want.items():
            torch.testing.assert_close(got[name], ref, rtol=1e-10, atol=1e-12,
                                       msg=lambda m: f"{kind} {name}: {m}")


def test_fused_and_chunked_loss_agree_and_logprobs_are_unchanged() -> None:
    """`compile.fused_loss: false` (the chunked-loss scan) gives the same loss and gradients;
    the logprobs graph (the same LM head, its own chunked scan) matches the logits'
    log-softmax at the targets."""
    spec = tiny_spec(**{"model.block": "mag"})
    params, toks = R.init_params(spec.model, seed=3), tokens(spec)
    fused = ArenaExecutor(compile_graphs(spec).plans["training"]).run({"tokens": toks, **params})
    chunked_spec = tiny_spec(**{"model.block": "mag", "compile.fused_loss": False})
    chunked_c = compile_graphs(chunked_spec)
    assert not any(n.op in LCE for n in chunked_c.graphs["training"].graph)
    chunked = ArenaExecutor(chunked_c.plans["training"]).run({"tokens": toks, **params})
    for name, ref in chunked.items():
        torch.testing.assert_close(fused[name], ref, rtol=1e-10, atol=1e-13)
    c = compile_graphs(spec)
    logits = ArenaExecutor(c.graph("logits").plan).run({"tokens": toks, **params})["logits"]
    lp = ArenaExecutor(c.graph("logprobs").plan).run({"tokens": toks, **params})
    want = torch.log_softmax(logits, -1).gather(-1, toks[:, 1:, None])[..., 0]
    (got,) = lp.values()
    torch.testing.assert_close(got.reshape(want.shape), want, rtol=1e-10, atol=1e-12)
