"""The planned storage an executor binds values to: byte regions handing out typed views
(`Storage`: the activation arena, the persistent region, a scan's workspace) and the stack
allocator of kernel-internal values (`Scratch`). A region on the `meta` device only measures:
an executor binds once on meta storage to size its scratch stack, then on real storage."""
from __future__ import annotations

import torch

from titanc.ir.types import DTYPES, ITEMSIZE, TensorType

Tensor = torch.Tensor


def torch_dtype(name: str, float_dtype: torch.dtype | None) -> torch.dtype:
    """The torch dtype of IR dtype `name`; a float one is `float_dtype` when it is set (the
    executor's floating-point override)."""
    if float_dtype is not None and name in ("f32", "f64"):
        return float_dtype
    return DTYPES[name]


class Storage:
    """A byte region handing out typed views; `meta` regions only measure (no memory)."""

    def __init__(self, nbytes: int, meta: bool = False, device: str = "cpu"):
        self.nbytes = nbytes
        self.data = torch.empty(nbytes, dtype=torch.uint8, device="meta" if meta else device)

    def view(self, offset: int, t: TensorType, float_dtype: torch.dtype | None) -> Tensor:
        dt = torch_dtype(t.dtype, float_dtype)
        size = t.numel * dt.itemsize
        if offset + size > self.nbytes:
            raise ValueError(f"view [{offset}, {offset + size}) beyond {self.nbytes} bytes")
        return self.data[offset:offset + size].view(dt).view(t.shape)

    def region(self, offset: int, size: int) -> "Storage":
        """A sub-region of this storage as a Storage of its own."""
        region = Storage(0)
        region.data = self.data[offset:offset + size]
        region.nbytes = size
        return region


class Scratch:
    """A stack allocator over one region: kernels allocate from `mark`, release on exit."""

    def __init__(self, storage: Storage, float_dtype: torch.dtype | None):
        self.storage, self.float_dtype = storage, float_dtype
        self.top = 0
        self.high = 0

    def alloc(self, t: TensorType) -> Tensor:
        size = -(-t.numel * ITEMSIZE[t.dtype] // 64) * 64
        if self.float_dtype is not None and t.is_float:
            size = -(-t.numel * torch.empty((), dtype=self.float_dtype).element_size() // 64) * 64
        off = self.top
        self.top += max(size, 64)
        self.high = max(self.high, self.top)
        if self.storage.data.device.type == "meta" or off + size > self.storage.nbytes:
            return torch.empty(t.shape, dtype=torch_dtype(t.dtype, self.float_dtype),
                               device="meta")
        return self.storage.view(off, t, self.float_dtype)
