"""The op set of the titanc IR.

One enum, grouped by kind, plus `OpGroup` sets for membership tests
(`node.op in OpGroup.ELEMENTWISE`). Each op's shape rule lives in `shapes.py`,
its reference semantics in `interpret.py` and its VJP in `passes/autodiff.py`.
"""
from __future__ import annotations

from enum import Enum, auto


class Op(Enum):
    # io / generators: no tensor inputs
    INPUT = auto()      # attrs: name            a graph argument (tokens, parameter, carry)
    FULL = auto()       # attrs: value, shape, dtype
    ROPE = auto()       # attrs: kind ('cos'|'sin'), positions (start, count), half, base
    MASK = auto()       # attrs: n_q, q_start, groups ((kind, length, window), ...) -> additive bias
    # elementwise unary
    NEG = auto()
    EXP = auto()
    LOG = auto()
    SIGMOID = auto()
    SILU = auto()
    RSQRT = auto()
    SQRT = auto()
    RECIP = auto()
    CAST = auto()       # attrs: dtype
    # elementwise binary (numpy broadcasting)
    ADD = auto()
    SUB = auto()
    MUL = auto()
    DIV = auto()
    MAX = auto()
    GT = auto()         # x > y as 0./1. of the float dtype (used for relu-like masks in VJPs)
    # reductions
    SUM = auto()        # attrs: axes, keepdim
    AMAX = auto()       # attrs: axes, keepdim
    # contraction
    EINSUM = auto()     # attrs: spec 'ab,bc->ac'
    # movement
    RESHAPE = auto()    # attrs: shape
    PERMUTE = auto()    # attrs: perm
    EXPAND = auto()     # attrs: shape   (broadcast_to)
    SLICE = auto()      # attrs: axis, start, stop
    PAD = auto()        # attrs: axis, before, after   (zeros)
    CONCAT = auto()     # attrs: axis
    TAKE = auto()       # rows of a table: (table [V, ...], idx int) -> idx.shape + table.shape[1:]
    INDEX_ADD = auto()  # VJP of TAKE: (grad idx.shape+rest, idx) -> [rows, ...]; attrs: rows
    TAKE_ALONG = auto() # (x [..., V], idx [...] int) -> [...]: x[..., idx]
    SCATTER_ALONG = auto()  # VJP of TAKE_ALONG: (grad [...], idx) -> [..., size]; attrs: size
    # scans
    CUMSUM = auto()     # attrs: axis, reverse
    SCAN = auto()       # attrs: body, length, n_carry, n_xs, reverse, role (outputs a tuple)
    ITEM = auto()       # attrs: index   picks one value of a tuple-typed node


class OpGroup:
    SOURCE = frozenset({Op.INPUT, Op.FULL, Op.ROPE, Op.MASK})
    GENERATOR = frozenset({Op.FULL, Op.ROPE, Op.MASK})
    UNARY = frozenset({Op.NEG, Op.EXP, Op.LOG, Op.SIGMOID, Op.SILU, Op.RSQRT, Op.SQRT, Op.RECIP, Op.CAST})
    BINARY = frozenset({Op.ADD, Op.SUB, Op.MUL, Op.DIV, Op.MAX, Op.GT})
    ELEMENTWISE = UNARY | BINARY
    REDUCE = frozenset({Op.SUM, Op.AMAX})
    CONTRACTION = frozenset({Op.EINSUM})
    MOVEMENT = frozenset({Op.RESHAPE, Op.PERMUTE, Op.EXPAND, Op.SLICE, Op.PAD, Op.CONCAT,
                          Op.TAKE, Op.INDEX_ADD, Op.TAKE_ALONG, Op.SCATTER_ALONG})
    SCAN = frozenset({Op.CUMSUM, Op.SCAN})
    TUPLE = frozenset({Op.ITEM})
    # ops whose output is a view-like rearrangement (no arithmetic)
    VIEW = frozenset({Op.RESHAPE, Op.PERMUTE, Op.EXPAND, Op.SLICE})


# what a SCAN is (its `role` attr), for the passes and the profiler: the layer stack, a MAC
# segment, a memory update over chunks (forward, backward and the decode write), the outer scan
# of chunk-carry checkpoints, a chunk of the LM-head loss, anything else
SCAN_ROLES = ("layer", "segment", "memory", "memory_group", "loss", "loop")
