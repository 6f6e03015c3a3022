"""`titanc serve`: an OpenAI-compatible HTTP API (FastAPI on uvicorn) in front of the engine.

FastAPI on uvicorn because it is what the Python LLM-serving ecosystem runs its OpenAI
front ends on (vLLM's and SGLang's OpenAI servers, llama-cpp-python's server): an ASGI app,
streaming responses for server-sent events, and uvicorn's graceful shutdown. Request bodies are
validated by hand (`runtime/serve/completions.py`) rather than by pydantic models, so every refusal is
a 400 in OpenAI's error format naming the field, never FastAPI's 422.

Endpoints: POST /v1/completions, POST /v1/chat/completions (with the run's chat template:
`runtime/serve/chat.py`), GET /v1/models, GET /health, GET /metrics (Prometheus), and
the sessions of `runtime/serve/sessions.py` (POST /v1/sessions, GET and DELETE
/v1/sessions/ID, POST /v1/sessions/ID/snapshot; a completion continues one with "session").
The engine runs in its own thread; its per-request updates reach the handler through
`loop.call_soon_threadsafe` into an asyncio queue.

Around the routes: `runtime/serve/guard.py` (API key, Host and Origin checks, JSON bodies only),
`runtime/serve/responses.py` (a choice assembled in linear time; the response-size bound
checked before a request runs; bodies rendered off the event loop, never with NaN), and
`runtime/serve/process.py` (draining shutdown, header-read timeout). A session's turn is
committed only once its response is made; on shutdown `serve` writes every live session to
`--sessions-dir`.
"""
from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

import uvicorn
from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge,
                               Histogram, generate_latest)
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from titanc.runtime.serve.chat import (ChatShape, ChatTemplate, add_chat_route,
                                       load_chat_template)
from titanc.runtime.serve.completions import (ApiError, CompletionParams, Limits, check_model,
                                               parse_completion)
from titanc.runtime.serve.engine import Draining, Engine, QueueFull, Request, Update, random_seed
from titanc.runtime.serve.generate import Generator, Sampling
from titanc.runtime.serve.guard import Access, Guard, exposure_warning
from titanc.runtime.serve.process import (HEADER_TIMEOUT_S, DrainingServer, check_address,
                                          header_timeout_protocol)
from titanc.runtime.serve.responses import Choice, render, response_bound
from titanc.runtime.serve.request_log import RequestLog
from titanc.runtime.serve.sessions import Session, SessionStore, StoreLimits, add_routes

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
               metrics: Metrics, sessions: SessionStore | None = None,
               access: Access | None = None, chat: ChatTemplate | None = None) -> Any:
    """The ASGI app of one engine behind its `Guard` (runtime/serve/guard.py: default, no key,
    Host and Origin checks for 127.0.0.1); sessions: memory only, 64 at most, unless given;
    chat: the run's chat template (runtime/serve/chat.py), without it the chat route is a 404."""
    app = FastAPI(title="titanc", docs_url=None, redoc_url=None, openapi_url=None)
    if sessions is None:
        sessions = SessionStore(engine.gen, 64)
    add_routes(app, sessions, lambda request: _read_json(request, limits.max_body_bytes),
               admitting=lambda: _admitting(engine))
    _add_error_handlers(app, metrics)
    _add_info_routes(app, engine, model_name, metrics)
    _add_completions(app, engine, codec, model_name, limits, metrics, sessions, chat)
    return Guard(app, access if access is not None else Access())


def _add_error_handlers(app: FastAPI, metrics: Metrics) -> None:
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


def _add_info_routes(app: FastAPI, engine: Engine, model_name: str, metrics: Metrics) -> None:
    created = int(time.time())
    card = {"id": model_name, "object": "model", "created": created, "owned_by": "titanc"}

    @app.get("/health")
    async def health() -> JSONResponse:
        status = ("error" if engine.error is not None else
                  "draining" if engine.draining else "ok")
        body = {"status": status, "slots": engine.n_slots, "active": engine.active,
                "queued": engine.queued, "steps": engine.steps, "failures": engine.failures}
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [card]})

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> JSONResponse:
        check_model(model, [model_name])
        return JSONResponse(card)


