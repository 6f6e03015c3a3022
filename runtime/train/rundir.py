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
import os
from pathlib import Path
from types import TracebackType

from titanc.errors import TitancError
from titanc.files import os_reason

__all__ = ["LOCK_NAME", "RunDir"]

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
