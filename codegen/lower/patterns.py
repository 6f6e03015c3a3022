"""Hooks of the pattern kernels: a kernel holding one `OpGroup.PATTERN` op (and its ITEMs)
rendered from its template by the op's rule in the triton target's template-kernel table
(`lowerings.TRITON_KERNEL`; the attention and cross-entropy renderers are in
`codegen/families/pattern_ops.py`).

    ATTENTION      attention_fwd.py.jinja: flash attention forward over the MASK's key groups,
                   a key and a value tensor per group, each through its own strides
                   (`launch(q, k_<group>..., v_<group>..., o, lse, n_<group>..., sm_scale)`)
    ATTENTION_BWD  attention_bwd.py.jinja: dq per query block, then dk/dv per key block and
                   group (`launch(q, ks.., vs.., o, lse, do, dq, dks.., dvs.., delta, ...,
                   sm_scale)`)
    LINEAR_CROSS_ENTROPY      cross_entropy.py.jinja: per-row loss and lse of h · headᵀ over
                   vocabulary blocks (`launch(h, head, targets, loss, lse)`)
    LINEAR_CROSS_ENTROPY_BWD  cross_entropy.py.jinja (backward): dh per row block, dhead per
                   vocabulary block, logits recomputed from lse
                   (`launch(h, head, targets, lse, dloss, dh, dhead)`)
    ADAMW          adamw_multi.py.jinja: partial sums of grad², then one update launch over
                   the flat regions (`launch(params…, grads…, ms…, vs…, lr, step, grad_scale,
                   new params…, new ms…, new vs…, grad_norm)`)

A tuple element no later kernel reads (the forward graph's log-sum-exp), and the backward's
`delta` rows, are `TensorArg`s with a negative value id and their shape as `view`: the executor
passes scratch of that shape, a generated program passes None (the launcher makes one).
"""
from __future__ import annotations

from titanc.ir import Graph, Node, Op
from titanc.ir.attention import split
from titanc.ir.lowering import register_lowering
from titanc.ir.schedule import Kernel

from titanc.codegen.families.pattern_ops import (KeyGroup, render_attention_bwd, render_attention_fwd,
                             render_cross_entropy)
from titanc.codegen.lower.code import KernelCode, TensorArg
from titanc.codegen.lower.lowerings import TRITON_KERNEL
from titanc.codegen.lower.nodes import KernelLowering
from titanc.codegen.meta import attention_cuda_blocks, compute_dtype, needs_int64, pow2
from titanc.codegen.render import render

__all__ = ["SCRATCH", "element_args", "key_groups", "lower_template", "render_template"]

SCRATCH = -1          # TensorArg.value of a temporary (its shape is the arg's `view`)


def key_groups(groups: tuple) -> list[KeyGroup]:
    """The MASK's groups as the template's key groups (labels from their position)."""
    out = []
    for i, (kind, _, window) in enumerate(groups):
        if kind == "all":
            out.append(KeyGroup(f"all{i}", False))
        else:
            out.append(KeyGroup(f"causal{i}", True, window))
    return out


def element_args(g: Graph, n: Node, kernel: Kernel) -> list[TensorArg]:
    """One arg per tuple element: its ITEM when a later kernel reads it, else scratch."""
    items = {g.node(u).attr("index"): u for u in g.users(n.id) if u in kernel.outputs}
    return [TensorArg(items[k]) if k in items else TensorArg(SCRATCH, t.shape)
            for k, t in enumerate(n.type)]


def render_template(g: Graph, kernel: Kernel, header: list[str], dtype: str,
                   allow_tf32: bool) -> KernelCode:
    """The KernelCode of a template kernel (a pattern op with its ITEMs, a scatter-add): its
    op's rule in `TRITON_KERNEL`."""
    n = next(g.node(i) for i in kernel.nodes if g.node(i).op is not Op.ITEM)
    return TRITON_KERNEL[n.op](g, n, kernel, header, dtype, allow_tf32)


def lower_template(low: KernelLowering, outs: list[int], header: list[str], dtype: str,
                   allow_tf32: bool = False) -> KernelCode:
    """The template families' hook (`ir.kernel_family`): `render_template` of the kernel."""
    return render_template(low.g, low.kernel, header, dtype, allow_tf32)


