"""Meta-parameter helpers shared by the family hooks: dtypes, block sizes, launcher names."""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["CARRY_REGISTER_BYTES", "INT32_LIMIT", "LAUNCH_LOCALS", "MATMUL_TILES", "Tile", "check_block", "compute_dtype",
           "dot_precision", "matmul_tiles", "needs_int64", "pow2"]

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


INT32_LIMIT = 2 ** 31

# Registers a scan kernel's program may spend on the carries it holds on chip across
# iterations (bytes), per compute capability. Every architecture here has 64 K 32-bit
# registers per SM and at most 255 per thread; a scan kernel runs 4 warps (128 threads), so
# 32 KiB is 64 registers per thread, a quarter of the most a thread may hold: the rest is for
# the stages' tiles (whole-carry dot operands included). A scan kernel's source is the same on
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


def matmul_tiles(itemsize: int, m: int, n: int, k: int) -> dict[int, Tile]:
    """Each architecture's tile for an [m, k] @ [k, n] contraction of `itemsize`-byte operands:
    the table's, each side shrunk to the problem (a power of two, >= 16 as tl.dot needs)."""
    out = {}
    for arch, by_size in MATMUL_TILES.items():
        t = by_size[itemsize]
        out[arch] = t._replace(block_m=max(16, min(t.block_m, pow2(m))),
                               block_n=max(16, min(t.block_n, pow2(n))),
                               block_k=max(16, min(t.block_k, pow2(k))))
    return out


# Names bound by the launcher code every template shares (module constants are per family).
LAUNCH_LOCALS = frozenset("""
    _check _broadcast_strides _as_3d launch grid shape numel ok message pad strides size stride
    full tensor TILES tiles_for _tiles num_warps num_stages NUM_WARPS NUM_STAGES arch
""".split())
