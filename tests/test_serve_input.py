"""The HTTP server under bad input: defects a client of the OpenAI-compatible API hit.

- a number field given an integer beyond float's range (`"temperature": 1e400` written out
  as digits) was an internal error (500), not a 400 naming the field;
- `best_of` was not type-checked (`true` passed as 1);
- a request without `max_tokens` on a server whose `--max-tokens` is below 16 was refused,
  naming a value the client never sent;
- a non-streaming client that hung up was noticed only once no token had come for
  POLL_S, i.e. never while its completion ran: its slot stayed busy to the end;
- DELETE of a session whose file was damaged was refused (the file could never be removed
  through the API), DELETE of a session held only on disk loaded it (evicting another one),
  and a file that could not be removed dropped the session anyway and answered an
  internal error;
- GET /v1/models/ID (the openai client's `models.retrieve`) did not exist, and the 404 of an
  absent endpoint (POST /v1/chat/completions) or the 405 of a wrong method said only
  "Not Found" / "Method Not Allowed";
- a client that sent less of a body than its Content-Length and waited held its connection
  and handler forever (now a 408 after BODY_IDLE_S without a byte);
- POST /v1/sessions still made sessions while the server drained (now 503, as completions).

One server subprocess on 127.0.0.1 (a free port, stopped at the end), every request with a
timeout; the store and the parser are also driven in-process.
"""
from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

import titanc
from titanc.runtime.serve.completions import ApiError, Limits, parse_completion
from tests.test_serve import MODEL, TIMEOUT, Server

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def sessions_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sessions3")


@pytest.fixture(scope="module")
def server(artifact: Path, sessions_dir: Path) -> Iterator[Server]:
    s = Server(artifact, "--slots", "2", "--max-queue", "8", "--max-tokens", "4000",
               "--max-sessions", "2", "--sessions-dir", str(sessions_dir), "--grace", "5")
    yield s
    s.stop()


@pytest.fixture()
def client(server: Server) -> Any:
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", timeout=TIMEOUT,
                         max_retries=0)


def _post_raw(server: Server, body: bytes) -> tuple[int, Any]:
    status, _, reply = server.request("POST", "/v1/completions", body,
                                      {"Content-Type": "application/json"})
    return status, reply


def test_a_huge_integer_in_a_number_field_is_a_400_naming_it(server: Server) -> None:
    huge = b"1" + b"0" * 400                       # a JSON integer beyond float's range
    before = server.metric('titanc_requests_total{code="500"}')
    for field in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
        for sign in (b"", b"-"):
            status, reply = _post_raw(server, b'{"prompt": "a", "' + field.encode() + b'": '
                                      + sign + huge + b"}")
            assert status == 400, (field, sign, reply)
            err = reply["error"]
            assert err["param"] == field and err["type"] == "invalid_request_error", err
            assert "out of range" in err["message"] and len(err["message"]) < 200, err
    assert server.metric('titanc_requests_total{code="500"}') == before


def test_best_of_must_be_an_integer(server: Server) -> None:
    for bad in (True, 1.0, "1", [1]):
        status, reply = _post_raw(server, json.dumps({"prompt": "a", "best_of": bad,
                                                      "max_tokens": 1}).encode())
        assert status == 400 and reply["error"]["param"] == "best_of", (bad, reply)
    status, reply = _post_raw(server, b'{"prompt": "a", "best_of": 1, "max_tokens": 1}')
    assert status == 200 and reply["usage"]["completion_tokens"] == 1, reply


def test_the_default_max_tokens_fits_the_servers_limit() -> None:
    class Bytes:
        vocab_size = 256

        def encode(self, text: str) -> list[int]:
            return list(text.encode())

        def decode(self, ids: list[int]) -> str:
            return bytes(ids).decode(errors="replace")

    assert parse_completion({"prompt": "a"}, Bytes(), Limits(max_tokens=8)).max_tokens == 8
    assert parse_completion({"prompt": "a"}, Bytes(), Limits()).max_tokens == 16
    with pytest.raises(ApiError) as err:                     # a value the client did send
        parse_completion({"prompt": "a", "max_tokens": 9}, Bytes(), Limits(max_tokens=8))
    assert err.value.param == "max_tokens" and err.value.status == 400


