"""The HTTP server's streams under odd clients: a client that hangs up mid-body is not a
server error, a second SIGTERM ends open streams with their final chunks, and one large request
cannot hold a small one back beyond a fair share; plus the text policy: invalid Unicode in a
JSON body is a 400 naming the field, never an encoder's exception.

One server subprocess on 127.0.0.1 (a free port), every request with a timeout; the
scheduling test drives the engine in-process."""
from __future__ import annotations

import json
import signal
import socket
import time
from pathlib import Path

import pytest

import titanc
from titanc.runtime.serve.codec import codec_for
from titanc.runtime.serve.engine import Engine, Request
from titanc.runtime.serve.generate import Generator, Sampling

from .test_serve import Server, Stream


def _req(prompt: list[int], max_tokens: int, seed: int = 0) -> Request:
    return Request(prompt, max_tokens, Sampling(temperature=1.0, seed=seed),
                   on_update=lambda u: None)


def test_a_large_request_cannot_hold_a_small_one_back(artifact: Path) -> None:  # noqa: F811
    """Two slots held by long requests: a short one that arrives later starts within about
    one quantum of decode steps (it is swapped in, a long one swapped out), and every
    request's tokens equal its solo run (a swap keeps the sequence and its sampler)."""
    prog = titanc.load(artifact)
    gen, codec = Generator(prog), codec_for(prog, artifact)
    quantum = 4
    eng = Engine(gen, codec, slots=2, quantum=quantum)
    longs = [_req([1, 2, 3], 40, seed=i) for i in range(2)]
    eng.submit(longs)
    for _ in range(6):
        eng.iterate()
    small = _req([5, 6], 3, seed=9)
    eng.submit([small])
    start = eng.steps
    while not small.done:
        eng.iterate()
        assert eng.steps - start < 40, "the small request waited for a long one to finish"
    assert eng.steps - start <= quantum + 2 + 3 + 2     # a quantum, its prompt, its tokens
    assert eng.preempted >= 1
    while not all(r.done for r in longs):
        eng.iterate()
    for r in [*longs, small]:
        solo = _req(r.prompt, r.max_tokens, seed=r.sampling.seed)
        alone = Engine(gen, codec, slots=1)
        alone.submit([solo])
        while not solo.done:
            alone.iterate()
        assert r.tokens == solo.tokens and r.finish_reason == "length"


def _raw(port: int, head: bytes, body: bytes) -> bytes:
    """Send a request whose body is shorter than its Content-Length, half-close, read all."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(head + body)
        s.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def test_hangups_a_second_sigterm_and_invalid_unicode(artifact: Path) -> None:  # noqa: F811
    server = Server(artifact, "--slots", "4", "--max-tokens", "4000", "--grace", "60")
    try:
        # 13: Content-Length 100, 10 bytes, half-close: a 4xx, not an internal error
        reply = _raw(server.port, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n",
                     b'{"prompt":')
        assert reply == b"" or reply.startswith(b"HTTP/1.1 400"), reply[:200]
        assert server.metric('titanc_requests_total{code="500"}') == 0

        # text policy: lone surrogates in string fields are refused, naming the field
        for field, body in (("prompt", '{"prompt": "ab\\ud800", "max_tokens": 2}'),
                            ("stop", '{"prompt": "ab", "stop": ["\\udfff"], "max_tokens": 2}'),
                            ("model", '{"prompt": "ab", "model": "\\ud800"}'),
                            ("\\ud800", '{"prompt": "ab", "\\ud800": 1}')):
            status, _, reply_body = server.request("POST", "/v1/completions", body.encode(),
                                                   {"Content-Type": "application/json"})
            assert status == 400, (field, reply_body)
            assert reply_body["error"]["param"] == field

        # 14: streams open, SIGTERM twice 2 s apart: every stream ends with an abort chunk
        # and [DONE], no traceback, exit 0
        streams = [Stream(server, {"prompt": f"stream {i}", "max_tokens": 4000})
                   for i in range(4)]
        events = [s.events() for s in streams]
        for ev in events:
            next(ev)
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(2)
        server.proc.send_signal(signal.SIGTERM)
        for ev in events:
            rest = list(ev)
            assert rest[-1] == "[DONE]", rest[-3:]
            assert rest[-2]["choices"][0]["finish_reason"] == "abort"
        assert server.proc.wait(30) == 0
        err = server.proc.stderr.read()
        assert "Traceback" not in err and "internal error" not in err, err[-3000:]
    finally:
        server.stop()


def test_every_completion_field_is_text_checked_before_encoding() -> None:
    """The policy in completions.py, without a server: a codec that raises on lone
    surrogates (as the byte and BPE encoders do) is never reached with one."""
    from titanc.runtime.serve.completions import ApiError, Limits, parse_completion

    class Strict:
        vocab_size = 256

        def encode(self, text: str) -> list[int]:
            return list(text.encode("utf-8"))             # raises on a lone surrogate

        def decode(self, ids: list[int]) -> str:
            return bytes(ids).decode("utf-8", "replace")

    for body in ({"prompt": "\ud800"}, {"prompt": ["ok", "\udc80x"]},
                 {"prompt": "ok", "stop": "\ud801"}):
        with pytest.raises(ApiError) as e:
            parse_completion(body, Strict(), Limits())
        assert e.value.status == 400 and "not valid Unicode" in e.value.message
        json.dumps(e.value.body()).encode("utf-8")          # the reply itself is sendable
