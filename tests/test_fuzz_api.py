"""Hypothesis over the HTTP API: random JSON bodies for POST /v1/completions (known fields
with values of every JSON type, huge integers, nan, lone surrogates, unknown fields, nesting)
and raw bodies that are not JSON or not UTF-8, sent to the real ASGI app of a running engine.
Every answer is a 2xx or a 4xx with OpenAI's error body naming a message, never a 5xx, and
arrives in bounded time; the GET endpoints are hit the same way.

The app is called in-process through the ASGI interface (one event loop for the module, as
a server has); the engine thread is the server's own; the limits keep a valid request to a
few tokens."""
from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any, Iterator

import pytest

import titanc
from titanc.runtime.serve.codec import codec_for
from titanc.runtime.serve.completions import Limits
from titanc.runtime.serve.engine import Engine
from titanc.runtime.serve.generate import Generator
from titanc.runtime.serve.server import Metrics, _Observer, create_app

from .test_serve import MODEL

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

REQUEST_S = 60                   # an answer that takes longer is a hang
LIMITS = Limits(max_prompt_tokens=64, max_tokens=4, max_body_bytes=1 << 16)


class App:
    def __init__(self, artifact: Path):  # noqa: F811
        prog = titanc.load(artifact)
        codec = codec_for(prog, artifact)
        ref: list[Engine] = []
        self.metrics = Metrics(ref)
        self.engine = Engine(Generator(prog), codec, 4, 8, observer=_Observer(self.metrics))
        ref.append(self.engine)
        self.engine.start()
        self.app = create_app(self.engine, codec, MODEL, LIMITS, self.metrics)
        self.loop = asyncio.new_event_loop()

    def call(self, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
        return self.loop.run_until_complete(asyncio.wait_for(self._call(method, path, body),
                                                             REQUEST_S))

    async def _call(self, method: str, path: str, body: bytes) -> tuple[int, bytes]:
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                 "method": method, "path": path, "raw_path": path.encode(),
                 "query_string": b"", "root_path": "", "scheme": "http",
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
                 "headers": [(b"content-type", b"application/json"),
                             (b"content-length", str(len(body)).encode())]}
        inbox = [{"type": "http.request", "body": body, "more_body": False}]
        sent: list[dict] = []

        async def receive() -> dict:
            if inbox:
                return inbox.pop()
            await asyncio.sleep(REQUEST_S)          # the client stays connected
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            sent.append(message)

        await self.app(scope, receive, send)
        start = next(m for m in sent if m["type"] == "http.response.start")
        return start["status"], b"".join(m.get("body", b"") for m in sent
                                         if m["type"] == "http.response.body")

    def close(self) -> None:
        self.engine.stop()
        self.loop.close()


@pytest.fixture(scope="module")
def app(artifact: Path) -> Iterator[App]:  # noqa: F811
    a = App(artifact)
    yield a
    a.close()


TEXT = st.text(st.characters(exclude_categories=()), max_size=16)      # lone surrogates too
INTS = st.one_of(st.integers(-3, 20), st.integers(),
                 st.sampled_from([2**31, 2**63, 2**64, -2**63 - 1, 10**30, 10**400]))
SCALARS = st.one_of(st.none(), st.booleans(), INTS, TEXT,
                    st.floats(allow_nan=True, allow_infinity=True))
JSON = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                     st.dictionaries(TEXT, inner, max_size=3)),
                    max_leaves=12)
FIELDS = ["model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n",
          "stream", "stream_options", "logprobs", "echo", "best_of", "suffix",
          "presence_penalty", "frequency_penalty", "logit_bias", "user"]
PROMPT = st.one_of(TEXT, st.lists(INTS, max_size=6), st.lists(TEXT, max_size=3), JSON)


def _dumps(obj: Any) -> bytes:
    """JSON as a client would send it; nan/inf as the non-standard literals some send."""
    return json.dumps(obj).encode()


BODIES = st.one_of(
    st.fixed_dictionaries({"prompt": PROMPT}, optional={f: JSON for f in FIELDS if f != "prompt"}).map(_dumps),
    st.dictionaries(TEXT, JSON, max_size=4).map(_dumps),
    JSON.map(_dumps),
    st.binary(max_size=40),                                      # not JSON, not UTF-8
)


def _check(status: int, body: bytes) -> None:
    event(f"status {status}")
    assert status < 500, body[:300]
    if status >= 400:
        err = json.loads(body)["error"]
        assert isinstance(err["message"], str) and "\n" not in err["message"]
        assert len(err["message"]) < 1000
    elif body.startswith(b"data: "):
        assert body.rstrip().endswith(b"data: [DONE]"), body[-200:]
    else:
        choices = json.loads(body)["choices"]
        assert all(math.isfinite(len(c["text"])) for c in choices)


@settings(max_examples=80, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(body=BODIES)
def test_every_completion_body_gets_a_2xx_or_a_4xx(app: App, body: bytes) -> None:
    _check(*app.call("POST", "/v1/completions", body))


@pytest.mark.parametrize("method,path", [("GET", "/health"), ("GET", "/v1/models"),
                                         ("GET", "/metrics"), ("POST", "/health"),
                                         ("GET", "/v1/completions"), ("GET", "/nope\udcff")])
def test_other_endpoints_answer_without_a_5xx(app: App, method: str, path: str) -> None:
    status, _ = app.call(method, path.encode("utf-8", "surrogateescape").decode("latin-1"))
    assert status < 500
    assert app.metrics.requests.labels("500")._value.get() == 0
