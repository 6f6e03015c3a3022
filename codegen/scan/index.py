"""Index arithmetic and value references of a scan kernel (`codegen.scan`).

Coordinates are Triton expressions (strings); a `Ref` says where a body value lives (the
program's workspace region, a kernel tensor, a literal, or a view / inlined node evaluated
from its operands); a `StageTile` is one stage's tile (mask, zero offsets, load cache).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from math import prod

from titanc.ir import Graph, Node

__all__ = ["DOT_BLOCK", "MAX_CUMSUM", "MAX_TILE", "MAX_UNPACKED", "MAX_WORKSPACE", "BodyRefs",
           "GroupMiss", "PaxError", "Ref", "RegMiss", "ScanFallback", "StageTile", "TooBig",
           "bare", "bcast", "delin", "lin", "local_shape", "reshape_coords", "sum_terms"]

# Tile caps. A scan kernel is one program per (batch, memory head) running its chunk loop
# serially, so its time is the count of dependent tile rounds per iteration (`serial_rounds`),
# each a load / dot / store trip through the workspace. At 8 warps, 4096-element tiles and
# 64^3 dots cut those rounds 1.4-1.7x at tiny.yaml, 3.1x at the benchmark's d_model 128 and
# 5.4-5.7x at large_125m (against 1024 / 32^3), for about the same registers and spills on
# sm_90 (docs/gpu_kernels.md, "Scan tiles"; 8192-element tiles spilled 3.7 KB at large_125m).
MAX_TILE = 4096                 # elements of one register tile (pointwise, reduction)
MAX_CUMSUM = 1024               # longest cumsum axis done as one tl.cumsum
MAX_WORKSPACE = 1 << 24         # workspace elements per program (after liveness packing)
MAX_UNPACKED = 1 << 28          # workspace buffers per program before packing (emission guard)
DOT_BLOCK = 64                  # largest M / N / K tile of an einsum

class ScanFallback(Exception):
    """The scan cannot be one kernel; `str(self)` says why (reported to the user)."""


class PaxError(ScanFallback):
    """The candidate independent axes are mixed somewhere (try a shorter prefix)."""


class RegMiss(Exception):
    """Carry `k` of scan `scan`, held on chip, is read where its tile does not line up (a
    view, a broadcast, a looped block): emit that scan again with the carry in the workspace."""

    def __init__(self, scan: int, k: int, why: str):
        super().__init__(scan, k, why)
        self.scan, self.k, self.why = scan, k, why


class GroupMiss(Exception):
    """A pointwise stage holding several nodes reads one of its own results where the tile
    does not hold it (other coordinates, a pad's condition): end the stage before that node."""


class TooBig(PaxError):
    """This choice of independent / shared operands needs too large a workspace (another
    choice may not: operands read whole by every program make whole-size values)."""


# -- references: where a value lives --------------------------------------------------------------

@dataclass(frozen=True)
class Ref:
    """How to read a value at full coordinates.

    kind 'ws': local storage at workspace offset `base` (an expression), contiguous over the
    value's shape without its `pax` axes; 'arg': a kernel tensor `name` (full coordinates,
    through its strides), with `lead` fixed leading coordinates (an xs slice at iteration t);
    'lit': the literal `value`; 'node': a view / inlined node evaluated from its operands;
    'at': value `node` of the enclosing `scope` at leading coordinates `lead` (an xs slice,
    or a value a nested scan closes over); 'reg': a carry held on chip, the loop-carried
    tile `name` of padded shape `dims` over its local shape (zero off the shape), readable
    only by a tile whose axes are exactly the carry's (`StageTile.axes`), else `RegMiss`.
    """

    kind: str
    shape: tuple[int, ...]
    pax: tuple[int, ...] | None
    base: str = "0"
    name: str = ""
    lead: tuple[str, ...] = ()
    value: float = 0.0
    node: Node | None = None
    scope: "BodyRefs | None" = None
    dims: tuple[int, ...] = ()
    scan: int = -1                 # 'reg': the scan and carry index it belongs to
    carry: int = -1


@dataclass
class BodyRefs:
    """The references of one body graph's values during emission."""

    g: Graph
    refs: dict[int, Ref] = field(default_factory=dict)
    pax: dict[int, tuple[int, ...] | None] = field(default_factory=dict)


def _mul(c: str, s: int) -> str | None:
    if c == "0" or s == 0:
        return None
    if s == 1:
        return c
    return f"{c} * {s}"


def sum_terms(terms: list[str | None]) -> str:
    ts = [t for t in terms if t is not None and t != "0"]
    return " + ".join(ts) if ts else "0"


def delin(ix: str, shape: tuple[int, ...]) -> list[str]:
    """Coordinates of flat index `ix` over `shape` (row-major)."""
    out = []
    for j, d in enumerate(shape):
        st = prod(shape[j + 1:])
        if d == 1:
            out.append("0")
        elif j == 0 or prod(shape[:j]) == 1:
            out.append(f"({ix} // {st})" if st != 1 else f"({ix})")
        elif st == 1:
            out.append(f"({ix} % {d})")
        else:
            out.append(f"(({ix} // {st}) % {d})")
    return out


def lin(coords: list[str], shape: tuple[int, ...]) -> str:
    return sum_terms([_mul(f"({c})" if " " in c else c, prod(shape[j + 1:]))
                 for j, c in enumerate(coords)])


def local_shape(shape: tuple[int, ...], pax: tuple[int, ...] | None) -> tuple[int, ...]:
    return tuple(d for i, d in enumerate(shape) if pax is None or i not in pax)


def bcast(coords: list[str], out_shape: tuple[int, ...], shape: tuple[int, ...]) -> list[str]:
    """Coordinates of an operand of `shape` broadcast (numpy rules) to `out_shape`."""
    off = len(out_shape) - len(shape)
    return [coords[off + j] if d == out_shape[off + j] else "0" for j, d in enumerate(shape)]


def reshape_coords(c: list[str], out: tuple[int, ...], src: tuple[int, ...]) -> list[str]:
    """Coordinates in `src` of the element at `c` of its reshape to `out`."""
    so = [(i, d) for i, d in enumerate(out) if d != 1]
    ss = [(i, d) for i, d in enumerate(src) if d != 1]
    if [d for _, d in so] == [d for _, d in ss]:      # only unit axes added or removed
        res = ["0"] * len(src)
        for (io, _), (is_, _) in zip(so, ss):
            res[is_] = c[io]
        return res
    flat = lin(c, out)
    return delin(f"({flat})", src)


def bare(c: str) -> str:
    """`c` without redundant outer parentheses ("(rm3)" -> "rm3")."""
    c = c.strip()
    while c.startswith("(") and c.endswith(")"):
        depth = 0
        for i, ch in enumerate(c):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0 and i < len(c) - 1:
                return c
        c = c[1:-1].strip()
    return c


@dataclass
class StageTile:
    """One stage's tile: its mask, a zero offset tile (so every pointer is a tile), load cache."""

    mask: str | None           # None: every element of the tile is in bounds
    zero: str
    cache: dict = field(default_factory=dict)
    vars: tuple[str, ...] = ()                 # the tile's index variables
    flat: tuple[str, tuple[int, ...], tuple[str, ...]] | None = None   # (ix, shape, coords)
    # the tile's whole axes: (index variable, extent) of each axis that spans [0, extent) in
    # one block, in the tile's axis order (a register carry is read only through these)
    axes: tuple[tuple[str, int], ...] = ()
    # workspace buffers (`Ref.base`) this stage writes: read back only from `cache` (the
    # registers that hold them), never loaded (no barrier separates the store)
    written: set = field(default_factory=set)