@register_lowering(Op.ATTENTION, TRITON_KERNEL)
@register_lowering(Op.ATTENTION_BWD, TRITON_KERNEL)
def _attention(g: Graph, n: Node, kernel: Kernel, header: list[str], dtype: str,
               allow_tf32: bool) -> KernelCode:
    a = n.attr_dict
    q, ks, vs, _ = split([g.node(i).type for i in n.inputs], a)
    if any(q.shape[3] != v.shape[3] for v in vs):
        raise NotImplementedError(f"{kernel.name}: the attention templates need values as wide "
                                  f"as keys (q {q}, v {vs[0]})")
    # offsets in int64 when an operand reaches 2**31 elements (decided from the shapes)
    kw = dict(groups=key_groups(a["groups"]), head_dim=q.shape[3], dtype=dtype,
              allow_tf32=allow_tf32, header_lines=header,
              wide=needs_int64(q.numel, *(t.numel for t in ks + vs)))
    sizes = (*(length for _, length, _ in a["groups"]), float(a["scale"]))
    ins = [TensorArg(i) for i in n.inputs]
    outs = element_args(g, n, kernel)
    # An exact float32 or float64 dot (tf32 off) has no tensor-core instruction: Triton unrolls
    # it into FMAs, and compile time grows with their count per thread. At head_dim 64 ptxas
    # kept the forward (64 x 64 blocks, 4 warps) in 32 registers and spilled 34 KB per thread,
    # the dk/dv kernel 504 B (large_125m, float32, sm_90); with 32-query blocks and 8 warps
    # neither spills, and ptxas takes a fifth of the time. On CUDA the exact forward takes
    # 32 x 32 blocks at every width (tiny.yaml's, head_dim 16, compiles for sm_90 in 1.95 CPU-s
    # instead of 5.8 s); the interpreter keeps 64 x 64 (half the programs and loop steps).
    exact = dtype == "float64" or (dtype == "float32" and not allow_tf32)
    # 16-bit q, k, v (a bf16 program's) multiply on tensor cores on CUDA: the exact dots'
    # 32 x 32 blocks would keep them on mma.sync with 32-row tiles. With at least 64 queries
    # they take wgmma's tiles on 8 warps (`meta.attention_cuda_blocks`; large_125m, head_dim
    # 64, sm_90: forward 128 x 64, 127 registers; dq and dk/dv 64 x 64, 123 and 164; no spill)
    low, nq = q.dtype in ("bf16", "f16"), q.shape[2]
    fwd_cuda, bwd_cuda = attention_cuda_blocks(nq) if low else (None, None)
    wide_fma = exact and pow2(q.shape[3], 16) >= 64
    kw["num_warps"] = 8 if wide_fma or fwd_cuda else 4
    if n.op is Op.ATTENTION:
        source = render_attention_fwd(kernel.name, block_m=64, block_n=64,
                                      cuda_blocks=fwd_cuda or ((32, 32) if exact else None),
                                      **kw)
        return KernelCode(kernel.name, kernel.category, "attention_fwd", g.name, source,
                          (*ins, *outs), sizes)
    if any(a_.value == SCRATCH for a_ in outs):
        raise NotImplementedError(f"{kernel.name}: every gradient of ATTENTION_BWD must be read")
    # 32 x 32 blocks: the dk/dv kernel holds two accumulators and recomputes p and ds per
    # block; at 64 x 64 it spilled ~0.5 KB/thread on sm_90 (tests/test_aot.py budget 256 B)
    # as exact dots (FMAs); 16-bit operands on CUDA take 64 x 64 (above)
    source = render_attention_bwd(kernel.name, block_m=32, block_n=32, cuda_blocks=bwd_cuda,
                                  **kw)
    delta = TensorArg(SCRATCH, q.shape[:3])
    return KernelCode(kernel.name, kernel.category, "attention_bwd", g.name, source,
                      (*ins, *outs, delta), sizes)


@register_lowering(Op.ADAMW, TRITON_KERNEL)
def _adamw(g: Graph, n: Node, kernel: Kernel, header: list[str], dtype: str,
           allow_tf32: bool) -> KernelCode:
    a = n.attr_dict
    outs = element_args(g, n, kernel)
    if any(o.value == SCRATCH for o in outs):
        raise NotImplementedError(f"{kernel.name}: every result of ADAMW must be read")
    source = render("adamw_multi.py.jinja", name=kernel.name, header_lines=header,
                    n_params=a["n"], decay=[bool(d) for d in a["decay"]],
                    beta1=repr(float(a["beta1"])), beta2=repr(float(a["beta2"])),
                    eps=repr(float(a["eps"])), weight_decay=repr(float(a["weight_decay"])),
                    max_norm=repr(float(a["clip"])), clip=a["clip"] > 0, block=1024,
                    num_partials=256, acc_dtype=compute_dtype(dtype),
                    partials_dtype=compute_dtype(dtype).removeprefix("tl."), num_warps=4)
    return KernelCode(kernel.name, kernel.category, "adamw_multi", g.name, source,
                      (*(TensorArg(i) for i in n.inputs), *outs), ())


@register_lowering(Op.LINEAR_CROSS_ENTROPY, TRITON_KERNEL)
@register_lowering(Op.LINEAR_CROSS_ENTROPY_BWD, TRITON_KERNEL)
def _linear_cross_entropy(g: Graph, n: Node, kernel: Kernel, header: list[str], dtype: str,
                          allow_tf32: bool) -> KernelCode:
    rows, d = g.node(n.inputs[0]).type.shape
    head = g.node(n.inputs[1]).type.shape
    vocab = head[0] if n.attr("layout") == "vd" else head[1]
    backward = n.op is Op.LINEAR_CROSS_ENTROPY_BWD
    outs = element_args(g, n, kernel)
    if backward and any(o.value == SCRATCH for o in outs):
        raise NotImplementedError(f"{kernel.name}: every gradient of LINEAR_CROSS_ENTROPY_BWD "
                                  f"must be read")
    big = max(rows * vocab, rows * d, vocab * d) >= 2 ** 31
    source = render_cross_entropy(kernel.name, d_model=d, backward=backward,
                                  head_dv=n.attr("layout") == "dv", int64=big, dtype=dtype,
                                  allow_tf32=allow_tf32, header_lines=header)
    family = "cross_entropy_bwd" if backward else "cross_entropy"
    return KernelCode(kernel.name, kernel.category, family, g.name, source,
                      (*(TensorArg(i) for i in n.inputs), *outs), ())
