"""fusion rules: what one kernel of each category may contain, and per-node facts.

`KernelRules.category` decides whether a set of nodes is one legal kernel and of which
category (pointwise, reduction, matmul, template); the rules themselves are listed in
`passes/fusion.py`'s docstring (the pass's contract). A refusal leaves its reason in
`KernelRules.why` (`TITANC_DEBUG=2` prints it, `passes.fusion_greedy`). `node_flops` is the
modeled work of a node (`Kernel.flops`), `matmul_tile` the output tile a matmul kernel's
einsums share.
"""
from __future__ import annotations

from math import prod

from titanc.ir import Graph, Node, Op, OpGroup
from titanc.ir.kernel_family import FAMILIES
from titanc.ir.schedule import prologue_of
from titanc.ir.shapes import parse_einsum
from titanc.ir.structural import STRUCTURAL
from titanc.ir.types import TensorType

GATHERS = frozenset({Op.TAKE, Op.TAKE_ALONG})
REDUCTIONS = frozenset({Op.SUM, Op.AMAX, Op.CUMSUM})
MAX_CONTRACTIONS = 4         # einsums one matmul kernel may hold (one K loop each)


class _Templates:
    """Ops alone in a template kernel: those whose record names a kernel family of category
    "template" (`Structural.family`, `ir.kernel_family`): SCAN, the scatter-adds and every
    pattern op (read at each test, so an op or family registered later counts)."""

    def __contains__(self, op: Op) -> bool:
        entry = STRUCTURAL.get(op)
        fam = FAMILIES.get(entry.family) if entry is not None and entry.family else None
        return fam is not None and fam.category == "template"


TEMPLATES = _Templates()


# -- per-node facts ------------------------------------------------------------------------------

def numel(n: Node) -> int:
    """Elements of a tensor-typed node (0 for a tuple-typed SCAN)."""
    return n.type.numel if isinstance(n.type, TensorType) else 0


def node_flops(n: Node, g: Graph, body_flops: int = 0) -> int:
    """Work of one node: elementwise 1/element, einsum 2*prod(letter sizes), reductions and
    scatter-adds 1/input element, scans length * body, a pattern op its entry's `flops`
    (attention: the visible pairs only); views, gathers, generators 0."""
    if n.op in OpGroup.ELEMENTWISE:
        return numel(n)
    if n.op is Op.EINSUM:
        terms, _ = parse_einsum(n.attr("spec"), len(n.inputs))
        sizes: dict[str, int] = {}
        for term, i in zip(terms, n.inputs):
            sizes.update(zip(term, g.node(i).type.shape))
        return 2 * prod(sizes.values())
    if n.op in REDUCTIONS or n.op in (Op.INDEX_ADD, Op.SCATTER_ALONG):
        return numel(g.node(n.inputs[0]))
    if n.op is Op.SCAN:
        return n.attr("length") * body_flops
    e = STRUCTURAL.get(n.op)
    if e is not None and e.flops is not None:
        return e.flops(n, g)
    return 0


def graph_flops(g: Graph) -> int:
    """Work of a whole graph as `node_flops` counts it, a scan's body once per iteration
    (before fusion: what the graph computes, whichever kernels will run it)."""
    return sum(node_flops(n, g, graph_flops(n.attr("body")) if n.op is Op.SCAN else 0)
               for n in g)


def matmul_tile(g: Graph, e: Node) -> tuple | None:
    """The output tile of a two-operand einsum as the matmul family iterates it: its output
    shape and, per output axis, whether its letter is a batch letter (in both operands), an M
    letter (the first operand's) or an N letter (the second's); None when the matmul family
    cannot run it (not two operands, or a diagonal). Einsums with equal tiles share one
    kernel's (batch, M, N) grid, each with its own K loop and accumulator."""
    if len(e.inputs) != 2:
        return None
    (ta, tb), tc = parse_einsum(e.attr("spec"), 2)
    if len(set(ta)) != len(ta) or len(set(tb)) != len(tb):
        return None
    roles = tuple("b" if ch in ta and ch in tb else "m" if ch in ta else "n" for ch in tc)
    return e.type.shape, roles


def matmul_prologue(g: Graph, members: list[int], computed: set[int]) -> set[int]:
    """The prologue of a matmul kernel: the nodes of `computed` (the kernel's members that
    are neither free nor INPUT) an einsum of the kernel reads, directly or through other such
    nodes. The kernel evaluates them as it loads each operand tile, at the tile's coordinates
    (`codegen.lower.dispatch`), never as values of the output tile."""
    out: set[int] = set()
    stack = [i for n in members if g.node(n).op is Op.EINSUM for i in g.node(n).inputs]
    while stack:
        v = stack.pop()
        if v in computed and v not in out and g.node(v).op is not Op.EINSUM:
            out.add(v)
            stack.extend(g.node(v).inputs)
    return out


