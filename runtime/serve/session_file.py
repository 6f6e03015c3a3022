"""Conversation files: a batch-1 `DecodeState` on disk, and what a loaded state must satisfy.

A session file is safetensors: the tensors of `Generator.state_dict` and metadata naming what
the state is only valid with (`Generator.identity`: the spec's sha256, the tokenizer's, and
since version 2 the weights' sha256), plus a sha256 checksum over everything else. A file is
read only by the model, tokenizer and weights that wrote it: a state continued on other
weights would answer without a word from weights it was not made with.

A state read back (`check_loaded_state`, used by `Generator.load_state_dict`) is checked
against the model's bounds before any of it is used, so a file someone edited (the checksum
recomputed) is one TitancError, never a dead engine or a turn that feeds past the limits:

| what         | bound                                                                      |
|--------------|----------------------------------------------------------------------------|
| `pos`        | in [0, MAX_POSITION]: positions go through float64 RoPE angles and int64 index arithmetic |
| `unfed`      | at most MAX_UNFED ids, each in the vocabulary (titanc writes 1: the last sampled token) |
| `slot_pos`   | in [-1, pos)                                                               |
| every tensor | finite, |x| <= MAX_STATE_ABS: squares and dot products over 2**20 terms stay within float32 |
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import torch

from titanc.errors import TitancError

__all__ = ["SESSION_FORMAT", "SESSION_VERSION", "MAX_POSITION", "MAX_UNFED", "MAX_STATE_ABS",
           "weights_hash", "check_loaded_state", "save_session", "load_session"]

SESSION_FORMAT = "titanc-session"
SESSION_VERSION = "2"               # 2: the identity carries the weights' hash
MAX_POSITION = 2**48
MAX_UNFED = 64
MAX_STATE_ABS = 2.0**30


def weights_hash(prog: Any) -> str:
    """sha256 hex of a program's parameters (its flat parameter buffer, as stored)."""
    flat = prog.flat["param"].detach().contiguous().cpu()
    h = hashlib.sha256(f"{flat.dtype}{list(flat.shape)}".encode())
    h.update(flat.view(torch.uint8).numpy())
    return h.hexdigest()


def check_loaded_state(sd: dict[str, torch.Tensor], vocab_size: int, what: str) -> None:
    """The bounds of the module docstring's table; TitancError naming `what` and the entry."""
    from titanc.runtime.api_checks import first_nonfinite

    if sd["pos"].numel() != 1:
        raise TitancError(f"{what}: tensor 'pos' holds {sd['pos'].numel()} values, a "
                          f"conversation has one position")
    pos, unfed = int(sd["pos"].reshape(())), sd["unfed"]
    if not 0 <= pos <= MAX_POSITION:
        raise TitancError(f"{what}: position {pos} is outside [0, 2**48]; it is damaged")
    if unfed.numel() > MAX_UNFED:
        raise TitancError(f"{what}: {unfed.numel()} unfed tokens, more than the {MAX_UNFED} a "
                          f"conversation state may carry (titanc writes 1); it is damaged")
    ids = unfed.tolist()
    if any(not 0 <= u < vocab_size for u in ids):
        raise TitancError(f"{what}: unfed ids {ids[:4]} outside the vocabulary "
                          f"[0, {vocab_size}); it is damaged")
    held = sd["slot_pos"]
    if bool(((held < -1) | (held >= pos)).any()):
        raise TitancError(f"{what}: tensor 'slot_pos' holds positions outside [-1, {pos}) "
                          f"for a conversation at position {pos}; it is damaged")
    values = {k: t for k, t in sd.items() if k not in ("pos", "unfed", "slot_pos")}
    bad = first_nonfinite(values)
    if bad is not None:
        raise TitancError(f"{what}: tensor {bad!r} holds a NaN or an inf; it is damaged")
    for k in sorted(values):
        t = values[k]
        if t.numel() and float(t.detach().abs().max()) > MAX_STATE_ABS:
            raise TitancError(f"{what}: tensor {k!r} holds a value of magnitude "
                              f"{float(t.detach().abs().max()):.3g}, beyond the 2**30 a "
                              f"decoding state stays within; it is damaged")


