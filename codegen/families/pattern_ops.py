"""Hooks of the fixed-structure (`tem`) families: flash attention forward and backward over
key groups, and the fused LM-head cross-entropy.

Their kernels take no statements; hooks choose dtypes, block sizes and the key-group layout,
and name the few user-derived identifiers (attention group lengths) through a `Namer`. The
pattern kernels (`pattern_kernels.py`) render them for the ATTENTION(_BWD) and
LINEAR_CROSS_ENTROPY(_BWD) ops.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from titanc.config import current
from titanc.codegen.meta import (LAUNCH_LOCALS, check_block, compute_dtype, dot_precision, pow2,
                                 pow2_floor)
from titanc.codegen.render import Namer, render, sanitize_comment

__all__ = [
    "ATTENTION_KERNEL_LOCALS",
    "KeyGroup",
    "render_attention_bwd",
    "render_attention_fwd",
    "render_cross_entropy",
]


# --- attention --------------------------------------------------------------------------------

MAX_KEY_GROUPS = 16     # key groups a template names locals for (MAC has 3, SWA 2)
CE_TILE = 16384         # elements of the cross-entropy kernels' W tile (block_d x block_v)
# The widest slice of the model width the cross-entropy kernels hold in registers (BLOCK_D):
# a wider model is summed in slices of it, and the backward kernels take a slice a program
# (each recomputing its logits over the whole width). With the whole width one block,
# large_125m's (768 -> 1,024) dW kernel held 255 registers and spilled 644-1,072 B a thread
# on 8-16 warps on sm_90.
CE_MAX_BLOCK_D = 256
# An exact float32 dot (tf32 off: the LM head's h and W are float32 in every policy,
# docs/precision.md) has no tensor-core instruction; Triton unrolls it into FMAs. On CUDA the
# cross-entropy kernels' BLOCK_V keeps a dot step at most this many FMAs a thread
# (block_d x block_v x block_n / threads): at d_model 128 the interpreter's 64-wide vocabulary
# blocks (1,024 a thread) spilled 8,784 B a thread in the dW kernel and 3,232 B in the
# forward on sm_90; 16-wide (256 a thread) none.
CE_FMA_PER_THREAD = 256

ATTENTION_KERNEL_LOCALS = frozenset("""
    BLOCKS cuda_constexprs
    BLOCK_M BLOCK_N HEAD_DIM DOT_F32 dot_f32 _mma a b _visible _attend_group _dq_group q k v o do dq dk dv lse delta
    q_ptr k_ptr v_ptr o_ptr do_ptr dq_ptr dk_ptr dv_ptr lse_ptr delta_ptr n_queries head_dim
    key_offset key_len sm_scale start_m start_n head batch offs_m offs_n offs_d m_mask n_mask
    d_mask q_base k_base v_base o_base do_base dq_base dk_base dv_base m_i l_i acc l_safe
    lo hi CAUSAL WINDOW heads n_keys qi kj visible qk m_new m_safe alpha p dp ds sT pT dpT dsT
    tile_mask keys lengths GROUPS key_offset causal window kv_mask q_mask lse_base delta_base
    q_ptrs k_ptrs v_ptrs o_ptrs do_ptrs dq_ptrs dk_ptrs dv_ptrs lse_ptrs delta_ptrs
    k_ptr v_ptr dk_ptr dv_ptr k_ v_ dk_ dv_ groups
