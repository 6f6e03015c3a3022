"""One Triton kernel per scan: a SCAN node's body, loops and all, as a single generated program.

`render_scan(g, scan_id, dtype)` reads a scan's body graph and emits one `@triton.jit` kernel
(template `scan.py.jinja`) that runs every iteration inside the kernel. Nothing in it is
specific to Titans: a changed memory rule is a changed body graph, and it compiles the same way.

Independent axes. The grid is the product of the scan's *independent leading axes* (e.g.
[B, Nm] of a memory-chunk body): the longest prefix `P` of the carries' shape such that no body
op mixes those axes. Every body value gets a `pax` (where the axes of `P` sit in its shape, or
None when it does not vary along them); the rules, per op, are in `_Analysis.pax_of`: einsum
letters of P appear in the output, reductions, cumsums, slices, pads and concats leave them
alone, reshapes keep them as whole axes, permutes move them. A value with a `pax` is computed
per program on its local slice (the P axes dropped); a value without one ("shared": scalars,
the causal mask table, shared weights) is computed whole in every program and read at full
coordinates. Each program runs the whole loop for its slice.

Storage. Each program owns a region of a global workspace (`ws`, `WS` elements per program):
every computed body value has a fixed offset there (contiguous over its local shape), carries
ping-pong between two slots (`it % 2`), xs are read straight from the stacked inputs at
iteration `t`, ys are written straight into their slice of the stacked outputs. Views
(reshape, permute, expand, slice, pad, concat) cost nothing: they are index arithmetic on the
loads of their consumers, and single-use elementwise nodes are inlined into their consumer's
expression. `tl.debug_barrier()` separates stages that talk through the workspace.

Stages. Elementwise nodes (and copies) are tile expressions over the flat local index;
einsums are `tl.dot` on [M, K] x [K, N] tiles (padded to powers of two >= 16, masked, letters
grouped into batch / M / N / K); SUM / AMAX are `tl.sum` / `tl.max` over a [rows, cols]
tile; CUMSUM is `tl.cumsum` along the columns; a nested SCAN becomes a nested loop (its
carries are slots of the same workspace). MASK and ROPE tables are computed once on the host
(`tables`) and passed in.

Anything else (TAKE, INDEX_ADD, integer casts, a scan with no independent axis, tiles or a
workspace beyond the caps) raises `ScanFallback` with the reason; the executor then keeps the
host loop and reports the reason.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from math import prod
from typing import Any, Callable

from titanc.ir import Graph, Node, Op, OpGroup
from titanc.ir.types import TensorType

from .expr import POINTWISE_OPS, format_number
from .meta import compute_dtype, pow2
from .render import render, sanitize_comment, sanitize_identifier

__all__ = ["ScanFallback", "ScanKernel", "render_scan", "MAX_TILE", "MAX_WORKSPACE"]

MAX_TILE = 4096                 # elements of one register tile (rows x cols of a reduction)
MAX_CUMSUM = 1024               # longest cumsum axis done as one tl.cumsum
MAX_WORKSPACE = 1 << 24         # workspace elements per program
MAX_WORKSPACE_TOTAL = 1 << 26   # workspace elements of all programs
MAX_SERIAL = 1 << 22            # workspace elements of a one-program (serial) scan kernel
DOT_BLOCK = 64                  # largest M / N / K tile of an einsum

_POINTWISE = {Op.NEG: "neg", Op.EXP: "exp", Op.LOG: "log", Op.SIGMOID: "sigmoid",
              Op.SILU: "silu", Op.RSQRT: "rsqrt", Op.SQRT: "sqrt", Op.RECIP: "recip",
              Op.ADD: "add", Op.SUB: "sub", Op.MUL: "mul", Op.DIV: "div", Op.MAX: "max",
              Op.GT: "gt"}
# sigmoid spelled out: the same formula as tl.sigmoid, without a nested @jit call (which
# costs the interpreter a re-patch of triton.language per call)
_FORMATS = {Op.SIGMOID: (1, "1.0 / (1.0 + tl.exp(-{0}))"),
            Op.SILU: (1, "{0} / (1.0 + tl.exp(-{0}))")}
_VIEW_OPS = frozenset({Op.RESHAPE, Op.PERMUTE, Op.EXPAND, Op.SLICE, Op.PAD, Op.CONCAT})


class ScanFallback(Exception):
    """The scan cannot be one kernel; `str(self)` says why (reported to the user)."""


@dataclass(frozen=True)
class ScanKernel:
    """A rendered scan kernel and how to launch it.

    `launch(ws, *inputs, *outputs, *tables)`: `inputs` are the scan node's operands (in
    order, immediates excluded: they are inlined), `outputs` the scan's result items listed in
    `outputs` (item index -> written), `tables` the MASK / ROPE tables (node attrs, host-made).
    """

    name: str
    source: str
    grid: int
    prefix: tuple[int, ...]
    ws_per_program: int
    inputs: tuple[int, ...]                  # positions in the scan's operands passed
    outputs: tuple[int, ...]                 # item indices written
    tables: tuple[tuple[str, dict], ...]     # (op name, attrs) of each host-made table
    stages: int                              # stages emitted (for reports)
    serial: str = ""                         # why the grid is one program (else "")


# -- references: where a value lives --------------------------------------------------------------

@dataclass(frozen=True)
class Ref:
    """How to read a value at full coordinates.

    kind 'ws': local storage at workspace offset `base` (an expression), contiguous over the
    value's shape without its `pax` axes; 'arg': a kernel tensor `name` (full coordinates,
    through its strides), with `lead` fixed leading coordinates (an xs slice at iteration t);
    'lit': the literal `value`; 'node': a view / inlined node evaluated from its operands;
    'at': value `node` of the enclosing `scope` at leading coordinates `lead` (an xs slice,
    or a value a nested scan closes over).
    """

    kind: str
    shape: tuple[int, ...]
    pax: tuple[int, ...] | None
    base: str = "0"
    name: str = ""
    lead: tuple[str, ...] = ()
    value: float = 0.0
    node: Node | None = None
    scope: "Scope | None" = None


@dataclass
class Scope:
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


def _sum(terms: list[str | None]) -> str:
    ts = [t for t in terms if t is not None and t != "0"]
    return " + ".join(ts) if ts else "0"


def _delin(ix: str, shape: tuple[int, ...]) -> list[str]:
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


def _lin(coords: list[str], shape: tuple[int, ...]) -> str:
    return _sum([_mul(f"({c})" if " " in c else c, prod(shape[j + 1:]))
                 for j, c in enumerate(coords)])


def _local(shape: tuple[int, ...], pax: tuple[int, ...] | None) -> tuple[int, ...]:
    return tuple(d for i, d in enumerate(shape) if pax is None or i not in pax)


def _bcast(coords: list[str], out_shape: tuple[int, ...], shape: tuple[int, ...]) -> list[str]:
    """Coordinates of an operand of `shape` broadcast (numpy rules) to `out_shape`."""
    off = len(out_shape) - len(shape)
    return [coords[off + j] if d == out_shape[off + j] else "0" for j, d in enumerate(shape)]


class _Emitter:
    """Emits the kernel body: lines with indentation, fresh names, workspace offsets."""

    def __init__(self, g: Graph, scan: Node, cd: str, prefix: tuple[int, ...]):
        self.g, self.scan, self.cd, self.prefix = g, scan, cd, prefix
        self.p = len(prefix)
        self.lines: list[str] = []
        self.depth = 1
        self.n = 0
        self.ws = 0
        self.tables: list[tuple[str, dict]] = []
        self.stages = 0
        self.loop_depth = 0
        self.pc = [f"pc{i}" for i in range(self.p)]
        self.tiles: set[str] = set()          # names holding full tiles
        self.loads: set[str] = set()          # names holding masked loads (0 off the mask)
        self.shared = 0               # workspace elements of values every program computes whole

    # -- buffer helpers ---------------------------------------------------------------------------
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

    def alloc(self, numel: int) -> int:
        off = self.ws
        self.ws += -(-max(numel, 1) // 16) * 16
        if self.ws > MAX_WORKSPACE:
            raise ScanFallback(f"workspace of more than {MAX_WORKSPACE} elements per program")
        return off

    # -- pax analysis -------------------------------------------------------------------------------
    def pax_of(self, sc: Scope, n: Node) -> tuple[int, ...] | None:
        """Where the independent axes sit in `n`'s value, from its operands' (or raise)."""
        ins = [sc.pax.get(i) for i in n.inputs]
        op, a, shape = n.op, n.attr_dict, n.type.shape
        R = len(shape)
        bad = lambda why: _PaxError(f"%{n.id} ({op.name.lower()}) {why} the independent "
                                       f"axes {list(self.prefix)}")
        if op in OpGroup.ELEMENTWISE or op is Op.CONCAT:
            got = set()
            for i, q in zip(n.inputs, ins):
                if q is None:
                    continue
                r = sc.g.node(i).type.rank
                got.add(tuple(R - r + x for x in q) if op is not Op.CONCAT else q)
            if len(got) > 1:
                raise bad(f"misaligns (operand axes {sorted(got)} of)")
            q = got.pop() if got else None
            if q is not None and op is Op.CONCAT and a["axis"] % R in q:
                raise bad("concatenates along")
            return q
        if op is Op.EINSUM:
            terms, out = a["spec"].split("->")
            lets = set()
            for t, q in zip(terms.split(","), ins):
                if q is not None:
                    lets.add(tuple(t[x] for x in q))
            if len(lets) > 1:
                raise bad(f"misaligns (letters {sorted(lets)} of)")
            if not lets:
                return None
            ls = lets.pop()
            if any(ch not in out for ch in ls):
                raise bad("contracts")
            return tuple(out.index(ch) for ch in ls)
        q = ins[0] if ins else None
        if q is None:
            return None
        if op in (Op.SUM, Op.AMAX):
            axes = [x % len(sc.g.node(n.inputs[0]).type.shape) for x in a["axes"]]
            if set(axes) & set(q):
                raise bad("reduces")
            return q if a["keepdim"] else tuple(x - sum(1 for y in axes if y < x) for x in q)
        if op in (Op.CUMSUM, Op.SLICE, Op.PAD):
            if a["axis"] % R in q:
                raise bad("runs along")
            return q
        if op is Op.PERMUTE:
            return tuple(list(a["perm"]).index(x) for x in q)
        if op is Op.EXPAND:
            r = sc.g.node(n.inputs[0]).type.rank
            return tuple(x + R - r for x in q)
        if op is Op.RESHAPE:
            src = sc.g.node(n.inputs[0]).type.shape
            out = []
            for x in q:
                before = prod(src[:x])
                j = next((j for j in range(R) if prod(shape[:j]) == before
                          and shape[j] == src[x]), None)
                if j is None:
                    raise bad("reshapes")
                out.append(j)
            return tuple(out)
        if op is Op.CAST or op is Op.SCATTER_ALONG:
            return q
        if op is Op.TAKE_ALONG:
            if len(shape) in q or (ins[1] is not None and ins[1] != q):
                raise bad("gathers along")
            return q
        raise ScanFallback(f"%{n.id}: no scan-kernel rule for {op.name}")

    def ptr(self, sec: "Tile", ref: Ref, coords: list[str]) -> str:
        """A pointer tile: `addr`, broadcast by the zero tile when it has no tile index."""
        a = self.addr(ref, coords, sec)
        if not sec.vars or not all(re.search(rf"\b{v}\b", a) for v in sec.vars):
            a += f" + {sec.zero}"
        return a

    def full(self, x: str, shape: str) -> str:
        """`x` as a full tile of `shape` (a scalar expression is broadcast)."""
        return x if x in self.tiles else f"({x}) + tl.zeros({shape}, dtype={self.cd})"

    def masked(self, x: str, mask: str, shape: str, fill: str = "0.0") -> str:
        """`x` with `fill` outside `mask` (a masked load already holds 0 there)."""
        if x in self.loads and fill == "0.0":
            return x
        return self.let(f"tl.where({mask}, {self.full(x, shape)}, {fill})", "op", tile=True)

    # -- addresses and values -----------------------------------------------------------------------
    def addr(self, ref: Ref, coords: list[str], sec: "Tile | None" = None) -> str:
        if ref.kind == "ws":
            local = [c for i, c in enumerate(coords) if ref.pax is None or i not in ref.pax]
            shape = _local(ref.shape, ref.pax)
            if sec is not None and sec.flat is not None and sec.flat[1:] == (shape, tuple(local)):
                return f"ws_ptr + pbase + {_sum([ref.base, sec.flat[0]])}"   # contiguous
            return f"ws_ptr + pbase + {_sum([ref.base, _lin(local, shape)])}"
        full = list(ref.lead) + coords
        terms = [None if c == "0" else f"s_{ref.name}_{j}" if c == "1"
                 else f"({c}) * s_{ref.name}_{j}" for j, c in enumerate(full)]
        return f"{ref.name}_ptr + {_sum(terms)}"

    def value(self, sec: "Tile", sc: Scope, vid: int, coords: list[str],
              conds: tuple[str, ...] = ()) -> str:
        """An expression for value `vid` of scope `sc` at `coords` (0 where `conds` fail)."""
        ref = sc.refs[vid]
        if ref.kind == "lit":
            v = format_number(ref.value)
            return v if not conds else f"tl.where({' & '.join(conds)}, {v}, 0.0)"
        if ref.kind in ("ws", "arg"):
            key = (ref.kind, ref.name, ref.base, ref.lead, tuple(coords), conds)
            if key not in sec.cache:
                mask = " & ".join((sec.mask,) + tuple(f"({c})" for c in conds))
                sec.cache[key] = self.let(
                    f"tl.load({self.ptr(sec, ref, coords)}, mask={mask}, other=0)", "x", True)
                self.loads.add(sec.cache[key])
            return sec.cache[key]
        assert ref.node is not None and ref.scope is not None
        if ref.kind == "at":                          # an outer value at leading coordinates
            return self.value(sec, ref.scope, ref.node.id, list(ref.lead) + coords, conds)
        return self._node_value(sec, ref.scope, ref.node, coords, conds)

    def _node_value(self, sec: "Tile", sc: Scope, n: Node, c: list[str],
                    conds: tuple[str, ...]) -> str:
        op, a = n.op, n.attr_dict
        src = n.inputs[0] if n.inputs else None
        if op is Op.PERMUTE:
            inner = ["0"] * len(a["perm"])
            for i, p in enumerate(a["perm"]):
                inner[p] = c[i]
            return self.value(sec, sc, src, inner, conds)
        if op is Op.EXPAND:
            return self.value(sec, sc, src, _bcast(c, n.type.shape, sc.g.node(src).type.shape),
                              conds)
        if op is Op.SLICE:
            ax = a["axis"] % n.type.rank
            c = list(c)
            c[ax] = f"({c[ax]} + {a['start']})" if a["start"] else c[ax]
            return self.value(sec, sc, src, c, conds)
        if op is Op.RESHAPE:
            return self.value(sec, sc, src, self._reshape(c, n.type.shape,
                                                          sc.g.node(src).type.shape), conds)
        if op is Op.PAD:
            ax = a["axis"] % n.type.rank
            size = sc.g.node(src).type.shape[ax]
            c = list(c)
            c[ax] = f"({c[ax]} - {a['before']})" if a["before"] else c[ax]
            return self.value(sec, sc, src, c, conds + (f"{c[ax]} >= 0", f"{c[ax]} < {size}"))
        if op is Op.CONCAT:
            ax = a["axis"] % n.type.rank
            lo, out = 0, None
            parts = []
            for s in n.inputs:
                size = sc.g.node(s).type.shape[ax]
                cc = list(c)
                cc[ax] = f"({c[ax]} - {lo})" if lo else c[ax]
                parts.append((lo + size, self.value(sec, sc, s, cc, conds + (
                    f"{c[ax]} >= {lo}", f"{c[ax]} < {lo + size}"))))
                lo += size
            out = parts[-1][1]
            for hi, v in reversed(parts[:-1]):
                out = self.let(f"tl.where({c[ax]} < {hi}, {v}, {out})",
                               tile=v in self.tiles or out in self.tiles)
            return out
        if op is Op.TAKE_ALONG:                          # x[..., idx[...]]
            idx = self.value(sec, sc, n.inputs[1], c, conds)
            return self.value(sec, sc, src, list(c) + [idx], conds)
        if op is Op.SCATTER_ALONG:                       # grad[...] where idx[...] == j
            g = self.value(sec, sc, src, c[:-1], conds)
            idx = self.value(sec, sc, n.inputs[1], c[:-1], conds)
            return self.let(f"tl.where({idx} == {c[-1]}, {g}, 0.0)",
                            tile=g in self.tiles or idx in self.tiles)
        if op in _POINTWISE or op is Op.CAST:            # an inlined elementwise node
            args = [self.value(sec, sc, i, _bcast(c, n.type.shape, sc.g.node(i).type.shape),
                               conds) for i in n.inputs]
            tile = any(x in self.tiles for x in args)
            r = self.let(self._pointwise(n, args), tile=tile)
            if conds:                                 # a pad / concat above: 0 outside
                r = self.let(f"tl.where({' & '.join(f'({x})' for x in conds)}, {r}, 0.0)",
                             tile=tile)
            return r
        raise ScanFallback(f"%{n.id}: no index rule for {op.name}")

    @staticmethod
    def _reshape(c: list[str], out: tuple[int, ...], src: tuple[int, ...]) -> list[str]:
        """Coordinates in `src` of the element at `c` of its reshape to `out`."""
        so = [(i, d) for i, d in enumerate(out) if d != 1]
        ss = [(i, d) for i, d in enumerate(src) if d != 1]
        if [d for _, d in so] == [d for _, d in ss]:      # only unit axes added or removed
            res = ["0"] * len(src)
            for (io, _), (is_, _) in zip(so, ss):
                res[is_] = c[io]
            return res
        flat = _lin(c, out)
        return _delin(f"({flat})", src)

    def _pointwise(self, n: Node, args: list[str]) -> str:
        if n.op is Op.CAST:
            if n.attr("dtype") not in ("f32", "f64"):
                raise ScanFallback(f"%{n.id}: cast to {n.attr('dtype')}")
            return f"({args[0]}).to({self.cd})"
        _, fmt = _FORMATS.get(n.op) or POINTWISE_OPS[_POINTWISE[n.op]]
        return fmt.format(*[f"({x})" for x in args])


@dataclass
class Tile:
    """One stage's tile: its mask, a zero offset tile (so every pointer is a tile), load cache."""

    mask: str
    zero: str
    cache: dict = field(default_factory=dict)
    vars: tuple[str, ...] = ()                 # the tile's index variables
    flat: tuple[str, tuple[int, ...], tuple[str, ...]] | None = None   # (ix, shape, coords)


