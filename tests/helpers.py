"""Shared test helpers: tiny specs and parameter sets."""
from __future__ import annotations

from typing import Any

import torch

from titanc.spec import Spec, load_spec

TINY: dict[str, Any] = {
    "name": "t",
    "model": {"vocab_size": 32, "d_model": 16, "n_layers": 2, "block": "lmm", "seq_len": 16,
              "ffn_hidden": 24,
              "attention": {"heads": 2, "window": 6, "segment": 8, "persistent_tokens": 2},
              "memory": {"heads": 2, "depth": 2, "expansion": 2, "chunk_size": 4,
                         "lr_max": 0.5}},
    "train": {"batch_size": 2, "dtype": "float64"},
}
BLOCKS = ["attn", "lmm", "mag", "mal", "mac"]
MEMORY_BLOCKS = ["lmm", "mag", "mal", "mac"]


def tiny_spec(**overrides: Any) -> Spec:
    return load_spec(TINY, overrides)


def tokens(spec: Spec, batch: int | None = None, seed: int = 0) -> torch.Tensor:
    B = batch or spec.train.batch_size
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, spec.model.vocab_size, (B, spec.model.seq_len + 1), generator=gen)
