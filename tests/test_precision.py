"""`train.dtype: bfloat16` (mixed precision, passes/precision.py): the dtype the compiler gives
every tensor, float32 masters, the activation arena it saves, training against float32,
bit-for-bit resume, decoding against the model's own parallel forward, and the cpu and
(interpreted) triton executors agreeing."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path  # noqa: E402
from typing import Iterator  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import titanc  # noqa: E402
from tests.helpers import BLOCKS, TINY, one_thread, tokens  # noqa: E402,F401 (autouse)
from titanc.compiler import compile_graphs  # noqa: E402
from titanc.errors import SpecError  # noqa: E402
from titanc.ir import Graph, Op, OpGroup  # noqa: E402
from titanc.passes.buffer_plan import buffer_report  # noqa: E402
from titanc.runtime.train.checkpoint import load_checkpoint  # noqa: E402
from titanc.runtime.serve.generate import Generator  # noqa: E402
from titanc.model.spec import load_spec  # noqa: E402

from .conftest import EXAMPLES  # noqa: E402

BF16 = {"train.dtype": "bfloat16"}


def _nodes(g: Graph, depth: int = 0) -> Iterator[tuple[object, int, Graph]]:
    """Every node of `g` and of its scan bodies, with its nesting depth and graph."""
    for n in g:
        yield n, depth, g
        if n.op is Op.SCAN:
            yield from _nodes(n.attr("body"), depth + 1)


def _program(block: str, dtype: str = "bfloat16", **extra):
    return titanc.compile(TINY, **{"model.block": block, "train.dtype": dtype,
                                   "compile.target": "cpu", **extra})


# -- the policy, structurally -------------------------------------------------------------------

def test_the_compiler_assigns_bf16_and_float32_by_the_policy() -> None:
    c = compile_graphs(load_spec(TINY, {"model.block": "mac", **BF16}))
    fwd, grad = c.forward, c.grad
    # graph inputs and outputs stay float32: parameters, their gradients, the loss
    for g in (fwd, grad):
        for name, t in g.input_types().items():
            assert t.dtype == ("i64" if name == "tokens" else "f32"), (g.name, name, t)
        for name, v in g.outputs:
            assert g.node(v).type.dtype == "f32", (g.name, name)
    seen = {"einsum": 0, "memory_carry": 0}
    for n, _, g in _nodes(fwd):
        if n.op is Op.EINSUM:             # bf16 operands and result (fp32 accumulation inside)
            seen["einsum"] += 1
            assert n.type.dtype == "bf16"
            assert all(g.node(i).type.dtype == "bf16" for i in n.inputs), n
        if n.op in (Op.SUM, Op.CUMSUM, Op.LOG):     # statistics, log-space gates, the loss
            assert n.type.dtype == "f32", n
        if n.op is Op.SCAN:     # the residual stream is a bf16 activation; W, S stay float32
            body: Graph = n.attr("body")
            want = "bf16" if n.attr("role") == "layer" else "f32"
            for i in body.inputs[:n.attr("n_carry")]:
                assert body.node(i).type.dtype == want, (body.name, body.node(i))
            if n.attr("role") == "memory":
                seen["memory_carry"] += n.attr("n_carry")
            assert n.attr("checkpoint_dtype") == "bf16"    # what the backward saves of them
        if n.op in (Op.ADD, Op.MUL, Op.SUB, Op.DIV, Op.MAX):
            assert len({g.node(i).type.dtype for i in n.inputs}) == 1, n
    assert seen["einsum"] >= 10 and seen["memory_carry"] >= 4
    # activations between kernels are mostly bf16 now
    kinds = {t for n, _, _ in _nodes(grad) if not isinstance(n.type, tuple)
             for t in [n.type.dtype]}
    assert {"bf16", "f32"} <= kinds


@pytest.mark.parametrize("block", BLOCKS)
def test_values_read_only_by_matmuls_are_stored_bf16(block: str) -> None:
    """A float32 elementwise value whose users are all matmul (or attention) operands is
    computed in float32 and stored bf16 where it is made (a norm's x̂ feeding the projections,
    MAC's x̂ segments entering its scan), so no einsum reads a CAST of one: the float32 copy is
    never planned, and the backward saves the bf16 value the matmul reads anyway."""
    c = compile_graphs(load_spec(TINY, {"model.block": block, **BF16}), verify_each=False)
    for n, _, g in _nodes(c.forward):
        if n.op is not Op.EINSUM:
            continue
        for i in n.inputs:
            x = g.node(i)
            while x.op in (Op.RESHAPE, Op.PERMUTE, Op.EXPAND, Op.SLICE):
                x = g.node(x.inputs[0])
            if x.op is Op.CAST:         # only weights, graph and scan inputs are cast here
                assert g.node(x.inputs[0]).op not in OpGroup.ELEMENTWISE, (g.name, n, x)
    # the norm statistic stays float32: x̂ = x · rsqrt(mean(x²) + eps) is one float32 product
    rsqrts = [n for n, _, _ in _nodes(c.forward) if n.op is Op.RSQRT]
    assert rsqrts and all(n.type.dtype == "f32" for n in rsqrts)


def test_float32_graphs_are_untouched_by_the_pass() -> None:
    c = compile_graphs(load_spec(TINY, {"model.block": "lmm", "train.dtype": "float32"}))
    assert all(n.type.dtype != "bf16" for n, _, _ in _nodes(c.grad)
               if not isinstance(n.type, tuple))
    assert "mixed_precision" not in {r["name"] for r in c.passes}


def test_unsupported_dtype_is_a_one_line_error() -> None:
    with pytest.raises(SpecError) as e:
        load_spec(TINY, {"train.dtype": "float16"})
    assert str(e.value) == "train.dtype: 'float16' must be one of float32, float64, bfloat16"


# -- memory ---------------------------------------------------------------------------------------

def _arena(path: Path, dtype: str) -> int:
    c = compile_graphs(load_spec(path, {"train.dtype": dtype}), verify_each=False)
    return buffer_report(c.plans["training"], c.spec.model.vocab_size)["arena_bytes"]


@pytest.mark.parametrize("example, bound", [
    ("tiny_attn.yaml", 0.58), ("tiny.yaml", 0.63),
    *(pytest.param(e, b, marks=pytest.mark.slow)        # the other memory blocks: slow tier
      for e, b in (("tiny_lmm.yaml", 0.61), ("tiny_mag.yaml", 0.595), ("tiny_mal.yaml", 0.575)))])
def test_bf16_activation_arena_is_smaller(example: str, bound: float) -> None:
    """report.json `memory.arena_bytes` of the training graph, bf16 / float32. Measured:
    tiny_attn 0.566 (the residual stream, its per-layer checkpoints and its cotangent are bf16
    activations; what stays float32 at the peak is 90 KB: the tied embedding's gradient and
    norm statistics; the bf16 copies of the layer weights the matmuls read, 376 KB, are
    passes/hoist_casts.py's: 0.511 without them), tiny_mal 0.562, tiny_mag 0.582, tiny_lmm
    0.596, tiny.yaml (MAC) 0.621 (the fusion rules of tests/unit/passes/test_fusion_rules.py and the carry slot a scan's result lends
    shrink float32 and bf16 arenas by different amounts, so these move with them):
    in the memory models the memory state's carries (W1, W2, S1, S2, and their cotangents in
    the backward: ping-pong slots at each nesting level) stay float32 by policy, about 3 MB of
    the peak, and so do the chunk backward's hoisted products (passes/hoist.py: the forward
    recompute over every chunk of a segment or chunk group, 2 MB in tiny.yaml; 0.604 before
    them); its checkpoints saved per segment / chunk group are bf16."""
    f32, bf16 = _arena(EXAMPLES / example, "float32"), _arena(EXAMPLES / example, "bfloat16")
    assert bf16 <= bound * f32, (example, bf16 / f32)


# -- numerics -------------------------------------------------------------------------------------

@pytest.mark.parametrize("block", [b if b in ("attn", "mac") else pytest.param(b, marks=pytest.mark.slow)
                                   for b in BLOCKS])
def test_bf16_loss_and_gradients_track_float32(block: str) -> None:
    toks = tokens(load_spec(TINY))
    l32, g32 = _program(block, "float32").grads(toks)
    prog = _program(block)
    l16, g16 = prog.grads(toks)
    assert all(t.dtype == torch.float32 for t in prog.parameters().values())
    assert all(t.dtype == torch.float32 for t in g16.values())
    assert abs(l16 - l32) <= 1e-2 * abs(l32)
    for k in g32:      # 0.013 .. 0.030 measured (bf16 keeps 8 bits of mantissa)
        err = float((g16[k] - g32[k]).norm() / (g32[k].norm() + 1e-12))
        assert err < 0.1, (k, err)


def test_bf16_run_resumes_bit_for_bit_with_float32_masters(tmp_path: Path) -> None:
    from tests.test_trainer import read_metrics, tiny, train

    spec = tiny("lmm", train__warmup=2, train__checkpoint_every=1, train__dtype="bfloat16")
    straight, split = tmp_path / "straight", tmp_path / "split"
    train(spec, straight, steps=4)
    train(spec, split, steps=4, until=2)
    train(spec, split, steps=4, resume=split)
    a, _ = load_checkpoint(straight / "checkpoint.safetensors")
    b, _ = load_checkpoint(split / "checkpoint.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
        if k.startswith(("param.", "opt.")) and a[k].is_floating_point():
            assert a[k].dtype == torch.float32, k       # float32 master copies on disk
    losses = [[m["loss"] for m in read_metrics(d / "metrics.jsonl") if "loss" in m]
              for d in (straight, split)]
    assert losses[0] == losses[1] and len(losses[0]) == 4


@pytest.mark.parametrize("block", ["lmm", "mac", pytest.param("mag", marks=pytest.mark.slow)])
def test_bf16_decoding_matches_its_own_parallel_forward(block: str) -> None:
    prog = _program(block, **{"train.batch_size": 1})
    toks = tokens(prog.spec, 1, seed=2)
    want = prog.logits(toks)                                     # (1, T, V), float32
    gen = Generator(prog)
    st, logits = gen.prefill(toks[0, :5].tolist())
    rest = [gen.step(st, toks[:, t:t + 1]).clone() for t in range(5, prog.seq_len)]
    got = torch.cat([logits] + rest, 1)
    assert got.dtype == torch.float32
    # bf16 matmuls over other blockings round differently: a few bf16 ulps of the logits
    scale = float(want.abs().max())
    torch.testing.assert_close(got, want, rtol=0, atol=0.03 * scale)
    assert float((got - want).abs().mean()) < 0.005 * scale


# one memory layer and a batch of 2 keep the interpreted memory scans within the suite's budget
# (the interpreter runs a grid's programs one by one: batch 8 took 42 s, batch 2 13 s)
# lmm (a memory kind's bf16 scans on triton) is the slow tier: the MAC step below covers them
@pytest.mark.parametrize("block, layers", [("attn", 2),
                                           pytest.param("lmm", 1, marks=pytest.mark.slow)])
def test_cpu_and_triton_executors_agree_in_bf16(block: str, layers: int) -> None:
    two = {"model.n_layers": layers, "train.batch_size": 2}
    toks = tokens(load_spec(TINY), batch=2)
    cpu = _program(block, **two)
    tri = _program(block, **two, **{"compile.target": "triton"})
    assert tri.target == "triton"
    lc, gc = cpu.grads(toks)
    lt, gt = tri.grads(toks)
    assert abs(lc - lt) <= 1e-3 * abs(lc)
    _, g64 = _program(block, "float64", **two).grads(toks)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.double() - b.double()).norm() / (b.double().norm() + 1e-12))

    # 0.002 .. 0.013 measured (bf16 products rounded at other places), or within what bf16
    # itself costs that gradient: lmm's decay bias (mem_alpha_b, a sum with cancellation) is
    # 11% from float64 on the cpu target and 15% on triton, 4.5% apart
    for k in gc:
        assert rel(gt[k], gc[k]) < max(0.03, rel(gc[k], g64[k])), \
            (k, rel(gt[k], gc[k]), rel(gc[k], g64[k]))


def _cast_kernels(plan) -> int:
    """Kernels (scan bodies included) that only convert a value for other kernels to read: a
    CAST (and views) computing nothing else. Not counted: a scan body's checkpoint written in
    bf16 (a body output, which replaced the copy a float32 checkpoint needs) and a checkpoint
    widened for a nested scan's carry (a scan reads its operands from memory); on the triton
    target both are inside scan kernels."""
    g, n = plan.schedule.graph, 0
    for k, kern in enumerate(plan.schedule.kernels):
        nodes = [g.node(i) for i in kern.nodes]
        readers = {g.node(u).op for v in kern.outputs for u in g.users(v)} - {Op.SCAN}
        if not plan.is_noop(k) and readers and any(x.op is Op.CAST for x in nodes) and all(
                x.op is Op.CAST or x.op in OpGroup.VIEW for x in nodes):
            n += 1
    return n + sum(_cast_kernels(b) for b in plan.bodies.values())


@pytest.mark.parametrize("block", ["mac", *(pytest.param(b, marks=pytest.mark.slow)
                                            for b in ("attn", "lmm", "mag", "mal"))])
def test_bf16_steps_launch_what_float32_steps_launch(block: str) -> None:
    """Scan kernels render bf16 casts (rounded to nearest even, held in float32) and read bf16
    tensors, so a bf16 program's scans are kernels exactly where float32's are (the same
    scan fallbacks: MAC's layer backward is a host loop, for its nesting); the
    float32 master parameters' casts are fused into the loads of their readers (one copy per
    reader, `passes/split_casts.py`), the embedding gradient sums the bf16 cotangent in
    float32 itself, so no kernel only casts and a bf16 step launches no more kernels than a
    float32 step (before: MAC 92 vs 76, the casts inside the layer-backward loop). So does a
    decode write: the new states it returns are computed in float32 in its scan's body
    (before: in bf16, then widened by a cast kernel each: 18 vs 5). The decode step:
    `test_bf16_decode_steps_launch_what_float32_decode_steps_launch`."""
    from titanc.compiler import launches_per_step

    counts, falls = {}, {}
    for dt in ("float32", "bfloat16"):
        c = compile_graphs(load_spec(TINY, {"model.block": block, "train.dtype": dt}),
                           verify_each=False)
        falls[dt] = []
        counts[dt] = launches_per_step(c, "triton", falls[dt])    # training, decode, write
        assert _cast_kernels(c.plans["training"]) == 0, dt
    assert not any("cast" in f["reason"] for f in falls["bfloat16"]), falls["bfloat16"]
    assert [f["scan"].rsplit("_", 1)[0] for f in falls["bfloat16"]] == \
        [f["scan"].rsplit("_", 1)[0] for f in falls["float32"]]
    decode = {dt: counts[dt].pop("decode") for dt in counts}
    # no more launches than float32 but for what the min-cut of per_layer's re-run saves
    # (passes/remat.py `replay`: it weighs bytes, and bf16 values weigh half), and the greedy
    # fusion may merge differently at bf16's sizes, and the launch groups pack the kernels
    # differently (mac 222 launches for 218: 187 kernels each)
    assert counts["bfloat16"]["training"] <= counts["float32"]["training"] + 4, counts
    assert counts["bfloat16"].get("decode_write_per_chunk") == \
        counts["float32"].get("decode_write_per_chunk"), counts
    assert decode["bfloat16"] <= decode["float32"] + 2, decode
    write = compile_graphs(load_spec(TINY, {"model.block": block, **BF16}), verify_each=False
                           ).for_batch(1)
    if block != "attn":               # the memory state a decode write returns: float32 math
        g = write.graph("decode_write").graph
        scan = next(n for n in g if n.op is Op.SCAN)
        body = scan.attr("body")
        assert all(body.node(i).type.dtype == "f32" for _, i in body.outputs)
    if block == "mac":
        assert falls["float32"]          # the layer backward's host loop, where casts were


@pytest.mark.parametrize("block", ["mac", *(pytest.param(b, marks=pytest.mark.slow)
                                            for b in ("attn", "lmm", "mag", "mal"))])
def test_bf16_decode_steps_launch_what_float32_decode_steps_launch(block: str) -> None:
    """A decode step (one token, batch 1) launches the same kernels in bf16 as in float32
    (MAC 51 and attn 25 a token in both). It did not while a lone permute that copies into a
    scan output joined its operand's wave (`passes/waves.py`): the plan then lent the
    operand's bytes to a kernel beside it, and the two could not share a launch (MAC bf16
    53, attn float32 27)."""
    from titanc.compiler import launches_per_step

    counts = {dt: launches_per_step(compile_graphs(load_spec(TINY, {
        "model.block": block, "train.dtype": dt}), verify_each=False), "triton")["decode"]
        for dt in ("float32", "bfloat16")}
    assert counts["bfloat16"] == counts["float32"], counts


# examples/tiny.yaml shrunk (as tests/test_scan_kernel.py shrinks it): the same MAC program,
# its scans one kernel each, interpreted in about a minute
SMALL_MAC = {"model.d_model": 8, "model.n_layers": 1, "model.seq_len": 8,
             "model.vocab_size": 16, "model.ffn_hidden": 8, "train.batch_size": 1,
             "model.memory.heads": 2, "model.memory.chunk_size": 2, "model.attention.heads": 2,
             "model.attention.segment": 4, "model.attention.window": 4,
             "model.attention.persistent_tokens": 2}


@pytest.mark.slow      # bf16 dots in scan kernels: test_scan_kernel's bf16 test; GPU: chk_mac_bf16
def test_cpu_and_triton_agree_on_a_bf16_mac_training_step() -> None:
    """tiny.yaml's training step (loss and every gradient) in bf16 on the interpreted triton
    target, its scan kernels' dots of bf16 values on bf16 tiles (`codegen.meta.mma16`; the
    interpreter multiplies them as float32, DOT_F32), against the cpu target."""
    over = {**SMALL_MAC, **BF16, "model.memory.chunk_size": 4}   # two chunks: interpreted
    toks = tokens(load_spec(EXAMPLES / "tiny.yaml", over))
    cpu = titanc.compile(EXAMPLES / "tiny.yaml", **over, **{"compile.target": "cpu"})
    tri = titanc.compile(EXAMPLES / "tiny.yaml", **over, **{"compile.target": "triton"})
    lc, gc = cpu.grads(toks)
    lt, gt = tri.grads(toks)
    assert abs(lc - lt) <= 1e-3 * abs(lc)
    for k in gc:      # 0 .. 0.026 measured: bf16 products rounded at other places
        err = float((gt[k] - gc[k]).norm() / (gc[k].norm() + 1e-12))
        assert err < 0.05, (k, err)
    executors = [ex for ex in tri.executors.by_graph.values() if hasattr(ex, "scan_code")]
    kernels = [sk for ex in executors for sk in ex._scans.values() if not isinstance(sk, str)]
    assert {"memory_chunk", "memory_chunk_bwd"} <= {   # the scans that are kernels (scan_form)
        sk.name.split("_scan_")[1].rsplit("_", 1)[0] for sk in kernels}
    assert all("DOT_F32: tl.constexpr" in sk.source for sk in kernels)


@pytest.mark.parametrize("scan_kernels", [True, False], ids=["scan-kernels", "host-loops"])
def test_emitted_bf16_program_matches_the_cpu_executor(tmp_path: Path, monkeypatch,
                                                       scan_kernels: bool) -> None:
    """`titanc compile` of a bf16 spec writes a program.py whose planned views carry each
    tensor's dtype (bf16 activations, float32 masters: the residual stream between layers is
    bf16 either way, and where the layer scan is a host loop its body values are planned views
    too) and whose forward gives the cpu executor's loss."""
    import importlib.util

    import titanc.codegen.emit as emit
    import titanc.codegen.lower.dispatch as dispatch
    from titanc.codegen.scan.index import ScanFallback
    from titanc.model.params import init_params
    from titanc.runtime.targets.executor import ArenaExecutor

    if not scan_kernels:
        def refuse(*args, **kwargs):
            raise ScanFallback("refused by the test")
        monkeypatch.setattr(dispatch, "scan_kernel_for", refuse)
    spec = load_spec(TINY, {"model.block": "attn", **BF16})
    c = compile_graphs(spec)
    emit.emit_artifact(c, tmp_path)
    assert "torch.bfloat16" in (tmp_path / "program.py").read_text()
    mod_spec = importlib.util.spec_from_file_location("titanc_bf16_program",
                                                      tmp_path / "program.py")
    program = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(program)
    inputs = {"tokens": tokens(spec), **init_params(spec.model, seed=1)}
    want = ArenaExecutor(c.plans["forward"]).run(inputs)["loss"]
    arena, persistent = program.allocate("forward")
    got = program.forward(arena, persistent,
                          {k: inputs[k] for k in program.INPUTS["forward"]})["loss"]
    assert abs(float(got) - float(want)) <= 1e-3 * abs(float(want))