def _add_completions(app: FastAPI, engine: Engine, codec: Any, model_name: str, limits: Limits,
                     metrics: Metrics, sessions: SessionStore,
                     chat: ChatTemplate | None = None) -> None:
    @app.post("/v1/completions")
    async def completions(request: HttpRequest) -> Response:
        body = await _read_json(request, limits.max_body_bytes)
        return await run(request, body, parse_completion(body, codec, limits), None)

    async def run(request: HttpRequest, body: dict, params: CompletionParams,
                  shape: ChatShape | None) -> Response:
        """A checked request through the engine; `shape` writes a chat response."""
        check_model(body.get("model"), [model_name])
        _check_response_size(params, codec, limits)
        loop = asyncio.get_running_loop()
        if engine.deliver is None:
            engine.deliver = _deliverer(loop)
        channel: asyncio.Queue[tuple[int, Update]] = asyncio.Queue()
        reqs, choices = _make_requests(params, codec, channel)
        if len(reqs) > engine.max_queue:
            raise ApiError(400, f"prompts x n = {len(reqs)} completions is more than the "
                                f"server queues at once ({engine.max_queue})", param="n")
        turn = _Turn(sessions, sessions.begin(params.session, reqs[0])
                     if params.session is not None else None, reqs[0])
        try:
            engine.submit(reqs)
        except QueueFull as exc:
            turn.end(False)
            raise ApiError(429, f"the server is busy ({exc}); retry later",
                           kind="rate_limit_error", code="queue_full",
                           headers={"Retry-After": "1"}) from None
        except Draining:
            turn.end(False)
            raise _draining() from None
        metrics.prompt_tokens.inc(sum(map(len, params.prompts)))
        metrics.requests.labels("200").inc()
        head = shape.head(model_name, params.stream) if shape else {
            "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
            "created": int(time.time()), "model": model_name}
        work = _Work(engine, params, reqs, choices, channel, head, turn, shape)
        if params.stream:
            return _SSEResponse(_stream(work), media_type="text/event-stream",
                                headers={"Cache-Control": "no-cache"})
        return await _complete(work, request)
    add_chat_route(app, chat, codec, limits,
                   lambda request: _read_json(request, limits.max_body_bytes), run)


def _check_response_size(params: CompletionParams, codec: Any, limits: Limits) -> None:
    bound = response_bound(params, codec)
    if bound > limits.max_response_bytes:
        raise ApiError(400, f"this request's response could take {bound:,} bytes, more than "
                            f"the server's limit of {limits.max_response_bytes:,} "
                            f"(--max-response-bytes); lower max_tokens, n or logprobs, or "
                            f"leave out echo", code="response_too_large")


def _draining() -> ApiError:
    return ApiError(503, "the server is shutting down", kind="server_error", code="draining")


def _admitting(engine: Engine) -> None:
    """Refuse new work (a session) while the engine drains or after it stopped."""
    if engine.draining:
        raise _draining()


def _make_requests(params: CompletionParams, codec: Any,
                   channel: asyncio.Queue) -> tuple[list[Request], list[Choice]]:
    """One engine request per (prompt, choice); choice i of a seeded request uses seed + i."""
    reqs, choices = [], []
    for p, (prompt, text) in enumerate(zip(params.prompts, params.prompt_texts)):
        for j in range(params.n):
            index = p * params.n + j
            seed = random_seed() if params.seed is None else (params.seed + j) % (1 << 64)
            sampling = Sampling(params.temperature, params.top_k, params.top_p, seed, params.stop,
                                params.presence_penalty, params.frequency_penalty)
            reqs.append(Request(prompt, params.max_tokens, sampling,
                                on_update=lambda up, i=index: channel.put_nowait((i, up)),
                                logprobs=params.logprobs, echo=params.echo))
            choices.append(Choice(index, prompt, text, params.echo, params.logprobs is not None,
                                  codec))
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


@dataclass
class _Turn:
    """A completion's hold on its session (if any): committed once the response is made,
    released otherwise (runtime/serve/sessions.py: a turn is all or nothing)."""
    store: SessionStore
    session: Session | None
    req: Request
    ended: bool = False

    def end(self, made: bool) -> None:
        """Commit (`made`) or release, once; later calls do nothing."""
        if self.ended:
            return
        self.ended = True
        if made:
            self.store.commit(self.session, self.req.end)
        else:
            self.store.release(self.session)


