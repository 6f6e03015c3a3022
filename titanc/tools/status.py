"""A one-line status on stderr for work that may take more than a second.

    with status("compiling tiny-mac"):
        write_artifact(...)

Nothing is printed when the work ends within `after` seconds. Past it, on a terminal the
line shows the seconds so far and is cleared at the end; elsewhere (a log, a pipe) it is
printed once, as one line.
"""
from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from typing import TextIO

__all__ = ["status"]


@contextlib.contextmanager
def status(what: str, after: float = 1.0, stream: TextIO | None = None) -> Iterator[None]:
    """Show `what` on `stream` (default stderr) while the block runs longer than `after` s."""
    out = stream if stream is not None else sys.stderr
    tty = bool(getattr(out, "isatty", lambda: False)())
    done = threading.Event()
    shown = threading.Event()
    t0 = time.monotonic()

    def show() -> None:
        if done.wait(after):
            return
        shown.set()
        if not tty:
            _write(out, f"titanc: {what} ...\n")
            return
        while not done.is_set():
            _write(out, f"\rtitanc: {what} ... {time.monotonic() - t0:.0f} s")
            done.wait(1.0)

    thread = threading.Thread(target=show, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        if shown.is_set() and tty:
            _write(out, "\r\033[K")


def _write(out: TextIO, text: str) -> None:
    try:
        out.write(text)
        out.flush()
    except (OSError, ValueError):                 # a closed stderr: the work goes on
        pass
