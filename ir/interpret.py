"""Reference interpreter: runs a Graph on torch, op by op, in float64 or float32.

It is the numerical oracle for every pass and backend. Each op's reference semantics is its
registry entry's `ref` (`elementwise.py`, `structural.py`); the interpreter walks the graph,
frees values after their last use and maps float dtypes. It uses only out-of-place torch ops,
so autograd can also differentiate through it (tests use that as a cross-check of autodiff).
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from titanc.ir.elementwise import ELEMENTWISE
from titanc.ir.graph import Graph, Node
from titanc.ir.ops import Op
from titanc.ir.structural import STRUCTURAL
from titanc.ir.types import DTYPES

Tensor = torch.Tensor


class Interpreter:
    """Evaluate graphs; `float_dtype` (if given) replaces every float dtype of the graph."""

    def __init__(self, float_dtype: torch.dtype | None = None):
        self.float_dtype = float_dtype

    def dtype(self, name: str) -> torch.dtype:
        if self.float_dtype is not None and name in ("f32", "f64"):
            return self.float_dtype
        return DTYPES[name]

    def run(self, g: Graph, args: Sequence[Tensor]) -> list[Tensor]:
        """Positional: args in `g.inputs` order; returns outputs in `g.outputs` order."""
        env: dict[int, Any] = dict(zip(g.inputs, args))
        order = g.order()
        last_use: dict[int, int] = {}
        for pos, nid in enumerate(order):
            for i in g.node(nid).inputs:
                last_use[i] = pos
        keep = {nid for _, nid in g.outputs}
        for pos, nid in enumerate(order):
            node = g.node(nid)
            if node.op is not Op.INPUT:
                env[nid] = self._eval(node, [env[i] for i in node.inputs])
            for i in set(node.inputs):
                if last_use[i] == pos and i not in keep:
                    del env[i]
        return [env[nid] for _, nid in g.outputs]

    def __call__(self, g: Graph, inputs: Mapping[str, Tensor]) -> dict[str, Tensor]:
        missing = [n for n in g.input_names() if n not in inputs]
        if missing:
            raise KeyError(f"graph {g.name} needs inputs {missing}")
        args = [self._cast(inputs[n]) for n in g.input_names()]
        return dict(zip((n for n, _ in g.outputs), self.run(g, args)))

    def _cast(self, x: Tensor) -> Tensor:
        if self.float_dtype is not None and x.is_floating_point():
            return x.to(self.float_dtype)
        return x

    def _eval(self, node: Node, args: list[Any]) -> Any:
        if node.op in ELEMENTWISE:
            return ELEMENTWISE[node.op].ref(*args)
        return STRUCTURAL[node.op].ref(node, args, self)


def interpret(g: Graph, inputs: Mapping[str, Tensor],
              float_dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    return Interpreter(float_dtype)(g, inputs)
