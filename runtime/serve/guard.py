"""Who may talk to the server: the API key, Host and Origin checks, and JSON bodies only.

`Guard` wraps the ASGI app and refuses a request before any route sees it:

1. **Host** (403 `host_not_allowed`): a web page can reach a server on this machine through
   DNS rebinding (its own name made to resolve to 127.0.0.1), and then its requests carry
   that name in Host. Allowed: IP addresses (a rebinding page cannot send one), `localhost`
   and `*.localhost`, the `--host` name, and each `--allowed-host` (`*`: any). No Host
   header (HTTP/1.0 or an in-process client) is not a browser's request and passes.
2. **Origin** (403 `origin_not_allowed`): a browser names the page that sent a request; a
   request from a page of another origin is refused unless `--allowed-origin` names it
   (`*`: any). Clients that are not browsers send no Origin. No CORS headers are sent.
3. **API key** (401 `invalid_api_key`, with `WWW-Authenticate: Bearer`): with `--api-key`
   (or `TITANC_API_KEY`), every `/v1/...` route needs `Authorization: Bearer KEY`, OpenAI's
   scheme, compared in constant time. `/health` and `/metrics` stay open (probes, scrapers).
4. **JSON bodies** (415 `unsupported_media_type`): a request with a body must say
   `Content-Type: application/json`, so a page cannot send one as a "simple" cross-site
   request (text/plain, form data) that a browser sends without asking the server first.

`exposure_warning` is the one line `titanc serve` prints when it listens beyond the loopback
interface without a key.
"""
from __future__ import annotations

import hmac
import ipaddress
import socket
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from starlette.responses import JSONResponse

from titanc.runtime.serve.completions import ApiError

__all__ = ["Access", "Guard", "is_loopback", "exposure_warning"]


@dataclass(frozen=True)
class Access:
    api_key: str | None = None
    bound_host: str = "127.0.0.1"                   # --host
    allowed_hosts: tuple[str, ...] = ()             # --allowed-host, "*": any
    allowed_origins: tuple[str, ...] = ()           # --allowed-origin, "*": any

    def host_allowed(self, host: str) -> bool:
        name = _host_name(host)
        if "*" in self.allowed_hosts or name in {h.lower().rstrip(".") for h in self.allowed_hosts}:
            return True
        if name == "localhost" or name.endswith(".localhost") or _is_ip(name):
            return True
        return name == self.bound_host.lower().rstrip(".")

    def origin_allowed(self, origin: str, host: str | None) -> bool:
        if "*" in self.allowed_origins or origin.rstrip("/") in self.allowed_origins:
            return True
        try:
            netloc = urlsplit(origin).netloc.lower()
        except ValueError:
            return False
        return host is not None and netloc == host.lower()      # the same origin


def _host_name(host: str) -> str:
    """The name of a Host header value, without its port, lower case, no trailing dot."""
    host = host.strip().lower()
    if host.startswith("["):                        # [::1]:8000
        return host[1:host.find("]")] if "]" in host else host
    if host.count(":") == 1:
        host = host.rsplit(":", 1)[0]
    return host.rstrip(".")


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class Guard:
    """ASGI middleware: the checks of the module docstring, in that order."""

    def __init__(self, app: Any, access: Access):
        self.app, self.access = app, access
        self._key = None if access.api_key is None else access.api_key.encode("utf-8")

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            refusal = self.check(scope)
            if refusal is not None:
                response = JSONResponse(refusal.body(), status_code=refusal.status,
                                        headers=refusal.headers)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def check(self, scope: Any) -> ApiError | None:
        headers: dict[bytes, bytes] = {}
        for k, v in scope.get("headers") or ():
            headers.setdefault(k.lower(), v)
        host = _text(headers.get(b"host"))
        if host is not None and not self.access.host_allowed(host):
            return ApiError(403, f"Host {host[:60]!r} is not a name this server answers to "
                                 f"(protection against DNS rebinding); start it with "
                                 f"--allowed-host NAME to allow a name", code="host_not_allowed")
        origin = _text(headers.get(b"origin"))
        if origin is not None and not self.access.origin_allowed(origin, host):
            return ApiError(403, f"requests from web pages of origin {origin[:60]!r} are "
                                 f"refused (cross-site); start the server with "
                                 f"--allowed-origin ORIGIN to allow one",
                            code="origin_not_allowed")
        if self._key is not None and str(scope.get("path", "")).startswith("/v1"):
            refusal = self._check_key(headers.get(b"authorization"))
            if refusal is not None:
                return refusal
        return _check_body_type(headers)

    def _check_key(self, value: bytes | None) -> ApiError | None:
        scheme, _, token = (value or b"").partition(b" ")
        if value and scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(),
                                                                          self._key or b""):
            return None
        message = ("incorrect API key provided" if value else
                   "this server needs an API key: send the header 'Authorization: Bearer KEY'")
        return ApiError(401, message, code="invalid_api_key",
                        headers={"WWW-Authenticate": "Bearer"})


def _text(value: bytes | None) -> str | None:
    return None if value is None else value.decode("latin-1")


def _check_body_type(headers: dict[bytes, bytes]) -> ApiError | None:
    """415 when the request has a body that is not declared as JSON."""
    length = headers.get(b"content-length", b"").strip()
    if length in (b"", b"0") and b"transfer-encoding" not in headers:
        return None
    kind = (_text(headers.get(b"content-type")) or "").split(";", 1)[0].strip().lower()
    if kind == "application/json":
        return None
    shown = repr(kind[:40]) if kind else "none"
    return ApiError(415, f"the request body must be JSON sent with 'Content-Type: "
                         f"application/json' (got {shown})", code="unsupported_media_type")


def is_loopback(host: str) -> bool:
    """Does `host` (a --host value) listen on this machine's loopback interface only?"""
    name = host.strip("[]")
    if _is_ip(name):
        return ipaddress.ip_address(name).is_loopback
    try:
        infos = socket.getaddrinfo(name, None)
    except (OSError, UnicodeError):
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback
                               for i in infos)


def exposure_warning(host: str, port: int, api_key: str | None) -> str | None:
    """The line to print when the server listens beyond loopback with no API key."""
    if api_key is not None or is_loopback(host):
        return None
    return (f"titanc serve: warning: listening on {host}:{port}, beyond this machine, without "
            f"an API key: anyone who can reach it can run completions and fill --sessions-dir; "
            f"pass --api-key KEY or set TITANC_API_KEY")
