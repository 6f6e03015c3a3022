"""The server process around the app: uvicorn with a draining shutdown, a header-read timeout,
and the address checked before anything loads.

`DrainingServer` turns SIGTERM into a drain (runtime/serve/server.py's `serve` then writes the
live sessions); `header_timeout_protocol` closes a connection whose request head does not
arrive in time; `check_address` fails in one line when the address cannot be listened on.
"""
from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import uvicorn

from titanc.runtime.serve.engine import Engine

__all__ = ["HEADER_TIMEOUT_S", "DrainingServer", "header_timeout_protocol", "check_address"]

HEADER_TIMEOUT_S = 10.0            # the longest a connection may take to send a request's head


class DrainingServer(uvicorn.Server):
    """uvicorn's Server with a draining shutdown: the first SIGTERM/SIGINT stops admission
    (new requests get 503), lets running requests finish for up to `grace` seconds, cancels
    what is left (finish_reason "abort"), then stops uvicorn, and the process exits 0. A
    second signal cancels every request at once (each stream still ends with its "abort"
    chunk and `[DONE]`) and stops; a third stops without waiting. It prints the address it listens on (useful with port 0)."""

    def __init__(self, config: uvicorn.Config, engine: Engine, grace: float):
        super().__init__(config)
        self.engine, self.grace, self.draining, self.stopping = engine, grace, False, False

    def _stop_soon(self) -> None:
        deadline = time.monotonic() + 2.0
        while not self.engine.idle and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.1)                       # let the abort chunks reach their clients
        self.should_exit = True

    def handle_exit(self, sig: int, frame: Any) -> None:
        # unlike uvicorn's, this does not re-raise the signal after shutdown: exit status 0
        if self.stopping:                    # a third signal: now
            self.should_exit = self.force_exit = True
            return
        if self.draining:                    # a second: end every request now, as "abort"
            self.stopping = True             # chunks and [DONE], then stop
            self.engine.cancel_all()
            threading.Thread(target=self._stop_soon, name="titanc-stop", daemon=True).start()
            return
        self.draining = True
        self.engine.drain()
        threading.Thread(target=self._drain, name="titanc-drain", daemon=True).start()

    def _drain(self) -> None:
        for limit, action in ((self.grace, self.engine.cancel_all), (5.0, None)):
            deadline = time.monotonic() + limit
            while not self.engine.idle and time.monotonic() < deadline:
                time.sleep(0.02)
            if action is not None:
                action()
        time.sleep(0.1)                       # let the last events reach their clients
        self.should_exit = True

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        for server in self.servers:
            for sock in server.sockets:
                host, port = sock.getsockname()[:2]
                print(f"titanc serve: listening on http://{host}:{port}", flush=True)


def header_timeout_protocol(seconds: float) -> type:
    """uvicorn's h11 protocol with a header-read timeout: a connection whose request head
    (request line and headers) is not complete `seconds` after it opened, or after the first
    byte of its next request, is closed (a client holding many half-sent heads cannot keep
    connections forever; uvicorn's own timeout covers idle keep-alive only). A request whose
    head came in is never cut by it: its body has BODY_IDLE_S, its response no limit."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeoutProtocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None
        _head_cycle: Any = None

        def connection_made(self, transport: Any) -> None:      # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            waiting = self.cycle is None or self.cycle.response_complete
            if waiting and (self._head_timer is None or self._head_cycle is not self.cycle):
                self._arm()
            super().data_received(data)

        def connection_lost(self, exc: Exception | None) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            self._head_cycle = self.cycle
            self._head_timer = self.loop.call_later(seconds, self._expire)

        def _expire(self) -> None:
            self._head_timer = None
            waiting = self.cycle is None or self.cycle.response_complete
            if waiting and not self.transport.is_closing():
                self.transport.close()                    # no request head came in time

    return HeaderTimeoutProtocol


def check_address(host: str, port: int) -> None:
    """Fail early, in one line, when the address cannot be listened on."""
    import socket

    from titanc.errors import TitancError, printable

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        with socket.socket(infos[0][0], socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(infos[0][4])
    except (OSError, UnicodeError, ValueError) as exc:   # a host name idna cannot encode
        reason = getattr(exc, "strerror", None) or type(exc).__name__
        raise TitancError(f"--host/--port: cannot listen on {printable(host, 60)}:{port} "
                          f"({reason}); pick another port or --port 0") from None
