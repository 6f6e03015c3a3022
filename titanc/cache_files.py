"""The cache directory only its user can write, and entries in it that are checked before use.

titanc keeps compiled programs, rendered kernels and kernel modules under `config.cache_dir`
(`TITANC_CACHE_DIR`, default `<tmp>/titanc-kernels-<uid>`), and reading an entry runs code
(an unpickle, an import). So nothing is read from a directory another user could write:

- `private_directory(path, what)` creates the directory 0700, or accepts an existing one
  only when this user owns it and neither its group nor others may write it (nor its parent,
  unless that is sticky like /tmp); a symlink in its place must be this user's or root's. A
  directory of ours that others may only read is narrowed to 0700 (the key below lives in
  it). Anything else is one `TitancError` naming the directory and the fix.
- `read_regular(path, limit)` reads a file without following a symlink or blocking on a FIFO
  (`O_NOFOLLOW | O_NONBLOCK`, then `fstat`: a regular file of this user, at most `limit`
  bytes), else None: a device, FIFO, symlink or oversized file is a miss, never a hang.
- `seal(root, kind, key, payload)` / `unseal(...)`: an entry is `MAGIC + HMAC-SHA256 +
  payload`, the HMAC over the kind, the entry's key and the payload with a per-user secret
  (`<root>/.titanc-key`, 32 random bytes, 0600). An entry written for another key, or damaged,
  or written by anyone without the secret, does not verify and is never unpickled.
"""
from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
import stat
import tempfile
import time
from pathlib import Path

from titanc.errors import TitancError, printable

__all__ = ["private_directory", "read_regular", "seal", "unseal", "drop_stale_temporaries",
           "KEY_NAME"]

KEY_NAME = ".titanc-key"
MAGIC = b"TITANC\x01\n"
_DIGEST = 32


def _uid() -> int:
    return os.geteuid() if hasattr(os, "geteuid") else -1


def _refuse(path: Path, what: str, why: str, fix: str) -> TitancError:
    return TitancError(f"{what} {printable(str(path))} {why}: a file planted there could run "
                       f"code as you; {fix}")


def _check_link(path: Path, what: str, fix: str) -> None:
    """A symlink in place of the directory must be ours or root's (another user's symlink in
    /tmp would point our writes and reads where that user chooses)."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) and st.st_uid not in (_uid(), 0):
        raise _refuse(path, what, f"is a symlink owned by uid {st.st_uid}", fix)


def _check_parent(path: Path, what: str, fix: str) -> None:
    """A parent that others may write, without the sticky bit, lets them rename ours away."""
    parent = path.resolve().parent
    st = os.stat(parent)
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        raise _refuse(path, what, f"is inside {printable(str(parent))}, which any user may "
                      f"write (mode {stat.S_IMODE(st.st_mode):04o}, not sticky)", fix)


def private_directory(path: Path, what: str = "cache directory",
                      fix: str = "set TITANC_CACHE_DIR to a directory of your own") -> Path:
    """`path`, created 0700 if missing; TitancError if another user owns it or may write it
    (module docstring). OSError (a read-only or missing parent) is the caller's to handle."""
    path = Path(path)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
    _check_link(path, what, fix)
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise TitancError(f"{what} {printable(str(path))} is not a directory; {fix}")
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid != _uid():
        raise _refuse(path, what, f"belongs to uid {st.st_uid}, not to you (uid {_uid()})",
                      f"have it removed, or {fix}")
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise _refuse(path, what, f"may be written by other users (mode {mode:04o})",
                      f"remove it (its entries cannot be trusted) or {fix}")
    _check_parent(path, what, fix)
    if mode & 0o077:
        os.chmod(path, 0o700)            # ours, read-only to others: the key lives here
    return path


def read_regular(path: Path, limit: int) -> bytes | None:
    """The bytes of `path` when it is a regular file of this user of at most `limit` bytes,
    else None; never follows a symlink, never blocks on a FIFO, never reads past `limit`."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != _uid() or st.st_size > limit:
            return None
        chunks, left = [], limit + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        return data if len(data) <= limit else None
    except OSError:
        return None
    finally:
        os.close(fd)


STALE_TMP_S = 3600


def drop_stale_temporaries(directory: Path, age_s: float = STALE_TMP_S) -> None:
    """Remove `*.tmp` files older than `age_s` from `directory`: what a writer killed between
    its temporary file and the rename left (a live writer renames within seconds)."""
    cutoff = time.time() - age_s
    for p in directory.glob("*.tmp"):
        with contextlib.suppress(OSError):
            if os.lstat(p).st_mtime < cutoff:
                p.unlink()


def _new_key(path: Path, replace: bool) -> bytes | None:
    """Publish a fresh secret at `path` (0600, whole before it is visible); None when another
    process published one first."""
    key = secrets.token_bytes(_DIGEST)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".key-", suffix=".tmp")   # 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(key)
        if replace:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)
            except FileExistsError:
                return None
        return key
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def user_key(root: Path) -> bytes:
    """The per-user secret of `root` (a `private_directory`), created on first use; a key
    file that is damaged, not ours or readable by others is replaced (its entries then miss)."""
    path = root / KEY_NAME
    for attempt in range(3):
        data = read_regular(path, _DIGEST)
        if data is not None and len(data) == _DIGEST:
            if stat.S_IMODE(os.lstat(path).st_mode) & 0o077 == 0:
                return data
        key = _new_key(path, replace=attempt > 0 or os.path.lexists(path))
        if key is not None:
            return key
    raise TitancError(f"cannot create the cache key {printable(str(path))}; remove it or set "
                      f"TITANC_CACHE_DIR to a directory of your own")


def _mac(secret: bytes, kind: str, key: str, payload: bytes) -> bytes:
    h = hmac.new(secret, digestmod=hashlib.sha256)
    for part in (kind.encode(), key.encode()):
        h.update(len(part).to_bytes(8, "little") + part)
    h.update(payload)
    return h.digest()


def seal(root: Path, kind: str, key: str, payload: bytes) -> bytes:
    """`payload` as an entry of `kind` for `key`: MAGIC, its HMAC, the payload."""
    return MAGIC + _mac(user_key(root), kind, key, payload) + payload


def unseal(root: Path, kind: str, key: str, data: bytes | None) -> bytes | None:
    """The payload of entry `data` when it was sealed here for this `kind` and `key`, else
    None (damaged, another key's, or not written by this user's titanc)."""
    head = len(MAGIC) + _DIGEST
    if data is None or len(data) < head or not data.startswith(MAGIC):
        return None
    payload = data[head:]
    if not hmac.compare_digest(data[len(MAGIC):head], _mac(user_key(root), kind, key, payload)):
        return None
    return payload
