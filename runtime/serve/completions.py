"""The OpenAI `/v1/completions` request: validation into typed parameters, and error bodies.

Every problem with a request is an `ApiError` naming the field (`param`) and what is allowed,
answered as HTTP 4xx with OpenAI's error body
`{"error": {"message", "type": "invalid_request_error", "param", "code"}}`. Validation is
strict about types (a JSON `true` is not an integer, a string is not a number) and refuses
fields it does not know, so a misspelt option is an error rather than silently ignored.
Text policy: every string field (prompt, stop, model) must be valid Unicode; JSON can carry
lone surrogates (`"\\ud800"`), which are refused with a 400 naming the field, never passed to
an encoder. Integer ranges come from titanc/bounds.py (seed) or the server's limits.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from titanc.bounds import SEED
from titanc.errors import printable

# fields accepted and ignored (they change nothing for this server)
_IGNORED = {"user"}
_KNOWN = {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n",
          "stream", "stream_options", "logprobs", "echo", "best_of", "suffix",
          "presence_penalty", "frequency_penalty", "logit_bias", "session"} | _IGNORED
MAX_STOPS = 4
MAX_STOP_CHARS = 256
MAX_LOGPROBS = 20
MAX_N = 16
MAX_PROMPTS = 64


class ApiError(Exception):
    """A request the server refuses, with its HTTP status and OpenAI-style body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None):
        message, param = _clean(message), None if param is None else _clean(param)
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = \
            status, message, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


def _clean(text: str) -> str:
    """Text that can be sent as UTF-8: lone surrogates (invalid Unicode a JSON body may
    carry as \\udXXX escapes) shown as escapes."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def body_text(value: str, param: str) -> str:
    """The text policy: a string field must be valid Unicode (no lone surrogates), else a
    400 naming the field; nothing invalid reaches an encoder."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise _bad(param, f"is not valid Unicode text (a lone surrogate "
                          f"U+{ord(value[exc.start]):04X} at character {exc.start}); send "
                          f"UTF-8 text") from None
    return value


@dataclass(frozen=True)
class Limits:
    max_prompt_tokens: int = 8192
    max_tokens: int = 4096                   # per choice
    max_body_bytes: int = 1 << 20
    max_response_bytes: int = 32 << 20       # a request whose response could be larger: 400


@dataclass(frozen=True)
class CompletionParams:
    prompts: list[list[int]]                 # token ids, one list per prompt
    prompt_texts: list[str]                  # as given (or decoded from ids), for echo
    max_tokens: int
    temperature: float
    top_p: float | None
    top_k: int | None
    seed: int | None
    stop: tuple[str, ...]
    n: int
    stream: bool
    include_usage: bool
    logprobs: int | None
    echo: bool
    session: str | None = None               # continue this session (runtime/serve/sessions.py)
    presence_penalty: float = 0.0            # runtime/serve/penalties.py, in [-2, 2]
    frequency_penalty: float = 0.0


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{printable(param, 80)}: {message}", param=param)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def body_int(body: dict, key: str, default: int | None, lo: int, hi: int) -> int | None:
    v = body.get(key, default)
    if v is None:
        return default
    if not _is_int(v):
        raise _bad(key, f"expected an integer in [{lo}, {hi}], got {_show(v)}")
    if not lo <= v <= hi:
        raise _bad(key, f"{_show(v)} is out of range; expected an integer in [{lo}, {hi}]")
    return v


def _float(body: dict, key: str, default: float | None, lo: float, hi: float,
           open_lo: bool = False) -> float | None:
    v = body.get(key, default)
    if v is None:
        return default
    # an integer is finite however many digits it has (math.isfinite would overflow
    # converting one beyond float's range); the range check below refuses it
    if not (_is_int(v) or (isinstance(v, float) and math.isfinite(v))):
        raise _bad(key, f"expected a number, got {_show(v)}")
    if v > hi or v < lo or (open_lo and v == lo):
        rng = f"({lo}, {hi}]" if open_lo else f"[{lo}, {hi}]"
        raise _bad(key, f"{_show(v)} is out of range; expected a number in {rng}")
    return float(v)


