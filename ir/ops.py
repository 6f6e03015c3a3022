"""The op set of the titanc IR.

`Op` objects grouped by kind, plus `OpGroup` sets for membership tests
(`node.op in OpGroup.ELEMENTWISE`). An arithmetic elementwise op has all its rules (reference
semantics, folding, VJP, what its VJP reads, its Triton expression) in one entry of
`elementwise.py`; every other op has its shape rule, reference semantics, VJP, what its VJP
reads, its zero folding and the facts about its kernel (cost, precision class, strided
operands, in-place outputs, profile family) in one entry of `structural.py`; each target
registers how it lowers an op (`lowering.py`).
"""
from __future__ import annotations


class Op:
    """One IR operation, compared by identity; `op.name` is its upper-case name. The built-in
    ops are the attributes below; `Op.define(name)` adds one (with its rules in an entry of
    `ir/elementwise.py` or `ir/structural.py`; docs/architecture.md walks through it)."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"Op.{self.name}"

    def __reduce__(self) -> tuple:
        return getattr, (Op, self.name)         # unpickles as the same object

    @classmethod
    def define(cls, name: str) -> "Op":
        """A new op named `name` (upper case, not taken), reachable as `Op.<name>`."""
        if not name.isidentifier() or not name.isupper() or name in cls.__dict__:
            raise ValueError(f"op name {name!r}: an unused upper-case identifier")
        op = cls(name)
        setattr(cls, name, op)
        return op

    def __init_subclass__(cls) -> None:
        raise TypeError("Op is not subclassed: make a new op with Op.define")


# io / generators: no tensor inputs
Op.INPUT = Op("INPUT")                   # attrs: name            a graph argument (tokens, parameter, carry)
Op.FULL = Op("FULL")                     # attrs: value, shape, dtype
Op.ROPE = Op("ROPE")                     # attrs: kind ('cos'|'sin'), positions (start, count), half, base
Op.MASK = Op("MASK")                     # attrs: n_q, q_start, groups ((kind, length, window), ...) -> additive bias
# elementwise unary
Op.NEG = Op("NEG")
Op.EXP = Op("EXP")
Op.LOG = Op("LOG")
Op.SIGMOID = Op("SIGMOID")
Op.SILU = Op("SILU")
Op.RSQRT = Op("RSQRT")
Op.SQRT = Op("SQRT")
Op.RECIP = Op("RECIP")
Op.CAST = Op("CAST")                     # attrs: dtype
# elementwise binary (numpy broadcasting)
Op.ADD = Op("ADD")
Op.SUB = Op("SUB")
Op.MUL = Op("MUL")
Op.DIV = Op("DIV")
Op.MAX = Op("MAX")
Op.GT = Op("GT")                         # x > y as 0./1. of the float dtype (used for relu-like masks in VJPs)
# reductions
Op.SUM = Op("SUM")                       # attrs: axes, keepdim
Op.AMAX = Op("AMAX")                     # attrs: axes, keepdim
# contraction
Op.EINSUM = Op("EINSUM")                 # attrs: spec 'ab,bc->ac'
# movement
Op.RESHAPE = Op("RESHAPE")               # attrs: shape
Op.PERMUTE = Op("PERMUTE")               # attrs: perm
Op.EXPAND = Op("EXPAND")                 # attrs: shape   (broadcast_to)
Op.SLICE = Op("SLICE")                   # attrs: axis, start, stop
Op.PAD = Op("PAD")                       # attrs: axis, before, after   (zeros)
Op.CONCAT = Op("CONCAT")                 # attrs: axis
Op.TAKE = Op("TAKE")                     # rows of a table: (table [V, ...], idx int) -> idx.shape + table.shape[1:]
Op.INDEX_ADD = Op("INDEX_ADD")           # VJP of TAKE: (grad idx.shape+rest, idx) -> [rows, ...]; attrs: rows, dtype (optional: a wider sum)
Op.TAKE_ALONG = Op("TAKE_ALONG")         # (x [..., V], idx [...] int) -> [...]: x[..., idx]
Op.SCATTER_ALONG = Op("SCATTER_ALONG")   # VJP of TAKE_ALONG: (grad [...], idx) -> [..., size]; attrs: size
# scans
Op.CUMSUM = Op("CUMSUM")                 # attrs: axis, reverse
Op.SCAN = Op("SCAN")                     # attrs: body, length, n_carry, n_xs, reverse, role, checkpoint_dtype (optional) (outputs a tuple)
Op.ITEM = Op("ITEM")                     # attrs: index   picks one value of a tuple-typed node
# pattern ops (passes/flash_attention.py rewrites a subgraph into one; ir/attention.py has their rules)
Op.ATTENTION = Op("ATTENTION")           # (q, k per group.., v per group..) -> (o, lse); attrs: scale, n_q, q_start, groups (as MASK)
Op.ATTENTION_BWD = Op("ATTENTION_BWD")   # (q, ks.., vs.., o, lse, do) -> (dq, dks.., dvs..); attrs as ATTENTION
Op.LINEAR_CROSS_ENTROPY = Op("LINEAR_CROSS_ENTROPY")          # (h, head, targets) -> (loss, lse) per row; attrs: layout
Op.LINEAR_CROSS_ENTROPY_BWD = Op("LINEAR_CROSS_ENTROPY_BWD")  # (h, head, targets, lse, dloss) -> (dh, dhead); attrs as forward
Op.ADAMW = Op("ADAMW")                   # (params, grads, ms, vs, lr, step, grad_scale) -> (params, ms, vs, norm); attrs: n, betas, eps, weight_decay, clip, decay


ROPE_BASE = 10000.0         # the rotary base of ROPE nodes (the builder's default)


class OpGroup:
    SOURCE = frozenset({Op.INPUT, Op.FULL, Op.ROPE, Op.MASK})
    GENERATOR = frozenset({Op.FULL, Op.ROPE, Op.MASK})
    # elementwise: CAST, plus every op of the elementwise registry (it adds its ops here)
    UNARY = {Op.CAST}
    BINARY: set[Op] = set()
    ELEMENTWISE = {Op.CAST}
    REDUCE = frozenset({Op.SUM, Op.AMAX})
    CONTRACTION = frozenset({Op.EINSUM})
    MOVEMENT = frozenset({Op.RESHAPE, Op.PERMUTE, Op.EXPAND, Op.SLICE, Op.PAD, Op.CONCAT,
                          Op.TAKE, Op.INDEX_ADD, Op.TAKE_ALONG, Op.SCATTER_ALONG})
    SCAN = frozenset({Op.CUMSUM, Op.SCAN})
    TUPLE = frozenset({Op.ITEM})
    # a recognised subgraph as one template kernel (tuple-typed: results are its ITEMs):
    # every structural entry with "PATTERN" in its groups (ATTENTION, ATTENTION_BWD, ADAMW,
    # LINEAR_CROSS_ENTROPY, LINEAR_CROSS_ENTROPY_BWD)
    PATTERN: set[Op] = set()
    # ops whose output is a view-like rearrangement (no arithmetic): a strided view in torch
    VIEW = frozenset({Op.RESHAPE, Op.PERMUTE, Op.EXPAND, Op.SLICE})
    # ops a kernel computes by index arithmetic on its operand's loads (views, plus the zeros
    # of a pad and the pieces of a concat, and structural entries with "INDEXING" in their
    # groups): free inside a fused or scan kernel
    INDEXING = set(VIEW | {Op.PAD, Op.CONCAT})


# what a SCAN is (its `role` attr), for the passes and the profiler: the layer stack, a MAC
# segment, a memory update over chunks (forward, backward and the decode write), the outer scan
# of chunk-carry checkpoints, the outer scan of layer-group checkpoints (train.remat_group), a
# chunk of the LM-head loss, anything else
SCAN_ROLES = ("layer", "segment", "memory", "memory_group", "layer_group", "loss", "loop")