def test_a_non_streaming_client_that_hangs_up_frees_its_slot(server: Server) -> None:
    """4000 tokens take tens of seconds here; the client leaves after its first tokens and
    the slot must be free within a few polls, while tokens keep arriving."""
    body = json.dumps({"prompt": "a long answer", "max_tokens": 4000}).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                  b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        h = server.wait_for(lambda h: h["active"] == 1, "the request in its slot")
        server.wait_for(lambda h2: h2["steps"] > h["steps"] + 10, "decoding")
    t0 = time.monotonic()
    server.wait_for(lambda h: h["active"] == 0 and h["queued"] == 0, "the freed slot",
                    limit=5.0)
    assert time.monotonic() - t0 < 5.0
    status, _, ok = server.post({"prompt": "next", "max_tokens": 2})
    assert status == 200 and ok["usage"]["completion_tokens"] == 2


def test_delete_removes_a_damaged_or_evicted_session_file(server: Server,
                                                          sessions_dir: Path) -> None:
    damaged = "sess_" + "ab" * 16
    (sessions_dir / f"{damaged}.safetensors").write_bytes(b"not a safetensors file")
    assert server.request("GET", f"/v1/sessions/{damaged}")[0] == 400   # unreadable
    status, _, reply = server.request("DELETE", f"/v1/sessions/{damaged}")
    assert status == 200 and reply == {"id": damaged, "object": "session.deleted",
                                       "deleted": True}, reply
    assert not (sessions_dir / f"{damaged}.safetensors").exists()
    status, _, reply = server.request("DELETE", f"/v1/sessions/{damaged}")
    assert status == 404 and reply["error"]["code"] == "session_not_found", reply

    # --max-sessions 2: the third evicts the first to disk; deleting the evicted one must not
    # load it back (which would evict a live one to disk)
    ids = [server.request("POST", "/v1/sessions")[2]["id"] for _ in range(3)]
    files = lambda: sorted(p.name for p in sessions_dir.glob("sess_*.safetensors"))  # noqa: E731
    assert files() == [f"{ids[0]}.safetensors"]
    assert server.request("DELETE", f"/v1/sessions/{ids[0]}")[0] == 200
    assert files() == []
    for sid in ids[1:]:
        status, _, reply = server.request("DELETE", f"/v1/sessions/{sid}")
        assert status == 200 and reply["deleted"] is True, reply
    assert files() == []


def test_a_session_file_that_cannot_be_removed_keeps_its_session(
        artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from titanc.runtime.serve.generate import Generator
    from titanc.runtime.serve.sessions import SessionStore

    store = SessionStore(Generator(titanc.load(artifact)), 4, tmp_path)
    sid = store.create().id
    path = Path(store.snapshot(sid)["path"])

    def refuse(self: Path, missing_ok: bool = False) -> None:
        raise PermissionError(13, "Permission denied", str(self))
    monkeypatch.setattr(Path, "unlink", refuse)
    with pytest.raises(ApiError) as err:
        store.delete(sid)
    e = err.value
    assert e.status == 500 and e.code == "session_file_error" and e.kind == "server_error"
    assert path.name in e.message and str(path.parent) not in e.message \
        and "Permission denied" in e.message
    monkeypatch.undo()
    assert store.get(sid).id == sid and path.is_file()          # nothing half-done
    store.delete(sid)
    assert not path.exists() and len(store) == 0


def test_models_retrieve_and_absent_endpoints_name_what_there_is(server: Server,
                                                                 client: Any) -> None:
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as nf:
        client.models.retrieve("gpt-4")
    assert nf.value.body["code"] == "model_not_found" and nf.value.body["param"] == "model"

    with pytest.raises(openai.NotFoundError) as nf:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user",
                                                                "content": "hi"}])
    msg = nf.value.body["message"]
    assert "POST /v1/chat/completions" in msg and "POST /v1/completions" in msg, msg
    assert nf.value.body["code"] == "not_found"

    status, headers, reply = server.request("GET", "/v1/completions")
    assert status == 405 and headers["allow"] == "POST", headers
    assert reply["error"]["message"] == "GET /v1/completions is not allowed; use POST", reply
    status, _, reply = server.request("DELETE", "/v1/models")
    assert status == 405 and "use GET" in reply["error"]["message"], reply


