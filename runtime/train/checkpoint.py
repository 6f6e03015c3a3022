"""Checkpoints: one safetensors file holding everything a run needs to continue bit for bit.

Tensors: the program's `state_dict()` (`param.<name>`, `opt.m.<name>`, `opt.v.<name>`,
`opt.step`) and `rng.data`, the state of the data sampler's `torch.Generator` (uint8).
Metadata (strings): `format`, `version`, `step`, `spec` (the spec as JSON), `spec_hash`,
`titanc_version`, `extra` (JSON from the caller) and `checksum`: sha256 over every tensor
(name, dtype, shape, bytes, in name order) and every other metadata entry. `load_checkpoint`
recomputes it, so a damaged file is an error naming it, never weights loaded silently.

A checkpoint is written atomically: into a temporary file `.NAME.<pid>.tmp` in the same
directory, fsynced, then `os.replace`d over the old one, so a crash or a full disk leaves the
previous checkpoint whole. Temporary files of writers that are gone (a `kill -9` during a
save; titanc.files.remove_stale_temps, which also knows a reused pid) are removed by the next
save into the directory and by the next read of a checkpoint there (a resume, `generate`,
`eval`, into whatever --out). Resuming compares the checkpoint's spec with the new one field by field:

- run-control fields (`RUN_CONTROL`: train.steps, eval/checkpoint/log cadence, remat, every
  `compile.*` field, name) never matter;
- `model.*` decides the tensors. Differences are allowed only as an *upgrade*: every tensor of
  the checkpoint fits the new spec with the same shape, and the new spec may add tensors (say
  `model.memory.adaptive` or `output_gate` turned on), which keep their fresh initialisation;
- the other `train.*` and `data.*` fields change how training goes on, not the state; they are
  reported as notes.

`strict=True` (`--strict`) refuses any difference outside the run-control fields.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import struct
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from titanc.errors import TitancError, printable
from titanc.files import remove_stale_temps as _remove_temps
from titanc.model.spec import spec_hash, spec_to_dict
from titanc.runtime.api_checks import first_nonfinite

__all__ = [
    "CHECKPOINT_NAME", "RNG_KEY", "RUN_CONTROL", "save_checkpoint", "load_checkpoint",
    "checkpoint_path", "spec_differences", "expected_state", "check_resumable", "restore",
    "checksum", "remove_stale_temps",
]

Tensor = torch.Tensor
FORMAT = "titanc-checkpoint"
VERSION = "1"
CHECKPOINT_NAME = "checkpoint.safetensors"
RNG_KEY = "rng.data"
# the metadata entries save_checkpoint writes (`checksum` since issue 17)
META_KEYS = frozenset({"format", "version", "step", "spec", "spec_hash", "titanc_version",
                       "extra", "checksum"})
# Spec fields that steer a run without touching its state: they may differ on resume.
# Every field of the `compile` section is one (RUN_CONTROL_SECTIONS).
RUN_CONTROL = frozenset({
    "name", "train.steps", "train.eval_every", "train.eval_batches", "train.checkpoint_every",
    "train.log_every", "train.memory_stats_every", "train.remat", "train.remat_budget_mb",
    "train.remat_rows", "train.remat_group", "train.loss_chunk", "compile.target",
    "train.bucket_mb", "train.zero", "train.dist_timeout_s", "train.tensorboard",
})
RUN_CONTROL_SECTIONS = ("compile.",)


# ---------------------------------------------------------------------------------- writing


def save_checkpoint(path: str | os.PathLike, prog: Any, rng_state: Tensor | None = None,
                    extra: dict[str, Any] | None = None) -> Path:
    """Write `prog`'s state, the sampler RNG state and `extra` to `path`, atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous() for k, v in prog.state_dict().items()}
    if rng_state is not None:
        tensors[RNG_KEY] = rng_state.detach().cpu().to(torch.uint8).contiguous()
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "step": str(int(prog.step)),
        "spec": json.dumps(spec_to_dict(prog.spec), sort_keys=True),
        "spec_hash": spec_hash(prog.spec),
        "titanc_version": _titanc_version(),
        "extra": json.dumps(extra or {}, sort_keys=True),
    }
    meta["checksum"] = checksum(tensors, meta)
    remove_stale_temps(path)
    tmp = path.parent / f".{path.name}.{os.getpid()}.tmp"
    try:
        save_file(tensors, str(tmp), metadata=meta)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, Exception):  # OSError, or safetensors' own error on a full disk
            reason = getattr(exc, "strerror", None) or " ".join(str(exc).split())
            raise TitancError(f"could not write checkpoint {path}: {reason}; the previous "
                              f"checkpoint, if any, is unchanged") from None
        raise
    _fsync_dir(path.parent)
    return path


