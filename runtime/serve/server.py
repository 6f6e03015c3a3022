"""`titanc serve`: an OpenAI-compatible HTTP API (FastAPI on uvicorn) in front of the engine.

FastAPI on uvicorn because it is what the Python LLM-serving ecosystem runs its OpenAI
front ends on (vLLM's and SGLang's OpenAI servers, llama-cpp-python's server): an ASGI app,
streaming responses for server-sent events, and uvicorn's graceful shutdown. Request bodies are
validated by hand (`runtime/serve/completions.py`) rather than by pydantic models, so every refusal is
a 400 in OpenAI's error format naming the field, never FastAPI's 422.

Endpoints: POST /v1/completions, GET /v1/models, GET /health, GET /metrics (Prometheus), and
the sessions of `runtime/serve/sessions.py` (POST /v1/sessions, GET and DELETE
/v1/sessions/ID, POST /v1/sessions/ID/snapshot; a completion continues one with "session").
The engine runs in its own thread; its per-request updates reach the handler through
`loop.call_soon_threadsafe` into an asyncio queue.
"""
from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import uvicorn
from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge,
                               Histogram, generate_latest)
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from titanc.runtime.serve.completions import ApiError, CompletionParams, Limits, check_model, parse_completion
from titanc.runtime.serve.engine import Draining, Engine, QueueFull, Request, TokenLogprob, Update, random_seed
from titanc.runtime.serve.generate import Sampling
from titanc.runtime.serve.sessions import SessionStore, add_routes

POLL_S = 0.25                      # how often a waiting non-streaming handler checks the client
BODY_IDLE_S = 30.0                 # the longest wait for the next part of a request body


class Metrics:
    """Prometheus metrics of one server (its own registry, so servers do not share counts)."""

    def __init__(self, engine_ref: "list[Engine]"):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("titanc_requests", "HTTP completion requests by status code",
                                ["code"], registry=r)
        self.prompt_tokens = Counter("titanc_prompt_tokens", "prompt tokens admitted", registry=r)
        self.generated = Counter("titanc_generated_tokens", "tokens generated", registry=r)
        self.finished = Counter("titanc_finished", "completions (choices) by finish reason",
                                ["reason"], registry=r)
        self.ttft = Histogram("titanc_time_to_first_token_seconds",
                              "time from submission to the first generated token",
                              buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30),
                              registry=r)
        self.itl = Histogram("titanc_inter_token_latency_seconds",
                             "time between consecutive tokens of a request",
                             buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1),
                             registry=r)
        eng = lambda: engine_ref[0]
        Gauge("titanc_queue_depth", "requests waiting for a slot",
              registry=r).set_function(lambda: eng().queued)
        Gauge("titanc_slots_active", "slots holding a request",
              registry=r).set_function(lambda: eng().active)
        Gauge("titanc_slots", "slots in the pool", registry=r).set_function(lambda: eng().n_slots)
        Gauge("titanc_engine_steps", "batched decode steps run",
              registry=r).set_function(lambda: eng().steps)

    # engine Observer hooks (engine thread)
    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)
        self.generated.inc()

    def next_token(self, seconds: float) -> None:
        self.itl.observe(seconds)
        self.generated.inc()

    def finished_hook(self, reason: str, n_tokens: int) -> None:
        self.finished.labels(reason).inc()


class _Observer:
    def __init__(self, m: Metrics):
        self.first_token, self.next_token, self.finished = \
            m.first_token, m.next_token, m.finished_hook


# -- responses ---------------------------------------------------------------------------------

