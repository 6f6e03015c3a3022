"""What a hook hands back for one kernel, and the helpers every hook shares.

`KernelCode` is one rendered kernel: its module source and how to launch it (`TensorArg`s:
which values, viewed how; then the trailing size arguments of the family's `launch`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from titanc.ir import Graph
from titanc.ir.types import TensorType

from titanc.codegen.lower.indexing import Ix, Section
from titanc.codegen.lower.nodes import KernelLowering

__all__ = ["KernelCode", "TensorArg", "code_of", "graph_dtype", "index_tile", "indexed_args",
           "store"]


@dataclass(frozen=True)
class TensorArg:
    """A launcher argument: the tensor holding `value`, viewed as `view` (dense storage)."""

    value: int
    view: tuple[int, ...] | None = None


@dataclass(frozen=True)
class KernelCode:
    name: str
    category: str                  # the schedule's kernel category
    family: str                    # the template it was rendered from
    graph: str                     # the graph (or scan body) it belongs to
    source: str
    args: tuple[TensorArg, ...]    # tensors, in `launch` order
    sizes: tuple[Any, ...]         # the trailing `launch` arguments (ints, a shape tuple)

    @cached_property
    def key(self) -> str:
        """The source without its header comments and with the kernel's own name replaced:
        two kernels with equal keys can share one module (computed once: a host loop's
        binding asks it at every launch of its body)."""
        lines = self.source.splitlines()
        start = next(i for i, line in enumerate(lines) if not line.startswith("#"))
        body = "\n".join(lines[start:])
        return re.sub(rf"\b{re.escape(self.name)}\b", "KERNEL", body)


def graph_dtype(g: Graph) -> str:
    """The float dtype a graph computes in ('float32' unless its values are f64)."""
    for n in g:
        t = n.type
        if isinstance(t, TensorType) and t.is_float:
            return "float64" if t.dtype == "f64" else "float32"
    return "float32"


def index_tile(sec: Section, expr: str, dims: str) -> Ix:
    """A template's index tile as int64 (no overflow on large tensors, and the interpreter
    checks no int32 overflow on the index arithmetic built from it)."""
    return sec.ix(f"{expr}.to(tl.int64)", frozenset(dims))


def code_of(low: KernelLowering, family: str, source: str, args: list[TensorArg],
          sizes: tuple[Any, ...]) -> KernelCode:
    return KernelCode(low.kernel.name, low.kernel.category, family, low.g.name, source,
                      tuple(args), sizes)


def indexed_args(low: KernelLowering) -> list[TensorArg]:
    return [TensorArg(v) for v in low.tensors]


def store(low: KernelLowering, sec: Section, v: int, coords: list[Ix],
           stores: list[tuple[str, str, str]]) -> None:
    """Store output `v` (a value of `sec`, or read there) at its own coordinates `coords`."""
    val = sec.values.get(v) or low.read(sec, v, coords)
    val = low.block(sec, val)
    stores.append((low.tensor(v, "out"), low.offset(sec, v, coords), val.expr))