def body_bool(body: dict, key: str) -> bool:
    v = body.get(key, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise _bad(key, f"expected true or false, got {_show(v)}")
    return v


def _show(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _prompts(body: dict, codec: Any, limits: Limits) -> tuple[list[list[int]], list[str]]:
    """prompt: a string, a list of strings, a list of token ids, or a list of those lists."""
    if "prompt" not in body or body["prompt"] is None:
        raise _bad("prompt", "is required (a string, a list of strings, or token ids)")
    p = body["prompt"]
    if isinstance(p, str) or (isinstance(p, list) and p and all(_is_int(t) for t in p)):
        items: list[Any] = [p]
    elif isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
        items = p
    else:
        raise _bad("prompt", f"expected a non-empty string, list of strings or list of token "
                             f"ids, got {_show(p)}")
    if len(items) > MAX_PROMPTS:
        raise _bad("prompt", f"{len(items)} prompts; at most {MAX_PROMPTS} per request")
    ids, texts = [], []
    for x in items:
        if isinstance(x, str):
            toks = codec.encode(body_text(x, "prompt"))
            text = x
        else:
            if not x or not all(_is_int(t) for t in x):
                raise _bad("prompt", "a token-id prompt must be a non-empty list of integers")
            bad = [t for t in x if not 0 <= t < codec.vocab_size]
            if bad:
                raise _bad("prompt", f"token id {bad[0]} is outside the vocabulary "
                                     f"[0, {codec.vocab_size})")
            toks, text = list(x), codec.decode(x)
        if not toks:
            raise _bad("prompt", "an empty prompt has nothing to condition on; give at least "
                                 "one token")
        if len(toks) > limits.max_prompt_tokens:
            raise _bad("prompt", f"{len(toks)} tokens is longer than the server's maximum of "
                                 f"{limits.max_prompt_tokens}")
        ids.append(toks)
        texts.append(text)
    return ids, texts


def _stop(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _bad("stop", f"expected a string or a list of strings, got {_show(v)}")
    if len(stops) > MAX_STOPS:
        raise _bad("stop", f"{len(stops)} stop sequences; at most {MAX_STOPS}")
    if any(not s or len(s) > MAX_STOP_CHARS for s in stops):
        raise _bad("stop", f"each stop sequence must have 1 to {MAX_STOP_CHARS} characters")
    return tuple(body_text(s, "stop") for s in stops)


def parse_completion(body: Any, codec: Any, limits: Limits) -> CompletionParams:
    """Validate a decoded JSON body of POST /v1/completions."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - _KNOWN)
    if unknown:
        raise _bad(unknown[0], "unrecognized request argument")
    prompts, texts = _prompts(body, codec, limits)
    n = body_int(body, "n", 1, 1, MAX_N)
    best_of = body_int(body, "best_of", None, 1, MAX_N)
    if best_of is not None and best_of != n:
        raise _bad("best_of", "is not supported (leave it out or equal to n)")
    if body.get("suffix") is not None:
        raise _bad("suffix", "is not supported by this model")
    if body.get("logit_bias") not in (None, {}):
        raise _bad("logit_bias", "is not supported")
    top_k = body_int(body, "top_k", None, -1, 1 << 30)
    opts = body.get("stream_options")
    if opts is not None and (not isinstance(opts, dict) or set(opts) - {"include_usage"}
                             or not isinstance(opts.get("include_usage", False), bool)):
        raise _bad("stream_options", 'expected {"include_usage": true|false}')
    stream = body_bool(body, "stream")
    if opts is not None and not stream:
        raise _bad("stream_options", "is only allowed with stream: true")
    session = body.get("session")
    if session is not None and (len(prompts) != 1 or n != 1):
        raise _bad("session", "a session continues one conversation: give one prompt and n=1")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("model", f"expected a string, got {_show(model)}")
    if model is not None:
        body_text(model, "model")
    return CompletionParams(
        prompts=prompts, prompt_texts=texts,
        # the default, 16 (OpenAI's), never exceeds the server's --max-tokens
        max_tokens=body_int(body, "max_tokens", min(16, limits.max_tokens), 0, limits.max_tokens),
        temperature=_float(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_float(body, "top_p", None, 0.0, 1.0, open_lo=True),
        top_k=top_k if top_k and top_k > 0 else None,
        seed=body_int(body, "seed", None, -(1 << 63), SEED.hi),
        stop=_stop(body), n=n, stream=stream,
        include_usage=bool(opts and opts.get("include_usage")),
        logprobs=body_int(body, "logprobs", None, 0, MAX_LOGPROBS),
        echo=body_bool(body, "echo"), session=session,
        presence_penalty=_float(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_float(body, "frequency_penalty", 0.0, -2.0, 2.0))


def check_model(params_model: Any, served: Sequence[str]) -> None:
    if params_model is not None and params_model not in served:
        raise ApiError(404, f"model {_show(params_model)} does not exist; this server serves "
                            f"{', '.join(served)}", param="model", code="model_not_found")