@dataclass
class _Choice:
    """One choice being assembled from engine updates."""
    index: int
    prompt: list[int]
    prompt_text: str
    echo: bool
    logprobs: bool
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    lp_tokens: list[str] = field(default_factory=list)
    lp_values: list[float | None] = field(default_factory=list)
    lp_top: list[dict[str, float] | None] = field(default_factory=list)
    lp_offset: list[int] = field(default_factory=list)
    started: bool = False

    def add(self, up: Update, codec: Any) -> tuple[str, dict | None]:
        """Absorb an update; returns the text delta and the logprobs of this delta."""
        delta = up.text
        if not self.started:
            self.started = True
            if self.echo:
                delta = self.prompt_text + delta
        self.text += delta
        self.tokens += up.tokens
        if self.finish_reason is None:
            self.finish_reason = up.finish_reason
        if not self.logprobs:
            return delta, None
        n0 = len(self.lp_tokens)
        base = len(self.prompt_text) if self.echo else 0
        if up.prompt_logprobs is not None:
            self._add_lp(up.prompt_logprobs, codec, self.prompt, 0)
        self._add_lp(up.logprobs, codec, self.tokens, base, len(self.tokens) - len(up.tokens))
        return delta, {"tokens": self.lp_tokens[n0:], "token_logprobs": self.lp_values[n0:],
                       "top_logprobs": self.lp_top[n0:], "text_offset": self.lp_offset[n0:]}

    def _add_lp(self, lps: list[TokenLogprob], codec: Any, seq: list[int], base: int,
                start: int = 0) -> None:
        for i, lp in enumerate(lps):
            self.lp_tokens.append(codec.token_str(lp.token))
            self.lp_values.append(lp.logprob)
            self.lp_top.append(None if lp.top is None else
                               {codec.token_str(t): v for t, v in lp.top.items()})
            self.lp_offset.append(base + len(codec.decode(seq[:start + i])))

    def logprobs_body(self) -> dict | None:
        if not self.logprobs:
            return None
        return {"tokens": self.lp_tokens, "token_logprobs": self.lp_values,
                "top_logprobs": self.lp_top, "text_offset": self.lp_offset}


ENDPOINTS = ("POST /v1/completions, GET /v1/models, GET /v1/models/ID, GET /health, "
             "GET /metrics, POST /v1/sessions, GET and DELETE /v1/sessions/ID, "
             "POST /v1/sessions/ID/snapshot")


def _printable(text: str, limit: int = 80) -> str:
    """A path as it may be quoted in an error: short, and valid UTF-8."""
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _error_response(err: ApiError, metrics: Metrics | None = None) -> JSONResponse:
    if metrics is not None:
        metrics.requests.labels(str(err.status)).inc()
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


async def _read_json(request: HttpRequest, limit: int) -> Any:
    """The body as JSON, refusing bodies over `limit` bytes before reading them whole."""
    length = request.headers.get("content-length")
    too_big = ApiError(400, f"the request body is larger than the server's limit of {limit} "
                            f"bytes", code="body_too_large")
    if length is not None and (not length.isdigit() or int(length) > limit):
        raise too_big if length.isdigit() else ApiError(400, "bad Content-Length header")
    chunks, size = [], 0
    stream = request.stream()
    try:
        while True:
            # a client that stops sending mid-body (fewer bytes than its Content-Length)
            # would otherwise hold its connection and this handler forever
            try:
                chunk = await asyncio.wait_for(stream.__anext__(), BODY_IDLE_S)
            except StopAsyncIteration:
                break
            except asyncio.TimeoutError:
                raise ApiError(408, f"the client sent no more of the request body for "
                                    f"{BODY_IDLE_S:g} s after {size} bytes (is Content-Length "
                                    f"right?); send the whole body", code="body_timeout",
                               headers={"Connection": "close"}) from None
            size += len(chunk)
            if size > limit:
                raise too_big
            chunks.append(chunk)
    except ClientDisconnect:                 # the client's fault, not the server's: a 4xx
        raise ApiError(400, f"the client closed the connection after {size} bytes of the body",
                       code="incomplete_body") from None
    finally:
        await stream.aclose()
    try:
        return json.loads(b"".join(chunks))
    except (ValueError, RecursionError) as exc:
        msg = str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__
        raise ApiError(400, f"the request body is not valid JSON: {msg}",
                       code="invalid_json") from None


