"""Scan kernels, part 1: which axes are independent, and the value of a body node at coordinates.

`_ScanEmitter` holds the generated lines and workspace offsets of one scan kernel. `pax_of` is the
independence analysis (per op: where the independent axes sit in the output, or why they are
mixed); `value` is a Triton expression for a body value at coordinates (a masked load, a
literal, or a view / inlined elementwise node composed down to loads).
"""
from __future__ import annotations

import re
from collections import Counter
from math import prod

from titanc.ir import Graph, Node, Op, OpGroup
from titanc.ir.elementwise import ELEMENTWISE

from titanc.codegen.lower.expr import format_number
from titanc.codegen.scan.index import (MAX_UNPACKED, MAX_WORKSPACE, Ref, ScanFallback, BodyRefs, StageTile, _FORMATS,
                         _GroupMiss, _PaxError, _RegMiss, _TooBig, _bcast, _delin, _lin, _local, _sum)
from titanc.codegen.scan.pack import pack, wsoff

def _bare(c: str) -> str:
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


# generated names (fresh: a prefix and a number), an assignment to one, and the calls a line
# must keep even when its result is unread
_NAME = re.compile(r"\b[a-z]+\d+\b")
_ASSIGN = re.compile(r"^\s*([a-z]+\d+) = ")
_EFFECT = re.compile(r"tl\.(store|atomic|debug_barrier)")
# a workspace buffer's symbolic offset (`scan_pack.wsoff`), and a line that only stores to one
_WSOFF = re.compile(r"__wsoff\d+__")
_WS_STORE = re.compile(r"^\s*tl\.store\(ws_ptr \+ pbase \+ [^,]*__wsoff\d+__[^,]*, [a-z]+\d+(, mask=[a-z]+\d+)?\)$")

# float casts a scan kernel renders (a bf16 one rounds and stays in the compute dtype)
LOW_CASTS = ("f32", "f64", "bf16")