def float_cast(n: Node, node: dict[int, Node]) -> bool:
    """A float-to-float CAST: free where its operand is read from memory (a conversion as the
    value is loaded, like a view's index arithmetic)."""
    return n.op is Op.CAST and n.type.is_float and node[n.inputs[0]].type.is_float


# -- what one kernel may contain ----------------------------------------------------------------

class KernelRules:
    """The category of a set of nodes of `g` as one kernel (`category`), or None with the
    reason in `why`; `tag` and `compatible` reject most unions cheaply."""

    def __init__(self, g: Graph, node: dict[int, Node]):
        self.g, self.node = g, node
        self.why = ""                       # why the last `category` call refused
        self.size = {nid: numel(n) for nid, n in node.items()}            # elements
        self.template = {nid for nid, n in node.items() if n.op in TEMPLATES}

    def _refuse(self, why: str) -> None:
        self.why = why
        return None

    def category(self, members: list[int], inside: set[int], outputs: list[int]) -> str | None:
        """The kernel category of `members` fused (`outputs`: the values it writes), or None
        (the reason in `self.why`)."""
        nodes = [self.node[n] for n in members]
        if len(nodes) > 1 and any(n.op is Op.ROPE for n in nodes):
            return self._refuse("a rotary table stays alone: bound once as a constant table "
                                "that readers load, never computed per element")
        if any(n.id in self.template for n in nodes):
            return self._template(nodes)
        einsums = [n for n in nodes if n.op is Op.EINSUM]
        reds = [n for n in nodes if n.op in REDUCTIONS]
        why = self._contractions(einsums, reds)
        if why:
            return self._refuse(why)
        free: set[int] = set()
        post: set[int] = set()           # depends on a reduction / einsum of this kernel
        computed: list[Node] = []
        for n in nodes:
            local = [i for i in n.inputs if i in inside]
            bound = [i for i in local if i not in free]       # computed operands
            if n.op in OpGroup.GENERATOR or (n.op in OpGroup.INDEXING and not bound) or (
                    float_cast(n, self.node) and not bound):
                free.add(n.id)
                continue
            if n.op is Op.EXPAND and reds and all(i in post for i in bound):
                pass                     # a reduced value over its row (`_row_epilogue`)
            elif n.op in OpGroup.INDEXING and n.op is not Op.RESHAPE:
                return self._refuse(f"%{n.id} ({n.op.name.lower()}) views a computed value")
            if n.op is Op.EINSUM:
                if any(i in post for i in bound):
                    return self._refuse(f"%{n.id} (einsum) reads a value computed after a "
                                        f"contraction of the kernel (a second pass)")
            elif n.op in GATHERS:
                if bound:
                    return self._refuse(f"%{n.id} ({n.op.name.lower()}) reads a computed "
                                        f"operand (gathers read memory)")
            elif n.op in OpGroup.ELEMENTWISE:
                wide = [i for i in bound if self.size[i] != self.size[n.id]]
                if wide and not (reds and all(i in post for i in wide)):   # a row epilogue
                    return self._refuse(f"%{n.id} broadcasts a computed value")
            elif n.op in REDUCTIONS:
                if any(i in post or self.node[i].op in REDUCTIONS for i in bound):
                    return self._refuse(f"%{n.id} reduces a reduction (a second pass)")
            elif n.op not in (Op.RESHAPE, Op.EXPAND):
                return self._refuse(f"%{n.id} ({n.op.name.lower()}) fuses with nothing")
            if n.op in REDUCTIONS or n.op is Op.EINSUM or any(i in post for i in bound):
                post.add(n.id)
            computed.append(n)
        outs = [self.node[v] for v in outputs]
        if einsums:
            pro = matmul_prologue(self.g, members, inside - free)
            why = self._prologue(pro, inside, outputs)
            if why:
                return self._refuse(why)
            computed = [n for n in computed if n.id not in pro]
            dom = {self.size[einsums[0].id]}
            kind = "matmul"
        elif reds:
            r0 = reds[0]
            key = self.reduction_key(r0)
            if any(self.reduction_key(r) != key for r in reds[1:]):
                return self._refuse("reductions over different axes")
            n_in, n_out = self.size[r0.inputs[0]], self.size[r0.id]
            late = [n for n in computed if self.size[n.id] == n_in != n_out and n.id in post]
            if late:
                why = self._row_epilogue(r0, late, inside - free)
                if why:
                    return self._refuse(why)
            dom = {n_in, n_out}
            kind = "reduction"
        else:
            dom = {self.size[computed[0].id]} if computed else {self.size[n.id] for n in outs}
            kind = "pointwise"
        if len(dom) == 0 or any(self.size[n.id] not in dom for n in computed + outs):
            return self._refuse("values of more than one iteration domain")
        if kind == "pointwise" and len(dom) != 1:
            return self._refuse("a pointwise kernel over two domains")
        return kind

    def _template(self, nodes: list[Node]) -> str | None:
        """A template kernel holds one template node (a scan: its ITEMs and prologue too)."""
        tmpl = [n for n in nodes if n.id in self.template]
        t = tmpl[0]
        ok = len(tmpl) == 1 and all(n is t or (n.op is Op.ITEM and n.inputs[0] == t.id)
                                     or prologue_of(self.g, n.id) == t.id for n in nodes)
        return "template" if ok else self._refuse("a template kernel holds one template "
                                                  "node (a scan: and its prologue gathers)")

    def _contractions(self, einsums: list[Node], reds: list[Node]) -> str | None:
        """Why these einsums cannot share one matmul kernel (with these reductions), or None."""
        if einsums and reds:
            return "a contraction and a reduction"
        if len(einsums) > MAX_CONTRACTIONS:
            return f"more than {MAX_CONTRACTIONS} contractions"
        if len(einsums) > 1:
            tile = matmul_tile(self.g, einsums[0])
            if tile is None or any(matmul_tile(self.g, e) != tile for e in einsums[1:]):
                return "contractions over different output tiles"
        return None

    def _prologue(self, pro: set[int], inside: set[int], outputs: list[int]) -> str | None:
        """Why the prologue `pro` of a matmul kernel cannot be computed as its operand tiles
        are loaded, or None: each of its values must be read only by the prologue and the
        einsums (the epilogue's domain is the output tile) and by no other kernel (it exists
        only tile by tile, once per output tile reading it)."""
        for v in sorted(pro):
            if v in outputs:
                return f"%{v} (a matmul operand computed as it is loaded) is read by another kernel"
            late = [u for u in self.g.users(v) if u in inside and u not in pro
                    and self.node[u].op is not Op.EINSUM]
            if late:
                return (f"%{v} (a matmul operand computed as it is loaded) is read by %{late[0]} "
                        f"in the epilogue")
        return None

    def _row_epilogue(self, r0: Node, late: list[Node], computed: set[int]) -> str | None:
        """Why input-domain nodes after the reduction cannot be its row epilogue, or None.

        The reduction kernel holds each row while it reduces it (or loops over its column
        blocks again), so `x * rsqrt(mean(x²))` is one kernel: an input-domain node reads the
        reduced value of its own row. That is the element at its broadcast coordinates only
        when the node has the reduction's input shape and the reduced value the keep-dims
        shape (the reduced axes of size 1); other reads would cross rows."""
        x = self.node[r0.inputs[0]].type.shape
        axes = {a % len(x) for a in r0.attr("axes")}
        keep = tuple(1 if d in axes else s for d, s in enumerate(x))
        n_out = self.size[r0.id]
        for n in late:
            if n.op not in OpGroup.ELEMENTWISE and n.op not in (Op.RESHAPE, Op.EXPAND):
                return f"%{n.id} ({n.op.name.lower()}) after the reduction is no elementwise op"
            if n.op is Op.EXPAND and self.size[n.inputs[0]] != n_out:
                return f"%{n.id} expands no reduced value"
            for i in n.inputs:
                if i not in computed or self.size[i] != n_out:
                    continue                 # read from memory (or free) at its coordinates
                if n.type.shape != x or self.node[i].type.shape != keep:
                    return (f"%{n.id} reads the reduced %{i} {self.node[i].type.shape} at "
                            f"other than its row of {x} (a second pass)")
        return None

    def tag(self, members: list[int]) -> tuple[int, int, frozenset]:
        """(nodes that keep a kernel to themselves: templates and rotary tables, einsums,
        reduction keys): enough to reject most unions cheaply."""
        ops = [self.node[n] for n in members]
        return (sum(n.id in self.template or n.op is Op.ROPE for n in ops),
                sum(n.op is Op.EINSUM for n in ops),
                frozenset(self.reduction_key(n) for n in ops if n.op in REDUCTIONS))

    @staticmethod
    def compatible(ta: int, ea: int, ra: frozenset, tb: int, eb: int, rb: frozenset) -> bool:
        """A necessary condition for the union of two groups with these tags to be legal."""
        return not (ta or tb or ea + eb > MAX_CONTRACTIONS or ((ea or eb) and (ra or rb))
                    or len(ra | rb) > 1)

    def reduction_key(self, r: Node) -> tuple:
        shape = self.node[r.inputs[0]].type.shape
        if r.op is Op.CUMSUM:
            return ("cumsum", shape, r.attr("axis"), r.attr("reverse"))
        return ("reduce", shape, tuple(r.attr("axes")))

