"""Split-K (codegen/meta.py `split_k`, templates/matmul.py.jinja; `TITANC_SPLIT_K=1`, off by
default until a GPU measures it): a contraction with few output tiles and a long K runs its K
in slices, one program each, and a second kernel adds the partial tiles in slice order before
the epilogue.

- the rule: weight gradients over many tokens split, big or short contractions do not;
- parity: the triton target (interpreted) with split kernels == the cpu target, float64,
  a training step whose FFN weight gradients sum over 512 tokens;
- a split kernel launches alone (two kernels), never in a launch group;
- both kernels compile for sm_90 (ptxas, no GPU), the partial one with its MMA.
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # read when kernels are decorated: set first

import pytest  # noqa: E402
import torch  # noqa: E402

from tests import reference as R  # noqa: E402
from titanc import config  # noqa: E402
from titanc.codegen.lowered import LaunchGroup  # noqa: E402
from titanc.codegen.meta import kernel_split_k, split_k  # noqa: E402
from titanc.compiler import compile_graphs  # noqa: E402
from titanc.model.spec import load_spec  # noqa: E402
from titanc.runtime.targets.executor import ArenaExecutor  # noqa: E402
from titanc.runtime.targets.triton_executor import TritonExecutor  # noqa: E402

from .conftest import EXAMPLES  # noqa: E402

# 16 rows of 32 tokens: the FFN's weight gradients [16, 24] sum over 512 tokens
SIZES = {"model.d_model": 16, "model.n_layers": 1, "model.seq_len": 32, "model.vocab_size": 16,
         "model.ffn_hidden": 24, "model.attention.heads": 2, "model.attention.segment": 8,
         "model.attention.window": 8, "model.attention.persistent_tokens": 2,
         "train.batch_size": 16, "train.loss_chunk": 0, "train.dtype": "float64"}


def test_the_rule_splits_few_tiles_over_a_long_k() -> None:
    assert split_k(1, 64, 172, 1024) == 8        # tiny.yaml's FFN weight gradients
    assert split_k(1, 128, 341, 1024) == 5       # the medium size's: 12 tiles
    assert split_k(1, 16, 24, 512) == 4          # at least 2 K steps a slice
    assert split_k(1, 768, 2048, 32768) == 1     # large_125m's: 192 tiles already
    assert split_k(8, 32, 64, 32) == 1           # short K
    assert split_k(1, 64, 64, 448) == 1          # 7 K steps


@pytest.fixture(scope="module")
def compiled():
    return compile_graphs(load_spec(EXAMPLES / "tiny_attn.yaml", SIZES))


@pytest.fixture(autouse=True)
def split_on():
    with config.override(split_k=True):
        yield


def test_off_by_default(compiled) -> None:
    plan = compiled.plans["training"]
    with config.override(split_k=False):
        assert not _split_kernels(plan)
    assert config.Config.from_env({"TITANC_SPLIT_K": "1"}).split_k
    assert not config.Config.from_env({}).split_k


def _split_kernels(plan) -> list:
    """The split kernels of `plan` and its scan bodies'."""
    g = plan.schedule.graph
    own = [k for k in plan.schedule.kernels if kernel_split_k(g, k) > 1]
    return own + [k for body in plan.bodies.values() for k in _split_kernels(body)]


def test_split_triton_equals_cpu_float64(compiled) -> None:
    plan = compiled.plans["training"]
    split = _split_kernels(plan)
    assert split, "no kernel of this plan splits K"
    inputs = {"tokens": torch.randint(0, 16, (16, 33), generator=torch.Generator().manual_seed(3)),
              **R.init_params(compiled.spec.model, seed=1)}
    ex = TritonExecutor(plan)
    grouped = {m for low in ex.program.walk() for s in low.steps if isinstance(s, LaunchGroup)
               for m in (x.kernel.name for x in s.members)}
    assert not grouped & {k.name for k in split}
    got, want = ex.run(inputs), ArenaExecutor(plan).run(inputs)
    assert want
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=1e-9, atol=1e-11, msg=lambda m: f"{k}: {m}")


def test_split_kernels_compile_for_sm90(compiled) -> None:
    """Both kernels of a bf16 split matmul, through ptxas for sm_90 (a subprocess: this one
    interprets)."""
    import json
    import subprocess
    import sys

    script = r"""
import json, sys
from titanc.compiler import compile_graphs
from titanc.model.spec import load_spec
from titanc.codegen.lower.dispatch import render_kernel
from titanc.codegen.meta import kernel_split_k
from titanc.codegen.render import load_module
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
c = compile_graphs(load_spec(sys.argv[1], json.loads(sys.argv[2])))
def find(plan):
    g = plan.schedule.graph
    for k in plan.schedule.kernels:
        if kernel_split_k(g, k) > 1:
            return plan, k
    for body in plan.bodies.values():
        if find(body):
            return find(body)
plan, kern = find(c.plans["training"])
g = plan.schedule.graph
code = render_kernel(g, kern, dtype="bfloat16", skip=set(plan.aliases))
module = load_module(code.source, kern.name, False)
out = {}
for name in (kern.name, kern.name + "_finish"):
    fn = getattr(module, name)
    sig = {}
    for a in fn.arg_names:
        if a in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "DOT_F32"):
            sig[a] = "constexpr"
        elif a.endswith("_ptr"):
            sig[a] = "*fp32" if a in ("ws_ptr",) or a.startswith("out") else "*bf16"
        else:
            sig[a] = "i32"
    consts = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "DOT_F32": False}
    k = triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 4, "num_stages": 3})
    out[name] = "mma" in k.asm["ptx"]
print(json.dumps(out))
"""
    over = {**SIZES, "train.dtype": "bfloat16"}
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {
        "TITANC_SPLIT_K": "1"}
    r = subprocess.run([sys.executable, "-c", script, str(EXAMPLES / "tiny_attn.yaml"),
                        json.dumps(over)], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    mma = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(mma) == 2 and list(mma.values()) == [True, False]
