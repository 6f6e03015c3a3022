"""The graph inputs of `data.documents` for a batch (docs/data.md "Documents"): `doc_start`
and `loss_mask` [batch, seq_len], checked, defaulted and cast for a compiled program."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from titanc.errors import TitancError
from titanc.runtime.api_checks import check_dense, check_document_values

Tensor = torch.Tensor


def document_inputs(spec: Any, dtype: torch.dtype, tokens: Tensor,
                    docs: Mapping[str, Tensor] | None, loss: bool = True) -> dict[str, Tensor]:
    """The graph inputs of `data.documents` for a batch of `tokens` under `spec`: `docs` may
    hold `doc_start` and `loss_mask` [B, T] (the loader's, runtime/data/datasets.py); absent
    ones default to one document per row and every target counted; `loss` false: the graph
    computes no loss and takes no `loss_mask`. `data.loss: queries` takes `loss_mask` alone
    (which targets count; the loader marks the recall task's queries)."""
    if docs is not None and not isinstance(docs, Mapping):
        raise TypeError(f"docs must be a mapping {{'doc_start': tensor, 'loss_mask': "
                        f"tensor}} or None, got {type(docs).__name__}")
    if not spec.data.documents and spec.data.loss == "all":
        if docs:
            raise TitancError(f"{', '.join(sorted(docs))} given, but the program has no "
                              f"document inputs; set data.documents=true")
        return {}
    docs = dict(docs or {})
    unknown = set(docs) - {"doc_start", "loss_mask"}
    if unknown:
        raise TitancError(f"unknown document inputs {sorted(unknown)}; "
                          f"pass doc_start and loss_mask")
    shape = (tokens.shape[0], spec.model.seq_len)
    names = (["doc_start"] if spec.data.documents and spec.data.pack else []) \
        + (["loss_mask"] if loss else [])
    return {name: _document_input(name, docs.get(name), fill, shape, dtype).to(dtype)
            for name, fill in (("doc_start", 0.0), ("loss_mask", 1.0)) if name in names}


def _document_input(name: str, t: Any, fill: float, shape: tuple[int, int],
                    dtype: torch.dtype) -> Tensor:
    if t is None:
        return torch.full(shape, fill, dtype=dtype)
    if not isinstance(t, Tensor):
        raise TypeError(f"docs[{name!r}] must be a torch.Tensor [batch, seq_len], got "
                        f"{type(t).__name__}")
    if t.device.type == "meta" or t.is_complex():
        raise TitancError(f"{name} must be a real tensor holding values, got a "
                          f"{t.dtype} tensor on {t.device}")
    if tuple(t.shape) != shape:
        raise TitancError(f"{name} must be [batch, seq_len] = {list(shape)}, "
                          f"got {list(t.shape)}")
    check_dense(t, f"docs[{name!r}]")
    check_document_values(name, t)
    return t
