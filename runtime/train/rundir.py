"""A run directory held by one trainer at a time.

    with RunDir("runs/tiny") as run:      # creates it, locks it (or raises TitancError)
        ...                               # write spec.yaml, metrics, checkpoints

The lock is `fcntl.flock(LOCK_EX | LOCK_NB)` on `RUN/.lock`, which holds the owner's pid
for the error message. The kernel drops a flock when its file is closed, so a trainer killed
with `kill -9` never leaves the directory locked; the lock file itself stays (removing it
would let a third process lock a fresh inode while a second still holds the old one).

Creating the directory and every later write failure is a one-line `TitancError` naming the
path and the OS's reason (`titanc.files.writing_into`), never a traceback.
"""
from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from types import TracebackType
from typing import Any

from titanc.errors import TitancError
from titanc.files import os_reason

__all__ = ["LOCK_NAME", "RunDir", "run_tokenizer"]

LOCK_NAME = ".lock"


class RunDir:
    """Create `path` (with parents) and hold its exclusive lock until `release()` / exit."""

    def __init__(self, path: str | os.PathLike, flag: str = "--out"):
        self.path = Path(path)
        self.flag = flag
        self._fd: int | None = None

    def acquire(self) -> "RunDir":
        import fcntl

        if self.path.exists() and not self.path.is_dir():
            raise TitancError(f"{self.flag} {self.path} is a file; pass a directory for the run")
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise TitancError(f"{self.flag} {self.path}: cannot create the run directory or "
                              f"its lock file: {os_reason(exc)}; choose a writable "
                              f"directory") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _read_pid(fd)
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise TitancError(f"{self.flag} {self.path}: cannot lock the run directory: "
                                  f"{os_reason(exc)}") from None
            who = f"process {holder}" if holder else "another process"
            raise TitancError(f"{self.flag} {self.path} is in use by {who} (another titanc "
                              f"train holds {self.path / LOCK_NAME}); wait for it to finish or "
                              f"choose another {self.flag}") from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError:
            pass  # the pid is only for the message; the lock is what counts
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)   # closing drops the flock
            self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> "RunDir":
        return self.acquire()

    def __exit__(self, typ: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


# ---------------------------------------------------------------------------------- identity


def run_tokenizer(source: str | os.PathLike) -> Any:
    """The tokenizer of a run directory, checkpoint file or artifact directory, checked
    against what the checkpoint (or the artifact's manifest.json) recorded when it was
    written: its tokenizer hash, and for a run directory the model its spec.yaml describes.
    A mismatch (a tokenizer.json or spec.yaml replaced by another) is a one-line error naming
    both files, never wrong text with exit 0."""
    from titanc.runtime.data.tokenizer import TOKENIZER_FILE, ByteTokenizer, load_tokenizer
    from titanc.runtime.train.checkpoint import CHECKPOINT_NAME

    tok = load_tokenizer(source)
    p = Path(source)
    run = p.parent if p.suffix == ".safetensors" else p
    tok_file = run / TOKENIZER_FILE if (run / TOKENIZER_FILE).exists() else tok.name
    ckpt = p if p.is_file() else run / CHECKPOINT_NAME
    if ckpt.is_file():
        recorded_spec, extra = _recorded(ckpt)
        recorded, record = extra.get("tokenizer_hash") or ByteTokenizer.hash, ckpt
    elif (run / "manifest.json").is_file():
        try:
            manifest = json.loads((run / "manifest.json").read_text())
            recorded = manifest["tokenizer"]["hash"]
        except (OSError, ValueError, KeyError, TypeError):
            return tok                      # an older manifest records no tokenizer
        recorded_spec, record = None, run / "manifest.json"
    else:
        return tok
    if recorded != tok.hash:
        raise TitancError(f"tokenizer {tok_file} (hash {tok.hash[:12]}) is not the one "
                          f"{record} was made with (hash {str(recorded)[:12]}); put the run's "
                          f"own tokenizer.json back (none for a byte-level run)")
    if recorded_spec is not None and (run / "spec.yaml").is_file():
        _check_spec_yaml(run / "spec.yaml", recorded_spec, ckpt)
    return tok


def _recorded(ckpt: Path) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """The spec and extra a checkpoint's metadata records (read without its tensors); the
    full check (checksum, finiteness) is load_checkpoint's, when the weights are loaded."""
    from safetensors import safe_open

    try:
        with safe_open(str(ckpt), framework="pt") as f:
            raw = f.metadata() or {}
        spec, extra = json.loads(raw.get("spec", "null")), json.loads(raw.get("extra", "{}"))
    except Exception:  # noqa: BLE001 -- load_checkpoint names the damage when it reads it
        return None, {}
    return (spec if isinstance(spec, dict) else None), (extra if isinstance(extra, dict) else {})


def _check_spec_yaml(path: Path, recorded: dict[str, Any], ckpt: Path) -> None:
    import yaml

    from titanc.runtime.train.checkpoint import spec_differences

    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        doc = None
    if not isinstance(doc, dict):
        raise TitancError(f"{path} is not a spec mapping; restore the run's spec.yaml (the "
                          f"spec {ckpt} was trained with)")
    diffs = [d for d in spec_differences(recorded, doc)
             if d[0].startswith("model.") or d[0] == "data.tokenizer"]
    if diffs:
        shown = ", ".join(f"{k} (checkpoint {a!r}, spec.yaml {b!r})" for k, a, b in diffs[:2])
        raise TitancError(f"{path} does not describe the model {ckpt} holds: {shown}; "
                          f"restore the run's spec.yaml")