def checksum(tensors: dict[str, Tensor], meta: dict[str, str]) -> str:
    """sha256 hex over the tensors (name, dtype, shape, raw bytes; in name order) and the
    metadata entries other than `checksum` itself."""
    h = hashlib.sha256()
    for k in sorted(meta):
        if k != "checksum":
            h.update(json.dumps([k, meta[k]]).encode("utf-8"))
    for k in sorted(tensors):
        t = tensors[k].detach().cpu().contiguous()
        h.update(json.dumps([k, str(t.dtype), list(t.shape)]).encode("utf-8"))
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def remove_stale_temps(path: str | os.PathLike, *, keep_live: bool = True) -> list[Path]:
    """Delete the temporary files `.NAME.<pid>.tmp` that saves of `path` left behind.

    With `keep_live` (the default) only those of writers that are gone (no process with the
    pid, or one started after the file was written: a reused pid); without it every one but
    this process's own live ones (for a caller that holds the run directory's lock, so no
    other process can be saving into it). Returns the paths removed."""
    path = Path(path)
    pattern = re.escape(f".{path.name}.") + r"(?P<pid>\d{1,12})\.tmp"
    return _remove_temps(path.parent, pattern, keep_live=keep_live)


def _fsync_dir(directory: Path) -> None:
    """Make the rename durable (POSIX); a no-op where directories cannot be opened."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _titanc_version() -> str:
    from titanc.version import __version__
    return __version__


# ---------------------------------------------------------------------------------- reading


def checkpoint_path(run_or_file: str | os.PathLike, flag: str = "--resume") -> Path:
    """The checkpoint of a run directory (RUN/checkpoint.safetensors), or the file itself.
    `flag` names the option the path came from, for the error message."""
    if not os.fspath(run_or_file):       # Path("") would be the current directory
        raise TitancError(f"{flag} is empty; pass a run directory or a checkpoint file")
    p = Path(run_or_file)
    if p.is_dir():
        ckpt = p / CHECKPOINT_NAME
        remove_stale_temps(ckpt)              # a save killed before the first checkpoint
        if not ckpt.exists():
            fix = ("train without --resume to start a new run" if flag == "--resume"
                   else "train it first with 'titanc train'")
            raise TitancError(f"{flag} {p}: there is no checkpoint in it ({ckpt} does not "
                              f"exist); {fix}")
        return ckpt
    if not p.exists():
        raise TitancError(f"{flag} {p}: no such run directory or checkpoint file")
    return p


def load_checkpoint(path: str | os.PathLike) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Read a checkpoint: (tensors, meta) with meta = {step, spec (a dict), spec_hash,
    titanc_version, extra (a dict)}. Raises TitancError for a missing, truncated or corrupt
    file or one that titanc did not write."""
    path = Path(path)
    if not path.exists():
        raise TitancError(f"checkpoint {path} does not exist")
    if not path.is_file():                       # a FIFO would block, a device never end
        raise TitancError(f"checkpoint {path} is not a regular file; pass a checkpoint file "
                          f"or a run directory")
    remove_stale_temps(path)                     # what killed saves left beside it
    if not _safetensors_head(path):
        raise TitancError(f"{path} is not a checkpoint (not a safetensors file); pass a run "
                          f"directory or the checkpoint.safetensors a run wrote")
    unreadable = (f"{path} is not a readable checkpoint (truncated or corrupt); resume from "
                  f"another copy or train from scratch")
    try:
        with safe_open(str(path), framework="pt") as f:
            raw_meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception:  # safetensors raises SafetensorError, OSError or ValueError by case
        raise TitancError(unreadable) from None
    if raw_meta.get("format") != FORMAT:
        raise TitancError(f"{path} is a safetensors file but not a titanc checkpoint "
                          f"(no '{FORMAT}' metadata)")
    recorded = raw_meta.get("checksum")
    unknown = sorted(set(raw_meta) - META_KEYS)
    if recorded is None and unknown:
        # a checkpoint older than the checksum has none, but only the entries above; an entry
        # of another name is the `checksum` entry's name damaged, never to be skipped
        raise TitancError(f"{path} is damaged: it has no checksum but an unknown metadata entry "
                          f"{printable(unknown[0], 40)}; resume from another copy or train "
                          f"from scratch")
    if recorded is not None and recorded != checksum(tensors, raw_meta):
        raise TitancError(f"{path} is damaged: its content does not match the checksum it "
                          f"was written with; resume from another copy or train from scratch")
    try:
        meta = {
            "step": int(raw_meta["step"]),
            "spec": json.loads(raw_meta["spec"]),
            "spec_hash": raw_meta.get("spec_hash", ""),
            "titanc_version": raw_meta.get("titanc_version", ""),
            "extra": json.loads(raw_meta.get("extra", "{}")),
        }
    except (KeyError, ValueError):
        raise TitancError(unreadable) from None
    if (not isinstance(meta["spec"], dict) or not isinstance(meta["extra"], dict)
            or meta["step"] < 0):
        raise TitancError(f"{path} has malformed metadata (spec and extra must be JSON objects, "
                          f"step >= 0); resume from another copy or train from scratch")
    bad = first_nonfinite(tensors)
    if bad is not None:
        raise TitancError(f"{path} holds non-finite values in {bad}; it is not a good "
                          f"checkpoint: resume from another copy or train from scratch")
    return tensors, meta


