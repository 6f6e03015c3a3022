"""Sessions: a conversation's state kept by the server between requests.

A session is one sequence's `DecodeState` (batch 1): the neural memory's weights and momentum,
the attention window, the convolution history, the memory chunk in progress, and the last
sampled token, which has not run through the model yet. Its size is constant however long
the conversation grows. A completion naming `"session": ID` feeds only its new turn on top of
that state; when the turn finishes ("stop" or "length") and its response has been made (the
JSON body rendered, or the last stream chunk), the handler commits the state after it, every
generated token included. A turn that is cancelled (the client went away), refused, or whose
response fails leaves the session as it was, so a turn is all or nothing.

At most `max_sessions` sessions are held in memory. With a sessions directory, a new one
evicts the least recently used idle session to `DIR/ID.safetensors` (`session_file.py`: the
tensors, the spec, tokenizer and weights hashes and a checksum), and a completion or snapshot
naming a session that is not in memory loads it from there (a GET only reads the file); a
graceful shutdown writes every live session (`save_all`), so a server restarted on the same
directory continues every session. The directory is checked at startup (a session file is
written and removed), holds at most `StoreLimits` files and bytes (every live session
counted as one), and error bodies name a session's file, never the server's path. Without a
directory, a full store refuses new sessions with 429. A session is used by one completion at
a time (a second one gets 409).

Every method runs on the server's event loop (the engine thread only reads a busy session's
state and hands back the new one through the request; `save_all` runs after the loop has
stopped), so the store needs no lock.
"""
from __future__ import annotations

import os
import re
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse

from titanc.errors import TitancError
from titanc.files import pid_alive
from titanc.runtime.serve.completions import ApiError
from titanc.runtime.serve.engine import Request
from titanc.runtime.serve.generate import DecodeState, Generator
from titanc.runtime.serve.session_file import load_session, save_session

SESSION_ID = re.compile(r"sess_[0-9a-f]{32}")
STALE_TEMP = re.compile(r"\.((?:sess_[0-9a-f]{32}|\.titanc-probe-\d+)\.safetensors)\.\d+\.tmp")
PROBE = re.compile(r"\.titanc-probe-(\d+)\.safetensors")     # check_directory's file


@dataclass
class Session:
    id: str
    state: DecodeState                        # batch 1; replaced, never changed in place
    busy: bool = False                        # a completion is running on it

    def info(self) -> dict[str, Any]:
        return {"id": self.id, "object": "session", "tokens": self.state.tokens[0],
                "bytes": self.state.nbytes, "busy": self.busy}


@dataclass(frozen=True)
class StoreLimits:
    """What a sessions directory may hold (`--max-session-files`, `--max-session-bytes`):
    every session the server knows, in memory or on disk, counts, so a graceful shutdown
    that writes the live ones never passes them."""
    max_files: int = 1024
    max_bytes: int = 1 << 30


