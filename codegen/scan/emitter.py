"""The scan kernel being emitted: its lines, fresh names, workspace buffers and tile helpers.

`ScanEmitter` holds the state of one kernel's emission (the lines with their indentation,
the workspace buffers with symbolic offsets, the host tables, the stage count, the carries
held on chip) and the small helpers every stage uses: names, masks, pointers, stores,
barriers, loops over blocks. What the stages emit lives in modules of their own (`values`,
`stages`, `einsum`, `reduce`, `carries`, `loops`); `read` is how a rule of the TRITON_SCAN
table (`rules.py`) reads an operand.
"""
from __future__ import annotations

import re
from contextlib import contextmanager
from math import prod
from typing import Iterator

from titanc.ir import Graph, Node

from titanc.codegen.scan.index import (MAX_UNPACKED, MAX_WORKSPACE, BodyRefs, Ref, StageTile,
                                       TooBig, lin, local_shape, sum_terms)
from titanc.codegen.scan.pack import BARRIER, pack, wsoff
from titanc.codegen.scan.values import value

__all__ = ["SUB_LOOP", "ScanEmitter"]

# a split kernel's stage: the sub-programs this program runs (`ScanEmitter.stage`)
SUB_LOOP = "for sub in range(sub_lo, sub_hi):"


class ScanEmitter:
    """One scan kernel's emission state and helpers (the module's docstring)."""

    def __init__(self, g: Graph, scan: Node, cd: str, prefix: tuple[int, ...]):
        self.g, self.scan, self.cd, self.prefix = g, scan, cd, prefix
        self.p = len(prefix)
        self.lines: list[str] = []
        self.depth = 1
        self.n = 0
        self.ws = 0                   # workspace elements per program (packed at the end)
        self.sizes: list[int] = []    # elements of each workspace buffer (`pack.wsoff`)
        self.index = "tl.int64"       # integer type of index tiles (int32 where offsets fit)
        self.tables: list[tuple[str, dict]] = []
        self.stages = 0
        self.loop_depth = 0
        self.pc = [f"pc{i}" for i in range(self.p)]
        self.tiles: set[str] = set()          # names holding full tiles
        self.loads: set[str] = set()          # names holding masked loads (0 off the mask)
        self.shared = 0               # workspace elements of values every program computes whole
        self.low_args: set[str] = set()       # kernel tensors holding bf16 (loaded, then widened)
        self.carry_pax: dict[tuple[int, int], tuple[int, ...]] = {}
        self.grouped = False
        self.precision = '"ieee"'
        self.dot16 = False            # a dot takes 16-bit operands: the kernel has DOT_F32
        # carries on chip: the budget (bytes per program), what enclosing loops hold, the
        # carries found unreadable on chip (scan, k) -> why, and one note per emitted carry
        self.reg_budget = 0
        self.reg_bytes = 0
        self.reg_demoted: dict[tuple[int, int], str] = {}
        self.carry_notes: list[dict] = []
        # a split kernel (`render_scan(split=)`): the programs sharing a slice, and whether the
        # stage being emitted is still to hand its blocks out over them (`stage`, `open_loop`)
        self.split = 1
        self.in_stage = False
        self.undistributed = False

    # -- lines and names ---------------------------------------------------------------------
    def line(self, s: str) -> None:
        self.lines.append("    " * self.depth + s)

    def fresh(self, prefix: str = "v") -> str:
        self.n += 1
        return f"{prefix}{self.n}"

    def let(self, expr: str, prefix: str = "v", tile: bool = False) -> str:
        name = self.fresh(prefix)
        self.line(f"{name} = {expr}")
        if tile:
            self.tiles.add(name)
        return name

    def open_loop(self, var: str, total: int, block: int, independent: bool = False) -> str:
        """`var` = start of the block: a loop when `total` needs more than one block. In a
        split kernel the first `independent` loop of a stage (its blocks write disjoint
        outputs) hands its blocks out round-robin over the slice's sub-programs (`stage`)."""
        if total > block:
            if independent and self.undistributed:
                self.undistributed = False
                self.line(f"for {var} in range(sub * {block}, {total}, {block * self.split}):")
            else:
                self.line(f"for {var} in range(0, {total}, {block}):")
            self.depth += 1
            return var
        return "0"

    def open_batch(self, var: str, total: int) -> None:
        """`for var in range(0, total)` (total > 1): a batch loop of independent blocks,
        handed out like `open_loop`'s."""
        if self.undistributed:
            self.undistributed = False
            self.line(f"for {var} in range(sub, {total}, {self.split}):")
        else:
            self.line(f"for {var} in range(0, {total}):")
        self.depth += 1

    @contextmanager
    def stage(self) -> Iterator[None]:
        """One stage's work. In a split kernel (`split` > 1) it runs inside
        `for sub in range(sub_lo, sub_hi):` (`SUB_LOOP`): on a GPU each program of a slice
        runs its own sub-program (one trip), under SPLIT_SERIAL one program runs all of
        them in turn; the stage's first independent loop gives sub-program `sub` every
        `split`-th block from block `sub` (`open_loop`). A stage with no such loop runs on
        sub-program 0 alone (`kernel.split_stages` rewrites its header). Elsewhere nothing."""
        if self.split == 1 or self.in_stage:
            yield
            return
        self.line(SUB_LOOP)
        self.depth += 1
        self.in_stage = self.undistributed = True
        try:
            yield
        finally:
            self.depth -= 1
            self.in_stage = self.undistributed = False

    def close(self, opened: str) -> None:
        if opened != "0":
            self.depth -= 1

    def barrier(self) -> None:
        if self.grouped:
            return
        self.line(BARRIER)
        self.stages += 1

    @contextmanager
    def group(self) -> Iterator[None]:
        """Stages that touch disjoint storage (the carries' copies, the ys) as one stage:
        a single barrier after the last."""
        outer, self.grouped = self.grouped, True
        start = len(self.lines)
        try:
            yield
        finally:
            self.grouped = outer
        if len(self.lines) > start:
            self.barrier()

    # -- workspace ---------------------------------------------------------------------------
    def alloc(self, numel: int) -> str:
        """A workspace buffer of `numel` elements: its symbolic offset (`pack.pack` assigns
        the address once every lifetime is known)."""
        self.sizes.append(-(-max(numel, 1) // 16) * 16)
        if sum(self.sizes) > MAX_UNPACKED:
            raise TooBig(f"workspace buffers of more than {MAX_UNPACKED} elements per "
                         "program before packing")
        return wsoff(len(self.sizes) - 1)

    def local_ref(self, shape: tuple[int, ...], pax: tuple[int, ...] | None) -> Ref:
        """A new workspace buffer for a value of `shape` (its local slice)."""
        if pax is None and self.p:
            self.shared += prod(shape)
        return Ref("ws", shape, pax, base=self.alloc(prod(local_shape(shape, pax))))

    def pack(self) -> None:
        """Give buffers with disjoint lifetimes the same addresses (`pack.pack`)."""
        self.lines, self.ws = pack(self.lines, self.sizes)
        if self.ws > MAX_WORKSPACE:
            raise TooBig(f"a packed workspace of {self.ws} > {MAX_WORKSPACE} elements "
                         "per program")

    # -- tiles, masks, pointers --------------------------------------------------------------
    def arange(self, n: int | str) -> str:
        """`tl.arange(0, n)` in the index type (`tl.arange` is int32 already)."""
        return f"tl.arange(0, {n})" if self.index == "tl.int32" else \
            f"tl.arange(0, {n}).to({self.index})"

    def zero_tile(self, shape: str) -> str:
        """A zero index tile of `shape` (so that every pointer expression is a tile)."""
        return f"tl.full({shape}, 0, dtype={self.index})"

    @property
    def itemsize(self) -> int:
        return 8 if self.cd == "tl.float64" else 4

    def full_coords(self, local: list[str], shape: tuple[int, ...],
                    pax: tuple[int, ...] | None) -> list[str]:
        """Full coordinates of a value of `shape`: `local` ones, the program's on `pax`."""
        it = iter(local)
        return [self.pc[pax.index(i)] if pax is not None and i in pax else next(it)
                for i in range(len(shape))]

    def ptr(self, sec: StageTile, ref: Ref, coords: list[str]) -> str:
        """A pointer tile: `addr`, broadcast by the zero tile when it has no tile index."""
        a = self.addr(ref, coords, sec)
        if not sec.vars or not all(re.search(rf"\b{v}\b", a) for v in sec.vars):
            a += f" + {sec.zero}"
        return a

    def addr(self, ref: Ref, coords: list[str], sec: StageTile | None = None) -> str:
        if ref.kind == "ws":
            local = [c for i, c in enumerate(coords) if ref.pax is None or i not in ref.pax]
            shape = local_shape(ref.shape, ref.pax)
            if sec is not None and sec.flat is not None and sec.flat[1:] == (shape, tuple(local)):
                return f"ws_ptr + pbase + {sum_terms([ref.base, sec.flat[0]])}"   # contiguous
            return f"ws_ptr + pbase + {sum_terms([ref.base, lin(local, shape)])}"
        full = list(ref.lead) + coords
        terms = [None if c == "0" else f"s_{ref.name}_{j}" if c == "1"
                 else f"({c}) * s_{ref.name}_{j}" for j, c in enumerate(full)]
        return f"{ref.name}_ptr + {sum_terms(terms)}"

    def full(self, x: str, shape: str) -> str:
        """`x` as a full tile of `shape` (a scalar expression is broadcast)."""
        return x if x in self.tiles else f"({x}) + tl.full({shape}, 0, dtype={self.cd})"

    def masked(self, x: str, mask: str | None, shape: str, fill: str = "0.0") -> str:
        """`x` with `fill` outside `mask` (a masked load already holds 0 there; None: the
        tile has no element outside)."""
        if mask is None:
            return self.full(x, shape)
        if x in self.loads and fill == "0.0":
            return x
        return self.let(f"tl.where({mask}, {self.full(x, shape)}, {fill})", "op", tile=True)

    def store(self, ptr: str, value: str, mask: str | None) -> None:
        self.line(f"tl.store({ptr}, {value}" + (f", mask={mask})" if mask else ")"))

    def mask(self, *conds: str | None) -> str | None:
        """The tile mask of `conds` (None: each is statically true, `in_bounds`), bound to a
        name."""
        kept = [c for c in conds if c is not None]
        return self.let(" & ".join(kept), "m") if kept else None

    @staticmethod
    def in_bounds(var: str, extent: int, block: int) -> str | None:
        """`var < extent` for an index tile `start + arange(block)` whose starts step by
        `block` from 0 below `extent`: None where every block is whole (`block` divides
        `extent`), so the condition holds for every element and costs nothing."""
        return None if extent % block == 0 else f"({var} < {extent})"

    # -- values ------------------------------------------------------------------------------
    def read(self, sec: StageTile, sc: BodyRefs, vid: int, coords: list[str],
             conds: tuple[str, ...] = ()) -> str:
        """Value `vid` of scope `sc` at `coords`, 0 where `conds` fail (`values.value`)."""
        return value(self, sec, sc, vid, coords, conds)

    def rounded(self, n: Node, x: str) -> str:
        """`x`, the value of node `n` computed in `cd`, rounded to bf16 when `n` is a bf16
        value (as its storage would round it on the cpu target)."""
        return f"_bf16(({x}).to(tl.float32)).to({self.cd})" if n.type.dtype == "bf16" else x