def save_session(path: str | os.PathLike, gen: Any, state: Any,
                 shown: str | None = None) -> Path:
    """Write a conversation state (a batch-1 `DecodeState` of the `Generator` `gen`) as
    safetensors, atomically (a temporary file, then a rename; temporary files of saves that
    died are removed first). Metadata: format,
    version, `gen.identity()` and a sha256 checksum over everything else. Errors name the
    file as `shown` (default: its path)."""
    from safetensors.torch import save_file

    from titanc.runtime.train.checkpoint import checksum, remove_stale_temps

    path = Path(path)
    shown = str(path) if shown is None else shown
    tensors = gen.state_dict(state)
    meta = {"format": SESSION_FORMAT, "version": SESSION_VERSION, **gen.identity()}
    meta["checksum"] = checksum(tensors, meta)
    tmp = path.parent / f".{path.name}.{os.getpid()}.tmp"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(path)
        save_file(tensors, str(tmp), metadata=meta)
        os.replace(tmp, path)
    except Exception as exc:                    # OSError, or safetensors' own on a full disk
        try:
            tmp.unlink(missing_ok=True)
        except OSError:                         # a read-only directory: nothing was written
            pass
        reason = getattr(exc, "strerror", None) or " ".join(str(exc).split())
        if shown != str(path):                  # the caller hides the directory: all of it
            reason = reason.replace(str(path.parent.resolve()), "").replace(str(path.parent), "")
        raise TitancError(f"could not write session file {shown}: {reason}") from None
    return path


def load_session(path: str | os.PathLike, gen: Any,
                 shown: str | None = None) -> Any:
    """Read a conversation file written by `save_session` for this model, tokenizer and
    weights; every problem (a missing, truncated or damaged file, an unknown version, another
    model's, tokenizer's or weights' state, a value past the bounds) is one TitancError
    naming the file as `shown` (default: its path)."""
    shown = str(path) if shown is None else shown
    meta, tensors = _read(Path(path), shown)
    _check_identity(meta, gen.identity(), shown)
    return gen.load_state_dict(tensors, f"session file {shown}")


def _read(path: Path, shown: str) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    from safetensors import safe_open

    from titanc.runtime.train.checkpoint import checksum

    if not path.is_file():
        raise TitancError(f"session file {shown} does not exist")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:                    # safetensors' error on a truncated header/data
        first = (str(exc).splitlines() or [type(exc).__name__])[0][:120]
        raise TitancError(f"session file {shown} is truncated or not a safetensors file "
                          f"({first})") from None
    if meta.get("format") != SESSION_FORMAT:
        raise TitancError(f"{shown} is not a titanc session file (format "
                          f"{str(meta.get('format'))[:40]!r}); write one with a session "
                          f"snapshot")
    if meta.get("checksum") != checksum(tensors, meta):
        raise TitancError(f"session file {shown} is damaged (its checksum does not match)")
    if meta.get("version") != SESSION_VERSION:
        raise TitancError(f"session file {shown} is version {str(meta.get('version'))[:12]!r}; "
                          f"this titanc reads version {SESSION_VERSION} (version 1 carries no "
                          f"weights hash: start the conversation again)")
    return meta, tensors


def _check_identity(meta: dict[str, str], mine: dict[str, str], shown: str) -> None:
    if meta.get("spec_hash") != mine["spec_hash"]:
        raise TitancError(f"session file {shown} holds a state of model "
                          f"{str(meta.get('model'))[:60]!r} (spec "
                          f"{str(meta.get('spec_hash'))[:12]}), not of this model "
                          f"{mine['model']!r} (spec {mine['spec_hash'][:12]}); load it into "
                          f"the model that wrote it")
    if meta.get("tokenizer") != mine["tokenizer"]:
        raise TitancError(f"session file {shown} was written with another tokenizer "
                          f"({str(meta.get('tokenizer'))[:12]}, this one is "
                          f"{mine['tokenizer'][:12]}); load it with the run's own tokenizer")
    if meta.get("weights") != mine["weights"]:
        raise TitancError(f"session file {shown} was written with other weights "
                          f"({str(meta.get('weights'))[:12]}, these are "
                          f"{mine['weights'][:12]}) of the same model; load it into the run "
                          f"(checkpoint) that wrote it")