class SessionStore:
    def __init__(self, gen: Generator, max_sessions: int, directory: str | Path | None = None,
                 limits: StoreLimits = StoreLimits()):
        if max_sessions < 1:
            raise TitancError(f"--max-sessions: {max_sessions} must be at least 1")
        self.gen, self.max_sessions, self.limits = gen, max_sessions, limits
        self.directory = Path(directory) if directory is not None else None
        self._live: OrderedDict[str, Session] = OrderedDict()   # least recently used first
        self._disk: dict[str, int] = {}       # id -> bytes of its file in the directory
        self.file_bytes = 0                   # bytes of one session's file
        if self.directory is not None:
            self.file_bytes = check_directory(self.directory, gen)
            self._disk = scan_directory(self.directory)

    def __len__(self) -> int:
        return len(self._live)

    # -- lifecycle ---------------------------------------------------------------------------------
    def create(self) -> Session:
        self._check_room_on_disk()
        self._make_room()
        s = Session(f"sess_{uuid.uuid4().hex}", self.gen.new_state(1))
        self._live[s.id] = s
        return s

    def get(self, sid: Any) -> Session:
        """The session `sid`, from memory or else from its file in the sessions directory
        (which makes it live: a completion or a snapshot is about to use it)."""
        self._check_id(sid)
        if sid in self._live:
            self._live.move_to_end(sid)
            return self._live[sid]
        state = self._load(sid)
        self._make_room()
        s = self._live[sid] = Session(sid, state)
        return s

    def peek(self, sid: Any) -> dict[str, Any]:
        """GET: the session's info, read from its file when it is not live, without making
        it live (a GET never evicts another session or writes anything)."""
        self._check_id(sid)
        if sid in self._live:
            return self._live[sid].info()
        return Session(sid, self._load(sid)).info()

    def delete(self, sid: str) -> None:
        """Free a session and remove its file. A session only on disk is not loaded first
        (that could evict another one, or fail on a damaged file the client wants gone);
        the file is removed before the session leaves memory, so a file that cannot be
        removed leaves the session whole and is a one-line error naming it."""
        self._check_id(sid)
        s = self._live.get(sid)
        if s is not None and s.busy:
            raise self._busy(s)
        path = self._path(sid)
        on_disk = path is not None and (path.is_file() or path.is_symlink())
        if s is None and not on_disk:
            raise self._not_found(sid)
        if on_disk:
            try:
                path.unlink()                                   # type: ignore[union-attr]
            except FileNotFoundError:
                pass
            except OSError as exc:
                raise ApiError(500, f"could not remove session file {sid}.safetensors: "
                                    f"{exc.strerror or type(exc).__name__}; check the "
                                    f"permissions of --sessions-dir",
                               kind="server_error", code="session_file_error") from None
        self._disk.pop(sid, None)
        self._live.pop(sid, None)

    def snapshot(self, sid: str) -> dict[str, Any]:
        """Write the session to DIR/ID.safetensors (its state before a turn in progress)."""
        if self.directory is None:
            self._check_id(sid)
            raise ApiError(400, "this server keeps sessions in memory only; start it with "
                                "--sessions-dir DIR to write snapshots", code="no_sessions_dir")
        s = self.get(sid)
        path = self._save(s)
        return dict(s.info(), path=str(path), file_bytes=self._disk[sid])

    def save_all(self) -> tuple[int, list[str]]:
        """Write every live session to the directory (a graceful shutdown: the engine has
        stopped, so nothing changes them meanwhile); a busy one keeps its state before the
        unfinished turn. Each file is written whole or not at all. Returns (written, one
        line per failure)."""
        if self.directory is None:
            return 0, []
        done, failed = 0, []
        for s in list(self._live.values()):
            try:
                self._save(s)
                done += 1
            except ApiError as exc:
                failed.append(exc.message)
        return done, failed

    # -- completions -------------------------------------------------------------------------------
    def begin(self, sid: str, req: Request) -> Session:
        """Start a turn: `req` continues the session, which stays busy until the handler
        either `commit`s the turn (its response was made: `req.end` becomes the session's
        state) or `release`s it (refused, cancelled or failed: the session is as before)."""
        s = self.get(sid)
        if s.busy:
            raise self._busy(s)
        s.busy = True
        req.start = s.state
        return s

    def commit(self, s: Session | None, end: DecodeState | None) -> None:
        """The turn's response is made: its end state (when it finished) becomes the session's."""
        if s is not None:
            if end is not None:
                s.state = end
            s.busy = False

    def release(self, s: Session | None) -> None:
        """The turn was refused, cancelled or failed: the session keeps its state."""
        if s is not None:
            s.busy = False

    # -- internals ---------------------------------------------------------------------------------
    def _path(self, sid: str) -> Path | None:
        return None if self.directory is None else self.directory / f"{sid}.safetensors"

    def _load(self, sid: str) -> DecodeState:
        path = self._path(sid)
        if path is None or not path.is_file():
            raise self._not_found(sid)
        try:
            return load_session(path, self.gen, shown=path.name)
        except TitancError as exc:
            raise ApiError(400, str(exc), param="session", code="invalid_session_file") from None

    def _save(self, s: Session) -> Path:
        path = self._path(s.id)
        assert path is not None
        try:
            save_session(path, self.gen, s.state, shown=path.name)
            self._disk[s.id] = path.stat().st_size
        except (TitancError, OSError) as exc:
            raise ApiError(500, f"{exc}; check --sessions-dir (free space, permissions)",
                           kind="server_error", code="session_file_error") from None
        return path

    def _check_room_on_disk(self) -> None:
        """429 when one more session could pass --max-session-files or --max-session-bytes
        (counting each live session as a file: eviction or shutdown may write it)."""
        if self.directory is None:
            return
        on_disk_only = [n for sid, n in self._disk.items() if sid not in self._live]
        files = len(on_disk_only) + len(self._live) + 1
        size = sum(on_disk_only) + (len(self._live) + 1) * self.file_bytes
        lim = self.limits
        if files > lim.max_files or size > lim.max_bytes:
            what = (f"{lim.max_files} session files (--max-session-files)" if files > lim.max_files
                    else f"{lim.max_bytes} bytes of session files (--max-session-bytes)")
            raise ApiError(429, f"the sessions directory holds its limit of {what}; delete "
                                f"sessions (DELETE /v1/sessions/ID) first",
                           kind="rate_limit_error", code="session_storage_full")

    def _make_room(self) -> None:
        """Evict idle sessions, least recently used first, to the directory, until one more
        fits; 429 when none can go."""
        while len(self._live) >= self.max_sessions:
            idle = next((s for s in self._live.values() if not s.busy), None)
            if idle is None or self.directory is None:
                why = ("all of them are busy" if idle is None else
                       "start the server with --sessions-dir DIR to evict idle ones to disk")
                raise ApiError(429, f"the server holds its limit of {self.max_sessions} "
                                    f"sessions ({why}); delete one or retry later",
                               kind="rate_limit_error", code="too_many_sessions",
                               headers={"Retry-After": "1"})
            self._save(idle)
            del self._live[idle.id]

    @staticmethod
    def _check_id(sid: Any) -> None:
        if not isinstance(sid, str) or not SESSION_ID.fullmatch(sid):
            raise ApiError(400, f"session: {str(sid)[:80]!r} is not a session id (sess_ and 32 "
                                f"hex digits, from POST /v1/sessions)", param="session",
                           code="invalid_session_id")

    @staticmethod
    def _not_found(sid: str) -> ApiError:
        return ApiError(404, f"session {sid} does not exist (deleted, or never created on "
                             f"this server)", param="session", code="session_not_found")

    @staticmethod
    def _busy(s: Session) -> ApiError:
        return ApiError(409, f"session {s.id} is in use by another completion; wait for it "
                             f"to finish", param="session", code="session_busy")


