"""checkpoint_chunks: memory-chunk scans split into groups, so the backward saves √n states.

Every scan of role "memory" (length n, n >= 8 and not prime) becomes an outer scan of n/k
iterations (role "memory_group") over an inner scan of k, k the divisor of n closest to √n.
Under the `recompute` policy (passes/remat.py) the outer scan saves the memory state every k
chunks and the backward recomputes the k states in between: saved states drop from n to
n/k + k. Precondition: `g` verifies. Postcondition: same values (tests/test_remat.py), every
other node unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from titanc.ir import Graph, Op


def _split_factor(n: int) -> int:
    """The divisor of n closest to sqrt(n) (1 when n is small or prime)."""
    if n < 8:
        return 1
    best = 1
    for k in range(2, n):
        if n % k == 0 and abs(k - n ** 0.5) < abs(best - n ** 0.5):
            best = k
    return best


@dataclass(frozen=True)
class CheckpointChunks:
    """Split every memory scan (role "memory", length n) into an outer scan of n/k
    iterations over an inner scan of k, k ≈ sqrt(n) (the module docstring has the
    pre/postconditions)."""
    name: ClassVar[str] = "checkpoint_chunks"

    def __call__(self, g: Graph) -> Graph:
        from titanc.ir import Builder, Value

        b = Builder(g.name)
        env: dict[int, Any] = {}
        for node in g:
            attrs = node.attr_dict
            ins = [env[i] for i in node.inputs]
            if node.op is Op.ITEM and isinstance(ins[0], list):       # an ITEM of a split scan
                env[node.id] = ins[0][attrs["index"]]
                continue
            if node.op is Op.SCAN:
                attrs["body"] = self(attrs["body"])
            k = _split_factor(attrs["length"]) if node.op is Op.SCAN else 1
            if k == 1 or attrs.get("role") != "memory":
                env[node.id] = b.like(node, *ins, **attrs)
                continue
            n, nc, nx_ = attrs["length"], attrs["n_carry"], attrs["n_xs"]
            n_out = len(attrs["body"].outputs)
            xs = [x.reshape(n // k, k, *x.shape[1:]) for x in ins[nc:nc + nx_]]

            def outer(bb: Builder, c: list[Value], x: list[Value], ks: list[Value]):
                tup = bb.op(Op.SCAN, *c, *x, *ks, **{**attrs, "length": k})
                outs = [bb.item(tup, j) for j in range(n_out)]
                return outs[:nc], outs[nc:]

            cs, ys = b.scan(outer, ins[:nc], xs, ins[nc + nx_:], length=n // k,
                            reverse=attrs["reverse"], name=f"{attrs['body'].name}_group",
                            role="memory_group")
            env[node.id] = cs + [y.reshape(n, *y.shape[2:]) for y in ys]
        b.graph.set_outputs([(name, env[i].id) for name, i in g.outputs])
        return b.graph


checkpoint_chunks = CheckpointChunks()
