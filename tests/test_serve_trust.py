"""The server and its sessions under a hostile client or a hostile sessions directory: what
`titanc serve` trusts and what it refuses (docs/hardening.md, "The server's trust model").

One row of the table each: SIGTERM writes every live session; no key, Host, Origin or
content type check and no cap on session files (disk fill, DNS rebinding); `--max-sessions`
outside the memory-fit check; a session file continued on other weights; session files with
an absurd position, a huge or non-finite tensor, 100,000 unfed tokens, or version "99"; a
read-only sessions directory; echo + logprobs in quadratic time and unbounded size;
`new_state(2**40)`; no header-read timeout; a GET that evicts; temporary files of dead
writers left in the directory.

The model is tests/conftest.py's `artifact` (a 1-layer MAC of width 32, float64, fresh
weights). Servers run in-process (uvicorn in a thread on 127.0.0.1, a free port), except the
SIGTERM test's subprocesses; every socket has a timeout and every server stops at the end.
"""
from __future__ import annotations

import http.client
import json
import signal
import socket
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

import titanc
from titanc.errors import TitancError
from titanc.runtime.serve.codec import codec_for
from titanc.runtime.serve.completions import ApiError, Limits
from titanc.runtime.serve.engine import Engine, TokenLogprob, Update
from titanc.runtime.serve.generate import Generator, load_session, save_session
from titanc.runtime.serve.guard import Access
from titanc.runtime.serve.sessions import SessionStore, StoreLimits
from titanc.tools.cli import main
from tests.helpers import start_server
from tests.test_serve import MODEL, TIMEOUT, Server

KEY = "k-test-0123456789"
JSON_HEADERS = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def prog(artifact: Path) -> Any:
    return titanc.load(artifact)


@pytest.fixture(scope="module")
def codec(prog: Any, artifact: Path) -> Any:
    return codec_for(prog, artifact)


@pytest.fixture(scope="module")
def gen(prog: Any, codec: Any) -> Generator:
    return Generator(prog, codec.tok)


class Live:
    """The real app on uvicorn in a thread (127.0.0.1, a free port), with its engine."""

    def __init__(self, gen: Generator, codec: Any, directory: Path | None = None,
                 access: Access = Access(), limits: Limits = Limits(),
                 store_limits: StoreLimits = StoreLimits(), max_sessions: int = 4,
                 header_timeout: float = 10.0):
        from titanc.runtime.serve.process import header_timeout_protocol
        from titanc.runtime.serve.server import Metrics, create_app

        ref: list[Engine] = []
        self.engine = Engine(gen, codec, 2, 8)
        ref.append(self.engine)
        self.store = SessionStore(gen, max_sessions, directory, store_limits)
        app = create_app(self.engine, codec, MODEL, limits, Metrics(ref), self.store, access)
        self.engine.start()
        self.server, self.thread, self.port = start_server(
            app, http=header_timeout_protocol(header_timeout))

    def request(self, method: str, path: str, body: Any = None,
                headers: dict[str, str] | None = None) -> tuple[int, dict, Any]:
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=TIMEOUT)
        try:
            data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
            hdrs = dict(JSON_HEADERS if data else {}, **(headers or {}))
            c.request(method, path, body=data, headers=hdrs)
            r = c.getresponse()
            raw = r.read()
            headers_out = {k.lower(): v for k, v in r.getheaders()}
            return r.status, headers_out, json.loads(raw) if raw else None
        finally:
            c.close()

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        self.engine.stop()


@pytest.fixture()
def live(gen: Generator, codec: Any, tmp_path: Path) -> Iterator[Live]:
    s = Live(gen, codec, tmp_path / "sessions")
    yield s
    s.close()