def check_directory(directory: Path, gen: Generator) -> int:
    """Create `directory` if need be and write (then remove) one session file in it, so a
    directory the server cannot write is refused at startup in one line; returns the bytes
    of a session's file."""
    probe = directory / f".titanc-probe-{os.getpid()}.safetensors"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        save_session(probe, gen, gen.new_state(1), shown=str(probe))
        size = probe.stat().st_size
        probe.unlink()
    except (OSError, TitancError) as exc:            # save_session's names its reason last
        reason = getattr(exc, "strerror", None) or str(exc).rsplit(": ", 1)[-1]
        raise TitancError(f"--sessions-dir: cannot write session files in {directory} "
                          f"({reason}); pass a writable directory") from None
    return size


def scan_directory(directory: Path) -> dict[str, int]:
    """The session files in `directory` (id -> bytes); temporary files that dead writers
    left behind are removed."""
    from titanc.runtime.train.checkpoint import remove_stale_temps

    found: dict[str, int] = {}
    for entry in directory.iterdir():
        name = entry.name
        temp, probe = STALE_TEMP.fullmatch(name), PROBE.fullmatch(name)
        if temp:
            remove_stale_temps(directory / temp.group(1))
        elif probe and not pid_alive(int(probe.group(1))):
            entry.unlink(missing_ok=True)
        elif name.endswith(".safetensors") and SESSION_ID.fullmatch(name[:-12]):
            try:
                found[name[:-12]] = entry.stat().st_size
            except OSError:
                continue
    return found


def add_routes(app: FastAPI, store: SessionStore,
               read_json: Callable[[HttpRequest], Awaitable[Any]],
               admitting: Callable[[], None] | None = None) -> None:
    """POST /v1/sessions, GET and DELETE /v1/sessions/ID, POST /v1/sessions/ID/snapshot.
    `admitting` raises the server's refusal (503 while it drains) before a session is made:
    a session the server could never continue is no use to a client."""

    @app.post("/v1/sessions")
    async def create(request: HttpRequest) -> JSONResponse:
        if admitting is not None:
            admitting()
        if request.headers.get("content-length", "0") != "0":
            body = await read_json(request)
            if body not in ({}, None):
                raise ApiError(400, f"POST /v1/sessions takes no fields, got "
                                    f"{str(body)[:60]}")
        return JSONResponse(store.create().info())

    @app.get("/v1/sessions/{sid}")
    async def show(sid: str) -> JSONResponse:
        return JSONResponse(store.peek(sid))

    @app.post("/v1/sessions/{sid}/snapshot")
    async def snapshot(sid: str) -> JSONResponse:
        return JSONResponse(store.snapshot(sid))

    @app.delete("/v1/sessions/{sid}")
    async def delete(sid: str) -> JSONResponse:
        store.delete(sid)
        return JSONResponse({"id": sid, "object": "session.deleted", "deleted": True})
