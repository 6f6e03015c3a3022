"""hoist_casts: a layer body's bf16 casts of its weight slices run once, before the scan.

Mixed precision (passes/precision.py) casts every float32 weight down where a matmul reads
it, and the weights of a layer reach its body as xs slices of the stacked parameters. Cast
there, a matmul that takes the cast as its prologue (passes/fusion_rules.py
`matmul_prologue`) loads the float32 weight and rounds it in every program and every K step:
its main loop issues about twice the instructions of one that loads bf16 operands straight
into the tensor cores (`python -m titanc.tools.aot ... --arch 90`, docs/gpu_kernels.md).

Rule. A CAST from float32 to bf16 whose operand is an xs slice of the scan moves before the
scan as one cast of the stacked operand ([length, ...] in bf16); the body reads the bf16
slice as a new xs. Equal casts of one slice become one, and a cast of an operand the scan
already reads cast (a slice hoisted before autodiff) reads that one; an xs or const no node
reads any more is dropped. Bodies first, so a nested scan's hoisted cast lands in the
enclosing body and may leave it in turn. Not moved: casts of carries (a carry changes every
iteration) and widening casts (a bf16 checkpoint widened on load: hoisted, it would store a
float32 copy).

Casts of consts (a MAC segment scan's weights, slices of the layer scan's) move too with
`consts`, a bf16 const in their place, only where no autodiff follows: the training graph
after its autodiff, the logits and logprobs graphs. Before autodiff a bf16 const would make
autodiff accumulate its cotangent over the iterations in bf16 (`passes/autodiff.py`, the
accumulator carries take the const's type), where the cast in the body accumulates float32
(measured: a weight gradient of tiny.yaml's MAC differed in the third digit); after it there
is no derivative to take, and the segments of large_125m's forward, its re-run and its
backward load their weights as stored instead of rounding them in every segment's matmuls
and cast kernels (2.6 GB a step of elementwise traffic).

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
    """f32 -> bf16 casts of scan operands moved before their scans (module docstring);
    `consts`: casts of a scan's consts too (only where no autodiff follows)."""
    consts: bool = False
    name: ClassVar[str] = "hoist_casts"

    def __call__(self, g: Graph) -> Graph:
        return hoist_casts(g, self.consts)


def _narrowed(g: Graph, n: Node) -> int | None:
    """The operand of `n` if `n` casts a float32 tensor to bf16, else None."""
    if n.op is not Op.CAST or n.attr("dtype") != "bf16":
        return None
    src = g.node(n.inputs[0]).type
    return n.inputs[0] if isinstance(src, TensorType) and src.dtype == "f32" else None


def hoist_casts(g: Graph, consts: bool = False) -> Graph:
    if not any(n.op is Op.SCAN for n in g):
        return g
    out = Graph(g.name)
    env: dict[int, int] = {}
    for n in g:
        ins = [env[i] for i in n.inputs]
        if n.op is Op.SCAN:
            env[n.id] = _lift(out, n, hoist_casts(n.attr("body"), consts), ins, consts)
        else:
            env[n.id] = out.add_like(n, ins)
    out.set_outputs([(name, env[i]) for name, i in g.outputs])
    return out


def _lift(out: Graph, n: Node, body: Graph, ins: list[int], consts: bool) -> int:
    """Scan `n` with body `body` and operands `ins` (in `out`), its casts of xs slices (and
    of consts, where `consts`) computed before it; returns the new scan's id."""
    a = n.attr_dict
    nc, nx = a["n_carry"], a["n_xs"]
    carry_in, xs_in, const_in = (body.inputs[:nc], body.inputs[nc:nc + nx],
                                 body.inputs[nc + nx:])
    operand = dict(zip(body.inputs, ins))
    movable = set(xs_in) | (set(const_in) if consts else set())
    casts = [m for m in body if _narrowed(body, m) in movable]
    if not casts:
        return out.add_like(n, ins, body=body)
    # an operand already cast before the scan (a slice hoisted before autodiff) is read as is
    done = {(v in const_in, _narrowed(out, out.node(operand[v]))): v for v in xs_in + const_in
            if _narrowed(out, out.node(operand[v])) is not None}
    outer: dict[int, int] = {}                         # body input -> outer bf16 operand
    again: dict[int, int] = {}                         # body input -> its cast's body input
    for m in casts:
        src = m.inputs[0]
        key = (src in const_in, operand[src])
        if key in done:
            again[src] = done[key]
        elif src not in outer:
            outer[src] = out.add(Op.CAST, (operand[src],), {"dtype": "bf16"})
    hoisted = {m.id for m in casts}
    read = {i for m in body if m.id not in hoisted for i in m.inputs} | {
        v for _, v in body.outputs}
    keep_xs = [v for v in xs_in if v in read]
    keep_consts = [v for v in const_in if v in read]
    new_xs = [v for v in outer if v in set(xs_in)]
    new_consts = [v for v in outer if v in set(const_in)]

    nb = Graph(body.name)
    benv: dict[int, int] = {}
    as_bf16: dict[int, int] = {}                       # body input -> its new bf16 input
    for v in carry_in + keep_xs:
        benv[v] = nb.add_like(body.node(v))
    for src in new_xs:
        as_bf16[src] = _input(nb, body.node(src))
    for v in keep_consts:
        benv[v] = nb.add_like(body.node(v))
    for src in new_consts:
        as_bf16[src] = _input(nb, body.node(src))
    as_bf16.update((src, benv[v]) for src, v in again.items())
    for m in body:
        if m.op is Op.INPUT:
            continue
        if m.id in hoisted:
            benv[m.id] = as_bf16[m.inputs[0]]
        else:
            benv[m.id] = nb.add_like(m, [benv[i] for i in m.inputs])
    nb.set_outputs([(name, benv[v]) for name, v in body.outputs])
    new_ins = ([operand[v] for v in carry_in + keep_xs] + [outer[v] for v in new_xs]
               + [operand[v] for v in keep_consts] + [outer[v] for v in new_consts])
    return out.add_like(n, new_ins, body=nb, n_xs=len(keep_xs) + len(new_xs))


def _input(nb: Graph, src: Node) -> int:
    """A body input for the bf16 cast of body input `src` (a name no input of `nb` has: a
    training graph's body can hold a bf16 slice hoisted before autodiff beside it)."""
    names = {nb.node(i).attr("name") for i in nb.inputs}
    name, k = f"{src.attr('name')}_bf16", 1
    while name in names:
        name, k = f"{src.attr('name')}_bf16_{k}", k + 1
    return nb.add(Op.INPUT, (), {"name": name}, replace(src.type, dtype="bf16"))
