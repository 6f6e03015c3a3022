"""`titanc serve`: the real server on 127.0.0.1 (a subprocess on a free port), the official
`openai` client, continuous batching under 32 concurrent clients, disconnects, hostile
requests, 429, SIGTERM draining; and the engine driven step by step in-process.

The model is a 1-layer MAC of width 32 in float64 with fresh weights (an artifact directory):
its text is random bytes, which is fine for equality tests and exercises the UTF-8 handling.
Every client call has a timeout; the server is stopped at the end.
"""
from __future__ import annotations

import http.client
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import pytest

import titanc
from titanc.tools.cli import main
from titanc.runtime.serve.codec import TokenizerCodec, codec_for
from titanc.runtime.serve.engine import Engine, Request
from titanc.runtime.serve.generate import Generator, Sampling
from tests.helpers import SERVE_SETS

openai = pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parents[1]
SETS = SERVE_SETS                # the `artifact` fixture (tests/conftest.py) compiles these
MODEL = "tiny-mac"
TIMEOUT = 60.0


class Server:
    def __init__(self, artifact: Path, *extra: str):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "titanc", "serve", str(artifact), "--port", "0",
             "--threads", "1", *extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [lines.put(x) for x in self.proc.stdout],  # type: ignore
                         daemon=True).start()
        deadline = time.monotonic() + 120
        while True:
            try:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                self.stop()
                raise AssertionError("titanc serve did not start: " + self.proc.stderr.read())
            if "listening on" in line:
                self.port = int(line.rsplit(":", 1)[1])
                break
        self.base = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def conn(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=TIMEOUT)

    def request(self, method: str, path: str, body: bytes | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, dict, Any]:
        c = self.conn()
        try:
            c.request(method, path, body=body, headers=headers or {})
            r = c.getresponse()
            data = r.read()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, json.loads(data) if data else None
        finally:
            c.close()

    def post(self, body: Any) -> tuple[int, dict, Any]:
        return self.request("POST", "/v1/completions", json.dumps(body).encode(),
                            {"Content-Type": "application/json"})

    def health(self) -> dict:
        return self.request("GET", "/health")[2]

    def metric(self, name: str) -> float:
        c = self.conn()
        try:
            c.request("GET", "/metrics")
            text = c.getresponse().read().decode()
        finally:
            c.close()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name + " ") or line.startswith(name + "{")
                   if not line.startswith("#"))

    def wait_for(self, pred: Any, what: str, limit: float = 15.0) -> dict:
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            h = self.health()
            if pred(h):
                return h
            time.sleep(0.02)
        raise AssertionError(f"timed out waiting for {what}: {self.health()}")


class Stream:
    """A raw SSE completion stream over http.client (so a test can drop it mid-way)."""

    def __init__(self, server: Server, body: dict):
        self.c = server.conn()
        self.c.request("POST", "/v1/completions", json.dumps(dict(body, stream=True)).encode(),
                       {"Content-Type": "application/json"})
        self.r = self.c.getresponse()
        assert self.r.status == 200, self.r.read()

    def events(self) -> Iterator[Any]:
        while True:
            line = self.r.readline()
            if not line:
                return
            line = line.strip()
            if line.startswith(b"data: "):
                data = line[6:]
                yield "[DONE]" if data == b"[DONE]" else json.loads(data)

    def close(self) -> None:
        self.c.sock.close() if self.c.sock else None
        self.c.close()


@pytest.fixture(scope="module")
def server(artifact: Path) -> Iterator[Server]:
    s = Server(artifact, "--slots", "8", "--max-queue", "40", "--max-prompt-tokens", "512",
               "--max-tokens", "4000", "--max-body-bytes", "65536", "--grace", "5")
    yield s
    s.stop()


@pytest.fixture()
def client(server: Server) -> Any:
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", timeout=TIMEOUT,
                         max_retries=0)


def test_openai_client_matches_titanc_generate(server: Server, client: Any, artifact: Path,
                                               capsys: pytest.CaptureFixture) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    prompt = "The memory of"
    kw = dict(model=MODEL, prompt=prompt, max_tokens=24, temperature=0.8, seed=11)
    res = client.completions.create(**kw)
    choice = res.choices[0]
    assert choice.finish_reason == "length"
    assert (res.usage.prompt_tokens, res.usage.completion_tokens) == (len(prompt.encode()), 24)
    chunks = list(client.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert chunks[-1].choices[0].finish_reason == "length"
    capsys.readouterr()
    assert main(["generate", str(artifact), "--prompt", prompt, "--max-new-tokens", "24",
                 "--temperature", "0.8", "--seed", "11"]) == 0
    assert capsys.readouterr().out == prompt + choice.text + "\n"
    echo = client.completions.create(**kw, echo=True, logprobs=3)
    assert echo.choices[0].text == prompt + choice.text
    lp = echo.choices[0].logprobs
    assert len(lp.tokens) == len(prompt.encode()) + 24 and lp.token_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:]) and len(lp.top_logprobs[5]) == 3


