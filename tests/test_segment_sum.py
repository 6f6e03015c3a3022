"""The embedding gradient (INDEX_ADD) on the triton target: a sorted segment sum.

(e) the template against torch's index_add_ (interpreted, float32 and float64, repeated and
absent rows, several column blocks); (c) at a 151,936-token vocabulary the compiled training
step's INDEX_ADD renders to the segment sum, whose modeled work is O((indices + rows) ·
columns), not the rows · indices · columns of a one-hot product.
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from tests.helpers import tiny_spec
from titanc.codegen.lower.dispatch import render_kernel
from titanc.codegen.render import load_module
from titanc.config import triton_interpret_mode
from titanc.codegen.families.scatter import index_add_work, render_segment_sum
from titanc.compiler import compile_graphs
from titanc.ir import Op


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_segment_sum_template_matches_index_add(dtype: torch.dtype) -> None:
    name = f"titanc_tem_fused_segment_sum_{str(dtype)[-2:]}"
    src = render_segment_sum(name, dtype=str(dtype).removeprefix("torch."), block_c=16)
    gen = torch.Generator().manual_seed(3)
    R, n, C = 41, 60, 37                          # 3 column blocks; rows 38.. never hit
    idx = torch.randint(0, 38, (n,), generator=gen)
    idx[:7] = 5                                   # a long segment
    grad = torch.randn(n, C, generator=gen, dtype=dtype)
    out = torch.full((R, C), float("nan"), dtype=dtype)
    with triton_interpret_mode(True):
        load_module(src, name, True).launch(grad, idx, out)
    want = torch.zeros(R, C, dtype=dtype).index_add_(0, idx, grad)
    torch.testing.assert_close(out, want, rtol=0, atol=0)   # same order of additions


def test_embedding_gradient_at_a_large_vocab_is_a_segment_sum() -> None:
    V = 151_936
    spec = tiny_spec(**{"model.vocab_size": V, "model.block": "attn"})
    c = compile_graphs(spec, verify_each=False)
    plan = c.plans["training"]
    g = plan.schedule.graph
    kernels = [k for k in plan.schedule.kernels
               if any(g.node(n).op is Op.INDEX_ADD for n in k.nodes)]
    assert kernels
    for k in kernels:
        node = next(g.node(n) for n in k.nodes if g.node(n).op is Op.INDEX_ADD)
        grad, idx = (g.node(i).type for i in node.inputs)
        rows, n_idx = node.attr("rows"), idx.numel
        cols = grad.numel // n_idx
        assert rows == V
        code = render_kernel(g, k)
        assert code.family == "segment_sum"
        work = index_add_work(code.family, n_idx, rows, cols)
        assert work <= 2 * (n_idx + rows) * cols               # O(rows · columns)
        assert work * 8 < index_add_work("index_add", n_idx, rows, cols)
