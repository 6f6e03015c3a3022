"""CUDA graphs (`compile.cuda_graphs`): the training step captured once and replayed.

Without a GPU only the option's plumbing can be checked; the replay itself is a `gpu` test
(skipped here, run by the GPU check on a machine with CUDA)."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # read when kernels are decorated: set first

import pytest  # noqa: E402
import torch  # noqa: E402

import titanc  # noqa: E402
from titanc.errors import TitancError  # noqa: E402
from titanc.model.spec import load_spec  # noqa: E402

SMALL = {"model.n_layers": 1, "model.seq_len": 32, "model.attention.segment": 16,
         "model.attention.window": 16, "model.memory.chunk_size": 8, "train.batch_size": 2}


def test_option_is_validated(examples_dir) -> None:
    assert load_spec(examples_dir / "tiny.yaml").compile.cuda_graphs is None
    assert load_spec(examples_dir / "tiny.yaml", {"compile.cuda_graphs": False}).compile.cuda_graphs is False
    with pytest.raises(TitancError, match="compile.cuda_graphs"):
        load_spec(examples_dir / "tiny.yaml", {"compile.cuda_graphs": "yes"})


def test_no_capture_without_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("checks the CPU fallback")
    from titanc.passes.fusion import fuse
    from titanc.passes.buffer_plan import plan_buffers
    from titanc.runtime.targets.triton_executor import TritonExecutor
    from tests.test_memory_plan import small_scan_graph

    gen = torch.Generator().manual_seed(0)
    inputs = {"tokens": torch.randint(0, 10, (2, 5), generator=gen),
              "embed": torch.randn(10, 8, generator=gen), "w": torch.randn(8, 8, generator=gen)}
    ex = TritonExecutor(plan_buffers(fuse(small_scan_graph())), cuda_graphs=True)
    assert not ex.cuda_graphs                       # interpreted kernels on CPU tensors
    first = {k: v.clone() for k, v in ex.run(inputs).items()}
    again = ex.run(inputs)                          # the run that would capture on CUDA
    for k in first:
        torch.testing.assert_close(again[k], first[k])


@pytest.mark.gpu
def test_replayed_steps_equal_eager_steps(examples_dir) -> None:
    tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0)).cuda()
    params = {}
    for graphs in (False, True):
        prog = titanc.compile(examples_dir / "tiny.yaml", **SMALL, **{
            "compile.target": "triton", "compile.cuda_graphs": graphs})
        losses = [prog.train_step(tokens) for _ in range(4)]    # eager, capture, replay, replay
        params[graphs] = ({n: t.clone() for n, t in prog.parameters().items()}, losses)
        assert all(ex.cuda_graphs == graphs for ex in prog.executors.by_graph.values())
    (p0, l0), (p1, l1) = params[False], params[True]
    assert l0 == pytest.approx(l1, rel=1e-6)
    for n in p0:
        torch.testing.assert_close(p1[n], p0[n], rtol=1e-6, atol=1e-7)
