"""Writing files: `write_text_atomic` is the one text writer of run and artifact directories (a
failed write leaves no `.tmp` behind and the old file unchanged), and every write failure is a
one-line `TitancError` naming the path and the OS's reason (`writing_into`), never a traceback.

A directory that is replaced whole (`titanc compile -o`, `titanc data prepare -o`) is built in
`staging_dir(final)` beside it and put in place by `swap_in`: the old directory is renamed
aside, the new one renamed in, then the old one's entries the writer does not own move into
the new one and the rest is deleted. `recover_swap` finishes a swap a killed process left
half done; `holds_cwd` says when a directory cannot be swapped (the shell is in it). A
destination that is a symbolic link is resolved first: the directory it points to is the
one replaced (its user files carried over), the link itself stays as it was.

A writer that goes through `.NAME.<pid>.tmp` files (checkpoints, session files) removes the
ones its killed predecessors left with `remove_stale_temps`: a temp file is stale when no
process with its pid exists, or when that process started after the file was last written
(the pid was reused: the writer is gone).
"""
from __future__ import annotations

import contextlib
import errno
import glob
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator

from titanc.errors import TitancError, printable

__all__ = ["os_reason", "writing_into", "write_text_atomic", "check_file_target", "pid_alive",
           "holds_cwd", "temp_writer_alive", "remove_stale_temps", "target_of",
           "staging_dir", "swap_in", "recover_swap"]


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


def check_file_target(path: Path, flag: str, example: str) -> None:
    """`path` (given as `flag`) can be written as a file: not a directory, device, FIFO or
    socket; `example` is a file name to suggest."""
    shown = printable(str(path))
    if path.is_dir():
        raise TitancError(f"{flag} {shown} is a directory; pass a file such as "
                          f"{printable(str(path / example))}")
    if path.exists() and not path.is_file():
        raise TitancError(f"{flag} {shown} is not a regular file (a device, FIFO or socket); "
                          f"pass a file such as {example}")


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


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists (owned by anyone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, owned by someone else
        return True
    return True


def _started_at(pid: int) -> float | None:
    """When process `pid` started (seconds since the epoch), where /proc tells; else None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        with open("/proc/stat", "rb") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith(b"btime "))
        return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")   # field 22: starttime
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def temp_writer_alive(pid: int, written_at: float) -> bool:
    """Whether the process that wrote a temp file named after `pid`, last modified at
    `written_at`, may still be writing it: a process `pid` exists and started before then
    (a later process under a reused pid, this one included, is not its writer). Without
    /proc a live pid counts as the writer."""
    if not 0 < pid < 1 << 31:                    # no process has it (0: the process group)
        return False
    if pid != os.getpid() and not pid_alive(pid):
        return False
    started = _started_at(pid)
    return started is None or started <= written_at + 1.0   # /proc counts clock ticks


def remove_stale_temps(directory: str | os.PathLike, pattern: str | re.Pattern[str], *,
                       keep_live: bool = True) -> list[Path]:
    """Delete the temp files in `directory` whose names `pattern` matches in full, its group
    `pid` the writer's pid: those of writers that are gone (`temp_writer_alive`), or, without
    `keep_live` (a caller that holds the directory's lock, so no other process writes
    there), every one but this process's own live writes. Returns the paths removed; a
    directory that cannot be listed or a file that cannot be removed is left as it is."""
    regex = re.compile(pattern) if isinstance(pattern, str) else pattern
    removed: list[Path] = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    for entry in entries:
        m = regex.fullmatch(entry.name)
        if not m:
            continue
        pid = int(m.group("pid"))
        try:
            written_at = entry.stat(follow_symlinks=False).st_mtime
        except OSError:
            continue
        if (pid == os.getpid() or keep_live) and temp_writer_alive(pid, written_at):
            continue
        with contextlib.suppress(OSError):
            os.unlink(entry.path)
            removed.append(Path(entry.path))
    return removed


def holds_cwd(directory: str | os.PathLike) -> bool:
    """Whether `directory` is the working directory or holds it (a rename would pull it from
    under the shell)."""
    try:
        cwd = os.path.realpath(os.getcwd())
    except OSError:                               # the working directory was deleted
        return False
    real = os.path.realpath(directory)
    return cwd == real or cwd.startswith(real.rstrip(os.sep) + os.sep)


def target_of(final: str | os.PathLike) -> Path:
    """The absolute path a directory swap replaces: `final` with every symbolic link on the
    way resolved (a link to a directory that does not exist yet names where to create it)."""
    return Path(os.path.realpath(final))


def _left_by_the_dead(final: Path, kind: str) -> Iterator[Path]:
    """`.NAME.<kind>-PID` beside `final` of processes that no longer exist."""
    for p in final.parent.glob(f"{glob.escape('.' + final.name)}.{kind}-*"):
        pid = p.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not pid_alive(int(pid)):
            yield p


def staging_dir(final: Path) -> Path:
    """A path for a fresh `.NAME.partial-PID` beside `final` (same filesystem: the swap is a
    rename), not yet created; the staging directories of dead processes are removed. A
    `final` that is a symbolic link stands for the directory it points to."""
    final = target_of(final)
    for stale in _left_by_the_dead(final, "partial"):
        shutil.rmtree(stale, ignore_errors=True)
    stage = final.parent / f".{final.name}.partial-{os.getpid()}"
    shutil.rmtree(stage, ignore_errors=True)
    return stage


MoveOthers = Callable[[Path, Path], None]      # (old directory, new one): what to carry over


def swap_in(new: Path, final: Path, move_others: MoveOthers, last: str) -> None:
    """Make the complete directory `new` the one at `final`. An empty `final` (maybe the
    working directory) is filled in place, the entry `last` (the one readers check for)
    last; otherwise the old directory is renamed aside, `new` renamed into place, then
    `move_others(old, final)` carries over what the writer does not own and the rest is
    deleted. A kill between the renames or inside the move is finished by `recover_swap`.
    A `final` that is a symbolic link is resolved: the directory it points to is replaced
    and the link keeps pointing there."""
    final = target_of(final)
    if not final.exists():
        os.replace(new, final)
        return
    if next(os.scandir(final), None) is None:
        for entry in sorted(new.iterdir(), key=lambda e: e.name == last):
            os.replace(entry, final / entry.name)
        return
    old = final.parent / f".{final.name}.old-{os.getpid()}"
    os.replace(final, old)
    try:
        os.replace(new, final)
    except BaseException:
        os.replace(old, final)                    # the previous directory stays whole
        raise
    move_others(old, final)
    shutil.rmtree(old, ignore_errors=True)


def recover_swap(final: Path, move_others: MoveOthers) -> None:
    """Finish a `swap_in` into `final` that a killed process left half done."""
    final = target_of(final)
    if not final.parent.is_dir():
        return
    for old in _left_by_the_dead(final, "old"):
        if not final.exists():
            os.replace(old, final)                # killed between the two renames
        else:
            move_others(old, final)               # killed while moving the other files
            shutil.rmtree(old, ignore_errors=True)