def _first_ascii(text: str, start: int) -> str | None:
    for ch in text[start:]:
        if ch.isascii() and ch.isalnum():
            return ch
    return None


def test_32_concurrent_clients_equal_their_solo_runs(server: Server, client: Any) -> None:
    """Mixed streaming, prompt lengths and stop sequences against 8 slots: every output
    equals the same request run alone, and the engine really batched (steps << tokens)."""
    base = "Titans learn to memorize at test time. " * 8
    specs = [dict(model=MODEL, prompt=base[:1 + (i * 37) % 150], max_tokens=12 + 8 * (i % 3),
                  temperature=0.9, seed=100 + i) for i in range(32)]
    solo = [client.completions.create(**s).choices[0].text for s in specs]
    want = []
    for i, s in enumerate(specs):
        stop = _first_ascii(solo[i], 4) if i % 3 == 1 else None   # streaming ones too
        if stop is not None:
            s["stop"] = [stop, "\n\n\n"]
        want.append((solo[i][:solo[i].find(stop)], "stop") if stop else (solo[i], "length"))
    assert sum(r == "stop" for _, r in want) >= 4
    assert any(r == "stop" for _, r in want[::2])          # some streamed ones stop too

    def run(i: int) -> tuple[str, str]:
        if i % 2 == 0:
            chunks = list(client.completions.create(**specs[i], stream=True))
            return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        c = client.completions.create(**specs[i]).choices[0]
        return c.text, c.finish_reason

    peak, stop_watch = [0, 0], threading.Event()

    def watch() -> None:
        while not stop_watch.is_set():
            h = server.health()
            peak[0], peak[1] = max(peak[0], h["active"]), max(peak[1], h["queued"])
            time.sleep(0.01)

    steps0, tokens0 = server.health()["steps"], server.metric("titanc_generated_tokens_total")
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    with ThreadPoolExecutor(32) as pool:
        futures = [pool.submit(run, i) for i in range(32)]
        got = [f.result(timeout=180) for f in futures]
    stop_watch.set()
    watcher.join(10)
    assert got == want
    steps = server.health()["steps"] - steps0
    tokens = server.metric("titanc_generated_tokens_total") - tokens0
    assert tokens >= sum(len(w[0]) for w in want) * 0.5
    assert steps < tokens / 3, (steps, tokens)        # ~8 tokens per batched step
    assert peak[0] == 8 and peak[1] > 0, peak
    assert server.health()["active"] == 0
    assert server.metric("titanc_slots") == 8 and server.metric("titanc_queue_depth") == 0
    assert server.metric("titanc_slots_active") == 0
    assert server.metric("titanc_time_to_first_token_seconds_count") >= 64
    assert server.metric("titanc_inter_token_latency_seconds_count") >= tokens - 64
    assert server.metric("titanc_requests_total") >= 64


def test_disconnects_free_their_slots(server: Server) -> None:
    aborted = server.metric("titanc_finished_total")
    streams = [Stream(server, {"prompt": f"client {i}", "max_tokens": 4000, "seed": i})
               for i in range(5)]
    for s in streams:
        events = s.events()
        for _ in range(2):
            assert next(events)["choices"][0]["finish_reason"] is None
    assert server.health()["active"] == 5
    for s in streams:
        s.close()
    h = server.wait_for(lambda h: h["active"] == 0 and h["queued"] == 0, "freed slots")
    assert server.metric("titanc_finished_total") - aborted == 5
    time.sleep(0.2)
    assert server.health()["steps"] == h["steps"]      # idle: nothing left decoding


