"""checkpoint_chunks: memory-chunk scans (and, on request, the layer scan) split into groups,
so the backward saves about √n states.

Every scan of role "memory" (length n, n >= 8 and not prime) becomes an outer scan of n/k
iterations (role "memory_group") over an inner scan of k, k the divisor of n closest to √n.
Under the `recompute` policy (passes/remat.py) the outer scan saves the memory state every k
chunks and the backward recomputes the k states in between: saved states drop from n to
n/k + k. With `layer_group` k > 1 (train.remat_group) the layer scan (role "layer", k dividing
its length L) is split the same way (outer role "layer_group"): the residual stream is saved
every k layers and the backward of a group re-runs its k layers, so L/k + k layer checkpoints
are live instead of L, for one more forward of the layers. Precondition: `g` verifies.
Postcondition: same values (tests/test_remat.py, tests/test_remat_group.py), every other node
unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import isqrt
from typing import Any, ClassVar

from titanc.ir import Graph, Op


def _split_factor(n: int) -> int:
    """The divisor of n closest to sqrt(n) (1 when n is small or prime)."""
    if n < 8:
        return 1
    # the divisors pair up around sqrt(n): d <= sqrt(n) <= n / d, so O(sqrt n) candidates;
    # ties go to the smaller
    ks = [k for d in range(2, isqrt(n) + 1) if n % d == 0 for k in (d, n // d)]
    return min(ks, key=lambda k: (abs(k - n ** 0.5), k), default=1)


@dataclass(frozen=True)
class CheckpointChunks:
    """Split every memory scan (role "memory", length n) into an outer scan of n/k
    iterations over an inner scan of k, k ≈ sqrt(n) (the module docstring has the
    pre/postconditions)."""
    layer_group: int = 1           # layers per group of the layer scan (1: not split)
    # split the memory scans (compile.chunk_groups, off by default: every chunk's state is
    # saved and the backward recomputes no chunk; split, large_125m bf16 trains in a 1,954 MiB
    # arena for 2,085 with 28,162 launches a step for 21,538, its memory scans host loops)
    chunks: bool = True
    name: ClassVar[str] = "checkpoint_chunks"

    def _factor(self, attrs: dict) -> tuple[int, str]:
        """(inner length, outer role) of a scan to split; inner length 1: not split."""
        role, n = attrs.get("role"), attrs["length"]
        if role == "memory" and self.chunks:
            return _split_factor(n), "memory_group"
        if role == "layer" and 1 < self.layer_group < n and n % self.layer_group == 0:
            return self.layer_group, "layer_group"
        return 1, ""

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
            k, role = self._factor(attrs) if node.op is Op.SCAN else (1, "")
            if k == 1:
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
                            role=role)
            env[node.id] = cs + [y.reshape(n, *y.shape[2:]) for y in ys]
        b.graph.set_outputs([(name, env[i].id) for name, i in g.outputs])
        return b.graph


checkpoint_chunks = CheckpointChunks()