@dataclass
class _Work:
    """One completion request in flight: its engine requests and the choices they fill."""
    engine: Engine
    params: CompletionParams
    reqs: list[Request]
    choices: list[Choice]
    channel: asyncio.Queue
    head: dict
    turn: _Turn
    shape: ChatShape | None = None            # a chat response (runtime/serve/chat.py)

    async def absorb(self, i: int, up: Update) -> tuple[str, dict | None]:
        """Add an update to choice i; an echoed prompt's logprobs (thousands of tokens at
        once) are worked off the event loop, so /health and the other streams go on."""
        if up.prompt_logprobs:
            return await asyncio.to_thread(self.choices[i].add, up)
        return self.choices[i].add(up)

    def error(self) -> str | None:
        return next((c.error for c in self.choices if c.error), None)

    def cancel_rest(self) -> None:
        for r in self.reqs:
            if not r.done:
                self.engine.cancel(r)


def _usage(params: CompletionParams, choices: list[Choice]) -> dict[str, int]:
    prompt = sum(map(len, params.prompts))
    done = sum(len(c.tokens) for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}


def _engine_error(message: str) -> ApiError:
    return ApiError(500, message, kind="server_error", code="engine_error")


async def _complete(work: _Work, request: HttpRequest) -> Response:
    """Wait for every choice; a client that goes away cancels them. The client is checked
    every POLL_S seconds whether or not tokens keep arriving (a check only when none came
    for POLL_S would never happen while a long completion streams in). The body is
    rendered off the event loop; the session's turn is committed only once it is."""
    loop = asyncio.get_running_loop()
    made = False
    try:
        left = len(work.choices)
        check_at = loop.time() + POLL_S
        while left:
            wait = check_at - loop.time()
            if wait > 0:
                try:
                    i, up = await asyncio.wait_for(work.channel.get(), wait)
                except asyncio.TimeoutError:
                    pass
                else:
                    await work.absorb(i, up)
                    left -= up.finish_reason is not None
                    continue
            if await request.is_disconnected():
                return JSONResponse({}, status_code=499)
            check_at = loop.time() + POLL_S
        if work.error() is not None:
            raise _engine_error(work.error() or "")
        body = dict(work.head, choices=[work.shape.choice(c) if work.shape else
                                        {"text": c.text, "index": c.index,
                                         "logprobs": c.logprobs_body(),
                                         "finish_reason": c.finish_reason}
                                        for c in work.choices],
                    usage=_usage(work.params, work.choices))
        try:
            data = await asyncio.to_thread(render, body)
        except ValueError as exc:                 # a number JSON cannot carry: a bug upstream
            raise _engine_error(f"the response could not be written as JSON ({exc})") from None
        made = True
    finally:
        work.cancel_rest()
        work.turn.end(made)
    return Response(data, media_type="application/json")


def _event(body: Any) -> bytes:
    return b"data: " + render(body) + b"\n\n"


async def _stream(work: _Work) -> AsyncIterator[bytes]:
    """Server-sent events in OpenAI's chunk format, one per token, then `data: [DONE]`; a
    request the engine ended with an error sends an error event before [DONE]. The session's
    turn is committed once its last chunk is sent (before [DONE]: a client that sends the
    next turn on reading [DONE] finds the session free)."""
    try:
        left = len(work.choices)
        while left:
            i, up = await work.channel.get()
            delta, lp = await work.absorb(i, up)
            choice = {"text": delta, "index": i, "logprobs": lp,
                      "finish_reason": up.finish_reason}
            yield _event(dict(work.head, choices=[work.shape.chunk(choice) if work.shape
                                                  else choice]))
            left -= up.finish_reason is not None
        if work.error() is not None:
            yield _event(_engine_error(work.error() or "").body())
        else:
            work.turn.end(True)
        if work.params.include_usage:
            yield _event(dict(work.head, choices=[],
                              usage=_usage(work.params, work.choices)))
        yield b"data: [DONE]\n\n"
    finally:
        work.cancel_rest()
        work.turn.end(False)                      # a turn not committed above: released


