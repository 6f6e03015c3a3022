"""Meta-parameter helpers shared by the family hooks: dtypes, block sizes, launcher names."""

from __future__ import annotations

import math

from typing import Iterable, NamedTuple

from titanc.config import current
from titanc.ir import Graph, Op, OpGroup
from titanc.ir.schedule import Kernel
from titanc.ir.shapes import parse_einsum

__all__ = ["ACCUMULATOR_REGISTERS", "CARRY_REGISTER_BYTES", "GPU_PROGRAMS", "cuda_flat_block", "cuda_row_block", "split_k",
           "kernel_split_k", "EXACT_F32_TILE", "INT32_LIMIT", "LAUNCH_LOCALS", "MATMUL_TILES", "Tile", "check_block", "compute_dtype",
           "dot_precision", "matmul_tiles", "mma16", "needs_int64", "pow2", "value_dtype"]

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")


def compute_dtype(dtype: str) -> str:
    """The dtype arithmetic runs in: float64 stays float64, everything else uses float32."""
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"dtype {dtype!r} must be one of {', '.join(FLOAT_DTYPES)}")
    return "tl.float64" if dtype == "float64" else "tl.float32"


def pow2(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum)."""
    p = 1
    while p < max(n, minimum):
        p *= 2
    return p


def check_block(label: str, block: int, minimum: int = 1) -> int:
    if block < minimum or block & (block - 1):
        raise ValueError(f"{label}={block} must be a power of two >= {minimum}")
    return block


def dot_precision(allow_tf32: bool) -> str:
    """The `input_precision=` literal of fp32 `tl.dot`s: exact ("ieee") unless tf32 is allowed.
    bf16/fp16 operands always use their MMA (fp32 accumulation) and float64 the DMMA; the
    literal only matters for float32 operands."""
    return '"tf32"' if allow_tf32 else '"ieee"'


# float casts that keep every value exactly (IR dtypes: from, to)
_EXACT_WIDENING = frozenset({("bf16", "f32"), ("bf16", "f64"), ("f16", "f32"), ("f16", "f64"),
                             ("f32", "f64")})


def value_dtype(g: Graph, vid: int) -> str:
    """The IR dtype of the values node `vid` holds: its own type's, or, through views, exact
    widening casts and concatenations, its sources' (a bf16 value cast to float32 holds bf16
    values, as the float32 copies of bf16 q, k, v and their key-group concat do in an expanded
    attention chain)."""
    n = g.node(vid)
    while n.op in OpGroup.VIEW or (n.op is Op.CAST and (g.node(n.inputs[0]).type.dtype,
                                                       n.type.dtype) in _EXACT_WIDENING):
        n = g.node(n.inputs[0])
    if n.op is Op.CONCAT:
        parts = {value_dtype(g, i) for i in n.inputs}
        return parts.pop() if len(parts) == 1 else n.type.dtype
    return n.type.dtype


def mma16(storage: str, operands: Iterable[str]) -> str | None:
    """The 16-bit type ("bfloat16", "float16") a `tl.dot`'s operand tiles take on the GPU (the
    16-bit MMA, float32 accumulation), or None for a dot in the compute dtype (float32: tf32
    or exact, `dot_precision`; float64: DMMA). 16-bit when the kernel stores every value in
    16 bits (`storage`, the executor's float dtype), or when both operands hold bf16 values
    (`operands`: their `value_dtype`s; under mixed precision every einsum operand is bf16,
    and kernels that hold values in float32, the scan kernels, keep them bf16-exact), so the
    conversion is exact. The one decision of the matmul family and the scan kernels."""
    if storage in ("bfloat16", "float16"):
        return storage
    dts = list(operands)
    return "bfloat16" if dts and all(d == "bf16" for d in dts) else None


INT32_LIMIT = 2 ** 31

# Registers a scan kernel's program may spend on the carries it holds on chip across
# iterations (bytes), per compute capability. Every architecture here has 64 K 32-bit
# registers per SM and at most 255 per thread; a scan kernel runs 8 warps (256 threads), so
# 32 KiB is 32 registers per thread, an eighth of the most a thread may hold: the rest is for
# the stages' tiles (whole-carry dot operands included; at 4 warps tiny.yaml's memory chunk
# kernel needed 255 registers and spilled 836 B per thread on sm_90). A scan kernel's source is the same on
# every architecture, so it uses the smallest entry (`carry_register_bytes`).
CARRY_REGISTER_BYTES = {80: 32 * 1024, 86: 32 * 1024, 89: 32 * 1024, 90: 32 * 1024}


def carry_register_bytes() -> int:
    """The register budget for on-chip carries that holds on every listed architecture."""
    return min(CARRY_REGISTER_BYTES.values())


def needs_int64(*numels: int) -> bool:
    """Must a kernel over tensors of these element counts compute offsets in int64? Decided at
    compile time: an offset into a tensor of `numel` elements stays below `numel`."""
    return max(numels, default=0) >= INT32_LIMIT


class Tile(NamedTuple):
    """One matmul-family launch configuration: tile sides, warps, software-pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# Matmul tiles per compute capability and operand element size (bytes), chosen once and never
# autotuned, so a kernel is the same program on every run. 0 is the interpreter (CPU). The
# shared memory of a pipelined tile is num_stages * (BM*BK + BK*BN) * bytes, kept under each
# architecture's per-block limit (A100 163 KiB, sm_86/89 99 KiB, H100 227 KiB, with room for
# the epilogue's layout conversion); 8 warps for 128-wide tiles keep the fp32 accumulator at
# 64 registers per thread. tests/test_aot.py compiles every kernel with these for sm_80/sm_90.
MATMUL_TILES: dict[int, dict[int, Tile]] = {
    0: {2: Tile(64, 64, 64, 4, 3), 4: Tile(64, 64, 64, 4, 3), 8: Tile(64, 64, 64, 4, 3)},
    80: {2: Tile(128, 64, 32, 8, 3),     # 36 KiB (128x128 spilled 600 B with a fused epilogue)
         4: Tile(128, 64, 32, 8, 3),     # 72 KiB, tf32 mma.m16n8k8
         8: Tile(64, 64, 32, 4, 3)},     # 96 KiB, DMMA m8n8k4 (64^3 x 3 stages was 192 KiB)
    86: {2: Tile(128, 64, 32, 8, 3),     # 36 KiB
         4: Tile(64, 64, 32, 4, 3),      # 48 KiB
         8: Tile(64, 64, 16, 4, 3)},     # 48 KiB
    90: {2: Tile(128, 64, 64, 8, 3),     # 72 KiB, wgmma (128x128 spilled 2.4 KB)
         4: Tile(128, 64, 32, 8, 3),     # 72 KiB
         8: Tile(64, 64, 32, 4, 3)},     # 96 KiB
}
MATMUL_TILES[89] = MATMUL_TILES[86]

# An exact float32 dot (`input_precision="ieee"`, tf32 not allowed) has no tensor-core
# instruction: Triton unrolls it into FMAs, BLOCK_M * BLOCK_N * BLOCK_K / threads of them per
# K step, and compile time grows with that count. 32 x 64 x 16 on 8 warps is 128 FMAs per
# thread per step (the 128 x 64 x 32 table tile: 1,024) and needs no pipelining, which has
# no asynchronous copy to overlap here. tiny.yaml's 45 float32 matmul kernels for sm_90
# (CPU-s of compile, this machine): 128 x 64 x 32, 2.9-5.5 s each; 64 x 64 x 16, 35.9 s in
# all; 32 x 64 x 16, 25.7 s; 32 x 32 x 16, 23.7 s (half the operand reuse again for 2 s).
EXACT_F32_TILE = Tile(32, 64, 16, 8, 1)


# A matmul kernel holds one float32 accumulator tile per contraction it does not share
# (`codegen/lower/dispatch.py`, up to MAX_CONTRACTIONS). On a GPU the accumulators of a
# thread are kept within this many registers by halving BLOCK_M (to 64, a wgmma's rows), then
# BLOCK_N: the FFN's three-contraction kernel at the table's 128 x 64 bf16 tile on 8 warps
# (96 registers of accumulators) spilled 72 B a thread at tiny.yaml and 336-368 B at d_model
# 128 on sm_90; at 64 x 64, 108-112 registers and none.
ACCUMULATOR_REGISTERS = 64


def matmul_tiles(itemsize: int, m: int, n: int, k: int,
                 exact_f32: bool = False, accumulators: int = 1) -> dict[int, Tile]:
    """Each architecture's tile for an [m, k] @ [k, n] contraction of `itemsize`-byte operands
    (`exact_f32`: float32 operands without tf32, `EXACT_F32_TILE` on a GPU): the table's,
    each side shrunk to the problem (a power of two, >= 16 as tl.dot needs), and on a GPU to
    keep `accumulators` tiles within ACCUMULATOR_REGISTERS a thread."""
    out = {}
    for arch, by_size in MATMUL_TILES.items():
        t = EXACT_F32_TILE if exact_f32 and arch and itemsize == 4 else by_size[itemsize]
        t = t._replace(block_m=max(16, min(t.block_m, pow2(m))),
                       block_n=max(16, min(t.block_n, pow2(n))),
                       block_k=max(16, min(t.block_k, pow2(k))))
        while arch and accumulators * t.block_m * t.block_n > \
                ACCUMULATOR_REGISTERS * 32 * t.num_warps:
            if t.block_m > 64:
                t = t._replace(block_m=t.block_m // 2)
            elif t.block_n > 16:
                t = t._replace(block_n=t.block_n // 2)
            else:
                break
        out[arch] = t
    return out


# Split-K: a contraction with few output tiles and a long K (a weight gradient: [64, 172]
# summed over the 1,024 tokens of a step) runs on a few programs, each a long serial K loop:
# on an H100 three such kernels took 61 µs a launch. `split_k` cuts K into that many
# slices, each its own program writing a partial tile, and a second kernel sums them in
# slice order and runs the epilogue (deterministic, no atomics; templates/matmul.py.jinja).
SPLIT_TILE = 64            # the tile side the rule counts output tiles and K steps in
SPLIT_MAX_TILES = 16       # at most this many output tiles (x batch) to split
SPLIT_MIN_STEPS = 8        # at least this many K steps of SPLIT_TILE to split
SPLIT_PROGRAMS = 64        # aim for about this many programs
SPLIT_MAX = 8


def split_k(batch: int, m: int, n: int, k: int) -> int:
    """Slices of K for a [batch] x [m, k] @ [k, n] contraction (1: no split): each slice at
    least 2 K steps, about SPLIT_PROGRAMS programs in all, at most SPLIT_MAX."""
    tiles = batch * -(-m // SPLIT_TILE) * -(-n // SPLIT_TILE)
    steps = -(-k // SPLIT_TILE)
    if tiles > SPLIT_MAX_TILES or steps < SPLIT_MIN_STEPS:
        return 1
    return max(1, min(SPLIT_MAX, steps // 2, SPLIT_PROGRAMS // tiles))


# The blocks of the pointwise, reduction and cumsum kernels on a GPU. The interpreter's block
# (a flat block of up to 1,024 elements, up to ~4,096 elements of rows a program) costs one
# interpreted program each, so it is as large as the tensor allows. On a GPU those kernels are
# small and latency-bound: tiny.yaml's step on an H100 was ~520 of them at 5.2 µs on average,
# on grids of 4-33 programs for 132 SMs, and a kernel's time grew with the elements each of
# its threads works through one after another (the conv + SiLU + norm reduction: 7.6 µs at
# 16 elements a thread in tiny.yaml, 26 µs at 32 at d_model 128). On CUDA a block is cut
# until the grid reaches GPU_PROGRAMS programs, down to one element a thread; a row is never
# split (the same rows reduce in the same order: the results are bit-identical).
GPU_PROGRAMS = 128


def pow2_floor(n: int) -> int:
    """Largest power of two <= max(n, 1)."""
    return 1 << (max(n, 1).bit_length() - 1)


def cuda_flat_block(numel: int, block: int, num_warps: int) -> int:
    """The block of a flat kernel over `numel` elements on a GPU: `block` (the interpreter's)
    cut until the grid has GPU_PROGRAMS programs, at least one element a thread (`block`
    itself with `TITANC_GPU_BLOCKS=0`, `config.gpu_blocks`)."""
    if not current().gpu_blocks:
        return block
    return max(min(block, 32 * num_warps), min(block, pow2_floor(numel // GPU_PROGRAMS)))


def cuda_row_block(n_rows: int, block_r: int, block_c: int, num_warps: int) -> int:
    """BLOCK_R of a [rows, cols] kernel on a GPU: `block_r` (the interpreter's) cut until the
    grid has GPU_PROGRAMS programs, at least one element of a row a thread (rows of
    `block_c` columns; `block_r` itself with `TITANC_GPU_BLOCKS=0`)."""
    if not current().gpu_blocks:
        return block_r
    floor = max(1, (32 * num_warps) // block_c)
    return max(min(block_r, floor), min(block_r, pow2_floor(n_rows // GPU_PROGRAMS)))


# Column reductions on a GPU. A reduction whose rows include its input's last axis (the
# contiguous one: a weight gradient's or a gate's sum over the tokens of [batch, tokens,
# channels]) has its rows side by side in memory and its columns strided. The interpreter's
# layout, a whole row a program, then makes every warp load 32 elements a row apart: 32
# sectors of 32 bytes for 64 useful ones. large_125m's segment backward has such a group
# (768 rows of 4,096 tokens, ten tensors), which took 2.2 ms a launch on an H200, and its
# layer backward one of 768 x 32,768 at 6.3 ms. On CUDA a kernel of at least
# COLUMN_ELEMENTS elements takes COLUMN_ROWS adjacent rows a program (32 bytes of bf16, the
# sector) and loops over its columns in blocks of COLUMN_TILE / COLUMN_ROWS: Triton lays the
# tile out along the contiguous rows, so a warp reads whole sectors. Smaller kernels keep a
# row a program (tiny.yaml's, 64 rows of 256: their latency, not their bytes, is the cost).
# The columns are summed block by block: another order than the interpreter's one block.
COLUMN_ELEMENTS = 1 << 18
COLUMN_ROWS = 16
COLUMN_TILE = 2048


def cuda_column_blocks(n_rows: int, n_cols: int) -> tuple[int, int] | None:
    """(BLOCK_R, BLOCK_C) on CUDA of a reduction whose rows are contiguous in memory, or None
    where it keeps the interpreter's (fewer than COLUMN_ELEMENTS elements, a row that fits
    one column block, or `TITANC_GPU_BLOCKS=0`)."""
    block_c = COLUMN_TILE // COLUMN_ROWS
    if not current().gpu_blocks or n_rows * n_cols < COLUMN_ELEMENTS or n_cols <= block_c:
        return None
    return min(COLUMN_ROWS, pow2(n_rows)), block_c


def attention_cuda_blocks(n_queries: int) -> tuple[tuple[int, int] | None,
                                                 tuple[int, int] | None]:
    """(forward, backward) (BLOCK_M, BLOCK_N) of a flash attention with 16-bit q, k, v on CUDA
    (None: the interpreter's, or the exact dots' 32 x 32 for the forward): tiles wgmma
    multiplies (64 rows a warpgroup, 8 warps) where there are at least 64 queries, the
    forward 128 x 64 from 128 queries; fewer queries, or `TITANC_GPU_BLOCKS=0`, keep the
    blocks from before (32 x 32 on mma.sync)."""
    if not current().gpu_blocks or n_queries < 64:
        return None, None
    return ((128, 64) if n_queries >= 128 else (64, 64)), (64, 64)


# What a launch costs, in a scan kernel's serial tile rounds (`codegen.scan.kernel.
# serial_rounds`). Measured on an H200 (2026-11-28, benchmarks/gpu_profile.py): a round of the
# memory-chunk scans took 0.66-0.73 µs at tiny.yaml and 0.84-0.86 µs at d_model 128, their
# steps' other kernels 4.4 µs and 6.2 µs on average: a launch is 6.7-7.4 rounds. A chunk
# recurrence whose one kernel (a program per independent index) would run more rounds than
# its host loop's launches are worth runs as the loop (`scan_kernel_for`): large_125m's
# chunk groups ran 726-2,873 rounds an iteration at 3.4 µs each on 32 programs, 6.7 of its
# 8.6 s of kernels, where the loop is 14-36 launches an iteration, each over the whole chip.
ROUNDS_PER_LAUNCH = 8
# ... and only where the loop costs at most 1/LOOP_GAIN of the kernel: a near tie keeps the
# kernel (fewer launches; a launch's worth in rounds was measured at two sizes only). tiny_lmm
# at 512 tokens: its chunk groups' backward costs 2,200 rounds as a kernel, 2,144 as a loop.
LOOP_GAIN = 2
# A split scan kernel's group barrier (its slice's programs meet through an L2 atomic and a
# spin, `codegen/scan/kernel.py` "Split kernels"), in serial tile rounds: an estimate (about
# one µs, two rounds), never measured: no split kernel has run on a GPU.
BARRIER_ROUNDS = 2


# Names bound by the launcher code every template shares (module constants are per family).
LAUNCH_LOCALS = frozenset("""
    _check _cdiv block _broadcast_strides _as_3d launch grid shape numel ok message pad strides size stride
    full tensor TILES tiles_for _tiles num_warps num_stages NUM_WARPS NUM_STAGES arch BLOCKS COLS
    cuda_constexprs
""".split())


def kernel_split_k(g: Graph, kernel: Kernel) -> int:
    """`split_k` of a schedule kernel of graph `g`: 1 unless split-K is on (`TITANC_SPLIT_K=1`,
    `config.split_k`) and it is a matmul kernel, else from
    its first einsum's batch, M, N and the longest K of its einsums (the letters of both
    operands and the output, of one operand and the output, of the operands only)."""
    if kernel.category != "matmul" or not current().split_k:
        return 1
    einsums = [g.node(n) for n in kernel.nodes if g.node(n).op is Op.EINSUM]
    if not einsums:
        return 1
    sizes = []
    for e in einsums:
        (ta, tb), out = parse_einsum(e.attr("spec"), 2)
        size = dict(zip(ta, g.node(e.inputs[0]).type.shape))
        size |= dict(zip(tb, g.node(e.inputs[1]).type.shape))
        prod = lambda letters: math.prod(size[c] for c in letters)     # noqa: E731
        sizes.append((prod(c for c in out if c in ta and c in tb),
                      prod(c for c in out if c in ta and c not in tb),
                      prod(c for c in out if c in tb and c not in ta),
                      prod(c for c in size if c not in out)))
    batch, m, n, _ = sizes[0]
    return split_k(batch, m, n, max(k for *_, k in sizes))
