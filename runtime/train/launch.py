"""`titanc train SPEC --nproc N`: N local ranks of `python -m titanc.train`, as torchrun would
start them (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), watched
until they all finish. The ranks die with the launcher: SIGTERM, SIGHUP or SIGINT to it is
forwarded to them and they are reaped; a SIGKILLed launcher takes them along
(PR_SET_PDEATHSIG, runtime/children.py).

A rank that exits non-zero stops the job: the others normally fail their next collective at
once (gloo sees the closed connection) and exit with their own one-line error; any still
running after train.dist_timeout_s are terminated. The launcher then prints one line naming
the first rank that failed and how, and where the last checkpoint is, and exits 1.

Rank 0 prints to the launcher's terminal (its progress bar, its lines); the other ranks'
stderr is passed on line by line as it comes, except their `titanc: error: ...` lines, which
are held until the job ends, so that a job prints one error line, not one per rank: bad input
(a --resume that does not exist, a locked --out: every rank sees it, or rank 0 alone and the
others then lose it) and a non-finite loss are rank 0's own line, exit 2; a rank other than 0
that failed on its own with status 2 has its line shown, exit 2; a rank killed or crashing is
the launcher's line, exit 1.
"""
from __future__ import annotations

import contextlib
import functools
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Sequence

from titanc.config import child_environment, current, module_command
from titanc.errors import DistributedError, TitancError
from titanc.runtime.children import die_with_parent, forward_signals, reap

__all__ = ["launch", "free_port"]

POLL_S = 0.05             # (torch is imported only once a rank failed: the launcher stays light)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _how(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _checkpoint_step(run: Path) -> int | None:
    from titanc.runtime.train.checkpoint import CHECKPOINT_NAME
    path = run / CHECKPOINT_NAME
    if not path.exists():
        return None
    try:
        from safetensors import safe_open
        with safe_open(str(path), "pt") as f:
            return int((f.metadata() or {}).get("step", -1))
    except Exception:  # noqa: BLE001 -- an unreadable file is reported as such below
        return -1


def _kept(out: Path) -> str:
    from titanc.runtime.train.checkpoint import CHECKPOINT_NAME
    step = _checkpoint_step(out)
    return ("no checkpoint was written" if step is None
            else f"{out / CHECKPOINT_NAME} could not be read" if step < 0
            else f"the last checkpoint (step {step}) is in {out / CHECKPOINT_NAME}; "
                 f"continue with --resume {out}")


class _Relay:
    """A rank's stderr, copied to the launcher's line by line as it comes, except its titanc
    error lines (`titanc: error: ...`, `titanc: interrupted`), which are held in `held`."""

    HELD = (b"titanc: error:", b"titanc: interrupted")

    def __init__(self, stream: IO[bytes]):
        self.stream, self.held = stream, []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for line in iter(self.stream.readline, b""):
                if line.startswith(self.HELD):
                    self.held.append(line.decode("utf-8", "replace").rstrip("\n"))
                else:
                    _write_stderr(line)
        except (OSError, ValueError):             # the launcher's stderr went away
            pass

    def join(self) -> None:
        # a grandchild (a compile worker) may hold the pipe a little longer than its rank
        self.thread.join(timeout=5)
        with contextlib.suppress(OSError):
            self.stream.close()


def _write_stderr(line: bytes) -> None:
    buffer = getattr(sys.stderr, "buffer", None)
    if buffer is not None:
        buffer.write(line)
    else:
        sys.stderr.write(line.decode("utf-8", "replace"))
    sys.stderr.flush()


def launch(argv: Sequence[str], nproc: int, out: str, timeout_s: float) -> int:
    """Run `python -m titanc.train *argv` as `nproc` local ranks; returns 0 when every rank
    succeeded, 2 when a rank stopped on a titanc error of its own (bad input, a non-finite
    loss: its one line is printed), 128 + the signal when the launcher was stopped, else
    raises DistributedError with the one-line reason."""
    env = child_environment(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                            WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc))
    procs: list[subprocess.Popen] = []
    relays: dict[int, _Relay] = {}                # rank -> its stderr (ranks other than 0)
    first: tuple[int, int] | None = None          # (rank, exit code) of the first failure
    deadline = None
    stopped: set[int] = set()                     # ranks the launcher killed itself
    with forward_signals(procs) as stop:
        for rank in range(nproc):                 # a rank dies with the launcher (even SIGKILL)
            procs.append(subprocess.Popen(
                module_command("titanc.train", *argv),
                env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                stderr=subprocess.PIPE if rank else None,
                preexec_fn=functools.partial(die_with_parent, os.getpid())))
            if rank:
                relays[rank] = _Relay(procs[-1].stderr)
        while any(p.poll() is None for p in procs) and stop.signum is None:
            if first is None:
                failed = [(r, p.returncode) for r, p in enumerate(procs)
                          if p.returncode not in (None, 0)]
                if failed:                        # the others get train.dist_timeout_s to stop
                    first, deadline = failed[0], time.monotonic() + timeout_s
            elif deadline is not None and time.monotonic() > deadline:
                for rank, p in enumerate(procs):
                    if p.poll() is None:
                        p.kill()
                        stopped.add(rank)
            time.sleep(POLL_S)
        if stop.signum is not None:               # every rank got the signal: reap them
            for p in procs:                       # (one started after it arrived too)
                if p.poll() is None:
                    p.send_signal(stop.signum)
            reap(procs, timeout_s)
            for relay in relays.values():
                relay.join()
            print(f"titanc: stopped by {stop.name}: the {nproc} ranks were stopped; "
                  f"{_kept(Path(out))}", file=sys.stderr)
            return 128 + stop.signum
    for relay in relays.values():
        relay.join()
    codes = [p.returncode for p in procs]
    if codes[0] == 2:           # rank 0 printed its own one-line error (bad input, non-finite)
        return 2
    # status 1 is a rank reporting that a peer failed: name the rank that failed first-hand
    # (killed, crashed, bad input) when there is one
    cause = [(r, c) for r, c in enumerate(codes) if c not in (0, 1) and r not in stopped]
    if cause and (first is None or first[1] == 1):
        first = cause[0]
    if first is None:
        bad = [(r, c) for r, c in enumerate(codes) if c != 0]
        if not bad:
            return 0
        first = bad[0]
    rank, code = first
    if code == 2 and rank in relays and relays[rank].held:   # bad input only this rank saw
        _write_stderr((relays[rank].held[-1] + "\n").encode("utf-8"))
        return 2
    kept = _kept(Path(out))
    late = (f" (rank {', '.join(map(str, sorted(stopped)))} did not stop within "
            f"train.dist_timeout_s={timeout_s:g} s and was killed)" if stopped else "")
    raise DistributedError(f"rank {rank} of {nproc} {_how(code)}, so the job stopped{late}; "
                           f"{kept}")


def check_nproc(nproc: int) -> None:
    if nproc > 1 and "WORLD_SIZE" in current().torchrun:
        raise TitancError("--nproc starts its own ranks; under torchrun leave it out "
                          "(torchrun's --nproc-per-node sets the ranks)")