class _PaxError(ScanFallback):
    """The candidate independent axes are mixed somewhere (try a shorter prefix)."""


class _Redo(Exception):
    """A carry turned out to vary per program: emit its scan again with that `pax`."""

    def __init__(self, scan: int, k: int, pax: tuple[int, ...]):
        super().__init__(scan, k, pax)
        self.scan, self.k, self.pax = scan, k, pax


def _tile_zero(shape: str) -> str:
    return f"tl.zeros({shape}, dtype=tl.int64)"


class _ScanGen(_Emitter):
    """Stages (elementwise, einsum, reductions, cumsums) and the scan loops."""

    def __init__(self, *args: Any, **kw: Any):
        super().__init__(*args, **kw)
        self.carry_pax: dict[tuple[int, int], tuple[int, ...]] = {}
        self.precision = '"ieee"'

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
        self.line("tl.debug_barrier()")
        self.stages += 1

    # -- stages -----------------------------------------------------------------------------------
    def pointwise_stage(self, label: str, shape: tuple[int, ...], pax: tuple[int, ...] | None,
                        dest: Ref, lead: tuple[str, ...],
                        expr: Callable[[Tile, list[str]], str], guard: bool = False) -> None:
        """dest[lead + c] = expr(c) for every c of `shape` local to the program."""
        self.line(f"# {sanitize_comment(label)}")
        L = _local(shape, pax)
        N = prod(L)
        B = min(pow2(N, 16), 1024)
        o = self._open_loop(self.fresh("o"), N, B)
        ix = self.let(f"{o} + tl.arange(0, {B}).to(tl.int64)" if o != "0"
                      else f"tl.arange(0, {B}).to(tl.int64)", "i")
        z = self.let(_tile_zero(f"[{B}]"), "z")
        m = self.let(f"({ix} < {N})" + (f" & ((pid + {z}) == 0)" if guard else ""), "m")
        local = _delin(ix, L)
        sec = Tile(m, z, vars=(ix,), flat=(ix, L, tuple(local)))
        c = self.full_coords(local, shape, pax)
        r = expr(sec, c)
        self.line(f"tl.store({self.ptr(sec, dest, list(lead) + c)}, {self.full(r, f'[{B}]')}, "
                  f"mask={m})")
        self._close(o)
        self.barrier()

    def einsum_stage(self, sc: Scope, n: Node, dest: Ref) -> None:
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
        BM, BN, BK = (min(pow2(x, 16), DOT_BLOCK) for x in (M, N, K))
        self.line(f"# %{n.id} = einsum[{n.attr('spec')}]: [{M}, {K}] x [{K}, {N}], "
                  f"{NB} local batch")

        def letters(cs: list[str], ix: str) -> dict[str, str]:
            return dict(zip(cs, _delin(ix, tuple(size[c] for c in cs))))

        zb = "0"
        if NB > 1:
            zb = self.fresh("zb")
            self.line(f"for {zb} in range(0, {NB}):")
            self.depth += 1
        m0 = self._open_loop(self.fresh("m"), M, BM)
        n0 = self._open_loop(self.fresh("n"), N, BN)
        rm = self.let(f"({m0} + tl.arange(0, {BM}).to(tl.int64))[:, None]", "rm")
        rn = self.let(f"({n0} + tl.arange(0, {BN}).to(tl.int64))[None, :]", "rn")
        acc = self.let(f"tl.zeros([{BM}, {BN}], dtype={self.cd})", "acc")
        k0 = self._open_loop(self.fresh("k"), K, BK)
        ka = self.let(f"({k0} + tl.arange(0, {BK}).to(tl.int64))[None, :]", "ka")
        kb = self.let(f"({k0} + tl.arange(0, {BK}).to(tl.int64))[:, None]", "kb")
        base = {**pref, **letters(batch, zb)}
        tiles = []
        for t, v, rows, cols, rdim, cdim, rsz, csz in (
                (ta, ia, rm, ka, ms, ks, M, K), (tb, ib, kb, rn, ks, ns, K, N)):
            lmap = {**base, **letters(rdim, rows), **letters(cdim, cols)}
            mask = self.let(f"({rows} < {rsz}) & ({cols} < {csz})", "m")
            shape = f"[{BM if t == ta else BK}, {BK if t == ta else BN}]"
            sec = Tile(mask, self.let(_tile_zero(shape), "z"), vars=(rows, cols))
            x = self.value(sec, sc, v, [lmap[ch] for ch in t])
            tiles.append(self.masked(x, mask, shape))
        self.line(f"{acc} += tl.dot({tiles[0]}, {tiles[1]}, input_precision={self.precision})")
        self._close(k0)
        lmap = {**base, **letters(ms, rm), **letters(ns, rn)}
        mask = self.let(f"({rm} < {M}) & ({rn} < {N})", "m")
        sec = Tile(mask, self.let(_tile_zero(f"[{BM}, {BN}]"), "z"), vars=(rm, rn))
        self.line(f"tl.store({self.ptr(sec, dest, [lmap[ch] for ch in out])}, {acc}, "
                  f"mask={mask})")
        self._close(n0)
        self._close(m0)
        if NB > 1:
            self.depth -= 1
        self.barrier()

    def reduce_stage(self, sc: Scope, n: Node, dest: Ref) -> None:
        """SUM / AMAX over axes, or CUMSUM along one: a [rows, cols] tile per step."""
        x = n.inputs[0]
        xs = sc.g.node(x).type.shape
        q = sc.pax[n.id]
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
        BR = pow2(Rn, 2) if n.op is Op.CUMSUM else min(pow2(Rn, 2), 1024)
        BO = max(2, min(pow2(O, 2), MAX_TILE // BR))
        self.line(f"# %{n.id} = {n.op.name.lower()}: {O} rows of {Rn}")
        o = self._open_loop(self.fresh("o"), O, BO)
        ix = self.let(f"({o} + tl.arange(0, {BO}).to(tl.int64))[:, None]", "r")
        jx_ = self.fresh("j")
        row_c = dict(zip(rloc, _delin(ix, tuple(xs[i] for i in rloc))))

        def in_coords(jx: str) -> list[str]:
            col_c = dict(zip(axes, _delin(jx, tuple(xs[i] for i in axes))))
            if n.op is Op.CUMSUM and n.attr("reverse"):
                col_c = {a: f"({Rn - 1} - {jx})" for a in axes}
            return [self.pc[qx.index(i)] if qx is not None and i in qx else
                    row_c[i] if i in row_c else col_c[i] for i in range(len(xs))]

        rmask = f"({ix} < {O})"
        if n.op is Op.CUMSUM:
            jx = self.let(f"tl.arange(0, {BR}).to(tl.int64)[None, :]", "j")
            mask = self.let(f"{rmask} & ({jx} < {Rn})", "m")
            sec = Tile(mask, self.let(_tile_zero(f"[{BO}, {BR}]"), "z"), vars=(ix, jx))
            v = self.value(sec, sc, x, in_coords(jx))
            y = self.let(f"tl.cumsum({self.masked(v, mask, f'[{BO}, {BR}]')}, axis=1)", "y")
            self.line(f"tl.store({self.ptr(sec, dest, in_coords(jx))}, {y}, mask={mask})")
        else:
            is_max = n.op is Op.AMAX
            fill = 'float("-inf")' if is_max else "0.0"
            acc = self.let(f"tl.full([{BO}, {BR}], {fill}, dtype={self.cd})", "acc")
            r0 = self._open_loop(self.fresh("c"), Rn, BR)
            jx = self.let(f"({r0} + tl.arange(0, {BR}).to(tl.int64))[None, :]", jx_)
            mask = self.let(f"{rmask} & ({jx} < {Rn})", "m")
            sec = Tile(mask, self.let(_tile_zero(f"[{BO}, {BR}]"), "z"), vars=(ix, jx))
            v = self.value(sec, sc, x, in_coords(jx))
            v = self.masked(v, mask, f"[{BO}, {BR}]", fill)
            self.line(f"{acc} = tl.maximum({acc}, {v})" if is_max else f"{acc} += {v}")
            self._close(r0)
            red = self.let(f"tl.{'max' if is_max else 'sum'}({acc}, axis=1, keep_dims=True)",
                           "y")
            oc = in_coords("0")
            out_c = ([oc[i] for i in range(len(xs))] if n.attr("keepdim")
                     else [oc[i] for i in kept])
            sec = Tile(rmask, self.let(_tile_zero(f"[{BO}, 1]"), "z"), vars=(ix,))
            self.line(f"tl.store({self.ptr(sec, dest, out_c)}, {red}, mask={rmask})")
        self._close(o)
        self.barrier()

    # -- bodies -----------------------------------------------------------------------------------
    def uses(self, g: Graph, vid: int) -> int:
        return len(g.users(vid)) + sum(1 for _, v in g.outputs if v == vid)

    def local_ref(self, shape: tuple[int, ...], pax: tuple[int, ...] | None) -> Ref:
        if pax is None and self.p:
            self.shared += prod(shape)
        return Ref("ws", shape, pax, base=str(self.alloc(prod(_local(shape, pax)))))

    def body(self, sc: Scope) -> None:
        """Emit every node of `sc.g` (its inputs are already in `sc.refs`)."""
        g = sc.g
        for vid in g.order():
            n = g.node(vid)
            op = n.op
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
            if op in _VIEW_OPS:
                sc.refs[vid] = Ref("node", n.type.shape, q, node=n, scope=sc)
            elif op in _POINTWISE or op in (Op.CAST, Op.TAKE_ALONG, Op.SCATTER_ALONG):
                if op is Op.CAST and n.attr("dtype") not in ("f32", "f64"):
                    raise ScanFallback(f"%{vid}: cast to {n.attr('dtype')}")
                if self.uses(g, vid) == 1 and all(g.node(u).op is not Op.SCAN
                                                  for u in g.users(vid)):
                    sc.refs[vid] = Ref("node", n.type.shape, q, node=n, scope=sc)
                else:
                    sc.refs[vid] = dest = self.local_ref(n.type.shape, q)
                    self.pointwise_stage(
                        f"%{vid} = {op.name.lower()}", n.type.shape, q, dest, (),
                        lambda sec, c, n=n: self._node_value(sec, sc, n, c, ()))
            elif op is Op.EINSUM:
                sc.refs[vid] = dest = self.local_ref(n.type.shape, q)
                self.einsum_stage(sc, n, dest)
            elif op in (Op.SUM, Op.AMAX, Op.CUMSUM):
                sc.refs[vid] = dest = self.local_ref(n.type.shape, q)
                self.reduce_stage(sc, n, dest)
            elif op is Op.SCAN:
                self.scan_loop(sc, n)
            else:
                raise ScanFallback(f"%{vid}: no scan-kernel rule for {op.name}")

    def copy(self, label: str, sc: Scope, vid: int, shape: tuple[int, ...],
             pax: tuple[int, ...] | None, dest: Ref, lead: tuple[str, ...] = (),
             guard: bool = False) -> None:
        self.pointwise_stage(label, shape, pax, dest, lead,
                             lambda sec, c: self.value(sec, sc, vid, c), guard)

    def scan_loop(self, sc: Scope, n: Node, top: dict | None = None) -> None:
        """Emit scan `n` of scope `sc` as a loop; bind its ITEMs (nested) or write the
        kernel's outputs (`top`: item index -> output Ref)."""
        while True:
            state = (len(self.lines), self.n, self.ws, len(self.tables), self.stages,
                     self.depth, self.loop_depth, self.shared)
            try:
                self._scan_loop(sc, n, top)
                return
            except _Redo as r:
                if r.scan != n.id:
                    raise
                del self.lines[state[0]:]
                self.n, self.ws, self.stages = state[1], state[2], state[4]
                self.depth, self.loop_depth, self.shared = state[5], state[6], state[7]
                del self.tables[state[3]:]
                self.carry_pax[(n.id, r.k)] = r.pax

    def _scan_loop(self, sc: Scope, n: Node, top: dict | None) -> None:
        a = n.attr_dict
        body: Graph = a["body"]
        nc, nx, L = a["n_carry"], a["n_xs"], a["length"]
        self.loop_depth += 1
        d = self.loop_depth
        it, t = f"it{d}", f"t{d}"
        bsc = Scope(body)
        ins = body.inputs
        slots = []
        self.line(f"# scan %{n.id}: {L} iterations{', reversed' if a['reverse'] else ''}, "
                  f"{nc} carries")
        for k in range(nc):                           # carries: two slots each, init -> slot 0
            shape = body.node(ins[k]).type.shape
            q = self.carry_pax.get((n.id, k), sc.pax.get(n.inputs[k]))
            size = -(-prod(_local(shape, q)) // 16) * 16
            off = self.alloc(2 * size)
            slots.append((off, size, q, shape))
            self.copy(f"carry {k} of %{n.id}: initial value", sc, n.inputs[k], shape, q,
                      Ref("ws", shape, q, base=str(off)))
            bsc.refs[ins[k]] = Ref("ws", shape, q, base=f"{off} + ({it} % 2) * {size}")
            bsc.pax[ins[k]] = q
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
        for k, v in enumerate(outs[:nc]):             # next carry into the other slot
            off, size, q, shape = slots[k]
            self.copy(f"carry {k} of %{n.id}: next", bsc, v, shape, q,
                      Ref("ws", shape, q, base=f"{off} + (({it} + 1) % 2) * {size}"))
        self.depth -= 1
        self.loop_depth -= 1
        for k in range(nc):
            off, size, q, shape = slots[k]
            final = Ref("ws", shape, q, base=f"{off} + {(L % 2) * size}")
            if top is not None:
                if k in top:
                    self.pointwise_stage(
                        f"final carry {k} of %{n.id}", shape, q, top[k], (),
                        lambda sec, c, final=final: self._ref_value(sec, final, c),
                        guard=q is None)
            else:
                items[k] = final
        if top is None:
            for u in sc.g.users(n.id):
                un = sc.g.node(u)
                if un.op is Op.ITEM:
                    r = items[un.attr("index")]
                    sc.refs[u] = r
                    sc.pax[u] = r.pax

    def _ref_value(self, sec: Tile, ref: Ref, c: list[str]) -> str:
        key = ("ref", ref.base, tuple(c))
        if key not in sec.cache:
            sec.cache[key] = self.let(
                f"tl.load({self.ptr(sec, ref, c)}, mask={sec.mask}, other=0.0)", "x", True)
        return sec.cache[key]


# -- the kernel -------------------------------------------------------------------------------------

def _prefixes(g: Graph, n: Node) -> list[tuple[int, ...]]:
    """Candidate independent axes, longest first: leading shapes of the carries."""
    nc = n.attr("n_carry")
    seen: dict[tuple[int, ...], None] = {}
    shapes = [g.node(i).type.shape for i in n.inputs[:nc]]
    for p in range(max((len(s) for s in shapes), default=0), 0, -1):
        for s in shapes:
            if len(s) >= p:
                seen[tuple(s[:p])] = None
    return sorted(seen, key=len, reverse=True)


def render_scan(g: Graph, scan_id: int, *, dtype: str = "float32", used: set[int] | None = None,
                name: str | None = None, spec_path: str = "",
                immediate: Callable[[int], float | None] = lambda v: None) -> ScanKernel:
    """One Triton kernel running scan `scan_id` of `g` (raises `ScanFallback` with the reason
    when it cannot). `used`: the item indices the program reads afterwards (default all);
    `immediate(vid)`: the literal of an operand inlined as a constant, else None."""
    n = g.node(scan_id)
    if n.op is not Op.SCAN:
        raise ValueError(f"%{scan_id} is not a scan")
    cd = compute_dtype(dtype)
    nc, nx = n.attr("n_carry"), n.attr("n_xs")
    n_out = nc + len(n.attr("body").outputs) - nc
    used = set(range(n_out)) if used is None else set(used)
    name = sanitize_identifier(name or f"titanc_scan_{scan_id}")
    why = "no carry with a leading axis"
    for prefix in _prefixes(g, n):
        for shared in (0, 1, 2):     # operands other than carries taken by shape, or not
            try:
                return _render(g, n, cd, dtype, prefix, used, name, spec_path, immediate,
                               shared)
            except _PaxError as e:
                why = str(e)
    try:                             # one program for the whole scan, when that is small
        sk = _render(g, n, cd, dtype, (), used, name, spec_path, immediate, 2)
    except _PaxError as e:
        raise ScanFallback(f"no independent leading axes ({why}); serial: {e}") from None
    if sk.ws_per_program > MAX_SERIAL:
        raise ScanFallback(f"no independent leading axes ({why}), and a serial kernel "
                           f"would need {sk.ws_per_program} > {MAX_SERIAL} workspace elements")
    return replace(sk, serial=f"no independent leading axes ({why})")


def _render(g: Graph, n: Node, cd: str, dtype: str, prefix: tuple[int, ...], used: set[int],
            name: str, spec_path: str, immediate: Callable[[int], float | None],
            shared: int) -> ScanKernel:
    """Render with independent axes `prefix`: the carries whose shape starts with it vary
    per program, and so do the xs (`shared` < 2) and the other operands (`shared` < 1) whose
    shape does; every other operand is shared (read at full coordinates)."""
    em = _ScanGen(g, n, cd, prefix)
    p = len(prefix)
    nc, nx = n.attr("n_carry"), n.attr("n_xs")
    sc = Scope(g)
    inputs: list[int] = []
    for i, v in enumerate(n.inputs):
        shape = g.node(v).type.shape
        if v in sc.refs:                              # the same value passed twice
            continue
        lit = immediate(v)
        if lit is not None:
            sc.refs[v], sc.pax[v] = Ref("lit", shape, None, value=lit), None
            continue
        if nc <= i < nx + nc:
            q = tuple(range(1, p + 1)) if shape[1:p + 1] == prefix and shared < 2 else None
        elif i < nc or shared < 1:
            q = tuple(range(p)) if shape[:p] == prefix else None
        else:
            q = None
        sc.refs[v] = Ref("arg", shape, q, name=f"a{len(inputs)}")
        sc.pax[v] = q
        inputs.append(i)
    body: Graph = n.attr("body")
    top: dict[int, Ref] = {}
    outputs = []
    for k, (_, v) in enumerate(body.outputs):
        if k in used:
            shape = body.node(v).type.shape if k < nc else (n.attr("length"),) + \
                body.node(v).type.shape
            top[k] = Ref("arg", shape, None, name=f"o{len(outputs)}")
            outputs.append(k)
    if p and not any(sc.pax.get(v) is not None for v in n.inputs[:nc]):
        raise _PaxError(f"no carry has the leading axes {list(prefix)}")
    em.scan_loop(sc, n, top)
    if em.shared * 2 > em.ws and prod(prefix) > 1:
        raise _PaxError(f"with independent axes {list(prefix)} most of the work "
                        f"({em.shared} of {em.ws} workspace elements) would be repeated by "
                        "every program")
    if em.ws * prod(prefix) > MAX_WORKSPACE_TOTAL:
        raise _PaxError(f"a workspace of {em.ws} x {prod(prefix)} elements is more than "
                        f"{MAX_WORKSPACE_TOTAL}")
    tensors = ([f"a{k}" for k in range(len(inputs))] + [f"o{k}" for k in range(len(outputs))]
               + [f"g{k}" for k in range(len(em.tables))])
    ranks = ([g.node(n.inputs[i]).type.rank for i in inputs]
             + [top[k].shape.__len__() for k in outputs]
             + [len(_table_shape(op, a)) for op, a in em.tables])
    strides = [[f"s_{t}_{d}" for d in range(r)] for t, r in zip(tensors, ranks)]
    pcs = []
    for i in range(p):
        inner = prod(prefix[i + 1:])
        pcs.append(f"pc{i} = (pid // {inner}) % {prefix[i]}" if inner > 1
                   else f"pc{i} = pid % {prefix[i]}")
    header = [f"{name}: scan kernel of graph {g.name}", f"spec: {spec_path or '(none)'}",
              f"scan %{n.id}: length {n.attr('length')}, {nc} carries, {nx} xs; grid over the "
              f"independent axes {list(prefix)}; {em.stages} stages"]
    source = render("scan.py.jinja", name=name, header_lines=header, tensors=tensors,
                    strides=strides, pcs=pcs, body=em.lines, ws=max(em.ws, 16),
                    grid=prod(prefix), num_warps=4)
    return ScanKernel(name, source, prod(prefix), prefix, max(em.ws, 16), tuple(inputs),
                      tuple(outputs), tuple(em.tables), em.stages)


def _table_shape(op: str, a: dict) -> tuple[int, ...]:
    if op == "MASK":
        return (a["n_q"], sum(length for _, length, _ in a["groups"]))
    return (a["count"], a["half"])
