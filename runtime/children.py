"""Child processes die with the process that started them, whatever signal it gets.

    subprocess.Popen(cmd, preexec_fn=die_with_parent)             # a rank of the launcher
    ProcessPoolExecutor(..., initializer=worker_init, ...)         # calls die_with_parent()

Two mechanisms, because neither covers every case alone:
- `die_with_parent` (Linux `prctl(PR_SET_PDEATHSIG, SIGKILL)` through ctypes): the kernel kills
  the child when its parent dies, even by SIGKILL, which no handler in the parent can see;
- `forward_signals`: a parent that is asked to stop (SIGTERM, SIGHUP, SIGINT) passes the signal
  on to its children, then reaps them (`reap`), so they stop as they would themselves (a rank's
  checkpoint is atomic either way).

A process that can stop cleanly (the trainer, at a step boundary) uses `stop_on_term`: SIGTERM
sets a flag its loop checks; a second SIGTERM ends the process at once.

On a system without prctl `die_with_parent` does nothing; `forward_signals` still holds.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

__all__ = ["die_with_parent", "forward_signals", "reap", "StopRequest", "stop_on_term"]

_PR_SET_PDEATHSIG = 1
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


def die_with_parent(parent: int | None = None) -> None:
    """Ask the kernel to SIGKILL this process when its parent exits (Linux). `parent`: the
    pid the parent had; when the parent already died before this call (the process was
    re-parented), exit at once."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if parent is not None and os.getppid() != parent:
        os._exit(1)


def reap(procs: Sequence[subprocess.Popen], timeout: float) -> None:
    """Wait up to `timeout` seconds for `procs`, then SIGKILL and wait for the rest."""
    deadline = time.monotonic() + timeout
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


@contextlib.contextmanager
def forward_signals(procs: Sequence[subprocess.Popen]) -> Iterator["StopRequest"]:
    """While inside: SIGTERM, SIGHUP or SIGINT to this process is sent on to every child still
    running and recorded in the request this yields; the caller's loop sees `signum` set,
    reaps the children (`reap`) and stops. (The handler raises nothing: an exception raised
    from a signal handler can land anywhere, even where it is ignored.) Outside the main
    thread it records nothing."""
    req = StopRequest()

    def handler(signum: int, _frame: object) -> None:
        req.signum = req.signum or signum
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(OSError):
                    p.send_signal(signum)

    try:
        old = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    except ValueError:                                  # not the main thread
        old = {}
    try:
        yield req
    finally:
        for s, h in old.items():
            signal.signal(s, h)


class StopRequest:
    """`signum` is set once a stop was asked for (inside `stop_on_term`, `forward_signals`)."""
    signum: int | None = None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""


@contextlib.contextmanager
def stop_on_term(enabled: bool = True,
                 signals: tuple[int, ...] = (signal.SIGTERM,)) -> Iterator[StopRequest]:
    """While inside, the first of `signals` (SIGTERM by default) only sets the request's
    `signum` (the caller stops at its next boundary); a second one exits at once with status
    128 + its number (143, or 130 for SIGINT). Disabled (or outside the main thread) the
    request is never set."""
    req = StopRequest()

    def handler(signum: int, _frame: object) -> None:
        if req.signum is not None:
            os._exit(128 + signum)
        req.signum = signum

    old: dict[int, Any] = {}
    try:
        for sig in signals if enabled else ():
            old[sig] = signal.signal(sig, handler)
    except ValueError:                                  # not the main thread
        pass
    try:
        yield req
    finally:
        for sig, prev in old.items():
            signal.signal(sig, prev)