class _ScanEmitter:
    """Emits the kernel body: lines with indentation, fresh names, workspace offsets."""

    def __init__(self, g: Graph, scan: Node, cd: str, prefix: tuple[int, ...]):
        self.g, self.scan, self.cd, self.prefix = g, scan, cd, prefix
        self.p = len(prefix)
        self.lines: list[str] = []
        self.depth = 1
        self.n = 0
        self.ws = 0                   # workspace elements per program (packed at the end)
        self.sizes: list[int] = []    # elements of each workspace buffer (`scan_pack.wsoff`)
        self.index = "tl.int64"       # integer type of index tiles (int32 where offsets fit)
        self.tables: list[tuple[str, dict]] = []
        self.stages = 0
        self.loop_depth = 0
        self.pc = [f"pc{i}" for i in range(self.p)]
        self.tiles: set[str] = set()          # names holding full tiles
        self.loads: set[str] = set()          # names holding masked loads (0 off the mask)
        self.shared = 0               # workspace elements of values every program computes whole
        self.low_args: set[str] = set()       # kernel tensors holding bf16 (loaded, then widened)

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

    def alloc(self, numel: int) -> str:
        """A workspace buffer of `numel` elements: its symbolic offset (`scan_pack.pack`
        assigns the address once every lifetime is known)."""
        self.sizes.append(-(-max(numel, 1) // 16) * 16)
        if sum(self.sizes) > MAX_UNPACKED:
            raise _TooBig(f"workspace buffers of more than {MAX_UNPACKED} elements per "
                          "program before packing")
        return wsoff(len(self.sizes) - 1)

    def arange(self, n: int | str) -> str:
        """`tl.arange(0, n)` in the index type (`tl.arange` is int32 already)."""
        return f"tl.arange(0, {n})" if self.index == "tl.int32" else f"tl.arange(0, {n}).to({self.index})"

    def prune(self) -> None:
        """Drop assignments whose name nothing reads (index and zero tiles a stage made but did
        not use), to a fixpoint. The GPU compiler drops them too; the interpreter would run
        each one in every iteration (tiny.yaml's memory-chunk backward made 148 zero tiles and
        used 29)."""
        while True:
            uses = Counter(_NAME.findall("\n".join(self.lines)))
            keep = [line for line in self.lines
                    if not ((m := _ASSIGN.match(line)) and uses[m.group(1)] == 1
                            and not _EFFECT.search(line))]
            if len(keep) == len(self.lines):
                return
            self.lines = keep

    def drop_dead_stores(self) -> None:
        """Drop the stores of workspace buffers nothing loads (a value a stage of several
        nodes kept in registers for all its readers), the work only they used (`prune`),
        loops left empty, and barriers that no longer separate anything; `stages` counts
        what is left."""
        named: dict[str, list[int]] = {}
        for i, line in enumerate(self.lines):
            for t in set(_WSOFF.findall(line)):
                named.setdefault(t, []).append(i)
        dead = {i for at in named.values()
                if all(_WS_STORE.match(self.lines[i]) for i in at) for i in at}
        if not dead:
            return
        self.lines = [line for i, line in enumerate(self.lines) if i not in dead]
        self.prune()
        while True:                                   # loops with nothing inside
            keep, changed = [], False
            for i, line in enumerate(self.lines):
                body = line.lstrip()
                ind = len(line) - len(body)
                if body.startswith("for "):
                    nxt = next((x for x in self.lines[i + 1:] if not x.lstrip().startswith("#")),
                               "")
                    if len(nxt) - len(nxt.lstrip()) <= ind:
                        changed = True
                        continue
                keep.append(line)
            self.lines = keep
            if not changed:
                break
        out: list[str] = []
        for line in self.lines:                       # a barrier after nothing but comments
            if line.strip() == "tl.debug_barrier()":
                prev = next((x for x in reversed(out) if not x.lstrip().startswith("#")), "")
                if prev.strip() in ("tl.debug_barrier()", "") or prev.rstrip().endswith(":"):
                    continue
            out.append(line)
        self.lines = out
        self.stages = sum(line.strip() == "tl.debug_barrier()" for line in self.lines)

    def zero_tile(self, shape: str) -> str:
        """A zero index tile of `shape` (so that every pointer expression is a tile)."""
        return f"tl.full({shape}, 0, dtype={self.index})"

    def pack(self) -> None:
        """Give buffers with disjoint lifetimes the same addresses (`scan_pack`)."""
        self.lines, self.ws = pack(self.lines, self.sizes)
        if self.ws > MAX_WORKSPACE:
            raise _TooBig(f"a packed workspace of {self.ws} > {MAX_WORKSPACE} elements "
                          "per program")

    # -- pax analysis -------------------------------------------------------------------------------
    def pax_of(self, sc: BodyRefs, n: Node) -> tuple[int, ...] | None:
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

    def ptr(self, sec: "StageTile", ref: Ref, coords: list[str]) -> str:
        """A pointer tile: `addr`, broadcast by the zero tile when it has no tile index."""
        a = self.addr(ref, coords, sec)
        if not sec.vars or not all(re.search(rf"\b{v}\b", a) for v in sec.vars):
            a += f" + {sec.zero}"
        return a

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

    # -- addresses and values -----------------------------------------------------------------------
    def addr(self, ref: Ref, coords: list[str], sec: "StageTile | None" = None) -> str:
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

    def value(self, sec: "StageTile", sc: BodyRefs, vid: int, coords: list[str],
              conds: tuple[str, ...] = ()) -> str:
        """An expression for value `vid` of scope `sc` at `coords` (0 where `conds` fail)."""
        ref = sc.refs[vid]
        if ref.kind == "lit":
            v = format_number(ref.value)
            return v if not conds else f"tl.where({' & '.join(f'({x})' for x in conds)}, {v}, 0.0)"
        if ref.kind == "reg":
            r = self._reg_value(sec, ref, coords)
            return r if not conds else self.let(
                f"tl.where({' & '.join(f'({x})' for x in conds)}, {r}, 0.0)", tile=True)
        if ref.kind in ("ws", "arg"):
            key = (ref.kind, ref.name, ref.base, ref.lead, tuple(coords), conds)
            if key not in sec.cache and ref.kind == "ws" and ref.base in sec.written:
                raise _GroupMiss(ref.base)
            if key not in sec.cache:
                mask = " & ".join(((sec.mask,) if sec.mask else ()) +
                                  tuple(f"({c})" for c in conds))
                # bf16 tensors are widened as they are loaded: the kernel computes in `cd`
                widen = f".to({self.cd})" if ref.kind == "arg" and ref.name in self.low_args \
                    else ""
                masking = f", mask={mask}, other=0" if mask else ""
                sec.cache[key] = self.let(
                    f"tl.load({self.ptr(sec, ref, coords)}{masking}){widen}", "x", True)
                self.loads.add(sec.cache[key])
            return sec.cache[key]
        assert ref.node is not None and ref.scope is not None
        if ref.kind == "at":                          # an outer value at leading coordinates
            return self.value(sec, ref.scope, ref.node.id, list(ref.lead) + coords, conds)
        return self._node_value(sec, ref.scope, ref.node, coords, conds)

    def _reg_value(self, sec: "StageTile", ref: Ref, coords: list[str]) -> str:
        """A carry held on chip at `coords`: its tile itself where the coordinates are the
        tile's whole axes in the carry's order (or, 2-D, transposed), else `_RegMiss`."""
        local = [_bare(c) for i, c in enumerate(coords) if ref.pax is None or i not in ref.pax]
        if not local:
            return ref.name
        axes = list(sec.axes)
        if [v for v, _ in axes] == local and tuple(e for _, e in axes) == ref.dims:
            return ref.name
        if len(local) == 2 and [v for v, _ in axes[::-1]] == local and \
                tuple(e for _, e in axes[::-1]) == ref.dims:
            key = ("trans", ref.name)
            if key not in sec.cache:
                sec.cache[key] = self.let(f"tl.trans({ref.name})", "xt", True)
                self.loads.add(sec.cache[key])
            return sec.cache[key]
        raise _RegMiss(ref.scan, ref.carry, "read at coordinates other than its tile's "
                       f"({', '.join(coords)}) by a tile of axes {axes or 'none'}")

    def _node_value(self, sec: "StageTile", sc: BodyRefs, n: Node, c: list[str],
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
        if op is Op.TAKE:                                # table[idx[i...], j...]
            r = sc.g.node(n.inputs[1]).type.rank
            idx = self.value(sec, sc, n.inputs[1], list(c[:r]), conds)
            return self.value(sec, sc, src, [idx] + list(c[r:]), conds)
        if op is Op.TAKE_ALONG:                          # x[..., idx[...]]
            idx = self.value(sec, sc, n.inputs[1], c, conds)
            return self.value(sec, sc, src, list(c) + [idx], conds)
        if op is Op.SCATTER_ALONG:                       # grad[...] where idx[...] == j
            g = self.value(sec, sc, src, c[:-1], conds)
            idx = self.value(sec, sc, n.inputs[1], c[:-1], conds)
            return self.let(f"tl.where({idx} == {c[-1]}, {g}, 0.0)",
                            tile=g in self.tiles or idx in self.tiles)
        if op in OpGroup.ELEMENTWISE:                    # an inlined elementwise node
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
            if n.attr("dtype") not in LOW_CASTS:
                raise ScanFallback(f"%{n.id}: cast to {n.attr('dtype')}")
            if n.attr("dtype") == "bf16":     # rounded to bf16, held in `cd` like every value
                return f"_bf16(({args[0]}).to(tl.float32)).to({self.cd})"
            return f"({args[0]}).to({self.cd})"
        fmt = _FORMATS.get(n.op) or ELEMENTWISE[n.op].triton
        return self.rounded(n, fmt.format(*[f"({x})" for x in args]))

    def rounded(self, n: Node, x: str) -> str:
        """`x`, the value of node `n` computed in `cd`, rounded to bf16 when `n` is a bf16
        value (as its storage would round it on the cpu target)."""
        return f"_bf16(({x}).to(tl.float32)).to({self.cd})" if n.type.dtype == "bf16" else x