""".split()) | frozenset(  # strides: tensor letters x axis letters, as in the Triton tutorials
    f"stride_{t}{a}" for t in ("q", "k", "v", "o", "do", "dq", "dk", "dv", "l", "delta")
    for a in "zhmnd") | frozenset(  # one key, value (and gradient) tensor per key group
    name for t in ("k", "v", "dk", "dv") for i in range(MAX_KEY_GROUPS)
    for name in (f"{t}{i}", f"{t}{i}_ptr", f"{t}{i}_base", *(f"stride_{t}{i}{a}" for a in "zhnd")))


@dataclass(frozen=True)
class KeyGroup:
    """One key group: its own key and value tensor (and gradients) in the kernel's arguments.

    `causal=False`: every query sees every key of the group (persistent tokens).
    `causal=True`: query i sees group key j iff j <= i, and with a `window` W also i - W < j
    (the sequence itself in SWA; both the memory block h and the segment in MAC).
    """

    label: str
    causal: bool
    window: int | None = None

    def rule(self) -> str:
        if not self.causal:
            return "every query sees every key"
        if self.window:
            return f"causal sliding window, query i sees key j iff i - {self.window} < j <= i"
        return "causal, query i sees key j iff j <= i"


def _attention_context(name: str, groups: Sequence[KeyGroup], head_dim: int, dtype: str,
                       allow_tf32: bool, block_m: int, block_n: int, num_warps: int,
                       header_lines: Sequence[str], wide: bool = False) -> dict[str, object]:
    if not groups:
        raise ValueError("attention needs at least one key group")
    if len(groups) > MAX_KEY_GROUPS:
        raise ValueError(f"attention takes at most {MAX_KEY_GROUPS} key groups, got {len(groups)}")
    check_block("block_m", block_m, 16)
    check_block("block_n", block_n, 16)
    namer = Namer(ATTENTION_KERNEL_LOCALS | LAUNCH_LOCALS)
    len_args = [namer.fresh(f"n_{g.label}") for g in groups]
    ctx_groups = []
    for i, (g, n) in enumerate(zip(groups, len_args)):
        if g.window is not None and (not g.causal or g.window < 1):
            raise ValueError(f"key group {g.label!r}: a window needs causal=True and >= 1")
        ctx_groups.append({
            "label": sanitize_comment(g.label),
            "len_arg": n,
            "k": f"k{i}", "v": f"v{i}", "dk": f"dk{i}", "dv": f"dv{i}",
            "causal": str(g.causal),
            "window": str(int(g.window or 0)),
            "rule": g.rule(),
        })
    return dict(
        name=name,
        header_lines=header_lines,
        groups=ctx_groups,
        group_summary=" | ".join(f"{c['label']}: {'causal' if g.causal else 'all'}"
                                 + (f" W={g.window}" if g.window else "")
                                 for c, g in zip(ctx_groups, groups)),
        len_args=len_args,
        block_m=block_m,
        block_n=block_n,
        head_dim_block=pow2(head_dim, 16),
        acc_dtype=compute_dtype(dtype),
        precision=dot_precision(allow_tf32),
        num_warps=num_warps,
        wide=wide,
    )


def render_attention_fwd(
    name: str,
    *,
    groups: Sequence[KeyGroup],
    head_dim: int,
    dtype: str = "float32",
    allow_tf32: bool = False,
    header_lines: Sequence[str] = (),
    block_m: int = 64,
    block_n: int = 64,
    num_warps: int = 4,
    wide: bool = False,
    cuda_blocks: tuple[int, int] | None = None,
) -> str:
    """Flash-attention forward over `groups` of keys (persistent | causal+window | ...).

    SWA: `[KeyGroup("persistent", False), KeyGroup("seq", True, window=W)]`;
    MAC: `[KeyGroup("persistent", False), KeyGroup("memory", True), KeyGroup("segment", True)]`.
    Launcher: `launch(q, k_<group>..., v_<group>..., o, lse, n_<group>..., sm_scale)`, one
    key and one value tensor per group, each with its own strides. `wide`: query, key and
    width offsets in int64 (q, k or v has >= 2**31 elements, `meta.needs_int64`; batch and
    head offsets are int64 always). `cuda_blocks`: (BLOCK_M, BLOCK_N) of a CUDA launch where
    they differ from the interpreter's `block_m`, `block_n` (the module's `cuda_constexprs`
    gives them to an ahead-of-time compile).
    """
    ctx = _attention_context(name, groups, head_dim, dtype, allow_tf32, block_m, block_n,
                             num_warps, header_lines, wide)
    cuda_m, cuda_n = cuda_blocks or (block_m, block_n)
    check_block("cuda block_m", cuda_m, 16)
    check_block("cuda block_n", cuda_n, 16)
    return render("attention_fwd.py.jinja", cuda_block_m=cuda_m, cuda_block_n=cuda_n, **ctx)


def render_attention_bwd(
    name: str,
    *,
    groups: Sequence[KeyGroup],
    head_dim: int,
    dtype: str = "float32",
    allow_tf32: bool = False,
    header_lines: Sequence[str] = (),
    block_m: int = 64,
    block_n: int = 64,
    num_warps: int = 4,
    wide: bool = False,
    cuda_blocks: tuple[int, int] | None = None,
) -> str:
    """Flash-attention backward (dq kernel, then a dk/dv kernel per key group).

    Launcher: `launch(q, k_<group>..., v_<group>..., o, lse, do, dq, dk_<group>...,
    dv_<group>..., delta, n_<group>..., sm_scale)`;
    `delta` is a [batch, head, queries] scratch tensor. `wide`: as the forward's.
    `cuda_blocks`: as the forward's (both kernels take them).
    """
    ctx = _attention_context(name, groups, head_dim, dtype, allow_tf32, block_m, block_n,
                             num_warps, header_lines, wide)
    cuda_m, cuda_n = cuda_blocks or (block_m, block_n)
    check_block("cuda block_m", cuda_m, 16)
    check_block("cuda block_n", cuda_n, 16)
    return render("attention_bwd.py.jinja", cuda_block_m=cuda_m, cuda_block_n=cuda_n, **ctx)


# --- cross-entropy ----------------------------------------------------------------------------

def render_cross_entropy(
    name: str,
    *,
    d_model: int,
    backward: bool = False,
    accumulate_dw: bool = False,
    head_dv: bool = False,
    int64: bool = False,
    ignore_index: int = -100,
    dtype: str = "float32",
    allow_tf32: bool = False,
    header_lines: Sequence[str] = (),
    block_n: int = 16,
    block_v: int = 64,
    num_warps: int = 4,
    max_block_d: int = CE_MAX_BLOCK_D,
) -> str:
    """Chunked LM-head cross-entropy with the head matmul fused in (forward or backward).

    A model width of at most `max_block_d` is one block (BLOCK_D = next power of two >=
    d_model): h rows and W rows are loaded once per tile. A wider one is summed in slices of
    `max_block_d` (a power of two), and the backward kernels take a slice of the width a
    program. No [rows, vocab] logits exist beyond one block.
    Forward launcher: `launch(h, w, target, loss, lse)`.
    Backward launcher: `launch(h, w, target, lse, dloss, dh, dw)`; with `accumulate_dw` the
    kernel adds into dw (a tied embedding gradient, or several chunks of rows). `head_dv`:
    the launcher takes a [d_model, vocab] head (and gradient) and transposes the views;
    `int64`: row and vocabulary offsets in int64 (numel of h, w or rows x vocab >= 2^31).
    On CUDA the vocabulary block is cut to keep an exact float32 dot step within
    `CE_FMA_PER_THREAD` FMAs a thread (the module's `BLOCKS`, `cuda_constexprs`).
    """
    check_block("block_n", block_n, 16)
    check_block("block_v", block_v, 16)
    if d_model < 1:
        raise ValueError(f"d_model={d_model} must be >= 1")
    check_block("max_block_d", max_block_d, 16)
    block_d = min(pow2(d_model, 16), max_block_d)
    # a W tile (block_d x block_v) of at most CE_TILE elements: at d_model 768 a 1024 x 64
    # tile asked for 576 KiB of shared memory (the limit is 227) and spilled 98 KB per thread
    block_v = max(16, min(block_v, CE_TILE // block_d))
    cuda_block_v = block_v
    # FMAs on a GPU (float64: its DMMA); TITANC_GPU_BLOCKS=0 keeps the interpreter's block
    if not allow_tf32 and dtype != "float64" and current().gpu_blocks:
        fmas = CE_FMA_PER_THREAD * 32 * num_warps // (block_d * block_n)
        cuda_block_v = max(16, min(block_v, pow2_floor(fmas)))
    return render(
        "cross_entropy.py.jinja",
        name=name,
        header_lines=header_lines,
        backward=backward,
        accumulate=accumulate_dw,
        head_dv=head_dv,
        int64=int64,
        ignore_index=int(ignore_index),
        block_n=block_n,
        block_v=block_v,
        cuda_block_v=cuda_block_v,
        block_d=block_d,
        acc_dtype=compute_dtype(dtype),
        precision=dot_precision(allow_tf32),
        num_warps=num_warps,
    )
