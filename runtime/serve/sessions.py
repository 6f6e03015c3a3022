"""Sessions: a conversation's state kept by the server between requests.

A session is one sequence's `DecodeState` (batch 1): the neural memory's weights and momentum,
the attention window, the convolution history, the memory chunk in progress, and the last
sampled token, which has not run through the model yet. Its size is constant however long
the conversation grows. A completion naming `"session": ID` feeds only its new turn on top of
that state; when the turn finishes ("stop" or "length") the state after it, every generated
token included, becomes the session's state. A turn that is cancelled (the client went away)
or refused leaves the session as it was, so a turn is all or nothing.

At most `max_sessions` sessions are held in memory. With a sessions directory, a new one
evicts the least recently used idle session to `DIR/ID.safetensors` (the snapshot format of
`generate.save_session`: tensors, the spec hash, the tokenizer hash and a checksum), and any
request naming a session that is not in memory loads it from there; so a server restarted
on the same directory continues every session evicted or snapshotted before. Without a
directory, a full store refuses new sessions with 429. A session is used by one completion
at a time (a second one gets 409).

Every method runs on the server's event loop (the engine thread only reads a busy session's
state and hands back the new one through the request), so the store needs no lock.
"""
from __future__ import annotations

import re
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse

from titanc.errors import TitancError
from titanc.runtime.serve.completions import ApiError
from titanc.runtime.serve.engine import Request, Update
from titanc.runtime.serve.generate import DecodeState, Generator, load_session, save_session

SESSION_ID = re.compile(r"sess_[0-9a-f]{32}")


@dataclass
class Session:
    id: str
    state: DecodeState                        # batch 1; replaced, never changed in place
    busy: bool = False                        # a completion is running on it

    def info(self) -> dict[str, Any]:
        return {"id": self.id, "object": "session", "tokens": self.state.tokens[0],
                "bytes": self.state.nbytes, "busy": self.busy}


class SessionStore:
    def __init__(self, gen: Generator, max_sessions: int, directory: str | Path | None = None):
        if max_sessions < 1:
            raise TitancError(f"--max-sessions: {max_sessions} must be at least 1")
        self.gen, self.max_sessions = gen, max_sessions
        self.directory = Path(directory) if directory is not None else None
        if self.directory is not None:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise TitancError(f"--sessions-dir: cannot create {self.directory} "
                                  f"({exc.strerror})") from None
        self._live: OrderedDict[str, Session] = OrderedDict()   # least recently used first

    def __len__(self) -> int:
        return len(self._live)

    # -- lifecycle ---------------------------------------------------------------------------------
    def create(self) -> Session:
        self._make_room()
        s = Session(f"sess_{uuid.uuid4().hex}", self.gen.new_state(1))
        self._live[s.id] = s
        return s

    def get(self, sid: Any) -> Session:
        """The session `sid`, from memory or else from its file in the sessions directory."""
        self._check_id(sid)
        if sid in self._live:
            self._live.move_to_end(sid)
            return self._live[sid]
        path = self._path(sid)
        if path is None or not path.is_file():
            raise self._not_found(sid)
        try:
            state = load_session(path, self.gen)
        except TitancError as exc:
            raise ApiError(400, str(exc), param="session", code="invalid_session_file") from None
        self._make_room()
        s = self._live[sid] = Session(sid, state)
        return s

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
                raise ApiError(500, f"could not remove session file {path}: "
                                    f"{exc.strerror or type(exc).__name__}; check the "
                                    f"permissions of --sessions-dir",
                               kind="server_error", code="session_file_error") from None
        self._live.pop(sid, None)

    def snapshot(self, sid: str) -> dict[str, Any]:
        """Write the session to DIR/ID.safetensors (its state before a turn in progress)."""
        s = self.get(sid)
        path = self._path(sid)
        if path is None:
            raise ApiError(400, "this server keeps sessions in memory only; start it with "
                                "--sessions-dir DIR to write snapshots", code="no_sessions_dir")
        try:
            save_session(path, self.gen, s.state)
        except TitancError as exc:
            raise ApiError(500, str(exc), kind="server_error") from None
        return dict(s.info(), path=str(path), file_bytes=path.stat().st_size)

    # -- completions -------------------------------------------------------------------------------
    def begin(self, sid: str, req: Request) -> Session:
        """Start a turn: `req` continues the session, which is busy until the turn's last
        update; a finished turn's state (`req.end`) becomes the session's."""
        s = self.get(sid)
        if s.busy:
            raise self._busy(s)
        s.busy = True
        req.start = s.state
        deliver = req.on_update

        def on_update(up: Update) -> None:
            if up.finish_reason is not None:
                s.busy = False
                if req.end is not None:
                    s.state = req.end
            deliver(up)
        req.on_update = on_update
        return s

    def release(self, s: Session | None) -> None:
        """The turn was refused before the engine took it."""
        if s is not None:
            s.busy = False

    # -- internals ---------------------------------------------------------------------------------
    def _path(self, sid: str) -> Path | None:
        return None if self.directory is None else self.directory / f"{sid}.safetensors"

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
            try:
                save_session(self._path(idle.id), self.gen, idle.state)   # type: ignore[arg-type]
            except TitancError as exc:
                raise ApiError(500, str(exc), kind="server_error") from None
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
        return JSONResponse(store.get(sid).info())

    @app.post("/v1/sessions/{sid}/snapshot")
    async def snapshot(sid: str) -> JSONResponse:
        return JSONResponse(store.snapshot(sid))

    @app.delete("/v1/sessions/{sid}")
    async def delete(sid: str) -> JSONResponse:
        store.delete(sid)
        return JSONResponse({"id": sid, "object": "session.deleted", "deleted": True})
