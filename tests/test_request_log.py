"""The server's request log (runtime/serve/request_log.py): one line per HTTP request with the
client, method, path, status and time; never a query string, header or body."""
from __future__ import annotations

import asyncio
import io
from typing import Any

from titanc.runtime.serve.request_log import RequestLog


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["path"] == "/hangup":
        raise ConnectionError("client went away")
    await send({"type": "http.response.start", "status": 418, "headers": []})
    await send({"type": "http.response.body", "body": b"secret body"})


def _call(path: str, query: bytes = b"") -> str:
    out = io.StringIO()
    ticks = iter([1.0, 1.0125, 9.0])
    app = RequestLog(_app, out, clock=lambda: next(ticks))
    scope = {"type": "http", "method": "POST", "path": path, "query_string": query,
             "client": ("127.0.0.1", 5000),
             "headers": [(b"authorization", b"Bearer sk-secret")]}
    sent: list[dict[str, Any]] = []

    async def send(m: dict[str, Any]) -> None:
        sent.append(m)

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"{}"}

    try:
        asyncio.run(app(scope, receive, send))
    except ConnectionError:
        pass
    return out.getvalue()


def test_a_request_is_one_line_with_its_status_and_time() -> None:
    line = _call("/v1/completions", b"key=sk-in-query")
    assert line == '127.0.0.1:5000 "POST /v1/completions" 418 12.5 ms\n'
    assert "secret" not in line and "sk-" not in line


def test_a_request_that_ends_without_a_response_is_logged_with_a_dash() -> None:
    assert _call("/hangup").endswith('"POST /hangup" - 12.5 ms\n')


def test_an_odd_path_is_printed_escaped() -> None:
    line = _call("/v1/\x1b[2J")
    assert "\x1b" not in line and "\\x1b" in line


def test_the_cli_has_the_switch() -> None:
    from titanc.tools.cli import build_parser
    args = build_parser().parse_args(["serve", "runs/x", "--no-request-log"])
    assert args.request_log is False
    assert build_parser().parse_args(["serve", "runs/x"]).request_log is True