def _safetensors_head(path: Path) -> bool:
    """False when `path` cannot be a safetensors file, even a truncated one: its first 8
    bytes (the little-endian header length) are larger than the file and no JSON object
    follows them (a text file, an image, a pickle). Short and damaged files pass: the
    reader calls them truncated or corrupt."""
    try:
        with open(path, "rb") as f:
            head = f.read(9)
            size = os.fstat(f.fileno()).st_size
    except OSError:
        return True                              # let the reader say what is wrong
    if len(head) < 9:
        return True
    (n,) = struct.unpack("<Q", head[:8])
    return n <= size or head[8:9] == b"{"


# ---------------------------------------------------------------------------------- resuming


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else k
        if isinstance(v, dict):
            out.update(_flatten(v, key))
        else:
            out[key] = v
    return out


def spec_differences(old: dict[str, Any], new: dict[str, Any],
                     ignore: frozenset[str] = RUN_CONTROL) -> list[tuple[str, Any, Any]]:
    """(dotted field, old value, new value) for every leaf that differs, in schema order."""
    a, b = _flatten(old), _flatten(new)
    keys = list(b) + [k for k in a if k not in b]
    sections = RUN_CONTROL_SECTIONS if ignore is RUN_CONTROL else ()
    return [(k, a.get(k), b.get(k)) for k in keys
            if k not in ignore and not k.startswith(sections)
            and _norm(a.get(k)) != _norm(b.get(k))]


