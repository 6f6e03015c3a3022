"""Static tensor types: a shape and a dtype, both fixed at compile time."""
from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch

DTYPES: dict[str, torch.dtype] = {"f32": torch.float32, "f64": torch.float64,
                                   "bf16": torch.bfloat16, "i64": torch.int64}
ITEMSIZE = {"f32": 4, "f64": 8, "bf16": 2, "i64": 8}
FLOATS = frozenset({"f32", "f64", "bf16"})


def dtype_name(dtype: str | torch.dtype) -> str:
    """'float32' / torch.float32 / 'f32' -> 'f32' (and 'bfloat16' -> 'bf16')."""
    if isinstance(dtype, torch.dtype):
        return {v: k for k, v in DTYPES.items()}[dtype]
    names = {"float32": "f32", "float64": "f64", "bfloat16": "bf16", "int64": "i64"}
    return names.get(dtype, dtype)


@dataclass(frozen=True, slots=True)
class TensorType:
    shape: tuple[int, ...]
    dtype: str = "f32"

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * ITEMSIZE[self.dtype]

    @property
    def is_float(self) -> bool:
        return self.dtype in FLOATS

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.shape))}]"


Type = TensorType | tuple[TensorType, ...]


def type_str(t: Type) -> str:
    if isinstance(t, tuple):
        return "(" + ", ".join(map(str, t)) + ")"
    return str(t)


def type_bytes(t: Type) -> int:
    """Bytes of a value; a tuple counts the largest element (each is its own buffer)."""
    if isinstance(t, tuple):
        return max((x.nbytes for x in t), default=0)
    return t.nbytes
