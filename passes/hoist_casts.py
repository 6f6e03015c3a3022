"""hoist_casts: a layer body's bf16 casts of its weight slices run once, before the scan.

Mixed precision (passes/precision.py) casts every float32 weight down where a matmul reads
it, and the weights of a layer reach its body as xs slices of the stacked parameters. Cast
there, a matmul that takes the cast as its prologue (passes/fusion_rules.py
`matmul_prologue`) loads the float32 weight and rounds it in every program and every K step:
its main loop issues about twice the instructions of one that loads bf16 operands straight
into the tensor cores (`python -m titanc.tools.aot ... --arch 90`, docs/gpu_kernels.md).

Rule. A CAST from float32 to bf16 whose operand is an xs slice of the scan moves before the
scan as one cast of the stacked operand ([length, ...] in bf16); the body reads the bf16
slice as a new xs. Equal casts of one slice become one; an xs no node reads any more is
dropped. Bodies first. Not moved: casts of carries (a carry changes every iteration),
widening casts (a bf16 checkpoint widened on load: hoisted, it would store a float32 copy),
and casts of consts (a MAC segment scan's weights): a bf16 const makes autodiff accumulate
its cotangent over the iterations in bf16 (`passes/autodiff.py`, the accumulator carries
take the const's type), where the cast in the body accumulates float32 (measured: a weight
gradient of tiny.yaml's MAC differed in the third digit).

Where. The compiler runs it on a micro-batch of at least `HOIST_TOKENS` tokens (the forward,
training, logits and logprobs graphs; not a decode step): there a matmul's weight tile is
converted by every one of its row tiles (large_125m: 64 row tiles of a 4,096-token segment),
while a small step's matmuls read their weights a few times and a cast kernel of its own
costs a launch (tiny.yaml, 1,024 tokens: the casts stay fused into their readers,
passes/split_casts.py). The hoisted copies live in the arena: the layers' bf16 weights, half
the float32 parameters' bytes (large_125m: 242 MB).

The values are the same (a cast is exact to repeat), and so are the gradients: autodiff
differentiates the cast where it now is (the bf16 cotangent of every layer's slice, stacked,
cast to float32 once; in the body the same cast ran per slice): bitwise, tests/
test_precision.py.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from titanc.ir import Graph, Node, Op
from titanc.ir.types import TensorType


HOIST_TOKENS = 4096          # tokens a micro-batch from which the compiler runs the pass


@dataclass(frozen=True)
class HoistCasts:
    name: ClassVar[str] = "hoist_casts"

    def __call__(self, g: Graph) -> Graph:
        return hoist_casts(g)


def _narrowing(body: Graph, n: Node, movable: set[int]) -> bool:
    if n.op is not Op.CAST or n.attr("dtype") != "bf16" or n.inputs[0] not in movable:
        return False
    src = body.node(n.inputs[0]).type
    return isinstance(src, TensorType) and src.dtype == "f32"


def hoist_casts(g: Graph) -> Graph:
    if not any(n.op is Op.SCAN for n in g):
        return g
    out = Graph(g.name)
    env: dict[int, int] = {}
    for n in g:
        ins = [env[i] for i in n.inputs]
        if n.op is Op.SCAN:
            env[n.id] = _lift(out, n, hoist_casts(n.attr("body")), ins)
        else:
            env[n.id] = out.add_like(n, ins)
    out.set_outputs([(name, env[i]) for name, i in g.outputs])
    return out


def _lift(out: Graph, n: Node, body: Graph, ins: list[int]) -> int:
    """Scan `n` with body `body` and operands `ins` (in `out`), its casts of xs slices
    computed before it; returns the new scan's id."""
    a = n.attr_dict
    nc, nx = a["n_carry"], a["n_xs"]
    carry_in, xs_in, const_in = (body.inputs[:nc], body.inputs[nc:nc + nx],
                                 body.inputs[nc + nx:])
    operand = dict(zip(body.inputs, ins))
    casts = [m for m in body if _narrowing(body, m, set(xs_in))]
    if not casts:
        return out.add_like(n, ins, body=body)
    new_xs: dict[int, int] = {}                        # body input -> outer bf16 operand
    for m in casts:
        src = m.inputs[0]
        if src not in new_xs:
            new_xs[src] = out.add(Op.CAST, (operand[src],), {"dtype": "bf16"})
    hoisted = {m.id for m in casts}
    read = {i for m in body if m.id not in hoisted for i in m.inputs} | {
        v for _, v in body.outputs}
    keep_xs = [v for v in xs_in if v in read]

    nb = Graph(body.name)
    benv: dict[int, int] = {}
    as_bf16: dict[int, int] = {}                       # body input -> its new bf16 input
    for v in carry_in + keep_xs:
        benv[v] = nb.add_like(body.node(v))
    for src in new_xs:
        as_bf16[src] = _input(nb, body.node(src))
    for v in const_in:
        benv[v] = nb.add_like(body.node(v))
    for m in body:
        if m.op is Op.INPUT:
            continue
        if m.id in hoisted:
            benv[m.id] = as_bf16[m.inputs[0]]
        else:
            benv[m.id] = nb.add_like(m, [benv[i] for i in m.inputs])
    nb.set_outputs([(name, benv[v]) for name, v in body.outputs])
    new_ins = ([operand[v] for v in carry_in + keep_xs] + list(new_xs.values())
               + [operand[v] for v in const_in])
    return out.add_like(n, new_ins, body=nb, n_xs=len(keep_xs) + len(new_xs))


def _input(nb: Graph, src: Node) -> int:
    """A body input for the bf16 cast of body input `src`."""
    return nb.add(Op.INPUT, (), {"name": f"{src.attr('name')}_bf16"},
                  replace(src.type, dtype="bf16"))