def _norm(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v


def _show(v: Any) -> str:
    return json.dumps(v) if not isinstance(v, str) else v


def _describe(diffs: list[tuple[str, Any, Any]], limit: int = 4) -> str:
    parts = [f"{k} (checkpoint {_show(a)}, spec {_show(b)})" for k, a, b in diffs[:limit]]
    if len(diffs) > limit:
        parts.append(f"and {len(diffs) - limit} more")
    return ", ".join(parts)


def _names(keys: list[str], limit: int = 4) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def expected_state(spec: Any) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the state a program of `spec` holds (`Program.state_dict()`),
    from the parameter table alone: nothing is compiled or allocated."""
    from titanc.model.params import param_specs
    params = [(p.name, tuple(p.shape)) for p in param_specs(spec.model)]
    out = {f"{kind}.{n}": shape for kind in ("param", "opt.m", "opt.v") for n, shape in params}
    out["opt.step"] = ()
    return out


def check_resumable(tensors: dict[str, Tensor], meta: dict[str, Any], spec: Any,
                    expected: dict[str, tuple[int, ...]] | None = None, *, strict: bool = False,
                    path: str | os.PathLike = "checkpoint") -> dict[str, Any]:
    """Decide whether the checkpoint (`tensors`, `meta`) can continue as `spec`, whose state
    has the names and shapes `expected` (default: `expected_state(spec)`).

    Returns {"new": parameter names that keep their fresh init, "model_changes" and
    "train_changes": (field, checkpoint value, spec value) lists, "step": the checkpoint's step}.
    Raises TitancError naming the differing fields (and the tensor, for a shape mismatch)."""
    expected = expected_state(spec) if expected is None else expected
    diffs = spec_differences(meta["spec"], spec_to_dict(spec))
    model = [d for d in diffs if d[0].startswith("model.")]
    other = [d for d in diffs if not d[0].startswith("model.")]
    theirs = {k: tuple(t.shape) for k, t in tensors.items() if k != RNG_KEY}
    new = [k for k in expected if k not in theirs and k != "opt.step"]
    unused = sorted((k for k in theirs if k not in expected),
                    key=lambda k: not k.startswith("param."))
    bad_shape = [k for k in expected
                 if k in theirs and k != "opt.step" and theirs[k] != tuple(expected[k])]
    new_params = [k.removeprefix("param.") for k in new if k.startswith("param.")]
    upgrade = not unused and not bad_shape
    if strict and (diffs or new or unused):
        what = _describe(diffs) if diffs else f"its tensors ({_names(new + unused)})"
        fix = (f"drop --strict to load the matching tensors and initialise the new ones "
               f"({_names(new_params)})" if new_params and upgrade
               else "drop --strict to resume anyway" if upgrade
               else "resume with the spec it was trained with (spec.yaml in its run directory)")
        raise TitancError(f"checkpoint {path} differs from the spec in {what}; --strict "
                          f"refuses any difference: {fix}")
    origin = (f"the checkpoint's spec differs in {_describe(model)}" if model
              else "the spec is unchanged")
    advice = ("resume with the spec it was trained with (spec.yaml in its run directory) "
              "or train from scratch into a new --out")
    if bad_shape:
        k = bad_shape[0]
        raise TitancError(f"checkpoint {path} does not fit the spec: tensor {k} has shape "
                          f"{list(theirs[k])} in the checkpoint and {list(expected[k])} "
                          f"in the spec ({origin}); {advice}")
    if unused and "param.layers.mac_norm" in unused and spec.model.block == "mac" \
            and spec.model.memory.mac_write == "attention":
        # MAC's default write was rmsnorm(ỹ, mac_norm) before it became the paper's ỹ
        advice = ("its MAC writes rmsnorm(ỹ) (its layers.mac_norm): set "
                  "model.memory.mac_write: attention_norm in its spec.yaml (or --set "
                  "model.memory.mac_write=attention_norm) to resume it")
    if unused:
        raise TitancError(f"checkpoint {path} is from a different model: {len(unused)} of its "
                          f"tensors have no place in this spec ({_names(unused)}; {origin}); "
                          f"only upgrades that add parameters can resume; {advice}")
    return {"new": new_params, "model_changes": model, "train_changes": other,
            "step": int(meta["step"])}


def restore(prog: Any, tensors: dict[str, Tensor], meta: dict[str, Any], *,
            strict: bool = False, path: str | os.PathLike = "checkpoint") -> dict[str, Any]:
    """`check_resumable` against `prog`'s own state, then load every matching tensor into it
    (new ones keep their fresh initialisation). Raises before touching `prog`."""
    expected = {k: tuple(t.shape) for k, t in prog.state_dict().items()}
    report = check_resumable(tensors, meta, prog.spec, expected, strict=strict, path=path)
    prog.load_state_dict({k: t for k, t in tensors.items() if k != RNG_KEY}, strict=False)
    return report