def create_app(engine: Engine, codec: Any, model_name: str, limits: Limits,
               metrics: Metrics, sessions: SessionStore | None = None) -> FastAPI:
    """The ASGI app of one engine (sessions: memory only, 64 at most, unless given)."""
    app = FastAPI(title="titanc", docs_url=None, redoc_url=None, openapi_url=None)
    if sessions is None:
        sessions = SessionStore(engine.gen, 64)
    add_routes(app, sessions, lambda request: _read_json(request, limits.max_body_bytes),
               admitting=lambda: _admitting(engine))
    created = int(time.time())

    @app.exception_handler(ApiError)
    async def _api_error(_: HttpRequest, exc: ApiError) -> JSONResponse:
        return _error_response(exc, metrics)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: HttpRequest, exc: StarletteHTTPException) -> JSONResponse:
        # FastAPI's own 404 / 405 say only "Not Found" / "Method Not Allowed": name the
        # route asked for and the ones there are (a client of the chat API learns that this
        # server has none), and keep the Allow header of a 405
        message, path = str(exc.detail), str(request.scope.get("path", ""))
        route = f"{_printable(request.method, 16)} {_printable(path)}"
        if exc.status_code == 404:
            message = f"there is no {route}; this server serves {ENDPOINTS}"
            if path.rstrip("/").endswith("/chat/completions"):
                message += (" (a base language model without a chat template: send the "
                            "conversation as a prompt to POST /v1/completions, or keep it "
                            "on the server with POST /v1/sessions)")
        elif exc.status_code == 405:
            allow = (exc.headers or {}).get("Allow") or (exc.headers or {}).get("allow")
            message = f"{route} is not allowed" + (f"; use {allow}" if allow else "")
        return _error_response(ApiError(exc.status_code, message,
                                        code="not_found" if exc.status_code == 404 else None,
                                        headers=dict(exc.headers or {})))

    @app.exception_handler(Exception)
    async def _internal(_: HttpRequest, exc: Exception) -> JSONResponse:   # a bug, still JSON
        print(f"titanc serve: internal error: {exc!r}", file=sys.stderr)
        return _error_response(ApiError(500, "internal server error", kind="server_error"),
                               metrics)

    @app.get("/health")
    async def health() -> JSONResponse:
        status = ("error" if engine.error is not None else
                  "draining" if engine.draining else "ok")
        body = {"status": status, "slots": engine.n_slots, "active": engine.active,
                "queued": engine.queued, "steps": engine.steps}
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [
            {"id": model_name, "object": "model", "created": created, "owned_by": "titanc"}]})

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> JSONResponse:
        check_model(model, [model_name])
        return JSONResponse({"id": model_name, "object": "model", "created": created,
                             "owned_by": "titanc"})

    @app.post("/v1/completions")
    async def completions(request: HttpRequest) -> Response:
        body = await _read_json(request, limits.max_body_bytes)
        params = parse_completion(body, codec, limits)
        check_model(body.get("model"), [model_name])
        loop = asyncio.get_running_loop()
        if engine.deliver is None:
            engine.deliver = _deliverer(loop)
        channel: asyncio.Queue[tuple[int, Update]] = asyncio.Queue()
        reqs, choices = _make_requests(params, codec, channel)
        if len(reqs) > engine.max_queue:
            raise ApiError(400, f"prompts x n = {len(reqs)} completions is more than the "
                                f"server queues at once ({engine.max_queue})", param="n")
        session = (sessions.begin(params.session, reqs[0]) if params.session is not None
                   else None)
        try:
            engine.submit(reqs)
        except QueueFull as exc:
            sessions.release(session)
            raise ApiError(429, f"the server is busy ({exc}); retry later",
                           kind="rate_limit_error", code="queue_full",
                           headers={"Retry-After": "1"}) from None
        except Draining:
            sessions.release(session)
            raise _draining() from None
        metrics.prompt_tokens.inc(sum(map(len, params.prompts)))
        metrics.requests.labels("200").inc()
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                "created": int(time.time()), "model": model_name}
        if params.stream:
            return _SSEResponse(_stream(engine, codec, params, reqs, choices, channel, head),
                                media_type="text/event-stream",
                                headers={"Cache-Control": "no-cache"})
        return await _complete(engine, codec, params, reqs, choices, channel, head, request)

    return app


