"""Checks of the tensors a user hands the Python API (`Program.loss`, `train_step`, `grads`,
`logits`, `logprobs`, `advance`, `load_state_dict`), each a one-line `TitancError` naming the
argument and the fix, never an error from deep inside torch or a silent wrong result:

    check_dense(t, "tokens")                      # strided: not sparse, nested or quantized
    check_token_dtype(tokens, vocab_size)         # an integer dtype that holds every id
    check_document_values("loss_mask", t)         # data.documents' inputs: see below

Token ids must come in an integer dtype whose range covers [0, model.vocab_size): int64 and
int32 always (the vocabulary is at most 2**21, titanc/bounds.py), int16 / uint8 / int8 only
for a vocabulary they hold (uint8: the byte tokenizer's 256), so ids truncated by a cast to a
narrower type are refused rather than trained on. Their values are range-checked by
`runtime.program.check_token_ids`.

`data.documents` inputs, [batch, seq_len] each: `loss_mask` holds 0 or 1 (a negative or NaN
weight made a loss of −354 or NaN); `doc_start[b, t]` is the position in its row at which
token t's document starts, so an integer with 0 <= doc_start[t] <= t that either repeats
doc_start[t-1] or starts a document at t (doc_start[t] == t). The checks read the tensors
where they are: the loader's batches (runtime/data, what the trainer passes) are CPU tensors,
for which they cost a few vector operations over [batch, seq_len] and no device
synchronisation; a caller who hands device tensors pays one synchronisation per call.
"""
from __future__ import annotations

from typing import Any

import torch

from titanc.errors import TitancError

__all__ = ["check_dense", "check_token_dtype", "check_token_ids", "check_state_tensor",
           "check_document_values", "first_nonfinite"]

Tensor = torch.Tensor


def check_dense(t: Any, what: str) -> None:
    """`t` is a dense (strided) tensor: a sparse, nested or quantized one is refused by name
    (torch would raise NotImplementedError, or the executor read its raw storage)."""
    if not isinstance(t, Tensor):
        return                                    # the caller names the expected type
    if t.layout != torch.strided:
        kind = str(t.layout).removeprefix("torch.")
        raise TitancError(f"{what} is a {kind} tensor; pass a dense tensor "
                          f"({what}.to_dense())")
    if t.is_nested:
        raise TitancError(f"{what} is a nested tensor; pass a dense tensor with one row per "
                          f"sequence")
    if t.is_quantized:
        raise TitancError(f"{what} is a quantized tensor; pass a dense one "
                          f"({what}.dequantize())")


def check_token_dtype(tokens: Tensor, vocab_size: int, what: str = "tokens") -> None:
    """An integer `tokens` dtype holds every id of the vocabulary [0, vocab_size): a narrower
    one (int16 for a 50k vocabulary) means the ids were cut by a cast."""
    if tokens.dtype == torch.bool or tokens.is_floating_point() or tokens.is_complex():
        return                                    # check_token_ids refuses these by name
    info = torch.iinfo(tokens.dtype)
    if info.max < vocab_size - 1:
        raise TitancError(f"{what} is a {str(tokens.dtype).removeprefix('torch.')} tensor, "
                          f"which cannot hold the ids of model.vocab_size={vocab_size} (at "
                          f"most {info.max}); pass int64 token ids")


def check_document_values(name: str, t: Tensor) -> None:
    """`loss_mask` holds only 0 and 1; `doc_start` the document start of each position (see
    the module docstring). `t` is [batch, seq_len], real, already shape-checked. One pass of
    comparisons and one read; the position is looked for only when one is bad."""
    x = t.detach()
    if name == "loss_mask":
        bad = (x != 0) & (x != 1)                # NaN and inf included
        rule = "0 (a target left out of the loss) or 1"
    else:
        # doc_start[t] == doc_start[t-1] or == t, and doc_start[0] == 0: by induction each is
        # an integer in [0, t] where a document starts; NaN, -5 or 0.5 equal neither
        pos = torch.arange(x.shape[1], device=x.device).to(x.dtype)
        bad = x != pos
        bad[:, 1:] &= x[:, 1:] != x[:, :-1]
        rule = ("the position in its row where each token's document starts: an integer "
                "0 <= doc_start[t] <= t, equal to doc_start[t-1] or to t")
    if not bad.any().cpu().tolist():
        return
    b, i = torch.nonzero(bad)[0].cpu().tolist()
    value = x[b, i].cpu().tolist()
    raise TitancError(f"docs[{name!r}][{b}, {i}] is {value!r}; {name} holds {rule}")


def check_state_tensor(t: Any, what: str) -> None:
    """A tensor of a state dict (`what` names it): a torch.Tensor that holds values."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    check_dense(t, what)
    if t.device.type == "meta":
        raise TitancError(f"{what} is on the meta device and holds no values")


def check_token_ids(tokens: Tensor, vocab_size: int, what: str = "tokens",
                    scratch: Tensor | None = None) -> None:
    """Token ids are integers in [0, vocab_size): a float or bool tensor would be truncated
    into ids silently, and an id out of range fails deep inside torch. `scratch`, an int64
    tensor of 2 elements, holds the min and max of int64 tokens without allocating."""
    check_dense(tokens, what)
    if tokens.dtype == torch.bool or tokens.is_floating_point() or tokens.is_complex():
        raise TitancError(f"{what} must hold integer token ids, got a {tokens.dtype} tensor; "
                          f"convert with .long() only if the values are ids")
    if tokens.device.type == "meta":
        raise TitancError(f"{what} is a tensor on the meta device, which holds no values; "
                          f"pass the token ids themselves")
    check_token_dtype(tokens, vocab_size, what)
    if tokens.numel():
        if (scratch is not None and tokens.dtype == scratch.dtype and tokens.dim() == 2
                and tokens.device == scratch.device):
            if tokens.is_contiguous():         # one pass over the ids (about half the time)
                torch.aminmax(tokens.view(-1), dim=0, out=(scratch[0], scratch[1]))
            else:
                torch.amin(tokens, dim=(0, 1), out=scratch[0])
                torch.amax(tokens, dim=(0, 1), out=scratch[1])
            lo, hi = scratch.tolist()
        else:
            lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            raise TitancError(f"{what}: id {bad} is outside the vocabulary [0, {vocab_size}) "
                              f"of model.vocab_size={vocab_size}")


def first_nonfinite(tensors: dict[str, Tensor]) -> str | None:
    """The name of the first floating-point tensor (in name order) holding a NaN or an inf."""
    for k in sorted(tensors):
        t = tensors[k]
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return k
    return None
