"""The flash-attention pattern pass (passes/flash_attention.py) and its kernels.

(c) structure: the attention of every block kind compiles to the ATTENTION pattern op, whose
kernels render the flash templates, and no plan of any example holds a [B, H, Tq, Tk] buffer;
(e) parity, float64: the cpu target, the interpreted triton target and the reference on the
direct (unrewritten) graph agree on loss and gradients, for sliding windows smaller than,
equal to and larger than the segment / sequence, 0 and 4 persistent tokens, and MAC's
[persistent ‖ h ‖ u] keys; the whole model on the cpu target matches tests/reference.
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path

import pytest
import torch

import tests.reference as R
from tests.helpers import graphs_nested as _walk, plans_nested as _plans, tiny_spec, tokens
from titanc.model.attention import mac_attention, swa
from titanc.codegen.lower.dispatch import render_kernel
from titanc.codegen.render import load_module
from titanc.compiler import SHARED, compile_graphs
from titanc.model.frontend import lower_forward
from titanc.ir import Builder, Graph, Op, interpret
from titanc.ir.types import DTYPES
from titanc.passes.autodiff import grad_graph
from titanc.passes.canonicalize import Canonicalize
from titanc.passes.flash_attention import FlashAttention
from titanc.passes.fusion import fuse
from titanc.ir.buffer_plan import BufferPlan
from titanc.passes.buffer_plan import plan_buffers
from titanc.passes.precision import MixedPrecision
from titanc.ir.schedule import verify_schedule
from titanc.runtime.targets.executor import ArenaExecutor
from titanc.runtime.targets.triton_executor import TritonExecutor
from titanc.model.spec import load_spec

ROOT = Path(__file__).resolve().parent.parent
ATTENTION_BLOCKS = ["attn", "mag", "mal", "mac"]


def _is_scores(n) -> bool:
    return n.op is Op.EINSUM and n.attr("spec") in ("bhqe,bhke->bhqk", "bhqk,bhke->bhqe")


# --- structure ----------------------------------------------------------------------------------

@pytest.mark.parametrize("block", ATTENTION_BLOCKS)
def test_attention_of_every_block_kind_compiles_to_the_flash_template(block: str) -> None:
    c = compile_graphs(tiny_spec(**{"model.block": block}))
    direct = [n for g in _walk(lower_forward(c.spec)) for n in g if _is_scores(n)]
    assert direct                                      # the frontend emits the direct form
    families: dict[str, set[str]] = {}
    for kind in ("forward", "training"):
        cg = c.graphs[kind]
        assert not [n for g in _walk(cg.graph) for n in g if _is_scores(n)], kind
        for plan in _plans(cg.plan):
            g = plan.schedule.graph
            for k in plan.schedule.kernels:
                if any(g.node(n).op in (Op.ATTENTION, Op.ATTENTION_BWD) for n in k.nodes):
                    code = render_kernel(g, k, dtype="float64")
                    families.setdefault(kind, set()).add(code.family)
    assert families["forward"] == {"attention_fwd"}
    assert families["training"] == {"attention_fwd", "attention_bwd"}


@pytest.mark.parametrize("example", ["tiny", "large_125m", *(pytest.param(e, marks=pytest.mark.slow)
                                                 for e in ("tiny_attn", "tiny_mag", "tiny_mal"))])
def test_no_scores_buffer_in_the_plans_of_the_examples(example: str) -> None:
    spec = load_spec(ROOT / "examples" / f"{example}.yaml")
    c = compile_graphs(spec, verify_each=False)
    a = spec.model.attention
    B, H = spec.train.batch_size, a.heads
    for kind in ("forward", "training"):
        shapes = {(B, H) + n.type[0].shape[2:3] + (sum(x[1] for x in n.attr("groups")),)
                  for g in _walk(c.graphs[kind].graph) for n in g if n.op is Op.ATTENTION}
        assert shapes, f"{kind}: no ATTENTION"
        for plan in _plans(c.graphs[kind].plan):
            g = plan.schedule.graph
            for buf in plan.buffers:
                if buf.kind != "workspace":
                    assert g.node(buf.value).type.shape not in shapes, (kind, buf)


def test_pass_refuses_when_the_probabilities_are_read_elsewhere() -> None:
    b = Builder("t")
    q, k, v = (b.input(n, (1, 2, 4, 8), "f64") for n in "qkv")
    s = b.einsum("bhqe,bhke->bhqk", q, k) * 0.5
    e = (s - s.amax((-1,), keepdim=True)).exp()
    p = e / e.sum((-1,), keepdim=True)
    o = b.einsum("bhqk,bhke->bhqe", p, v)
    b.graph.set_outputs([("o", o.id), ("p", p.id)])
    assert not any(n.op is Op.ATTENTION for n in FlashAttention()(b.graph))
    b.graph.set_outputs([("o", o.id)])
    got = FlashAttention()(b.graph)
    assert [n.op for n in got].count(Op.ATTENTION) == 1
    assert not any(_is_scores(n) for n in got)
    xs = {n: torch.randn(1, 2, 4, 8, dtype=torch.float64) for n in "qkv"}
    torch.testing.assert_close(interpret(got, xs)["o"], interpret(b.graph, xs)["o"],
                               rtol=1e-12, atol=1e-12)


# --- parity of the attention subgraph: cpu target, interpreted triton, reference ----------------

def _attention_graph(kind: str, T: int, window: int, P: int, B: int = 2, D: int = 16,
                     H: int = 2, dtype: str = "f64") -> tuple[Graph, dict[str, torch.Tensor]]:
    """loss = Σ w ⊙ attention(u): SWA over T tokens, or MAC over [P ‖ h ‖ u] of T tokens."""
    b = Builder("attention_test")
    gen = torch.Generator().manual_seed(T * 100 + window + P)
    names = ["u", "attn_wq", "attn_wk", "attn_wv", "attn_wo"]
    shapes = {"u": (B, T, D), "h": (B, T, D), "attn_persistent": (P, D), "w": (B, T, D)}
    if kind == "mac":
        names.append("h")
    if P:
        names.append("attn_persistent")
    vals = {n: b.input(n, shapes.get(n, (D, D)), dtype) for n in names}
    u = vals.pop("u")
    if kind == "mac":
        out = mac_attention(b, u, vals.pop("h"), vals, H)
    else:
        out = swa(b, u, vals, H, window)
    w = b.input("w", out.shape, dtype)
    b.graph.set_outputs([("loss", (out * w).sum((0, 1, 2)).id)])
    inputs = {n: (torch.randn(*shapes.get(n, (D, D)), generator=gen, dtype=torch.float64) / 2)
              .to(DTYPES[dtype]) for n in names + ["w"]}
    return b.graph, inputs


def _compiled(g: Graph, wrt: list[str], bf16: bool = False) -> BufferPlan:
    g = FlashAttention()(Canonicalize()(g))
    if bf16:
        g = MixedPrecision()(g)
    assert [n.op for n in g].count(Op.ATTENTION) == 1
    gg = grad_graph(g, wrt)
    for p in SHARED:
        gg = p(gg)
    assert [n.op for n in gg].count(Op.ATTENTION_BWD) == 1
    assert not any(_is_scores(n) for n in gg)
    return plan_buffers(verify_schedule(fuse(gg)), set())


# the last four in `make test-all` (longer sequences of shapes the others cover)
CASES = [("swa", 16, 4, 0), ("swa", 16, 4, 4), ("swa", 16, 16, 4), ("swa", 16, 24, 0),
         ("swa", 80, 24, 4), ("mac", 8, 0, 0), ("mac", 8, 0, 4),
         *(pytest.param(*c, marks=pytest.mark.slow) for c in (
             ("swa", 80, 100, 0), ("mac", 80, 0, 4), ("swa", 200, 24, 4), ("mac", 136, 0, 4)))]


@pytest.mark.parametrize("kind,T,window,P", CASES)
def test_attention_targets_match_reference(kind: str, T: int, window: int, P: int) -> None:
    g, inputs = _attention_graph(kind, T, window, P)
    wrt = [n for n in g.input_names() if n != "w"]
    want = interpret(grad_graph(g, wrt), inputs)       # the direct form, float64
    plan = _compiled(g, wrt)
    for target, ex in (("cpu", ArenaExecutor(plan)), ("triton", TritonExecutor(plan))):
        got = ex.run(inputs)
        for name, ref in want.items():
            torch.testing.assert_close(got[name], ref, rtol=1e-9, atol=1e-11,
                                       msg=lambda m: f"{target}: {name}: {m}")


def test_exact_wide_heads_take_small_query_blocks_on_8_warps() -> None:
    """Exact (FMA) dots: on CUDA the forward takes 32 x 32 blocks at every head width (at
    64 x 64 on 4 warps ptxas spilled 34 KB per thread at width 64, and took 3x the compile
    time at width 16; tests/test_aot.py checks the compile), the interpreter 64 x 64; a wide
    head runs both templates on 8 warps, a narrow one on 4. The wide head gives the
    reference's values; a tf32 forward keeps 64 x 64 on CUDA."""
    sources = {}
    for D, T in ((128, 40), (16, 8)):                       # head_dim 64 and 8
        g, inputs = _attention_graph("mac", T, 0, 4, B=1, D=D)
        wrt = [n for n in g.input_names() if n != "w"]
        plan = _compiled(g, wrt)
        fams = {}
        for k in plan.schedule.kernels:
            if k.category == "template":
                code = render_kernel(plan.schedule.graph, k, dtype="float64")
                fams[code.family] = code.source
        sources[D] = fams
        if D == 128:
            want = interpret(grad_graph(g, wrt), inputs)
            got = TritonExecutor(plan).run(inputs)
            for name, ref in want.items():
                torch.testing.assert_close(got[name], ref, rtol=1e-9, atol=1e-11)
    wide, narrow = sources[128], sources[16]
    for D, src in sources.items():
        fwd = load_module(src["attention_fwd"], f"attention_fwd_blocks_{D}", interpret=True)
        assert fwd.BLOCKS[False] == (64, 64)
        assert fwd.cuda_constexprs(90) == {"BLOCK_M": 32, "BLOCK_N": 32}
    for fam in ("attention_fwd", "attention_bwd"):
        assert "num_warps=8" in wide[fam] and "num_warps=4" in narrow[fam], fam
    g, _ = _attention_graph("mac", 8, 0, 4, B=1, D=16)
    plan = _compiled(g, [n for n in g.input_names() if n != "w"])
    tf32 = {c.family: c.source for c in (
        render_kernel(plan.schedule.graph, k, dtype="float32", allow_tf32=True)
        for k in plan.schedule.kernels if k.category == "template")}
    fwd = load_module(tf32["attention_fwd"], "attention_fwd_blocks_tf32", interpret=True)
    assert fwd.cuda_constexprs(90) == {"BLOCK_M": 64, "BLOCK_N": 64}