def _draining() -> ApiError:
    return ApiError(503, "the server is shutting down", kind="server_error", code="draining")


def _admitting(engine: Engine) -> None:
    """Refuse new work (a session) while the engine drains or after it stopped."""
    if engine.draining:
        raise _draining()


def _make_requests(params: CompletionParams, codec: Any, channel: asyncio.Queue) -> tuple[list[Request], list[_Choice]]:
    """One engine request per (prompt, choice); choice i of a seeded request uses seed + i."""
    reqs, choices = [], []
    for p, (prompt, text) in enumerate(zip(params.prompts, params.prompt_texts)):
        for j in range(params.n):
            index = p * params.n + j
            seed = random_seed() if params.seed is None else (params.seed + j) % (1 << 64)
            sampling = Sampling(params.temperature, params.top_k, params.top_p, seed, params.stop)
            reqs.append(Request(prompt, params.max_tokens, sampling,
                                on_update=lambda up, i=index: channel.put_nowait((i, up)),
                                logprobs=params.logprobs, echo=params.echo))
            choices.append(_Choice(index, prompt, text, params.echo, params.logprobs is not None))
    return reqs, choices


def _deliverer(loop: asyncio.AbstractEventLoop) -> Any:
    """The engine's `deliver`: one thread-safe call into the event loop per engine iteration,
    which runs every request's on_update (a put into its handler's queue) there."""
    def run(batch: list[tuple[Request, Update]]) -> None:
        for r, update in batch:
            r.on_update(update)

    def deliver(batch: list[tuple[Request, Update]]) -> None:
        try:
            loop.call_soon_threadsafe(run, batch)
        except RuntimeError:                  # loop closed at shutdown: nobody is listening
            pass
    return deliver


def _usage(params: CompletionParams, choices: list[_Choice]) -> dict[str, int]:
    prompt = sum(map(len, params.prompts))
    done = sum(len(c.tokens) for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}


async def _complete(engine: Engine, codec: Any, params: CompletionParams, reqs: list[Request],
                    choices: list[_Choice], channel: asyncio.Queue, head: dict,
                    request: HttpRequest) -> JSONResponse:
    """Wait for every choice; a client that goes away cancels them. The client is checked
    every POLL_S seconds whether or not tokens keep arriving (a check only when none came
    for POLL_S would never happen while a long completion streams in)."""
    loop = asyncio.get_running_loop()
    try:
        left = len(choices)
        check_at = loop.time() + POLL_S
        while left:
            wait = check_at - loop.time()
            if wait > 0:
                try:
                    i, up = await asyncio.wait_for(channel.get(), wait)
                except asyncio.TimeoutError:
                    pass
                else:
                    choices[i].add(up, codec)
                    left -= up.finish_reason is not None
                    continue
            if await request.is_disconnected():
                return JSONResponse({}, status_code=499)
            check_at = loop.time() + POLL_S
    finally:
        for r in reqs:
            if not r.done:
                engine.cancel(r)
    body = dict(head, choices=[{"text": c.text, "index": c.index,
                                "logprobs": c.logprobs_body(),
                                "finish_reason": c.finish_reason} for c in choices],
                usage=_usage(params, choices))
    return JSONResponse(body)


