"""One line per HTTP request on the server's standard output, as an access log reads:

    127.0.0.1:51234 "POST /v1/completions" 200 12.3 ms

The client address, method, path (printable, without the query string: a query may hold a
secret), status and the time to the response's first byte. A request that ends before any
response (a client that hung up) is logged with status `-`. `titanc serve --no-request-log`
turns it off. The line never holds a header or a body: no key or prompt reaches the log."""
from __future__ import annotations

import sys
import time
from typing import Any, Callable, TextIO

from titanc.errors import printable

__all__ = ["RequestLog", "request_line"]

Scope = dict[str, Any]


def request_line(scope: Scope, status: int | None, seconds: float) -> str:
    client = scope.get("client")
    who = f"{client[0]}:{client[1]}" if client else "-"
    path = printable(str(scope.get("path", "")), 200)
    shown = "-" if status is None else str(status)
    return f'{who} "{scope.get("method", "?")} {path}" {shown} {seconds * 1e3:.1f} ms'


class RequestLog:
    """ASGI middleware: logs each HTTP request of `app` to `out` (default stdout)."""

    def __init__(self, app: Any, out: TextIO | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.app, self.out, self.clock = app, out, clock

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        t0, status, seconds = self.clock(), [None], [None]

        async def logged_send(message: dict[str, Any]) -> None:
            if message.get("type") == "http.response.start":
                status[0], seconds[0] = int(message.get("status", 0)), self.clock() - t0
            await send(message)

        try:
            await self.app(scope, receive, logged_send)
        finally:
            took = seconds[0] if seconds[0] is not None else self.clock() - t0
            out = self.out if self.out is not None else sys.stdout
            print(request_line(scope, status[0], took), file=out, flush=True)