def test_full_queue_answers_429(server: Server) -> None:
    # 2 prompts x n=16 = 32 completions: 8 in slots, 24 waiting (limit 40)
    big = Stream(server, {"prompt": ["a", "b"], "n": 16, "max_tokens": 4000})
    next(big.events())
    assert server.health()["queued"] == 24
    status, headers, body = server.post({"prompt": ["x", "y"], "n": 9, "max_tokens": 4})
    assert status == 429 and headers["retry-after"] == "1"
    assert body["error"]["type"] == "rate_limit_error"
    status, _, body = server.post({"prompt": ["x"] * 3, "n": 14, "max_tokens": 4})
    assert status == 400 and body["error"]["param"] == "n"       # can never fit: not a 429
    big.close()
    server.wait_for(lambda h: h["active"] == 0 and h["queued"] == 0, "cancelled queue")


HOSTILE: list[tuple[str, bytes | None, str, str, int, str | None]] = [
    # (kind, body, method, path, status, param)
    ("malformed JSON", b'{"prompt": "a",', "POST", "/v1/completions", 400, None),
    ("not an object", b"[1, 2, 3]", "POST", "/v1/completions", 400, None),
    ("invalid UTF-8", b'{"prompt": "\xff\xfe"}', "POST", "/v1/completions", 400, None),
    ("deeply nested", b"[" * 60000 + b"]" * 60000, "POST", "/v1/completions", 400, None),
    ("body over the limit", b'{"prompt": "' + b"a" * 70000 + b'"}', "POST", "/v1/completions",
     400, None),
    ("missing prompt", b'{"max_tokens": 4}', "POST", "/v1/completions", 400, "prompt"),
    ("empty prompt", b'{"prompt": ""}', "POST", "/v1/completions", 400, "prompt"),
    ("prompt of wrong type", b'{"prompt": 42}', "POST", "/v1/completions", 400, "prompt"),
    ("prompt too long", json.dumps({"prompt": "x" * 600}).encode(), "POST", "/v1/completions",
     400, "prompt"),
    ("token id outside vocab", b'{"prompt": [1, 999]}', "POST", "/v1/completions", 400, "prompt"),
    ("negative max_tokens", b'{"prompt": "a", "max_tokens": -1}', "POST", "/v1/completions",
     400, "max_tokens"),
    ("max_tokens too large", b'{"prompt": "a", "max_tokens": 100000}', "POST",
     "/v1/completions", 400, "max_tokens"),
    ("max_tokens as string", b'{"prompt": "a", "max_tokens": "8"}', "POST", "/v1/completions",
     400, "max_tokens"),
    ("max_tokens as bool", b'{"prompt": "a", "max_tokens": true}', "POST", "/v1/completions",
     400, "max_tokens"),
    ("huge integer", b'{"prompt": "a", "max_tokens": ' + b"9" * 5000 + b"}", "POST",
     "/v1/completions", 400, None),
    ("negative temperature", b'{"prompt": "a", "temperature": -0.5}', "POST",
     "/v1/completions", 400, "temperature"),
    ("NaN temperature", b'{"prompt": "a", "temperature": NaN}', "POST", "/v1/completions",
     400, "temperature"),
    ("top_p zero", b'{"prompt": "a", "top_p": 0}', "POST", "/v1/completions", 400, "top_p"),
    ("top_k not an integer", b'{"prompt": "a", "top_k": 2.5}', "POST", "/v1/completions",
     400, "top_k"),
    ("n zero", b'{"prompt": "a", "n": 0}', "POST", "/v1/completions", 400, "n"),
    ("logprobs too many", b'{"prompt": "a", "logprobs": 1000}', "POST", "/v1/completions",
     400, "logprobs"),
    ("stop of wrong type", b'{"prompt": "a", "stop": 7}', "POST", "/v1/completions", 400,
     "stop"),
    ("too many stops", json.dumps({"prompt": "a", "stop": list("abcdef")}).encode(), "POST",
     "/v1/completions", 400, "stop"),
    ("seed out of range", b'{"prompt": "a", "seed": 1e30}', "POST", "/v1/completions", 400,
     "seed"),
    ("stream not a bool", b'{"prompt": "a", "stream": "yes"}', "POST", "/v1/completions", 400,
     "stream"),
    ("unknown field", b'{"prompt": "a", "max_tokenz": 4}', "POST", "/v1/completions", 400,
     "max_tokenz"),
    ("unsupported suffix", b'{"prompt": "a", "suffix": "z"}', "POST", "/v1/completions", 400,
     "suffix"),
    ("unknown model", b'{"prompt": "a", "model": "gpt-9"}', "POST", "/v1/completions", 404,
     "model"),
    ("wrong method", None, "GET", "/v1/completions", 405, None),
    ("unknown path", None, "GET", "/v1/../../etc/passwd", 404, None),
]