def _rewrite(path: Path, tensors: dict[str, torch.Tensor] | None = None,
             meta: dict[str, str] | None = None) -> None:
    """Change a session file's tensors or metadata and recompute its checksum (write access
    to the directory is all it takes)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from titanc.runtime.train.checkpoint import checksum

    with safe_open(str(path), framework="pt") as f:
        old_meta = dict(f.metadata())
        old = {k: f.get_tensor(k) for k in f.keys()}
    old.update(tensors or {})
    old_meta.update(meta or {})
    old_meta["checksum"] = checksum(old, old_meta)
    save_file(old, str(path), metadata=old_meta)


def _one_line_error(reply: Any, status: int, got: int) -> dict:
    assert got == status, (got, reply)
    err = reply["error"]
    assert "\n" not in err["message"] and "Traceback" not in err["message"], err
    return err


# -- row 2: SIGTERM writes every live session ------------------------------------------------

def test_sigterm_writes_every_live_session(artifact: Path, gen: Generator,
                                           tmp_path: Path) -> None:
    """A snapshotted session that ran a turn after it, and a session only in memory: after
    SIGTERM (exit 0) a restart on the directory (here the store of a new server) has both at
    the state the clients were answered from."""
    sessions = tmp_path / "sessions"
    server = Server(artifact, "--sessions-dir", str(sessions), "--max-sessions", "4")
    try:
        def turn(sid: str) -> tuple[int, dict, Any]:
            return server.post({"prompt": "Hello", "max_tokens": 5, "temperature": 0,
                                "session": sid})
        a = server.request("POST", "/v1/sessions")[2]["id"]
        assert server.request("POST", f"/v1/sessions/{a}/snapshot")[0] == 200
        assert turn(a)[0] == 200
        b = server.request("POST", "/v1/sessions")[2]["id"]
        assert turn(b)[0] == 200
        want = {s: server.request("GET", f"/v1/sessions/{s}")[2]["tokens"] for s in (a, b)}
        assert want[a] > 0 and want[b] > 0
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(60) == 0
    finally:
        server.stop()
    again = SessionStore(gen, 4, sessions)
    assert {s: again.peek(s)["tokens"] for s in (a, b)} == want


# -- row 3: key, Host, Origin, content type, a cap on session files, no paths in errors -------

def test_an_unauthenticated_client_cannot_fill_the_disk(gen: Generator, codec: Any,
                                                        tmp_path: Path) -> None:
    directory = tmp_path / "sessions"
    live = Live(gen, codec, directory, Access(api_key=KEY), max_sessions=2,
                store_limits=StoreLimits(max_files=3))
    auth = {"Authorization": f"Bearer {KEY}"}
    try:
        status, headers, reply = live.request("POST", "/v1/sessions")
        assert _one_line_error(reply, 401, status)["code"] == "invalid_api_key"
        assert headers["www-authenticate"] == "Bearer"
        wrong = live.request("GET", "/v1/models", headers={"Authorization": "Bearer nope"})
        assert wrong[0] == 401 and wrong[2]["error"]["message"] == "incorrect API key provided"
        assert live.request("GET", "/health")[0] == 200                 # probes stay open
        assert live.request("GET", "/v1/models", headers=auth)[0] == 200

        # DNS rebinding: a name the server does not answer to; a cross-site page
        for hdrs, code in (({"Host": "evil.example:8000"}, "host_not_allowed"),
                           ({"Origin": "http://evil.example"}, "origin_not_allowed")):
            status, _, reply = live.request("POST", "/v1/sessions", headers={**auth, **hdrs})
            assert _one_line_error(reply, 403, status)["code"] == code
        for host in ("localhost:1", "127.0.0.1", "[::1]:8000", "a.localhost"):
            assert live.request("GET", "/v1/models", headers={**auth, "Host": host})[0] == 200
        # a "simple" cross-site request: a body that is not declared JSON
        status, _, reply = live.request("POST", "/v1/completions", b'{"prompt": "a"}',
                                        {**auth, "Content-Type": "text/plain"})
        assert _one_line_error(reply, 415, status)["code"] == "unsupported_media_type"

        # at most 3 session files, live ones counted: 1,000 creations cannot pass it
        codes = [live.request("POST", "/v1/sessions", headers=auth)[0] for _ in range(12)]
        assert codes == [200] * 3 + [429] * 9, codes
        status, _, reply = live.request("POST", "/v1/sessions", headers=auth)
        assert "--max-session-files" in _one_line_error(reply, 429, status)["message"]
        assert len(list(directory.glob("sess_*.safetensors"))) <= 3

        # a damaged file in DIR: the error names the file, never the server's path
        bad = "sess_" + "c" * 32
        (directory / f"{bad}.safetensors").write_bytes(b"\x00" * 64)
        status, _, reply = live.request("GET", f"/v1/sessions/{bad}", headers=auth)
        err = _one_line_error(reply, 400, status)
        assert f"{bad}.safetensors" in err["message"] and str(tmp_path) not in err["message"]
    finally:
        live.close()


def test_serving_beyond_loopback_without_a_key_warns_and_the_key_comes_from_config(
        artifact: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    from titanc.runtime.serve import server as srv

    seen: list[Any] = []

    class NoServer:                      # everything up to listening, then return at once
        def __init__(self, config: Any, engine: Any, grace: float):
            seen.append(config.app)

        def run(self) -> None:
            pass
    monkeypatch.setattr(srv, "DrainingServer", NoServer)
    monkeypatch.setattr(srv, "warm_up", lambda engine: None)
    assert main(["serve", str(artifact), "--host", "0.0.0.0", "--port", "0"]) == 0
    err = capsys.readouterr().err
    assert err.count("warning: listening on 0.0.0.0") == 1 and "--api-key" in err, err
    monkeypatch.setenv("TITANC_API_KEY", KEY)
    assert main(["serve", str(artifact), "--host", "0.0.0.0", "--port", "0"]) == 0
    assert "warning" not in capsys.readouterr().err
    from titanc.runtime.serve.request_log import RequestLog
    assert isinstance(seen[-1], RequestLog)             # the request log, around the guard
    assert seen[-1].app.access.api_key == KEY
    assert main(["serve", str(artifact), "--port", "0", "--api-key", " "]) == 2
    assert "--api-key: the key is empty" in capsys.readouterr().err


# -- row 4: --max-sessions through the memory-fit check ---------------------------------------

def test_max_sessions_is_in_the_memory_fit_check(artifact: Path, gen: Generator,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture) -> None:
    from titanc.runtime import capacity
    from titanc.runtime.serve import server as srv

    one = gen.state_bytes(1)
    machine = 256 << 20                    # room for the program and the slot pool
    assert 65536 * one > machine, one
    monkeypatch.setattr(capacity, "machine_bytes", lambda device="cpu": machine)
    monkeypatch.setattr(srv, "DrainingServer", None)     # never listen, whatever happens
    assert main(["serve", str(artifact), "--port", "0", "--max-sessions", "65536"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("titanc: error: ") and err.count("\n") == 1, err
    assert "reduce --max-sessions (65536" in err, err


# -- row 5: a session file is read only by the weights that wrote it ---------------------------

def test_a_session_file_of_other_weights_is_refused(prog: Any, artifact: Path, gen: Generator,
                                                    codec: Any, tmp_path: Path) -> None:
    other_prog = titanc.load(artifact)
    with torch.no_grad():
        next(iter(other_prog.parameters().values())).add_(0.01)
    other = Generator(other_prog, codec.tok)
    path = save_session(tmp_path / "sess.safetensors", gen, gen.new_state(1))
    with pytest.raises(TitancError, match="written with other weights"):
        load_session(path, other)
    assert load_session(path, gen).tokens == [0]
    # through the server: a one-line 400 naming the reason
    sid = "sess_" + "d" * 32
    directory = tmp_path / "dir"
    directory.mkdir()
    (directory / f"{sid}.safetensors").write_bytes(path.read_bytes())
    with pytest.raises(ApiError) as err:
        SessionStore(other, 4, directory).peek(sid)
    assert err.value.status == 400 and "other weights" in err.value.message


# -- rows 12, 13, 14 and version "99": a session file checked against the model's bounds -------

@pytest.mark.parametrize("change, words", [
    ({"pos": torch.tensor([2**63 - 1])}, "position"),
    ({"unfed": torch.zeros(100_000, dtype=torch.int64)}, "100000 unfed tokens"),
    ({"state.W1": "3e38"}, "'state.W1' holds a value of magnitude 3e+38"),
    ({"state.W1": "nan"}, "'state.W1' holds a NaN"),
    ("99", "version '99'"),
])
def test_a_session_file_past_the_models_bounds_is_refused(gen: Generator, tmp_path: Path,
                                                          change: Any, words: str) -> None:
    path = save_session(tmp_path / "s.safetensors", gen, gen.new_state(1))
    if change == "99":
        _rewrite(path, meta={"version": "99"})
    else:
        tensors = {}
        for k, v in change.items():
            tensors[k] = v if isinstance(v, torch.Tensor) else torch.full_like(
                gen.state_dict(gen.new_state(1))[k], float(v))
        if "pos" in change:                       # slot_pos stays within [-1, pos)
            tensors["slot_pos"] = torch.full_like(gen.state_dict(gen.new_state(1))["slot_pos"], -1)
        _rewrite(path, tensors)
    with pytest.raises(TitancError) as err:
        load_session(path, gen)
    assert words in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_one_requests_bad_state_never_stops_the_engine(live: Live) -> None:
    """A state past the bounds that got in anyway (here: set in memory) fails its own turn,
    in one line; the session keeps its state, and the server goes on serving."""
    sid = live.store.create().id
    live.store._live[sid].state.pos = [2**63 - 1]
    status, _, reply = live.request("POST", "/v1/completions",
                                    {"prompt": "ab", "max_tokens": 3, "session": sid})
    assert _one_line_error(reply, 500, status)["code"] == "engine_error"
    assert live.store._live[sid].state.pos == [2**63 - 1] and not live.store._live[sid].busy
    status, _, reply = live.request("POST", "/v1/completions", {"prompt": "ab", "max_tokens": 3})
    assert status == 200 and reply["choices"][0]["finish_reason"] == "length", reply
    assert live.request("GET", "/health")[2]["status"] == "ok"


def test_a_turn_is_all_or_nothing_when_its_response_fails(live: Live,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from titanc.runtime.serve import server as srv

    sid = live.request("POST", "/v1/sessions")[2]["id"]
    turn = {"prompt": "Hello", "max_tokens": 4, "logprobs": 1, "session": sid}
    # a non-finite state: the engine ends the turn, the session keeps its state
    live.store._live[sid].state.tensors["W1"].fill_(float("nan"))
    status, _, reply = live.request("POST", "/v1/completions", turn)
    assert "not finite" in _one_line_error(reply, 500, status)["message"]
    assert live.request("GET", f"/v1/sessions/{sid}")[2]["tokens"] == 0
    # a response that cannot be rendered: the turn is not committed either
    sid = live.request("POST", "/v1/sessions")[2]["id"]

    def fail(body: Any) -> bytes:
        raise ValueError("Out of range float values are not JSON compliant")
    monkeypatch.setattr(srv, "render", fail)
    status, _, reply = live.request("POST", "/v1/completions", dict(turn, session=sid))
    assert _one_line_error(reply, 500, status)["code"] == "engine_error"
    info = live.request("GET", f"/v1/sessions/{sid}")[2]
    assert info["tokens"] == 0 and not info["busy"], info
    monkeypatch.undo()
    status, _, reply = live.request("POST", "/v1/completions", dict(turn, session=sid))
    assert status == 200 and live.request("GET", f"/v1/sessions/{sid}")[2]["tokens"] > 0


# -- row 15: a sessions directory the server cannot write ---------------------------------------

def test_an_unwritable_sessions_dir_is_one_line(artifact: Path, live: Live,
                                                monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture) -> None:
    from titanc.runtime.serve import server as srv

    # /sys: a directory that exists and refuses new files, even to root
    monkeypatch.setattr(srv, "DrainingServer", None)
    assert main(["serve", str(artifact), "--port", "0", "--sessions-dir", "/sys"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("titanc: error: --sessions-dir: cannot write session files in /sys")
    assert err.count("\n") == 1, err
    # a directory that stops being writable while serving: a snapshot is a one-line 5xx
    sid = live.request("POST", "/v1/sessions")[2]["id"]
    live.store.directory = Path("/sys")
    status, _, reply = live.request("POST", f"/v1/sessions/{sid}/snapshot")
    err = _one_line_error(reply, 500, status)
    assert err["code"] == "session_file_error" and f"{sid}.safetensors" in err["message"]
    assert "/sys" not in err["message"], err


# -- row 16: echo and logprobs in linear time, the response size bounded -----------------------

class _Counting:
    """A codec that counts the tokens it decodes."""

    def __init__(self, codec: Any):
        self.codec, self.decoded = codec, 0

    def decode(self, tokens: Any) -> str:
        self.decoded += len(tokens)
        return self.codec.decode(tokens)

    def token_str(self, token: int) -> str:
        return self.codec.token_str(token)


def test_text_offsets_are_linear_and_exact(codec: Any) -> None:
    from titanc.runtime.serve.responses import Choice

    text = "héllo wörld, ünïcode ✓ " * 40                   # multi-byte characters
    prompt = codec.encode(text)
    counting = _Counting(codec)
    c = Choice(0, prompt, text, echo=True, logprobs=True, codec=counting)
    lps = [TokenLogprob(t, -1.0, {t: -1.0}) for t in prompt]
    c.add(Update("", [], [], prompt_logprobs=lps))
    gen_tokens = codec.encode("ça va? ✓✓")
    c.add(Update(codec.decode(gen_tokens), gen_tokens,
                 [TokenLogprob(t, float("nan"), {t: float("-inf")}) for t in gen_tokens],
                 finish_reason="length"))
    want = [len(codec.decode(prompt[:i])) for i in range(len(prompt))]
    want += [len(text) + len(codec.decode(gen_tokens[:i])) for i in range(len(gen_tokens))]
    assert c.lp_offset == want
    n = len(prompt) + len(gen_tokens)
    assert counting.decoded <= 40 * n, (counting.decoded, n)            # not n**2 / 2
    assert c.lp_values[-1] is None and list(c.lp_top[-1].values()) == [None]   # never NaN


def test_incremental_text_equals_decoding_the_whole_sequence(codec: Any) -> None:
    """The engine's output text and the offsets decode only a tail per token: equal to
    decoding everything, for valid, invalid and truncated UTF-8 and ids past the bytes."""
    import random

    from titanc.runtime.serve.codec import IncrementalText

    rng = random.Random(0)
    pools = [list(range(codec.vocab_size)), list(range(0x80, 0x100)),
             list("é✓€😀a".encode()) + [0xFF, 0x80, codec.vocab_size - 1]]
    for trial in range(240):
        toks = [rng.choice(pools[trial % 3]) for _ in range(rng.randrange(1, 90))]
        inc = IncrementalText(codec)
        for i in range(1, len(toks) + 1):
            assert inc.text(toks[:i]) == codec.decode(toks[:i]), (trial, toks[:i])


def test_a_response_past_the_size_limit_is_refused_up_front(gen: Generator, codec: Any) -> None:
    live = Live(gen, codec, limits=Limits(max_prompt_tokens=8192, max_tokens=4096))
    try:
        big = {"prompt": "a" * 8192, "echo": True, "logprobs": 20, "max_tokens": 4096,
               "n": 4}
        status, _, reply = live.request("POST", "/v1/completions", big)
        err = _one_line_error(reply, 400, status)
        assert err["code"] == "response_too_large" and "--max-response-bytes" in err["message"]
        assert live.engine.steps == 0                              # refused before it ran
        small = {"prompt": "a" * 300, "echo": True, "logprobs": 20, "max_tokens": 2}
        status, _, reply = live.request("POST", "/v1/completions", small)
        assert status == 200 and len(reply["choices"][0]["logprobs"]["text_offset"]) == 302
    finally:
        live.close()


# -- row 21: new_state of an absurd batch ---------------------------------------------------------

def test_new_state_of_a_batch_that_cannot_fit_names_it(gen: Generator) -> None:
    with pytest.raises(TitancError) as err:
        gen.new_state(2**40)
    msg = str(err.value)
    assert "reduce the new_state batch (1099511627776)" in msg and "\n" not in msg, msg


# -- also seen: a header-read timeout; a GET never evicts -----------------------------------------

def test_a_stalled_request_head_is_closed(gen: Generator, codec: Any) -> None:
    live = Live(gen, codec, header_timeout=0.5)
    try:
        socks = [socket.create_connection(("127.0.0.1", live.port), timeout=8)
                 for _ in range(3)]
        socks[0].sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        socks[1].sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\nGET /hea")
        for s in socks:                   # each closed by the server, well before 8 s
            data = b""
            while chunk := s.recv(4096):
                data += chunk
            assert b"X-Slow" not in data
            s.close()
        assert live.request("GET", "/health")[0] == 200
    finally:
        live.close()


def test_a_get_reads_an_evicted_session_without_evicting(gen: Generator, codec: Any,
                                                         tmp_path: Path) -> None:
    store = SessionStore(gen, 1, tmp_path)
    a = store.create().id
    b = store.create().id                     # evicts a to disk
    files = lambda: sorted(p.name for p in tmp_path.glob("sess_*.safetensors"))  # noqa: E731
    assert files() == [f"{a}.safetensors"]
    assert store.peek(a)["tokens"] == 0 and store.peek(b)["tokens"] == 0
    assert list(store._live) == [b] and files() == [f"{a}.safetensors"]


def test_temporary_files_of_dead_writers_are_removed_at_startup(gen: Generator,
                                                                tmp_path: Path) -> None:
    sid = "sess_" + "e" * 32
    dead = [tmp_path / f".{sid}.safetensors.4194999.tmp",      # no such process
            tmp_path / ".titanc-probe-4194999.safetensors"]
    for p in dead:
        p.write_bytes(b"\0" * 1000)
    mine = tmp_path / "notes.txt"
    mine.write_text("kept")
    SessionStore(gen, 2, tmp_path)
    assert [p for p in dead if p.exists()] == [] and mine.read_text() == "kept"