# -- the ASGI app in-process (an engine that never runs: these requests never reach it) -------

class _App:
    def __init__(self, artifact: Path):
        from titanc.runtime.serve.codec import codec_for
        from titanc.runtime.serve.engine import Engine
        from titanc.runtime.serve.generate import Generator
        from titanc.runtime.serve.server import Metrics, create_app

        prog = titanc.load(artifact)
        codec = codec_for(prog, artifact)
        ref: list[Engine] = []
        self.engine = Engine(Generator(prog), codec, 1, 4)
        ref.append(self.engine)
        self.app = create_app(self.engine, codec, MODEL, Limits(), Metrics(ref))

    def call(self, method: str, path: str, parts: list[bytes], length: int,
             limit_s: float = 10.0) -> tuple[int, dict, Any]:
        """Send the body in `parts` (then nothing more: the client stalls, connected)."""
        import asyncio

        async def run() -> tuple[int, dict, Any]:
            inbox = [{"type": "http.request", "body": p, "more_body": True} for p in parts]
            sent: list[dict] = []

            async def receive() -> dict:
                if inbox:
                    return inbox.pop(0)
                await asyncio.Event().wait()                  # never more: a stalled client
                return {"type": "http.disconnect"}

            async def send(message: dict) -> None:
                sent.append(message)

            scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                     "method": method, "path": path, "raw_path": path.encode(),
                     "query_string": b"", "root_path": "", "scheme": "http",
                     "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
                     "headers": [(b"content-type", b"application/json"),
                                 (b"content-length", str(length).encode())]}
            await self.app(scope, receive, send)
            start = next(m for m in sent if m["type"] == "http.response.start")
            body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
            return (start["status"], {k.decode().lower(): v.decode() for k, v in start["headers"]},
                    json.loads(body))
        return asyncio.run(asyncio.wait_for(run(), limit_s))


@pytest.fixture(scope="module")
def app(artifact: Path) -> _App:
    return _App(artifact)


def test_a_client_that_stalls_mid_body_gets_408(app: _App,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from titanc.runtime.serve import server as srv

    monkeypatch.setattr(srv, "BODY_IDLE_S", 0.3, raising=False)
    t0 = time.monotonic()
    status, headers, reply = app.call("POST", "/v1/completions", [b'{"prompt": "ab'], 100)
    assert time.monotonic() - t0 < 5.0
    assert status == 408 and headers["connection"] == "close", (status, headers)
    err = reply["error"]
    assert err["code"] == "body_timeout" and "after 14 bytes" in err["message"], err
    status, _, reply = app.call("POST", "/v1/sessions", [b"{"], 10)     # every body reader
    assert status == 408 and reply["error"]["code"] == "body_timeout", reply


def test_no_new_session_while_draining(artifact: Path) -> None:
    app = _App(artifact)
    status, _, reply = app.call("POST", "/v1/sessions", [b""], 0)
    assert status == 200 and reply["object"] == "session", reply
    app.engine.drain()
    status, _, reply = app.call("POST", "/v1/sessions", [b""], 0)
    assert status == 503 and reply["error"]["code"] == "draining", reply
    assert reply["error"]["type"] == "server_error"