@pytest.fixture
def hoisting_from(monkeypatch):
    """`compile(spec, n)`: `spec` compiled with `hoist_casts` from `n` tokens a micro-batch,
    past the tests' memo of compiles by spec, with the on-disk caches off for the whole test
    (they key a program by its spec, which the patched threshold does not change)."""
    import titanc.compiler as compiler
    from titanc import config

    def compile(spec, tokens_from: int):
        monkeypatch.setattr(compiler, "HOIST_TOKENS", tokens_from)
        return compiler.compile_graphs.__wrapped__(spec)

    with config.override(compile_cache=False):
        yield compile


def test_hoisted_weight_casts_leave_the_scans_and_keep_every_value(hoisting_from) -> None:
    """passes/hoist_casts.py: in a step of many tokens the weight slices the layers' matmuls
    read are cast to bf16 once, before the layer scan, not in its body, and after autodiff so
    are the MAC segment scans' weights (consts); the training graph's loss and every gradient
    are bitwise those of the casts in the body."""
    from titanc.ir import interpret
    import tests.reference as R

    spec = load_spec(TINY, {**SMALL_MAC, "model.block": "mac", "model.n_layers": 2,
                            "model.seq_len": 16, **BF16})
    hoisted, fused = hoisting_from(spec, 1), hoisting_from(spec, 10 ** 9)
    assert "hoist_casts" in {r["name"] for r in hoisted.passes}
    assert "hoist_casts" not in {r["name"] for r in fused.passes}

    def body_casts(g: Graph, consts: bool = False) -> int:
        """f32 -> bf16 casts of a scan body's xs slices (or consts) that a matmul reads"""
        n = 0
        for node in g:
            if node.op is Op.SCAN:
                body, nc, nx = node.attr("body"), node.attr("n_carry"), node.attr("n_xs")
                outer = set(body.inputs[nc + nx:] if consts else body.inputs[nc:nc + nx])
                n += sum(m.op is Op.CAST and m.attr("dtype") == "bf16" and m.inputs[0] in outer
                         and body.node(m.inputs[0]).type.dtype == "f32"
                         and any(body.node(u).op is Op.EINSUM for u in body.users(m.id))
                         for m in body)
                n += body_casts(body, consts)
        return n

    assert body_casts(fused.graph("forward").graph) > 0
    assert body_casts(hoisted.graph("forward").graph) == 0
    assert body_casts(fused.graph("training").graph, consts=True) > 0
    assert body_casts(hoisted.graph("forward").graph, consts=True) > 0    # autodiff reads them
    assert body_casts(hoisted.graph("training").graph, consts=True) == 0
    feed = {"tokens": tokens(spec), **R.init_params(spec.model, seed=5)}
    a, b = interpret(hoisted.grad, feed), interpret(fused.grad, feed)
    for k, v in b.items():
        assert torch.equal(a[k], v), k


# the triton target interprets every kernel of both programs (~90 s): in `make test-all`
@pytest.mark.parametrize("target", ["cpu", pytest.param("triton", marks=pytest.mark.slow)])
def test_hoisted_casts_run_on_each_target_as_in_the_body(hoisting_from, target: str) -> None:
    """A program whose layer and segment scans read bf16 slices and consts cast before them
    (`hoist_casts`) trains, on each target, to the loss and gradients of the one that casts
    in the bodies: bitwise on the cpu target; on triton the norms' weight gradients are
    reduced in other kernels, so in another order (measured 0.2-0.3%, each 0.6-0.9% from the
    cpu target's), the rest bitwise."""
    from titanc.runtime.program import Program

    spec = load_spec(TINY, {**SMALL_MAC, "model.block": "mac", "model.n_layers": 2,
                            "model.seq_len": 16, "compile.target": target, **BF16})
    (la, ga), (lb, gb) = [Program(hoisting_from(spec, n)).grads(tokens(spec))
                          for n in (1, 10 ** 9)]
    assert la == lb
    for k, v in gb.items():
        if target == "triton" and k.endswith("_norm"):
            assert float((ga[k] - v).norm() / v.norm()) < 0.01, k
        else:
            assert torch.equal(ga[k], v), k
