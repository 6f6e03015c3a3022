"""`titanc serve`'s trust and size flags, declared once for the CLI (no server import: the
parser is built without FastAPI) and turned into the keyword arguments of `serve`.

| flag                   | default          | what it bounds                                       |
|------------------------|------------------|------------------------------------------------------|
| `--api-key KEY`        | `TITANC_API_KEY` | `/v1/...` needs `Authorization: Bearer KEY`           |
| `--allowed-host NAME`  | none             | Host names answered besides IPs, localhost, `--host`  |
| `--allowed-origin O`   | none             | browser origins allowed besides the same origin       |
| `--max-session-files N`| 1024             | sessions in `--sessions-dir` (live ones counted)      |
| `--max-session-bytes N`| 1 GiB            | bytes of session files in `--sessions-dir`            |
| `--max-response-bytes N` | 32 MiB         | the largest response a request may ask for            |
| `--header-timeout S`   | 10               | seconds a connection may take to send a request head  |
"""
from __future__ import annotations

import argparse
from typing import Any

from titanc import bounds as B
from titanc import config

__all__ = ["add_trust_arguments", "trust_kwargs"]

FILES = B.Bound(1, 1 << 20, "a number of files")
BYTES = B.Bound(1, 1 << 50, "a number of bytes")


def add_trust_arguments(serve: argparse.ArgumentParser) -> None:
    """The flags of the module docstring's table."""
    serve.add_argument("--api-key", default=None, metavar="KEY",
                       help="require 'Authorization: Bearer KEY' on /v1/... (default: "
                            "TITANC_API_KEY, else no key; prefer the variable: a flag shows "
                            "in the process list)")
    serve.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                       help="a Host name to answer besides IP addresses, localhost and "
                            "--host (repeatable; '*' any): DNS rebinding protection")
    serve.add_argument("--allowed-origin", action="append", default=[], metavar="ORIGIN",
                       help="a browser origin (http://host:port) whose pages may call the "
                            "server (repeatable; '*' any; default: none)")
    serve.add_argument("--max-session-files", type=FILES.arg, default=1024, metavar="N",
                       help="sessions kept in --sessions-dir, live ones counted (default 1024)")
    serve.add_argument("--max-session-bytes", type=BYTES.arg, default=1 << 30, metavar="N",
                       help="bytes of session files in --sessions-dir (default 1 GiB)")
    serve.add_argument("--max-response-bytes", type=BYTES.arg, default=32 << 20, metavar="N",
                       help="largest response a request may ask for (n x tokens x logprobs; "
                            "default 32 MiB)")
    serve.add_argument("--no-request-log", dest="request_log", action="store_false",
                       help="print no line per request (default: client, method, path, "
                            "status and time on stdout; never a header or a body)")
    serve.add_argument("--header-timeout", type=B.finite_float(0.1, 3600.0, "seconds"),
                       default=10.0, metavar="SECONDS",
                       help="close a connection whose request head takes longer (default 10)")


def trust_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """`serve`'s keyword arguments for these flags (the key from TITANC_API_KEY when no
    --api-key is given)."""
    from titanc.runtime.serve.guard import Access
    from titanc.runtime.serve.sessions import StoreLimits

    key = args.api_key if args.api_key is not None else config.current().api_key
    return {"access": Access(api_key=key, bound_host=args.host,
                             allowed_hosts=tuple(args.allowed_host),
                             allowed_origins=tuple(args.allowed_origin)),
            "store_limits": StoreLimits(args.max_session_files, args.max_session_bytes),
            "header_timeout": args.header_timeout, "request_log": args.request_log}
