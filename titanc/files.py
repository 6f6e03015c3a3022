"""Writing files: `write_text_atomic` is the one text writer of run and artifact directories (a
failed write leaves no `.tmp` behind and the old file unchanged), and every write failure is a
one-line `TitancError` naming the path and the OS's reason (`writing_into`), never a traceback.
"""
from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from pathlib import Path
from typing import Iterator

from titanc.errors import TitancError

__all__ = ["os_reason", "writing_into", "write_text_atomic"]


def os_reason(exc: OSError) -> str:
    """The OS's words for an error ('No space left on device'), not the errno tuple."""
    return exc.strerror or (os.strerror(exc.errno) if exc.errno else str(exc)) or type(exc).__name__


@contextlib.contextmanager
def writing_into(directory: str | os.PathLike, what: str = "the run directory") -> Iterator[None]:
    """Turn an OSError raised inside the block into a one-line TitancError naming the file."""
    try:
        yield
    except OSError as exc:
        where = exc.filename if exc.filename is not None else directory
        fix = ("free some space" if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
               else "choose a writable directory")
        raise TitancError(f"cannot write {what} {directory}: {where}: {os_reason(exc)}; "
                          f"{fix}") from None


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write `text` to `path` through `PATH.tmp` and a rename; on any failure (a full disk)
    the temporary file is removed and the old `path`, if any, is unchanged."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` through a temporary file of its own in the same directory and a
    rename (several processes may write one cache entry at once); on any failure the
    temporary file is removed and the old `path`, if any, is unchanged."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def trim_directory(directory: Path, pattern: str, max_bytes: int, keep: Path) -> None:
    """Drop the least recently used files matching `pattern` beyond `max_bytes` in all
    (never `keep`, just written)."""
    entries = []
    for p in directory.glob(pattern):
        try:
            st = p.stat()
        except OSError:
            continue
        entries.append((st.st_mtime, st.st_size, p))
    total = sum(size for _, size, _ in entries)
    for _, size, p in sorted(entries):
        if total <= max_bytes:
            break
        if p == keep:
            continue
        p.unlink(missing_ok=True)
        total -= size