class _SSEResponse(StreamingResponse):
    """A streaming response that always closes its generator (so a disconnect cancels the
    engine requests at once, not when the generator is garbage-collected)."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()         # type: ignore[attr-defined]


# -- the process -------------------------------------------------------------------------------

def serve(source: str, host: str = "127.0.0.1", port: int = 8000, slots: int = 8,
          max_queue: int = 64, limits: Limits = Limits(), grace: float = 30.0,
          model_name: str | None = None, prefill_budget: int | None = None,
          log_level: str = "warning", max_sessions: int = 64,
          sessions_dir: str | None = None, access: Access | None = None,
          store_limits: StoreLimits = StoreLimits(),
          header_timeout: float = HEADER_TIMEOUT_S, chat_template: str | None = None,
          request_log: bool = True) -> int:
    """Load a run or artifact, warm the engine up and serve until SIGTERM, then write every
    live session to `sessions_dir`; returns 0 (1 when a session could not be written).
    `chat_template`: a file for /v1/chat/completions (else the run's, runtime/serve/chat.py);
    `request_log`: a line per request on stdout (runtime/serve/request_log.py)."""
    import titanc

    from titanc.errors import TitancError
    from titanc.runtime.serve.codec import TokenizerCodec
    from titanc.runtime.train.rundir import run_tokenizer

    access = access if access is not None else Access(bound_host=host)
    if access.api_key is not None and not access.api_key.strip():
        raise TitancError("--api-key: the key is empty; pass a secret, or leave the flag and "
                          "TITANC_API_KEY out to serve without one")
    check_address(host, port)
    chat = load_chat_template(source, chat_template)
    tok = run_tokenizer(source)                  # the run's own, checked against its record
    prog = titanc.load(source)
    codec = TokenizerCodec(tok, prog.spec.model.vocab_size)
    engine_ref: list[Engine] = []
    metrics = Metrics(engine_ref)
    gen = Generator(prog, codec.tok)
    check_serving_fits(gen, slots, limits, max_queue, max_sessions)
    sessions = SessionStore(gen, max_sessions, sessions_dir, store_limits)
    engine = Engine(gen, codec, slots, max_queue, prefill_budget, observer=_Observer(metrics))
    engine_ref.append(engine)
    warm_up(engine)
    engine.start()
    app = create_app(engine, codec, model_name or prog.spec.name, limits, metrics, sessions,
                     access, chat)
    if request_log:
        app = RequestLog(app)
    warning = exposure_warning(host, port, access.api_key)
    if warning is not None:
        print(warning, file=sys.stderr, flush=True)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=5, lifespan="off",
                            http=header_timeout_protocol(header_timeout))
    server = DrainingServer(config, engine, grace)
    try:
        server.run()
    finally:
        engine.stop()
        failed = _write_sessions(sessions)
    return 1 if failed else 0


def _write_sessions(sessions: SessionStore) -> int:
    """Shutdown: every live session to the sessions directory; returns the failures."""
    if sessions.directory is None:
        if len(sessions):
            print(f"titanc serve: {len(sessions)} sessions held in memory end with the "
                  f"server (no --sessions-dir)", file=sys.stderr)
        return 0
    done, failed = sessions.save_all()
    for line in failed:
        print(f"titanc serve: {line}", file=sys.stderr)
    if done:
        print(f"titanc serve: wrote {done} live sessions to --sessions-dir", flush=True)
    return len(failed)


def check_serving_fits(gen: Generator, slots: int, limits: Limits, max_queue: int = 0,
                       max_sessions: int = 0) -> None:
    """The slot pool and the slots' prefill states (measured on a batch-1 decoding state of
    `gen`), a step's logits, the longest requests the limits admit (running and queued) and
    the sessions held in memory must fit, checked before anything is allocated."""
    from titanc.runtime.capacity import TOKEN_BYTES, check_fits
    from titanc.runtime.serve.session_file import MAX_UNFED

    one = gen.state_bytes(1)
    spec = gen.prog.spec
    per_request = limits.max_prompt_tokens + limits.max_tokens
    need = (2 * slots * one + slots * spec.model.vocab_size * 4
            + (slots + max_queue) * per_request * TOKEN_BYTES)
    sessions = max_sessions * (one + 8 * (MAX_UNFED + 1))
    device = str(gen.prog.device)
    check_fits(need + sessions, spec, device, lower=True,
               reduce=f"--max-sessions ({max_sessions}: {sessions:,} bytes at most)"
               if sessions > need else
               f"--slots ({slots}), --max-queue, --max-prompt-tokens or --max-tokens")


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
