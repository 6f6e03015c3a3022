"""Scan kernels, part 2: stages (elementwise, einsum, reductions, cumsums) and scan loops.

`_ScanGen` emits each computed body node as a stage over the program's local slice, each
nested scan as a loop with ping-pong carry slots, and the top-level scan's outputs.
"""
from __future__ import annotations

from math import prod
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from titanc.ir import Graph, Node, Op, OpGroup

from titanc.codegen.meta import mma16, pow2, value_dtype
from titanc.codegen.render import sanitize_comment
from titanc.codegen.scan.index import (DOT_BLOCK, MAX_CUMSUM, MAX_TILE, Ref, ScanFallback, BodyRefs, StageTile,
                         _GroupMiss, _PaxError, _RegMiss, _delin, _local)
from titanc.codegen.scan.values import LOW_CASTS, _ScanEmitter


# float32 and float64 dots share no stage: two at once took tiny.yaml's chunk backward from
# 72 to 364 B spilled a thread on sm_90 (exact), and to 412 B (tf32); tests set it to check
# a shared stage's values in float64
SHARED_EXACT_DOTS = False


@dataclass(frozen=True)
class _Contraction:
    """An einsum's letters (the independent axes' aside, `pref`: letter -> program
    coordinate) grouped into batch / M / N / K, their sizes, and the blocks of M, N, K."""

    ta: str
    tb: str
    out: str
    size: dict[str, int]
    pref: dict[str, str]
    batch: list[str]
    ms: list[str]
    ns: list[str]
    ks: list[str]
    NB: int
    M: int
    N: int
    K: int
    BM: int
    BN: int
    BK: int

    @property
    def one_block(self) -> bool:
        """No batch, M, N or K loop: straight-line code."""
        return self.NB == 1 and self.M <= self.BM and self.N <= self.BN and self.K <= self.BK

    def letters(self, cs: list[str], ix: str) -> dict[str, str]:
        """Coordinates of letters `cs` (grouped) at flat index `ix`."""
        return dict(zip(cs, _delin(ix, tuple(self.size[c] for c in cs))))


@dataclass
class _OpenEinsum:
    """An einsum emitted up to its operand tiles (`_ScanGen._einsum_open`)."""

    n: Node
    dest: Ref
    c: _Contraction
    sc: BodyRefs
    base: dict[str, str]          # batch and independent letters' coordinates
    loops: tuple[str, str, str]   # m0, n0, k0 ("0": no loop)
    rm: str
    rn: str
    acc: str
    tiles: list[str]


class _Redo(Exception):
    """A carry turned out to vary per program: emit its scan again with that `pax`."""

    def __init__(self, scan: int, k: int, pax: tuple[int, ...]):
        super().__init__(scan, k, pax)
        self.scan, self.k, self.pax = scan, k, pax