def test_cpu_attention_skips_key_blocks_outside_the_window() -> None:
    """The blocked loop computes only the key blocks a query block can see: causal blocks
    after its last query and window blocks before its first are never computed."""
    from titanc.runtime.targets.attention_kernels import BLOCK_K, BLOCK_Q, key_runs
    T, W, P = 512, 64, 4
    a = {"n_q": T, "q_start": 0, "groups": (("all", P, None), ("causal", T, W))}
    n_k, computed = P + T, 0
    for i0 in range(0, T, BLOCK_Q):
        runs = key_runs(a, i0, i0 + BLOCK_Q)           # (group, lo, hi), keys of the group
        assert runs[0] == (0, 0, P)                    # the persistent tokens: always seen
        for grp, lo, hi in runs:                       # every visible key is inside a run
            length = a["groups"][grp][1]
            assert lo % BLOCK_K == 0 and (hi % BLOCK_K == 0 or hi == length)
        seen = torch.zeros(n_k, dtype=torch.bool)
        for grp, lo, hi in runs:
            at = P if grp else 0
            seen[at + lo:at + hi] = True
        for p in range(i0, i0 + BLOCK_Q):             # visible: persistent, p - W < j <= p
            assert bool(seen[:P].all()) and bool(seen[P + max(0, p - W + 1):P + p + 1].all())
        computed += sum(hi - lo for _, lo, hi in runs)
        assert sum(hi - lo for _, lo, hi in runs) <= P + BLOCK_K * (2 + (W + BLOCK_Q) // BLOCK_K)
    assert computed < (T // BLOCK_Q) * n_k // 2       # most of the [T, P + T] pairs skipped
    full = {"n_q": T, "q_start": 0, "groups": (("all", P + T, None),)}
    assert key_runs(full, 0, BLOCK_Q) == [(0, 0, n_k)]   # nothing to skip without a mask


@pytest.mark.parametrize("kind,T,window,P", [("swa", 16, 4, 4), ("mac", 80, 0, 4)])
def test_bf16_attention_ops_match_float64(kind: str, T: int, window: int, P: int) -> None:
    """Under bf16 mixed precision the ops take bf16 q, k, v (o, do, dq, dk, dv bf16, lse
    float32, no float32 copy of q, k, v planned) and compute in float32: the cpu loop and the
    interpreted triton templates (exact float32 dots off CUDA) are within bf16 rounding of the
    float64 direct form."""
    g, inputs = _attention_graph(kind, T, window, P, dtype="f32")
    wrt = [n for n in g.input_names() if n != "w"]
    g64, _ = _attention_graph(kind, T, window, P)
    want = interpret(grad_graph(g64, wrt), {k: v.double() for k, v in inputs.items()})
    plan = _compiled(g, wrt, bf16=True)
    gg = plan.schedule.graph
    ops = {n.op: n for n in gg if n.op in (Op.ATTENTION, Op.ATTENTION_BWD)}
    assert all(gg.node(i).type.dtype == "bf16" for i in ops[Op.ATTENTION].inputs)
    assert [t.dtype for t in ops[Op.ATTENTION].type] == ["bf16", "f32"]
    assert [t.dtype for t in ops[Op.ATTENTION_BWD].type] == ["bf16"] * len(
        ops[Op.ATTENTION].inputs)
    assert not any(n.op is Op.CAST and n.type.dtype == "f32" and len(n.type.shape) == 4
                   for n in gg), "a float32 copy of q, k or v"
    for target, ex in (("cpu", ArenaExecutor(plan)), ("triton", TritonExecutor(plan))):
        got = ex.run(inputs)
        for name, ref in want.items():      # 2e-3 .. 8e-3 measured
            err = float((got[name].double() - ref).norm() / ref.norm())
            assert err < 0.03, (target, name, err)


def test_bf16_attention_takes_tensor_core_tiles_on_cuda() -> None:
    """16-bit q, k, v on CUDA with at least 64 queries (`meta.attention_cuda_blocks`): the
    forward 128 x 64 from 128 queries, dq and dk/dv 64 x 64, on 8 warps (wgmma's tiles; the
    exact dots' 32 x 32 kept them on mma.sync); the interpreter keeps its blocks. Run with the
    CUDA blocks by the interpreter, the attention kernels launch with them, and every result
    is as close to float64 as the interpreter's blocks give (the loss of this case cancels: 5%
    there either way, gradients 1%).

    The launches, not the bits, show that the other blocks ran: the forward keeps BLOCK_N = 64
    (the same key order), and the backward's other float32 summation order is rounded away by
    its bf16 dq, dk and dv (every output equal to the bit, with Triton 3.6 and 3.9), so
    comparing results cannot tell the blocks apart."""
    from titanc.runtime.targets.aot import fresh_kernel_modules, record_launches

    kind, T, window, P = "mac", 136, 0, 4
    g, inputs = _attention_graph(kind, T, window, P, dtype="f32")
    wrt = [n for n in g.input_names() if n != "w"]
    g64, _ = _attention_graph(kind, T, window, P)
    want = interpret(grad_graph(g64, wrt), {k: v.double() for k, v in inputs.items()})
    plan = _compiled(g, wrt, bf16=True)
    srcs = {c.family: c.source for c in (
        render_kernel(plan.schedule.graph, k, dtype="float32")
        for k in plan.schedule.kernels if k.category == "template")}
    fwd = load_module(srcs["attention_fwd"], "attention_fwd_bf16_blocks", interpret=True)
    bwd = load_module(srcs["attention_bwd"], "attention_bwd_bf16_blocks", interpret=True)
    assert fwd.BLOCKS == {False: (64, 64), True: (128, 64)}
    assert bwd.BLOCKS == {False: (32, 32), True: (64, 64)}
    assert "num_warps=8" in srcs["attention_fwd"] and "num_warps=8" in srcs["attention_bwd"]

    def attention_blocks() -> set[tuple[str, int, int]]:
        """(kernel, BLOCK_M, BLOCK_N) of the attention kernels' launches of one run."""
        out = set()
        for launch in record_launches(plan):
            c, name = dict(launch.constexprs), launch.name
            if "attention" in name:
                kernel = name.rsplit("_", 1)[1] if name.endswith(("_dq", "_dkdv")) else "fwd"
                out.add((kernel, c["BLOCK_M"], c["BLOCK_N"]))
        return out

    base = TritonExecutor(plan).run(inputs)
    assert attention_blocks() == {("fwd", 64, 64), ("dq", 32, 32), ("dkdv", 32, 32)}
    with fresh_kernel_modules(cuda_blocks=True, attention=True) as changed:
        got = TritonExecutor(plan).run(inputs)
        launched = attention_blocks()           # the modules `got` ran: other blocks did run
    assert {m.BLOCKS[False] for m in changed if isinstance(m.BLOCKS[False], tuple)} == {
        (128, 64), (64, 64)}
    assert launched == {("fwd", 128, 64), ("dq", 64, 64), ("dkdv", 64, 64)}
    for name, ref in want.items():
        err = lambda r: float((r[name].double() - ref).norm() / ref.norm())
        assert err(got) <= 1.1 * err(base) + 2e-3, (name, err(got), err(base))
        assert name == "loss" or err(got) < 0.03, (name, err(got))


# --- the whole model on the cpu target ----------------------------------------------------------

# Every (block, window, persistent tokens) in `make test-all`; `make test` keeps six: every
# block, every window (segment 8: smaller, equal, larger) with both persistent counts, MAC
# and MAL twice.
FAST_MODEL_CASES = {("attn", 12, 0), ("mac", 8, 0), ("mac", 4, 4), ("mag", 12, 4), ("mal", 4, 0),
                    ("mal", 8, 4)}
MODEL_CASES = [pytest.param(b, w, p, marks=[] if (b, w, p) in FAST_MODEL_CASES
                            else [pytest.mark.slow])
               for b in ATTENTION_BLOCKS for w in (4, 8, 12) for p in (0, 4)]


@pytest.mark.parametrize("block,window,persistent", MODEL_CASES)
def test_cpu_target_matches_reference_model(block: str, window: int, persistent: int) -> None:
    spec = tiny_spec(**{"model.block": block, "model.attention.window": window,
                        "model.attention.persistent_tokens": persistent})
    params = R.init_params(spec.model, seed=1)
    toks = tokens(spec)
    leaf = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    ref = R.forward_loss(leaf, toks, spec.model)
    ref.backward()
    c = compile_graphs(spec)
    got = ArenaExecutor(c.plans["training"]).run({"tokens": toks, **params})
    assert abs(float(got["loss"]) - float(ref)) < 1e-10
    for name, p in leaf.items():
        want = p.grad if p.grad is not None else torch.zeros_like(p)
        torch.testing.assert_close(got[f"grad.{name}"], want, rtol=1e-8, atol=1e-12,
                                   msg=lambda m: f"grad of {name}: {m}")
