"""`memory.objective` (docs/semantics.md, "Inner objective"): huber and lp against the eager
reference (tests/reference/memory.py takes torch.func.grad of the declared objective), for
every memory block, on the IR interpreter and on both targets; finite differences of the
loss against its gradient; the memory diagnostics; a short training run on synthetic:recall.

Tolerances (float64): loss 1e-10 absolute, gradients rtol 1e-8 / atol 1e-12 (as
tests/test_parity.py); finite differences (central, step 1e-6) 1e-6 relative to the
directional derivative. huber_delta 0.25 sits near the median |M(k) − v| of these models at
initialisation (about half the residuals inside δ), so both branches are exercised.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Iterator

os.environ.setdefault("TRITON_INTERPRET", "1")  # read when kernels are decorated: set first

import pytest
import torch

import tests.reference as R
import titanc
from tests.helpers import MEMORY_BLOCKS, TINY, assert_decodes_like_forward, tiny_spec, tokens
from tests.reference.memory import gates, initial_state, objective, projections
from tests.reference.ops import layer_params, rmsnorm
from titanc.ir import Graph, Op, interpret
from titanc.model.decode import lower_write
from titanc.model.frontend import lower_forward
from titanc.passes.aggregate import aggregate
from titanc.passes.autodiff import grad_graph
from titanc.passes.canonicalize import canonicalize
from titanc.runtime.diagnostics.neural_memory import memory_stats

ROOT = Path(__file__).resolve().parent.parent
OBJECTIVES = {"huber": {"model.memory.objective": "huber", "model.memory.huber_delta": 0.25},
              "lp": {"model.memory.objective": "lp", "model.memory.lp_p": 1.5}}


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    n = torch.get_num_threads()
    torch.set_num_threads(1)           # tiny ops: one thread is fastest
    yield
    torch.set_num_threads(n)


def _spec(block: str, obj: str, **extra):
    return tiny_spec(**{"model.block": block, "model.n_layers": 1, **OBJECTIVES[obj], **extra})


def _reference(spec, params: dict[str, torch.Tensor], toks: torch.Tensor
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    leaf = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    loss = R.forward_loss(leaf, toks, spec.model)
    loss.backward()
    return loss.detach(), {k: p.grad if p.grad is not None else torch.zeros_like(p)
                           for k, p in leaf.items()}


def _assert_matches(loss: float, grads: dict[str, torch.Tensor], ref_loss: torch.Tensor,
                    ref_grads: dict[str, torch.Tensor]) -> None:
    assert abs(loss - float(ref_loss)) < 1e-10
    for name, want in ref_grads.items():
        torch.testing.assert_close(grads[name], want, rtol=1e-8, atol=1e-12,
                                   msg=lambda m: f"grad of {name}: {m}")


@pytest.mark.parametrize("obj", list(OBJECTIVES))
@pytest.mark.parametrize("block", MEMORY_BLOCKS)
def test_objective_matches_reference(block: str, obj: str) -> None:
    """Loss and every gradient of the lowered graph (interpreter) equal the reference's, and
    the objective is a different model from l2."""
    spec = _spec(block, obj)
    params = R.init_params(spec.model, seed=1)
    toks = tokens(spec)
    ref_loss, ref_grads = _reference(spec, params, toks)
    out = interpret(grad_graph(lower_forward(spec), list(params)), {"tokens": toks, **params})
    _assert_matches(float(out["loss"]), {k: out[f"grad.{k}"] for k in params}, ref_loss,
                    ref_grads)
    l2 = tiny_spec(**{"model.block": block, "model.n_layers": 1})
    other = float(interpret(lower_forward(l2), {"tokens": toks, **params})["loss"])
    assert abs(other - float(ref_loss)) > 1e-6


# lmm on both targets and MAC on the cpu target in the default tier; the other blocks, and the
# interpreted triton target (a few hundred interpreted launches each), in the slow tier
TARGET_CASES = [pytest.param(b, t, marks=[] if b == "lmm" or (b, t) == ("mac", "cpu")
                             else [pytest.mark.slow])
                for t in ("cpu", "triton") for b in MEMORY_BLOCKS]
SMALL = {"model.d_model": 8, "model.seq_len": 8, "model.vocab_size": 16, "model.ffn_hidden": 8,
         "train.batch_size": 1, "model.memory.heads": 1, "model.memory.chunk_size": 2,
         "model.attention.segment": 4, "model.attention.window": 4}


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning",
                            "ignore:divide by zero encountered:RuntimeWarning")
@pytest.mark.parametrize("block,target", TARGET_CASES)
def test_compiled_huber_matches_reference(block: str, target: str) -> None:
    """The compiled program (all passes: aggregate, fusion, the target's kernels) computes
    the reference's loss and gradients in float64, Huber on both targets."""
    if target == "triton":
        pytest.importorskip("triton")
    spec = _spec(block, "huber", **SMALL, **{"compile.target": target})
    prog = titanc.compile(spec)
    params = {k: v.detach().cpu().clone() for k, v in prog.parameters().items()}
    toks = torch.randint(0, 16, (1, 9), generator=torch.Generator().manual_seed(7))
    loss, grads = prog.grads(toks)
    ref_loss, ref_grads = _reference(prog.spec, params, toks)
    _assert_matches(loss, {k: v.cpu() for k, v in grads.items()}, ref_loss, ref_grads)


def _outer_products(g: Graph) -> int:
    """Per-token outer products (B, Nm, u, o, i) left in g and its scan bodies."""
    n = 0
    for node in g:
        if node.op is Op.SCAN:
            n += _outer_products(node.attr("body"))
        elif node.op is Op.EINSUM and node.type.rank == 5 and len(node.inputs) == 2:
            lhs, out = node.attr("spec").split("->")
            n += set(lhs.replace(",", "")) == set(out)
    return n


@pytest.mark.parametrize("obj", list(OBJECTIVES))
def test_aggregate_serves_the_objective(obj: str) -> None:
    """The write's per-token outer products, whatever ∂ℓ/∂ŷ feeds them, become one
    contraction each (passes/aggregate.py), in the training forward and the decode write."""
    spec = _spec("lmm", obj)
    for g in (lower_forward(spec), lower_write(spec, 2)):
        before = canonicalize(g)
        assert _outer_products(before) == spec.model.memory.depth   # one per layer (CSE)
        assert _outer_products(aggregate(before)) == 0


@pytest.mark.parametrize("obj", list(OBJECTIVES))
def test_gradient_matches_finite_differences(obj: str) -> None:
    """The outer gradient (through the inner gradient of the objective) against central
    differences of the loss along a random direction: all parameters at once, and the key
    projection and the memory's initial weights alone (they reach the loss only through the
    writes)."""
    spec = _spec("lmm", obj)
    params = R.init_params(spec.model, seed=2)
    toks = tokens(spec, seed=3)
    g = lower_forward(spec)
    out = interpret(grad_graph(g, list(params)), {"tokens": toks, **params})
    gen = torch.Generator().manual_seed(4)

    def loss(p: dict[str, torch.Tensor]) -> float:
        return float(interpret(g, {"tokens": toks, **p})["loss"])

    for names in (list(params), ["layers.mem_wk"], ["layers.mem_w1", "layers.mem_w2"]):
        d = {k: torch.randn(params[k].shape, generator=gen, dtype=torch.float64) for k in names}
        eps = 1e-6
        up = loss({**params, **{k: params[k] + eps * d[k] for k in names}})
        down = loss({**params, **{k: params[k] - eps * d[k] for k in names}})
        fd = (up - down) / (2 * eps)
        exact = sum(float((out[f"grad.{k}"] * d[k]).sum()) for k in names)
        assert abs(fd - exact) <= 1e-6 * max(abs(exact), 1e-3), (names, fd, exact)


def test_memory_stats_follow_the_objective() -> None:
    """The diagnostics' inner loss is the declared objective's: each chunk's loss before and
    after its write equals the float64 reference's huber loss (a 1-layer lmm)."""
    spec = _spec("lmm", "huber", **{"model.memory.lr_max": 2.0,     # residuals mostly past δ
                                    "model.memory.huber_delta": 0.05})
    prog = titanc.compile(spec)
    tok = tokens(spec)
    (layer,) = memory_stats(prog, tok)["layers"]
    cfg, rho = spec.model, objective(spec.model.memory)
    p = layer_params({k: v.double() for k, v in prog.parameters().items()}, 0)
    u = rmsnorm(prog.parameters()["embed"].double()[tok[:, :-1]], p["mem_norm"])
    _, k, v = projections(p, u, cfg)
    theta, eta, alpha = gates(p, u, cfg)
    W, S = initial_state(p, u.shape[0], cfg)
    b = cfg.memory.chunk_size
    for i, c0 in enumerate(range(0, cfg.seq_len, b)):
        sl = slice(c0, c0 + b)
        before = float(rho(R.mem_apply(W, k[:, :, sl]) - v[:, :, sl]).mean())
        l2_before = float((R.mem_apply(W, k[:, :, sl]) - v[:, :, sl]).pow(2).mean())
        g = R.inner_grads(W, k[:, :, sl], v[:, :, sl], rho)
        W, S = R.chunk_token_loop(W, S, g, theta[:, :, sl], eta[:, :, sl], alpha[:, :, sl])
        after = float(rho(R.mem_apply(W, k[:, :, sl]) - v[:, :, sl]).mean())
        assert layer["chunk_loss_before"][i] == pytest.approx(before, abs=1e-5)   # rounded
        assert layer["chunk_loss_after"][i] == pytest.approx(after, abs=1e-5)
        assert abs(layer["chunk_loss_before"][i] - l2_before) > 1e-3   # not l2's loss


def test_huber_trains_on_recall() -> None:
    """A short run of benchmarks/recall.py's MAC model with the Huber objective on
    synthetic:recall: the training loss goes down."""
    path = ROOT / "benchmarks" / "recall.py"
    module_spec = importlib.util.spec_from_file_location("recall_benchmark", path)
    bench = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(bench)
    prog = titanc.compile(bench.SPEC, **{"model.block": "mac", "compile.target": "cpu",
                                         "train.batch_size": 8, **OBJECTIVES["huber"]})
    task = bench.make_task(0)
    gen = torch.Generator().manual_seed(0)
    losses = [prog.train_step(task.batch(8, "train", gen)) for _ in range(20)]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.3, (first, last)


@pytest.mark.parametrize("block,obj", [("lmm", "huber"),
                                       pytest.param("mac", "lp", marks=pytest.mark.slow)])
def test_decoding_follows_the_objective(block: str, obj: str) -> None:
    """Prefill to mid-chunk, then decode token by token (the decode write is the objective's
    chunk write): every position's logits equal the reference's parallel forward, float64."""
    prog = titanc.compile(TINY, **{"model.block": block, "train.batch_size": 1,
                                   **OBJECTIVES[obj]})
    params = R.init_params(prog.spec.model, seed=3)
    prog.load_state_dict({f"param.{k}": v for k, v in params.items()}, strict=False)
    toks = tokens(prog.spec, 1, seed=2)
    assert_decodes_like_forward(prog, params, toks, 11)


@pytest.mark.parametrize("block,obj", [("lmm", "huber"), ("mac", "lp")])
def test_documents_follow_the_objective(block: str, obj: str) -> None:
    """Packed documents (`data.documents`: the write at a document start takes its gradient
    at W⁽⁰⁾, `chunk_update_docs`): masked loss and every gradient match the reference with
    starts before, at and inside chunks."""
    spec = _spec(block, obj, **{"data.documents": True})
    params = R.init_params(spec.model, seed=4)
    toks = tokens(spec, batch=2, seed=5)
    T = spec.model.seq_len
    doc = torch.zeros(2, T, dtype=torch.long)
    for row, starts in enumerate([[3, 8, 13], [5, 6]]):
        for s in starts:
            doc[row, s:] = s
    mask = torch.ones(2, T, dtype=torch.float64)
    mask[0, 7] = mask[1, 4] = 0.0                        # targets across a boundary
    leaf = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    logits = R.forward_logits(leaf, toks[:, :-1], spec.model, doc)
    ce = logits.logsumexp(-1) - logits.gather(-1, toks[:, 1:, None])[..., 0]
    ref = (ce * mask).sum() / mask.sum()
    ref.backward()
    out = interpret(grad_graph(lower_forward(spec), list(params)),
                    {"tokens": toks, "doc_start": doc.double(), "loss_mask": mask, **params})
    _assert_matches(float(out["loss"]), {k: out[f"grad.{k}"] for k in params}, ref.detach(),
                    {k: p.grad if p.grad is not None else torch.zeros_like(p)
                     for k, p in leaf.items()})