def test_malformed_and_hostile_requests_get_4xx_json(server: Server) -> None:
    kinds = set()
    for kind, body, method, path, status, param in HOSTILE:
        code, headers, got = server.request(method, path, body,
                                            {"Content-Type": "application/json"})
        assert code == status, (kind, code, got)
        assert headers["content-type"].startswith("application/json"), kind
        err = got["error"]
        assert isinstance(err["message"], str) and err["message"] and "type" in err, kind
        if param is not None:
            assert err["param"] == param, (kind, err)
        kinds.add(kind)
    assert len(kinds) >= 15
    assert server.health()["status"] == "ok"
    status, _, ok = server.post({"prompt": "still alive", "max_tokens": 3})
    assert status == 200 and ok["usage"]["completion_tokens"] == 3


# -- the engine, driven step by step ------------------------------------------------------------

@pytest.fixture(scope="module")
def engine_parts(artifact: Path) -> tuple[Generator, TokenizerCodec]:
    prog = titanc.load(artifact)
    return Generator(prog), codec_for(prog, artifact)


def _req(prompt: list[int], max_tokens: int, seed: int = 0) -> Request:
    return Request(prompt, max_tokens, Sampling(0.9, seed=seed), on_update=lambda u: None)


def test_cancel_frees_the_slot_before_the_next_step(engine_parts: Any) -> None:
    gen, codec = engine_parts
    eng = Engine(gen, codec, slots=2)
    a, b = _req([1, 2, 3], 100), _req([4, 5], 100, seed=1)
    eng.submit([a, b])
    for _ in range(10):                               # prompts fed, a few tokens out
        eng.iterate()
    assert eng.active == 2 and len(a.tokens) >= 2 and len(b.tokens) >= 2
    eng.cancel(a)
    steps, n_a, n_b = eng.steps, len(a.tokens), len(b.tokens)
    eng.iterate()                                     # one iteration = one decode step
    assert eng.slots[0] is None and a.finish_reason == "abort" and len(a.tokens) == n_a
    assert eng.steps == steps + 1 and len(b.tokens) == n_b + 1
    c = _req([9], 50)                                 # the freed slot is reused at once
    eng.submit([c])
    eng.iterate()
    assert eng.slots[0] is c


def test_long_prefill_is_chunked_between_decode_steps(engine_parts: Any) -> None:
    gen, codec = engine_parts
    eng = Engine(gen, codec, slots=2, prefill_budget=gen.chunk)
    short = _req([1, 2], 50)
    eng.submit([short])
    eng.iterate()
    long = _req(list(range(200)), 5)
    eng.submit([long])
    iterations = 0
    while not long.tokens:
        before = len(short.tokens)
        eng.iterate()
        iterations += 1
        assert len(short.tokens) == before + 1        # decoding never stalls
    assert iterations >= 200 // gen.chunk            # the prompt went in chunk by chunk
    alone = Engine(gen, codec, slots=2)
    solo = _req(list(range(200)), 5)
    alone.submit([solo])
    while not solo.done:
        alone.iterate()
    while not long.done:
        eng.iterate()
    assert long.tokens == solo.tokens


def test_sigterm_drains_then_exits_0(artifact: Path, server: Server) -> None:
    """Runs last on the shared server: a short request finishes within the grace period, a
    long one is cancelled when it ends, new requests get 503, and the process exits 0."""
    short = Stream(server, {"prompt": "short", "max_tokens": 30})
    long = Stream(server, {"prompt": "long", "max_tokens": 4000})
    ev_short, ev_long = short.events(), long.events()
    next(ev_short), next(ev_long)
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    status, _, body = server.post({"prompt": "late", "max_tokens": 2})
    assert status == 503 and body["error"]["code"] == "draining"
    rest_short, rest_long = list(ev_short), list(ev_long)
    assert rest_short[-1] == "[DONE]" and rest_long[-1] == "[DONE]"
    assert rest_short[-2]["choices"][0]["finish_reason"] == "length"
    assert len(rest_short) == 30                     # 29 more tokens + [DONE]
    assert rest_long[-2]["choices"][0]["finish_reason"] == "abort"
    assert server.proc.wait(30) == 0


def test_serve_cli_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import socket

    assert main(["serve", str(tmp_path / "missing"), "--port", "0"]) == 2
    assert "no such run directory" in capsys.readouterr().err
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", str(tmp_path), "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("titanc: error: --host/--port: cannot listen") and err.count("\n") == 1
