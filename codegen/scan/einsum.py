"""Einsum stages of a scan kernel: `tl.dot` on [M, K] x [K, N] tiles.

An einsum's letters (its independent ones aside) group into batch / M / N / K, each padded
to a power of two >= 16 and cut into blocks of at most `DOT_BLOCK` (an operand held on chip
is one tile: its letters get whole blocks). A run of one-block einsums with 16-bit operands,
none reading another's result, is one stage: every member's loads first, one barrier.
`em` is the kernel's `emitter.ScanEmitter`.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Any

from titanc.ir import Node

from titanc.codegen.meta import mma16, pow2, value_dtype
from titanc.codegen.scan.carries import is_reg
from titanc.codegen.scan.index import (DOT_BLOCK, BodyRefs, Ref, ScanFallback, StageTile,
                                       delin)
from titanc.codegen.scan.values import value

__all__ = ["SHARED_EXACT_DOTS", "einsum_shares", "einsum_stage"]

# float32 and float64 dots share no stage: two at once took tiny.yaml's chunk backward from
# 72 to 364 B spilled a thread on sm_90 (exact), and to 412 B (tf32); tests set it to check
# a shared stage's values in float64
SHARED_EXACT_DOTS = False


@dataclass(frozen=True)
class Contraction:
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
        return dict(zip(cs, delin(ix, tuple(self.size[c] for c in cs))))


@dataclass
class _OpenEinsum:
    """An einsum emitted up to its operand tiles (`_open`)."""

    n: Node
    dest: Ref
    c: Contraction
    sc: BodyRefs
    base: dict[str, str]          # batch and independent letters' coordinates
    loops: tuple[str, str, str]   # m0, n0, k0 ("0": no loop)
    flat: bool                    # m0 and n0 from one loop over both (a split kernel's)
    rm: str
    rn: str
    acc: str
    tiles: list[str]


def contraction(em: Any, sc: BodyRefs, n: Node) -> Contraction:
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
    pref = {out[x]: em.pc[i] for i, x in enumerate(q)} if q is not None else {}
    batch = [c for c in out if c in ta and c in tb and c not in pref]
    ms = [c for c in out if c in ta and c not in tb and c not in pref]
    ns = [c for c in out if c in tb and c not in ta and c not in pref]
    ks = [c for c in dict.fromkeys(ta + tb) if c not in out]
    gsize = lambda cs: prod(size[c] for c in cs)
    NB, M, N, K = gsize(batch), gsize(ms), gsize(ns), gsize(ks)
    whole = {ch for t, v in ((ta, ia), (tb, ib)) if is_reg(sc, v) for ch in t}
    BM, BN, BK = (pow2(x, 16) if whole & set(cs) else min(pow2(x, 16), DOT_BLOCK)
                  for x, cs in ((M, ms), (N, ns), (K, ks)))
    return Contraction(ta, tb, out, size, pref, batch, ms, ns, ks, NB, M, N, K, BM, BN, BK)


def einsum_shares(em: Any, sc: BodyRefs, n: Node) -> bool:
    """May einsum `n` share a stage with others (`einsum_stage`): one block (no batch,
    M, N or K loop: straight-line code) of 16-bit operands (the bf16 MMA). Two float32
    dots at once spilled: exact ones are FMAs, and tf32 ones hold float32 operand tiles
    (`SHARED_EXACT_DOTS`)."""
    mma = mma16(em.cd.removeprefix("tl."), [value_dtype(sc.g, v) for v in n.inputs]) is not None
    return contraction(em, sc, n).one_block and (mma or SHARED_EXACT_DOTS)


def einsum_stage(em: Any, sc: BodyRefs, run: list[tuple[Node, Ref]]) -> None:
    """Each einsum of `run` as `tl.dot` on [M, K] x [K, N] tiles, then one barrier. A run
    of several (`loops.joins_einsums`: one block each, none reading another's result) loads
    every member's operands first, then multiplies and stores them all: one round."""
    with em.stage():
        opened = [_open(em, sc, n, dest) for n, dest in run]
        for op in opened:
            _close(em, op)
    em.barrier()


def _open(em: Any, sc: BodyRefs, n: Node, dest: Ref) -> _OpenEinsum:
    """Emit einsum `n` up to its operand tiles (opening its batch, M, N and K loops)."""
    c = contraction(em, sc, n)
    em.line(f"# %{n.id} = einsum[{n.attr('spec')}]: [{c.M}, {c.K}] x [{c.K}, {c.N}], "
            f"{c.NB} local batch")
    zb = "0"
    if c.NB > 1:
        zb = em.fresh("zb")
        em.open_batch(zb, c.NB)
    mb, nb = -(-c.M // c.BM), -(-c.N // c.BN)
    flat = em.split > 1 and em.undistributed and mb > 1 and nb > 1
    if flat:                  # a split kernel hands out the M x N blocks
        mn = em.fresh("mn")
        em.open_batch(mn, mb * nb)
        m0 = em.let(f"({mn} // {nb}) * {c.BM}", "m")
        n0 = em.let(f"({mn} % {nb}) * {c.BN}", "n")
    else:
        m0 = em.open_loop(em.fresh("m"), c.M, c.BM, independent=True)
        n0 = em.open_loop(em.fresh("n"), c.N, c.BN, independent=True)
    rm = em.let(f"({m0} + {em.arange(c.BM)})[:, None]", "rm")
    rn = em.let(f"({n0} + {em.arange(c.BN)})[None, :]", "rn")
    acc = em.let(f"tl.full([{c.BM}, {c.BN}], 0, dtype={em.cd})", "acc")
    k0 = em.open_loop(em.fresh("k"), c.K, c.BK)
    ka = em.let(f"({k0} + {em.arange(c.BK)})[None, :]", "ka")
    kb = em.let(f"({k0} + {em.arange(c.BK)})[:, None]", "kb")
    base = {**c.pref, **c.letters(c.batch, zb)}
    wm, wn, wk = m0 == "0", n0 == "0", k0 == "0"
    # (an operand whose letters are the first's takes the first's tile shape literal)
    shape = {c.tb: f"[{c.BK}, {c.BN}]", c.ta: f"[{c.BM}, {c.BK}]"}
    tiles = [_operand(em, sc, c, base, c.ta, n.inputs[0], rm, ka, c.ms, c.ks, c.M, c.K,
                      ((rm, c.BM, wm), (ka, c.BK, wk)), shape[c.ta]),
             _operand(em, sc, c, base, c.tb, n.inputs[1], kb, rn, c.ks, c.ns, c.K, c.N,
                      ((kb, c.BK, wk), (rn, c.BN, wn)), shape[c.tb])]
    return _OpenEinsum(n, dest, c, sc, base, (m0, n0, k0), flat, rm, rn, acc, tiles)


def _operand(em: Any, sc: BodyRefs, c: Contraction, base: dict[str, str], t: str, v: int,
             rows: str, cols: str, rdim: list[str], cdim: list[str], rsz: int, csz: int,
             axes: tuple, shape: str) -> str:
    """One operand's masked tile: letters `t` of value `v` at rows x cols."""
    lmap = {**base, **c.letters(rdim, rows), **c.letters(cdim, cols)}
    mask = em.mask(em.in_bounds(rows, rsz, axes[0][1]), em.in_bounds(cols, csz, axes[1][1]))
    sec = StageTile(mask, em.let(em.zero_tile(shape), "z"), vars=(rows, cols),
                    axes=tuple((a, e) for a, e, w in axes if w))
    x = value(em, sec, sc, v, [lmap[ch] for ch in t])
    return em.masked(x, mask, shape)


def _close(em: Any, op: _OpenEinsum) -> None:
    """Emit the rest of an opened einsum: its dot, the K loop's end, the store, and the M,
    N and batch loops' ends."""
    n, c, acc, tiles = op.n, op.c, op.acc, op.tiles
    m0, n0, k0 = op.loops
    # the workspace stores `cd` (never 16 bits): the operands' values decide
    op16 = mma16(em.cd.removeprefix("tl."), [value_dtype(op.sc.g, v) for v in n.inputs])
    if op16 is None:
        em.line(f"{acc} += tl.dot({tiles[0]}, {tiles[1]}, input_precision={em.precision})")
    else:       # bf16 values held in `cd`: exact in 16 bits, the MMA accumulates in float32
        em.dot16 = True
        a, b = (em.let(f"{t}.to(tl.{op16})", "h", True) for t in tiles)
        em.line("if DOT_F32:  # interpreter (it multiplies 16-bit floats as integers)")
        em.line(f'    {acc} += tl.dot({a}.to({em.cd}), {b}.to({em.cd}), '
                'input_precision="ieee")')
        em.line(f"else:        # 16-bit MMA, float32 accumulation")
        em.line(f"    {acc} += tl.dot({a}, {b})")
    em.close(k0)
    lmap = {**op.base, **c.letters(c.ms, op.rm), **c.letters(c.ns, op.rn)}
    mask = em.mask(em.in_bounds(op.rm, c.M, c.BM), em.in_bounds(op.rn, c.N, c.BN))
    sec = StageTile(mask, em.let(em.zero_tile(f"[{c.BM}, {c.BN}]"), "z"), vars=(op.rm, op.rn))
    em.store(em.ptr(sec, op.dest, [lmap[ch] for ch in c.out]), em.rounded(n, acc), mask)
    if op.flat:
        em.depth -= 1
    else:
        em.close(n0)
        em.close(m0)
    if c.NB > 1:
        em.depth -= 1