class _ScanGen(_ScanEmitter):
    """Stages (elementwise, einsum, reductions, cumsums) and the scan loops."""

    def __init__(self, *args: Any, **kw: Any):
        super().__init__(*args, **kw)
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

    def full_coords(self, local: list[str], shape: tuple[int, ...],
                    pax: tuple[int, ...] | None) -> list[str]:
        it = iter(local)
        return [self.pc[pax.index(i)] if pax is not None and i in pax else next(it)
                for i in range(len(shape))]

    def _open_loop(self, var: str, total: int, block: int) -> str:
        """`var` = start of the block: a loop when `total` needs more than one block."""
        if total > block:
            self.line(f"for {var} in range(0, {total}, {block}):")
            self.depth += 1
            return var
        return "0"

    def _close(self, opened: str) -> None:
        if opened != "0":
            self.depth -= 1

    def barrier(self) -> None:
        if self.grouped:
            return
        self.line("tl.debug_barrier()")
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

    # -- stages -----------------------------------------------------------------------------------
    def pointwise_stage(self, label: str, shape: tuple[int, ...], pax: tuple[int, ...] | None,
                        dest: Ref, lead: tuple[str, ...],
                        expr: Callable[[StageTile, list[str]], str], guard: bool = False) -> None:
        """dest[lead + c] = expr(c) for every c of `shape` local to the program: flat tiles,
        or, where that reads a carry held on chip, one tile of the local shape (its axes the
        carry's)."""
        self.line(f"# {sanitize_comment(label)}")
        L = _local(shape, pax)
        mark = (len(self.lines), self.depth)
        try:
            self._flat_stage(shape, pax, L, dest, lead, expr, guard)
        except _RegMiss:
            dims = tuple(pow2(d, 16) for d in L)
            if not L or len(L) > 2 or prod(dims) * self.itemsize > max(self.reg_budget, 1):
                raise
            del self.lines[mark[0]:]
            self.depth = mark[1]
            sec, c, tshape = self.whole_tile(shape, pax, dims, guard)
            r = expr(sec, c)
            self.store(self.ptr(sec, dest, list(lead) + c), self.full(r, tshape), sec.mask)
        self.barrier()

    def _flat_stage(self, shape: tuple[int, ...], pax: tuple[int, ...] | None,
                    L: tuple[int, ...], dest: Ref, lead: tuple[str, ...],
                    expr: Callable[[StageTile, list[str]], str], guard: bool) -> None:
        N = prod(L)
        B = min(pow2(N, 16), MAX_TILE)
        o = self._open_loop(self.fresh("o"), N, B)
        ix = self.let(f"{o} + {self.arange(B)}" if o != "0"
                      else f"{self.arange(B)}", "i")
        z = self.let(self.zero_tile(f"[{B}]"), "z")
        m = self.mask(self.in_bounds(ix, N, B), f"((pid + {z}) == 0)" if guard else None)
        local = _delin(ix, L)
        sec = StageTile(m, z, vars=(ix,), flat=(ix, L, tuple(local)),
                   axes=((ix, B),) if len(L) == 1 and o == "0" else ())
        c = self.full_coords(local, shape, pax)
        r = expr(sec, c)
        self.store(self.ptr(sec, dest, list(lead) + c), self.full(r, f'[{B}]'), m)
        self._close(o)

    # -- carries on chip ----------------------------------------------------------------------------
    @property
    def itemsize(self) -> int:
        return 8 if self.cd == "tl.float64" else 4

    def whole_tile(self, shape: tuple[int, ...], pax: tuple[int, ...] | None,
                   dims: tuple[int, ...], guard: bool = False) -> tuple[StageTile, list[str], str]:
        """One tile over the local shape of `shape`, padded to `dims` (a carry's tile): the
        StageTile, the full coordinates of its elements and its shape literal (rank 0: one element
        of a 16-wide tile)."""
        L = _local(shape, pax)
        if not L:
            ix = self.let(f"{self.arange(16)}", "i")
            z = self.let(self.zero_tile("[16]"), "z")
            m = self.let(f"({ix} < 1)" + (f" & ((pid + {z}) == 0)" if guard else ""), "m")
            return StageTile(m, z, vars=(ix,)), self.full_coords([], shape, pax), "[16]"
        axes = []
        for j, P in enumerate(dims):
            sfx = "" if len(dims) == 1 else "[:, None]" if j == 0 else "[None, :]"
            axes.append(self.let(f"{self.arange(P)}{sfx}", "r"))
        tshape = f"[{', '.join(map(str, dims))}]"
        z = self.let(self.zero_tile(tshape), "z")
        m = self.mask(*(self.in_bounds(a, d, P) for a, d, P in zip(axes, L, dims)),
                      f"((pid + {z}) == 0)" if guard else None)
        return (StageTile(m, z, vars=tuple(axes), axes=tuple(zip(axes, dims))),
                self.full_coords(axes, shape, pax), tshape)

    def reg_value(self, sc: BodyRefs, vid: int, shape: tuple[int, ...],
                  pax: tuple[int, ...] | None, dims: tuple[int, ...]) -> str:
        """A register tile (a carry's) holding value `vid` of `sc`, zero off its shape."""
        sec, c, tshape = self.whole_tile(shape, pax, dims)
        v = self.value(sec, sc, vid, c)
        full = self.full(v, tshape) if sec.mask is None else \
            f"tl.where({sec.mask}, {self.full(v, tshape)}, 0.0)"
        if not dims:
            return self.let(f"tl.sum({full}, axis=0).to({self.cd})", "cn")
        return self.let(f"({full}).to({self.cd})", "cn", tile=True)

    def reg_store(self, var: str, dims: tuple[int, ...], shape: tuple[int, ...],
                  pax: tuple[int, ...] | None, dest: Ref, guard: bool = False) -> None:
        """dest = the register tile `var` (a carry's final value)."""
        sec, c, tshape = self.whole_tile(shape, pax, dims, guard)
        x = var if dims else f"({var}) + tl.full([16], 0, dtype={self.cd})"
        self.store(self.ptr(sec, dest, c), x, sec.mask)

    def reg_why(self, scan: int, k: int, local: tuple[int, ...], nests: bool) -> str | None:
        """Why carry `k` of `scan` stays in the workspace (None: it is held on chip).
        `nests`: the scan's body holds a scan (whose loop gets the registers: a carry held
        across it would stay live through every inner stage)."""
        if (scan, k) in self.reg_demoted:
            return self.reg_demoted[(scan, k)]
        if nests:
            return "its loop holds a nested scan, whose carries and stages get the registers"
        if len(local) > 2:
            return (f"its local tile {list(local)} has rank {len(local)} (carries on chip are "
                    "tiles of rank <= 2)")
        b = prod(pow2(d, 16) for d in local) * self.itemsize
        if self.reg_bytes + b > self.reg_budget:
            return (f"{b} B would pass the budget of {self.reg_budget} B of registers per "
                    f"program for carries ({self.reg_bytes} B taken)")
        return None

    def _is_reg(self, sc: BodyRefs, v: int) -> bool:
        ref = sc.refs[v]
        while ref.kind == "at" and not ref.lead and ref.scope is not None:
            ref = ref.scope.refs[ref.node.id]
        return ref.kind == "reg"

    def _contraction(self, sc: BodyRefs, n: Node) -> _Contraction:
        """Einsum `n`'s letters, sizes and blocks (an operand held on chip is one tile: its
        letters get whole blocks)."""
        terms, out = n.attr("spec").split("->")
        tt = terms.split(",")
        if len(tt) != 2 or any(len(set(t)) != len(t) for t in tt + [out]):
            raise ScanFallback(f"%{n.id}: einsum {n.attr('spec')} is not a two-operand "
                               "contraction")
        ta, tb = tt
        ia, ib = n.inputs
        size = {ch: d for t, v in ((ta, ia), (tb, ib)) for ch, d in
                zip(t, sc.g.node(v).type.shape)}
        q = sc.pax[n.id]
        pref = {out[x]: self.pc[i] for i, x in enumerate(q)} if q is not None else {}
        batch = [c for c in out if c in ta and c in tb and c not in pref]
        ms = [c for c in out if c in ta and c not in tb and c not in pref]
        ns = [c for c in out if c in tb and c not in ta and c not in pref]
        ks = [c for c in dict.fromkeys(ta + tb) if c not in out]
        gsize = lambda cs: prod(size[c] for c in cs)
        NB, M, N, K = gsize(batch), gsize(ms), gsize(ns), gsize(ks)
        whole = {ch for t, v in ((ta, ia), (tb, ib)) if self._is_reg(sc, v) for ch in t}
        BM, BN, BK = (pow2(x, 16) if whole & set(cs) else min(pow2(x, 16), DOT_BLOCK)
                      for x, cs in ((M, ms), (N, ns), (K, ks)))
        return _Contraction(ta, tb, out, size, pref, batch, ms, ns, ks, NB, M, N, K, BM, BN, BK)

    def _einsum_shares(self, sc: BodyRefs, n: Node) -> bool:
        """May einsum `n` share a stage with others (`einsum_stage`): one block (no batch,
        M, N or K loop: straight-line code) of 16-bit operands (the bf16 MMA). Two float32
        dots at once spilled: exact ones are FMAs, and tf32 ones hold float32 operand tiles
        (`SHARED_EXACT_DOTS`)."""
        mma = mma16(self.cd.removeprefix("tl."),
                    [value_dtype(sc.g, v) for v in n.inputs]) is not None
        return self._contraction(sc, n).one_block and (mma or SHARED_EXACT_DOTS)

    def einsum_stage(self, sc: BodyRefs, run: list[tuple[Node, Ref]]) -> None:
        """Each einsum of `run` as `tl.dot` on [M, K] x [K, N] tiles, then one barrier. A run
        of several (`_joins_einsums`: one block each, none reading another's result) loads
        every member's operands first, then multiplies and stores them all: one round."""
        opened = [self._einsum_open(sc, n, dest) for n, dest in run]
        for op in opened:
            self._einsum_close(op)
        self.barrier()

    def _einsum_open(self, sc: BodyRefs, n: Node, dest: Ref) -> _OpenEinsum:
        """Emit einsum `n` up to its operand tiles (opening its batch, M, N and K loops)."""
        c = self._contraction(sc, n)
        ia, ib = n.inputs
        self.line(f"# %{n.id} = einsum[{n.attr('spec')}]: [{c.M}, {c.K}] x [{c.K}, {c.N}], "
                  f"{c.NB} local batch")
        zb = "0"
        if c.NB > 1:
            zb = self.fresh("zb")
            self.line(f"for {zb} in range(0, {c.NB}):")
            self.depth += 1
        m0 = self._open_loop(self.fresh("m"), c.M, c.BM)
        n0 = self._open_loop(self.fresh("n"), c.N, c.BN)
        rm = self.let(f"({m0} + {self.arange(c.BM)})[:, None]", "rm")
        rn = self.let(f"({n0} + {self.arange(c.BN)})[None, :]", "rn")
        acc = self.let(f"tl.full([{c.BM}, {c.BN}], 0, dtype={self.cd})", "acc")
        k0 = self._open_loop(self.fresh("k"), c.K, c.BK)
        ka = self.let(f"({k0} + {self.arange(c.BK)})[None, :]", "ka")
        kb = self.let(f"({k0} + {self.arange(c.BK)})[:, None]", "kb")
        base = {**c.pref, **c.letters(c.batch, zb)}
        tiles = []
        wm, wn, wk = m0 == "0", n0 == "0", k0 == "0"
        for t, v, rows, cols, rdim, cdim, rsz, csz, axes in (
                (c.ta, ia, rm, ka, c.ms, c.ks, c.M, c.K, ((rm, c.BM, wm), (ka, c.BK, wk))),
                (c.tb, ib, kb, rn, c.ks, c.ns, c.K, c.N, ((kb, c.BK, wk), (rn, c.BN, wn)))):
            lmap = {**base, **c.letters(rdim, rows), **c.letters(cdim, cols)}
            mask = self.mask(self.in_bounds(rows, rsz, axes[0][1]),
                             self.in_bounds(cols, csz, axes[1][1]))
            shape = f"[{c.BM if t == c.ta else c.BK}, {c.BK if t == c.ta else c.BN}]"
            sec = StageTile(mask, self.let(self.zero_tile(shape), "z"), vars=(rows, cols),
                       axes=tuple((a, e) for a, e, w in axes if w))
            x = self.value(sec, sc, v, [lmap[ch] for ch in t])
            tiles.append(self.masked(x, mask, shape))
        return _OpenEinsum(n, dest, c, sc, base, (m0, n0, k0), rm, rn, acc, tiles)

    def _einsum_close(self, op: _OpenEinsum) -> None:
        """Emit the rest of an opened einsum: its dot, the K loop's end, the store, and the M,
        N and batch loops' ends."""
        n, c, acc, tiles = op.n, op.c, op.acc, op.tiles
        m0, n0, k0 = op.loops
        # the workspace stores `cd` (never 16 bits): the operands' values decide
        op16 = mma16(self.cd.removeprefix("tl."), [value_dtype(op.sc.g, v) for v in n.inputs])
        if op16 is None:
            self.line(f"{acc} += tl.dot({tiles[0]}, {tiles[1]}, input_precision={self.precision})")
        else:       # bf16 values held in `cd`: exact in 16 bits, the MMA accumulates in float32
            self.dot16 = True
            a, b = (self.let(f"{t}.to(tl.{op16})", "h", True) for t in tiles)
            self.line("if DOT_F32:  # interpreter (it multiplies 16-bit floats as integers)")
            self.line(f'    {acc} += tl.dot({a}.to({self.cd}), {b}.to({self.cd}), '
                      'input_precision="ieee")')
            self.line(f"else:        # 16-bit MMA, float32 accumulation")
            self.line(f"    {acc} += tl.dot({a}, {b})")
        self._close(k0)
        lmap = {**op.base, **c.letters(c.ms, op.rm), **c.letters(c.ns, op.rn)}
        mask = self.mask(self.in_bounds(op.rm, c.M, c.BM), self.in_bounds(op.rn, c.N, c.BN))
        sec = StageTile(mask, self.let(self.zero_tile(f"[{c.BM}, {c.BN}]"), "z"),
                        vars=(op.rm, op.rn))
        self.store(self.ptr(sec, op.dest, [lmap[ch] for ch in c.out]), self.rounded(n, acc),
                   mask)
        self._close(n0)
        self._close(m0)
        if c.NB > 1:
            self.depth -= 1

    def reduce_stage(self, sc: BodyRefs, run: list[tuple[Node, Ref]]) -> None:
        """SUM / AMAX over axes, or CUMSUM along one: a [rows, cols] tile per step; where
        that reads a carry held on chip, a SUM / AMAX over one tile of the local shape. A run
        of reductions alike (`_reduce_key`) that read none of each other's results is one
        stage: one loop over their common tile, every member's loads in the same round, one
        barrier; where a member reads a carry on chip, each is a stage of its own."""
        mark = (len(self.lines), self.depth)
        try:
            self._reduce_rows(sc, run)
            self.barrier()
            return
        except _RegMiss:
            if len(run) == 1:
                n, dest = run[0]
                x = n.inputs[0]
                L = _local(sc.g.node(x).type.shape, sc.pax.get(x))
                dims = tuple(pow2(d, 16) for d in L)
                if n.op is Op.CUMSUM or not L or len(L) > 2 or \
                        prod(dims) * self.itemsize > max(self.reg_budget, 1):
                    raise
            del self.lines[mark[0]:]
            self.depth = mark[1]
        if len(run) > 1:
            for member in run:
                self.reduce_stage(sc, [member])
            return
        n, dest = run[0]
        x = n.inputs[0]
        L = _local(sc.g.node(x).type.shape, sc.pax.get(x))
        self._reduce_whole(sc, n, dest, tuple(pow2(d, 16) for d in L))
        self.barrier()

    @staticmethod
    def _reduce_key(sc: BodyRefs, n: Node) -> tuple:
        """Reductions with equal keys share a stage's loops: the op, its input's shape and
        independent axes, and what it reduces along."""
        x = sc.g.node(n.inputs[0])
        a = n.attr_dict
        along = (a["axis"] % x.type.rank, a["reverse"]) if n.op is Op.CUMSUM else \
            (tuple(sorted(v % x.type.rank for v in a["axes"])), a["keepdim"])
        return (n.op, x.type.shape, sc.pax.get(n.inputs[0]), along)

    def _reduce_whole(self, sc: BodyRefs, n: Node, dest: Ref, dims: tuple[int, ...]) -> None:
        x = n.inputs[0]
        xs, qx = sc.g.node(x).type.shape, sc.pax.get(x)
        axes = sorted(a % len(xs) for a in n.attr("axes"))
        lx = [i for i in range(len(xs)) if qx is None or i not in qx]
        self.line(f"# %{n.id} = {n.op.name.lower()}: over {[xs[a] for a in axes]} of one tile")
        sec, c, tshape = self.whole_tile(xs, qx, dims)
        is_max = n.op is Op.AMAX
        fill = 'float("-inf")' if is_max else "0.0"
        y = self.masked(self.value(sec, sc, x, c), sec.mask, tshape, fill)
        for pos in sorted((lx.index(a) for a in axes), reverse=True):
            y = self.let(f"tl.{'max' if is_max else 'sum'}({y}, axis={pos}, keep_dims=True)",
                         "y", True)
        var = dict(zip(lx, (v for v, _ in sec.axes)))
        yshape = [1 if i in axes else dims[j] for j, i in enumerate(lx)]
        zo = self.let(self.zero_tile(str(yshape)), "z")
        mo = self.let(" & ".join([f"({var[i]} < {xs[i]})" for i in lx if i not in axes]
                                 + [f"({zo} == 0)"]), "m")
        oc = [self.pc[qx.index(i)] if qx is not None and i in qx else "0" if i in axes
              else var[i] for i in range(len(xs))]
        out_c = oc if n.attr("keepdim") else [oc[i] for i in range(len(xs)) if i not in axes]
        self.line(f"tl.store({self.ptr(StageTile(mo, zo, vars=()), dest, out_c)}, {y}, mask={mo})")

    def _reduce_rows(self, sc: BodyRefs, run: list[tuple[Node, Ref]]) -> None:
        n = run[0][0]
        x = n.inputs[0]
        xs = sc.g.node(x).type.shape
        qx = sc.pax.get(x)
        if n.op is Op.CUMSUM:
            axes = [n.attr("axis") % len(xs)]
        else:
            axes = sorted(a % len(xs) for a in n.attr("axes"))
        kept = [i for i in range(len(xs)) if i not in axes]
        rloc = [i for i in kept if qx is None or i not in qx]        # row axes (local)
        O = prod(xs[i] for i in rloc)
        Rn = prod(xs[i] for i in axes)
        if n.op is Op.CUMSUM and Rn > MAX_CUMSUM:
            raise ScanFallback(f"%{n.id}: cumsum over {Rn} > {MAX_CUMSUM} elements")
        BR = pow2(Rn, 2) if n.op is Op.CUMSUM else min(pow2(Rn, 2), MAX_TILE)
        BO = max(2, min(pow2(O, 2), MAX_TILE // BR))
        self.line("# " + sanitize_comment(", ".join(f"%{m.id} = {m.op.name.lower()}"
                                                    for m, _ in run)
                                          + f": {O} rows of {Rn}"))
        o = self._open_loop(self.fresh("o"), O, BO)
        ix = self.let(f"({o} + {self.arange(BO)})[:, None]", "r")
        jx_ = self.fresh("j")
        row_c = dict(zip(rloc, _delin(ix, tuple(xs[i] for i in rloc))))

        def in_coords(jx: str, m: Node) -> list[str]:
            col_c = dict(zip(axes, _delin(jx, tuple(xs[i] for i in axes))))
            if m.op is Op.CUMSUM and m.attr("reverse"):
                col_c = {a: f"({Rn - 1} - {jx})" for a in axes}
            return [self.pc[qx.index(i)] if qx is not None and i in qx else
                    row_c[i] if i in row_c else col_c[i] for i in range(len(xs))]

        rmask = self.in_bounds(ix, O, BO)
        if n.op is Op.CUMSUM:
            jx = self.let(f"{self.arange(BR)}[None, :]", "j")
            mask = self.mask(rmask, self.in_bounds(jx, Rn, BR))
            sec = StageTile(mask, self.let(self.zero_tile(f"[{BO}, {BR}]"), "z"), vars=(ix, jx))
            vals = [self.value(sec, sc, m.inputs[0], in_coords(jx, m)) for m, _ in run]
            for (m, dest), v in zip(run, vals):
                y = self.let(f"tl.cumsum({self.masked(v, mask, f'[{BO}, {BR}]')}, axis=1)", "y")
                self.store(self.ptr(sec, dest, in_coords(jx, m)), y, mask)
        else:
            is_max = n.op is Op.AMAX
            fill = 'float("-inf")' if is_max else "0.0"
            accs = [self.let(f"tl.full([{BO}, {BR}], {fill}, dtype={self.cd})", "acc")
                    for _ in run]
            r0 = self._open_loop(self.fresh("c"), Rn, BR)
            jx = self.let(f"({r0} + {self.arange(BR)})[None, :]", jx_)
            mask = self.mask(rmask, self.in_bounds(jx, Rn, BR))
            sec = StageTile(mask, self.let(self.zero_tile(f"[{BO}, {BR}]"), "z"), vars=(ix, jx))
            vals = [self.value(sec, sc, m.inputs[0], in_coords(jx, m)) for m, _ in run]
            for acc, v in zip(accs, vals):
                v = self.masked(v, mask, f"[{BO}, {BR}]", fill)
                self.line(f"{acc} = tl.maximum({acc}, {v})" if is_max else f"{acc} += {v}")
            self._close(r0)
            sec = StageTile(rmask, self.let(self.zero_tile(f"[{BO}, 1]"), "z"), vars=(ix,))
            for (m, dest), acc in zip(run, accs):
                red = self.let(f"tl.{'max' if is_max else 'sum'}({acc}, axis=1, "
                               "keep_dims=True)", "y")
                oc = in_coords("0", m)
                out_c = ([oc[i] for i in range(len(xs))] if m.attr("keepdim")
                         else [oc[i] for i in kept])
                self.store(self.ptr(sec, dest, out_c), red, rmask)
        self._close(o)

    # -- bodies -----------------------------------------------------------------------------------
    def uses(self, g: Graph, vid: int) -> int:
        return len(g.users(vid)) + sum(1 for _, v in g.outputs if v == vid)

    def local_ref(self, shape: tuple[int, ...], pax: tuple[int, ...] | None) -> Ref:
        if pax is None and self.p:
            self.shared += prod(shape)
        return Ref("ws", shape, pax, base=self.alloc(prod(_local(shape, pax))))

    def body(self, sc: BodyRefs) -> None:
        """Emit every node of `sc.g` (its inputs are already in `sc.refs`). Consecutive
        stored elementwise nodes of one local shape wait in `run` and become one stage
        (`pointwise_run`); consecutive reductions alike that read none of each other's
        results wait in `reds` and become one stage (`reduce_stage`)."""
        g = sc.g
        run: list[tuple[Node, Ref]] = []
        reds: list[tuple[Node, Ref]] = []        # reductions alike, none reading another
        mms: list[tuple[Node, Ref]] = []         # one-block einsums, none reading another
        for vid in g.order():
            n = g.node(vid)
            op = n.op
            if reds and (op is Op.SCAN or op is Op.EINSUM or (
                    op in (Op.SUM, Op.AMAX, Op.CUMSUM) and not self._joins(sc, reds, n))):
                self.reduce_stage(sc, reds)
                reds = []
            if op is Op.EINSUM:
                sc.pax[vid] = self.pax_of(sc, n)      # (its blocks depend on it)
            if mms and (op is Op.SCAN or op in (Op.SUM, Op.AMAX, Op.CUMSUM) or (
                    op is Op.EINSUM and not self._joins_einsums(sc, mms, n))):
                self.einsum_stage(sc, mms)
                mms = []
            if run and (op is Op.SCAN or op is Op.EINSUM or op in (Op.SUM, Op.AMAX, Op.CUMSUM)):
                self.pointwise_run(sc, run)
                run = []
            if op is Op.INPUT:
                continue
            if op is Op.FULL:
                sc.refs[vid], sc.pax[vid] = Ref("lit", n.type.shape, None,
                                                value=float(n.attr("value"))), None
                continue
            if op in (Op.MASK, Op.ROPE):
                name = f"g{len(self.tables)}"
                self.tables.append((op.name, dict(n.attr_dict)))
                sc.refs[vid], sc.pax[vid] = Ref("arg", n.type.shape, None, name=name), None
                continue
            if op is Op.ITEM:
                continue                              # bound by its scan
            sc.pax[vid] = q = self.pax_of(sc, n) if op is not Op.SCAN else None
            if op in OpGroup.INDEXING:
                sc.refs[vid] = Ref("node", n.type.shape, q, node=n, scope=sc)
            elif op in OpGroup.ELEMENTWISE or op in (Op.TAKE_ALONG, Op.SCATTER_ALONG):
                if op is Op.CAST and n.attr("dtype") not in LOW_CASTS:
                    raise ScanFallback(f"%{vid}: cast to {n.attr('dtype')}")
                # a cast of a stored value is inlined into every user (one rounding each)
                # rather than a stage of its own
                cheap = op is Op.CAST and sc.refs[n.inputs[0]].kind in ("ws", "arg", "lit", "at")
                if (self.uses(g, vid) == 1 or cheap) and all(g.node(u).op is not Op.SCAN
                                                             for u in g.users(vid)):
                    sc.refs[vid] = Ref("node", n.type.shape, q, node=n, scope=sc)
                else:
                    sc.refs[vid] = dest = self.local_ref(n.type.shape, q)
                    if reds:                          # a stored value: its stage comes after
                        self.reduce_stage(sc, reds)
                        reds = []
                    if mms:
                        self.einsum_stage(sc, mms)
                        mms = []
                    if run and (run[0][0].type.shape, sc.pax[run[0][0].id]) != (n.type.shape, q):
                        self.pointwise_run(sc, run)
                        run = []
                    run.append((n, dest))
            elif op is Op.EINSUM:
                sc.refs[vid] = dest = self.local_ref(n.type.shape, q)
                if self._einsum_shares(sc, n):
                    mms.append((n, dest))
                else:
                    self.einsum_stage(sc, [(n, dest)])
            elif op in (Op.SUM, Op.AMAX, Op.CUMSUM):
                sc.refs[vid] = dest = self.local_ref(n.type.shape, q)
                reds.append((n, dest))
            elif op is Op.SCAN:
                self.scan_loop(sc, n)
            else:
                raise ScanFallback(f"%{vid}: no scan-kernel rule for {op.name}")
        if reds:
            self.reduce_stage(sc, reds)
        if mms:
            self.einsum_stage(sc, mms)
        if run:
            self.pointwise_run(sc, run)

    def _joins_einsums(self, sc: BodyRefs, mms: list[tuple[Node, Ref]], n: Node) -> bool:
        """May einsum `n` share the stage of `mms`: it may share one (`_einsum_shares`), and
        reads none of their results (`_reads`)."""
        return self._einsum_shares(sc, n) and not any(
            self._reads(sc, {m.id for m, _ in mms}, v) for v in n.inputs)

    @staticmethod
    def _reads(sc: BodyRefs, members: set[int], v: int) -> bool:
        """Does value `v` read one of `members`: itself, or through the views and inlined
        elementwise nodes it is evaluated from."""
        todo, seen = [v], set()
        while todo:
            v = todo.pop()
            if v in members:
                return True
            if v in seen:
                continue
            seen.add(v)
            ref = sc.refs.get(v)
            if ref is not None and ref.kind == "node" and ref.scope is sc:
                todo.extend(sc.g.node(v).inputs)
        return False

    def _joins(self, sc: BodyRefs, reds: list[tuple[Node, Ref]], n: Node) -> bool:
        """May reduction `n` share the stage of `reds`: alike (`_reduce_key`), and reading
        none of their results, directly or through the views and inlined elementwise nodes
        its input is evaluated from (a stage's members are stored after its loads)."""
        return self._reduce_key(sc, n) == self._reduce_key(sc, reds[0][0]) and \
            not self._reads(sc, {m.id for m, _ in reds}, n.inputs[0])

    def pointwise_run(self, sc: BodyRefs, run: list[tuple[Node, Ref]]) -> None:
        """Stored elementwise nodes of one local shape, in order: as few stages as they allow.
        A stage holds a prefix of the run whose members read the earlier members' results
        at the tile's own coordinates (from registers: no store, barrier and load between
        them); the first member that reads one otherwise, or reads a carry held on chip,
        starts over in a stage of its own (`pointwise_stage`)."""
        i = 0
        while i < len(run):
            took = self._flat_run(sc, run[i:]) if len(run) - i > 1 else 0
            if took < 2:
                n, dest = run[i]
                self.pointwise_stage(f"%{n.id} = {n.op.name.lower()}", n.type.shape,
                                     sc.pax[n.id], dest, (),
                                     lambda sec, c, n=n: self._node_value(sec, sc, n, c, ()))
                took = 1
            i += took

    def _flat_run(self, sc: BodyRefs, run: list[tuple[Node, Ref]]) -> int:
        """Emit the longest prefix of `run` that one flat stage holds (`pointwise_run`), if
        it has at least two members; return its length (0: nothing emitted)."""
        first = run[0][0]
        shape, pax = first.type.shape, sc.pax[first.id]
        mark = (len(self.lines), self.depth)
        self.line("# " + sanitize_comment(", ".join(f"%{n.id} = {n.op.name.lower()}"
                                                    for n, _ in run)))
        L = _local(shape, pax)
        N = prod(L)
        B = min(pow2(N, 16), MAX_TILE)
        o = self._open_loop(self.fresh("o"), N, B)
        ix = self.let(f"{o} + {self.arange(B)}" if o != "0" else f"{self.arange(B)}", "i")
        z = self.let(self.zero_tile(f"[{B}]"), "z")
        m = self.mask(self.in_bounds(ix, N, B))
        local = _delin(ix, L)
        sec = StageTile(m, z, vars=(ix,), flat=(ix, L, tuple(local)),
                        axes=((ix, B),) if len(L) == 1 and o == "0" else ())
        c = self.full_coords(local, shape, pax)
        took = len(run)
        for j, (n, dest) in enumerate(run):
            at = len(self.lines)
            try:
                r = self._node_value(sec, sc, n, c, ())
            except (_GroupMiss, _RegMiss):
                del self.lines[at:]
                took = j
                break
            r = r if r in self.tiles else self.let(self.full(r, f"[{B}]"), tile=True)
            self.store(self.ptr(sec, dest, c), r, m)
            sec.cache[("ws", "", dest.base, (), tuple(c), ())] = r
            sec.written.add(dest.base)
        if took < 2:
            del self.lines[mark[0]:]
            self.depth = mark[1]
            return 0
        if took < len(run):                          # the comment names the stage's members
            self.lines[mark[0]] = "    " * mark[1] + "# " + sanitize_comment(
                ", ".join(f"%{n.id} = {n.op.name.lower()}" for n, _ in run[:took]))
        self._close(o)
        self.barrier()
        return took

    def copy(self, label: str, sc: BodyRefs, vid: int, shape: tuple[int, ...],
             pax: tuple[int, ...] | None, dest: Ref, lead: tuple[str, ...] = (),
             guard: bool = False) -> None:
        self.pointwise_stage(label, shape, pax, dest, lead,
                             lambda sec, c: self.value(sec, sc, vid, c), guard)

    def scan_loop(self, sc: BodyRefs, n: Node, top: dict | None = None) -> None:
        """Emit scan `n` of scope `sc` as a loop; bind its ITEMs (nested) or write the
        kernel's outputs (`top`: item index -> output Ref)."""
        while True:
            state = (len(self.lines), self.n, len(self.sizes), len(self.tables), self.stages,
                     self.depth, self.loop_depth, self.shared, self.reg_bytes,
                     len(self.carry_notes))
            try:
                self._scan_loop(sc, n, top)
                return
            except (_Redo, _RegMiss) as r:
                if r.scan != n.id:
                    raise
                del self.lines[state[0]:]
                self.n, self.stages = state[1], state[4]
                del self.sizes[state[2]:]
                self.depth, self.loop_depth, self.shared = state[5], state[6], state[7]
                self.reg_bytes = state[8]
                del self.carry_notes[state[9]:]
                del self.tables[state[3]:]
                if isinstance(r, _RegMiss):
                    self.reg_demoted[(n.id, r.k)] = r.why
                else:
                    self.carry_pax[(n.id, r.k)] = r.pax

    def _scan_loop(self, sc: BodyRefs, n: Node, top: dict | None) -> None:
        a = n.attr_dict
        body: Graph = a["body"]
        nc, nx, L = a["n_carry"], a["n_xs"], a["length"]
        self.loop_depth += 1
        d = self.loop_depth
        it, t = f"it{d}", f"t{d}"
        bsc = BodyRefs(body)
        ins = body.inputs
        slots = []
        self.line(f"# scan %{n.id}: {L} iterations{', reversed' if a['reverse'] else ''}, "
                  f"{nc} carries")
        regs: dict[int, tuple[str, tuple[int, ...]]] = {}     # carries on chip: tile, dims
        held = self.reg_bytes
        with self.group():
            for k in range(nc):     # carries: on chip (a loop-carried tile), or two workspace
                shape = body.node(ins[k]).type.shape      # slots each (init -> slot 0)
                q = self.carry_pax.get((n.id, k), sc.pax.get(n.inputs[k]))
                local = _local(shape, q)
                why = self.reg_why(n.id, k, local, any(m.op is Op.SCAN for m in body))
                self.carry_notes.append({"scan": f"%{n.id}", "carry": k, "shape": list(local),
                                         "on_chip": why is None, "why": why or ""})
                bsc.pax[ins[k]] = q
                if why is None:
                    dims = tuple(pow2(d, 16) for d in local)
                    self.reg_bytes += prod(dims) * self.itemsize
                    self.line(f"# carry {k} of %{n.id}: initial value, held on chip")
                    var = self.fresh("cr")
                    self.line(f"{var} = {self.reg_value(sc, n.inputs[k], shape, q, dims)}")
                    self.tiles.add(var)
                    self.loads.add(var)
                    regs[k] = (var, dims)
                    slots.append((None, 0, q, shape))
                    bsc.refs[ins[k]] = Ref("reg", shape, q, name=var, dims=dims, scan=n.id,
                                           carry=k)
                    continue
                size = -(-prod(local) // 16) * 16
                off = self.alloc(2 * size)
                slots.append((off, size, q, shape))
                self.copy(f"carry {k} of %{n.id}: initial value", sc, n.inputs[k], shape, q,
                          Ref("ws", shape, q, base=off))
                bsc.refs[ins[k]] = Ref("ws", shape, q, base=f"{off} + ({it} % 2) * {size}")
        for j in range(nx):                           # xs: the stacked operand at t
            v = n.inputs[nc + j]
            q = sc.pax.get(v)
            if q is not None and 0 in q:
                raise _PaxError(f"scan %{n.id} iterates along the independent axes")
            bsc.refs[ins[nc + j]] = Ref("at", (), None, lead=(t,), node=sc.g.node(v), scope=sc)
            bsc.pax[ins[nc + j]] = tuple(x - 1 for x in q) if q is not None else None
        for i in range(nc + nx, len(ins)):            # closed-over operands
            v = n.inputs[i]
            bsc.refs[ins[i]] = Ref("at", (), None, node=sc.g.node(v), scope=sc)
            bsc.pax[ins[i]] = sc.pax.get(v)
        self.line(f"for {it} in range(0, {L}):")
        self.depth += 1
        self.line(f"{t} = {L - 1} - {it}" if a["reverse"] else f"{t} = {it}")
        self.body(bsc)
        outs = [v for _, v in body.outputs]
        for k, v in enumerate(outs[:nc]):
            qo = bsc.pax.get(v)
            off, size, q, shape = slots[k]
            if qo is not None and q != qo:
                if q is None:
                    raise _Redo(n.id, k, qo)
                raise _PaxError(f"carry {k} of scan %{n.id} moves the independent axes")
        with self.group():          # the ys at t, the next carries
            items: dict[int, Ref] = {}
            for k, v in enumerate(outs[nc:], start=nc):   # ys: into their slice at t
                qo = bsc.pax.get(v)
                shape = body.node(v).type.shape
                if top is not None:
                    if k in top:
                        self.copy(f"y {k - nc} of %{n.id} at t", bsc, v, shape, qo, top[k], (t,),
                                  guard=qo is None)
                    continue
                stacked = (L,) + shape
                qs = tuple(x + 1 for x in qo) if qo is not None else None
                dest = self.local_ref(stacked, qs)
                self.copy(f"y {k - nc} of %{n.id} at t", bsc, v, shape, qo, dest, (t,))
                items[k] = dest
            nxt = {}
            for k, v in enumerate(outs[:nc]):             # next carry into the other slot
                off, size, q, shape = slots[k]
                if k in regs:                             # or into its tile (after all reads)
                    self.line(f"# carry {k} of %{n.id}: next, on chip")
                    nxt[k] = self.reg_value(bsc, v, shape, q, regs[k][1])
                    continue
                self.copy(f"carry {k} of %{n.id}: next", bsc, v, shape, q,
                          Ref("ws", shape, q, base=f"{off} + (({it} + 1) % 2) * {size}"))
            for k, x in nxt.items():
                self.line(f"{regs[k][0]} = {x}")
        self.depth -= 1
        self.loop_depth -= 1
        with self.group():
            for k in range(nc):
                off, size, q, shape = slots[k]
                if k in regs:
                    self.line(f"# final carry {k} of %{n.id}, from chip")
                    if top is None:
                        items[k] = self.local_ref(shape, q)
                        self.reg_store(*regs[k], shape, q, items[k])
                    elif k in top:
                        self.reg_store(*regs[k], shape, q, top[k], guard=q is None)
                    continue
                final = Ref("ws", shape, q, base=f"{off} + {(L % 2) * size}")
                if top is not None:
                    if k in top:
                        self.pointwise_stage(
                            f"final carry {k} of %{n.id}", shape, q, top[k], (),
                            lambda sec, c, final=final: self._ref_value(sec, final, c),
                            guard=q is None)
                else:
                    items[k] = final
        self.reg_bytes = held
        if top is None:
            for u in sc.g.users(n.id):
                un = sc.g.node(u)
                if un.op is Op.ITEM:
                    r = items[un.attr("index")]
                    sc.refs[u] = r
                    sc.pax[u] = r.pax

    def _ref_value(self, sec: StageTile, ref: Ref, c: list[str]) -> str:
        key = ("ref", ref.base, tuple(c))
        if key not in sec.cache:
            masking = f", mask={sec.mask}, other=0.0" if sec.mask else ""
            sec.cache[key] = self.let(f"tl.load({self.ptr(sec, ref, c)}{masking})", "x", True)
        return sec.cache[key]