async def _stream(engine: Engine, codec: Any, params: CompletionParams, reqs: list[Request],
                  choices: list[_Choice], channel: asyncio.Queue,
                  head: dict) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chunk format, one per token, then `data: [DONE]`."""
    try:
        left = len(choices)
        while left:
            i, up = await channel.get()
            delta, lp = choices[i].add(up, codec)
            chunk = dict(head, choices=[{"text": delta, "index": i, "logprobs": lp,
                                         "finish_reason": up.finish_reason}])
            yield f"data: {json.dumps(chunk)}\n\n"
            left -= up.finish_reason is not None
        if params.include_usage:
            yield f"data: {json.dumps(dict(head, choices=[], usage=_usage(params, choices)))}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        for r in reqs:
            if not r.done:
                engine.cancel(r)


class _SSEResponse(StreamingResponse):
    """A streaming response that always closes its generator (so a disconnect cancels the
    engine requests at once, not when the generator is garbage-collected)."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()         # type: ignore[attr-defined]


# -- the process -------------------------------------------------------------------------------

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


def serve(source: str, host: str = "127.0.0.1", port: int = 8000, slots: int = 8,
          max_queue: int = 64, limits: Limits = Limits(), grace: float = 30.0,
          model_name: str | None = None, prefill_budget: int | None = None,
          log_level: str = "warning", max_sessions: int = 64,
          sessions_dir: str | None = None) -> int:
    """Load a run or artifact, warm the engine up and serve until SIGTERM; returns 0."""
    import titanc

    from titanc.runtime.serve.codec import TokenizerCodec
    from titanc.runtime.serve.generate import Generator
    from titanc.runtime.train.rundir import run_tokenizer

    _check_address(host, port)
    tok = run_tokenizer(source)                  # the run's own, checked against its record
    prog = titanc.load(source)
    codec = TokenizerCodec(tok, prog.spec.model.vocab_size)
    engine_ref: list[Engine] = []
    metrics = Metrics(engine_ref)
    gen = Generator(prog, codec.tok)
    check_serving_fits(gen, slots, limits, max_queue)
    sessions = SessionStore(gen, max_sessions, sessions_dir)
    engine = Engine(gen, codec, slots, max_queue, prefill_budget, observer=_Observer(metrics))
    engine_ref.append(engine)
    warm_up(engine)
    engine.start()
    name = model_name or prog.spec.name
    app = create_app(engine, codec, name, limits, metrics, sessions)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=5, lifespan="off")
    server = DrainingServer(config, engine, grace)
    try:
        server.run()
    finally:
        engine.stop()
    return 0


def check_serving_fits(gen: Generator, slots: int, limits: Limits, max_queue: int = 0) -> None:
    """The slot pool and the slots' prefill states (measured on a batch-1 decoding state of
    `gen`), a step's logits, and the longest requests the limits admit (running and queued)
    must fit in memory, checked before the pool is allocated."""
    from titanc.runtime.capacity import TOKEN_BYTES, check_fits

    st = gen.new_state(1)
    one = sum(t.numel() * t.element_size()
              for t in [*st.tensors.values(), *st.pending.values(), st.slot_pos])
    spec = gen.prog.spec
    per_request = limits.max_prompt_tokens + limits.max_tokens
    need = (2 * slots * one + slots * spec.model.vocab_size * 4
            + (slots + max_queue) * per_request * TOKEN_BYTES)
    check_fits(need, spec, lower=True,
               reduce=f"--slots ({slots}), --max-queue, --max-prompt-tokens or --max-tokens")


def _check_address(host: str, port: int) -> None:
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


def warm_up(engine: Engine) -> None:
    """Run one request through every graph the engine uses (chunk prefill, token prefill,
    batched decode, memory writes), so the first client does not pay for building them."""
    chunk, observer = engine.gen.chunk, engine.observer
    engine.observer = None
    r = Request([0] * (chunk + 1), chunk + 1, Sampling(temperature=0.0), on_update=lambda u: None)
    engine.submit([r])
    while not r.done:
        engine.iterate()
    engine.iterate()
    engine.steps, engine.observer = 0, observer
