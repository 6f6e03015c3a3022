"""Meta-parameter helpers shared by the family hooks: dtypes, block sizes, launcher names."""

from __future__ import annotations

__all__ = ["LAUNCH_LOCALS", "check_block", "compute_dtype", "dot_precision", "pow2"]

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
    """The `input_precision=` literal of fp32 `tl.dot`s: exact ("ieee") unless tf32 is allowed."""
    return '"tf32"' if allow_tf32 else '"ieee"'


# Names bound by the launcher code every template shares (module constants are per family).
LAUNCH_LOCALS = frozenset("""
    _check _broadcast_strides _as_3d launch grid shape numel ok message pad strides size stride
    full tensor
""".split())
