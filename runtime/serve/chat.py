"""POST /v1/chat/completions: a run's chat template, and the chat request and response shapes.

Where a run's template comes from (first found): `titanc serve --chat-template FILE` (a Jinja
file, or a JSON file with a `chat_template` field such as a Hugging Face
`tokenizer_config.json`), else `chat_template.jinja` in the run (or artifact) directory, else
the `chat_template` field of its `tokenizer_config.json`. `bos_token` and `eos_token` come
from that `tokenizer_config.json` when it has them, else they are empty. Without a template
the route is a 404 saying how to set one.

The template is rendered as Hugging Face's `apply_chat_template` renders it: jinja2's
`ImmutableSandboxedEnvironment` (a template is untrusted: no attribute starting with `_`, no
mutation of the messages, no `range` past 100,000), `trim_blocks` and `lstrip_blocks`,
`loopcontrols`, the globals `raise_exception` and `strftime_now`, the filter `tojson`, and
the variables `messages`, `add_generation_prompt`, `bos_token`, `eos_token`, `tools=None`,
`documents=None`. A template that does not parse stops `serve` with one line naming the file;
`raise_exception(...)` in a template is a 400 with its message; an operation the sandbox
forbids is a 500 `chat_template_error`; the server goes on serving either way.

A chat request is turned into a completion request (`completions.parse_completion`, so every
field is checked as there) whose prompt is the rendered conversation; the completion path
runs it, and `ChatShape` writes its choices as chat messages and `chat.completion.chunk`
deltas.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Awaitable, Callable

from starlette.requests import Request as HttpRequest

from titanc.errors import TitancError
from titanc.runtime.serve.completions import (MAX_LOGPROBS, ApiError, Limits, body_bool, body_int,
                                               body_text, parse_completion)

__all__ = ["ChatTemplate", "ChatShape", "load_chat_template", "add_chat_route",
           "TEMPLATE_FILE", "CONFIG_FILE"]

TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"
ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_MESSAGES = 4096
MAX_RENDERED_CHARS = 8 << 20          # a template that writes more is stopped there
PASSED = ("model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n",
          "stream", "stream_options", "presence_penalty", "frequency_penalty", "logit_bias")
OWN = {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "user",
       "add_generation_prompt"}
UNSUPPORTED = ("tools", "tool_choice", "functions", "function_call", "response_format",
               "parallel_tool_calls", "audio", "modalities", "prediction")
NO_TEMPLATE = ("POST /v1/chat/completions: this run has no chat template; set one with "
               "`titanc serve RUN --chat-template FILE` (a Jinja file, or a "
               f"{CONFIG_FILE} with chat_template) or put {TEMPLATE_FILE} in the run "
               "directory, or send the conversation as a prompt to POST /v1/completions")


class _Raised(Exception):
    """`raise_exception(message)` called by a template (HF's convention for a refusal)."""


def _raise_exception(message: Any) -> None:
    raise _Raised(str(message))


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@dataclass
class ChatTemplate:
    """A chat template (Jinja text) compiled in a sandbox, with the special tokens it uses."""
    text: str
    source: str                                   # the file it came from, for messages
    bos_token: str = ""
    eos_token: str = ""
    _compiled: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._compiled = env.from_string(self.text)
        except jinja2.TemplateSyntaxError as exc:
            raise TitancError(f"{self.source}: the chat template does not parse (line "
                              f"{exc.lineno}: {exc.message}); fix it or pass another with "
                              f"--chat-template") from None

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The conversation as prompt text; ApiError (400 or 500, one line) when the template
        refuses it, fails, or writes more than MAX_RENDERED_CHARS."""
        import jinja2
        from jinja2.exceptions import SecurityError

        parts, size = [], 0
        try:
            for piece in self._compiled.generate(
                    messages=messages, add_generation_prompt=add_generation_prompt,
                    bos_token=self.bos_token, eos_token=self.eos_token, tools=None,
                    documents=None):
                size += len(piece)
                if size > MAX_RENDERED_CHARS:
                    raise ApiError(400, f"messages: the chat template wrote more than "
                                        f"{MAX_RENDERED_CHARS:,} characters for this "
                                        f"conversation", param="messages")
                parts.append(piece)
        except _Raised as exc:
            raise ApiError(400, f"messages: the chat template refused the conversation: "
                                f"{_first_line(exc)}", param="messages") from None
        except SecurityError as exc:
            raise ApiError(500, f"the chat template ({Path(self.source).name}) tried an "
                                f"operation the sandbox forbids ({_first_line(exc)}); fix the "
                                f"template", kind="server_error",
                           code="chat_template_error") from None
        except (jinja2.TemplateError, TypeError, ValueError, LookupError,
                ArithmeticError, RecursionError) as exc:
            raise ApiError(400, f"messages: the chat template could not render this "
                                f"conversation ({type(exc).__name__}: {_first_line(exc)})",
                           param="messages", code="chat_template_error") from None
        return "".join(parts)


def _first_line(exc: BaseException) -> str:
    return ((str(exc).splitlines() or [""])[0])[:200]


# -- where a run's template is -------------------------------------------------------------------

def load_chat_template(run: str | Path, flag: str | Path | None = None) -> ChatTemplate | None:
    """The template of the module docstring's order, or None; a file that cannot be read or
    used is a TitancError naming it."""
    if flag is not None:
        path = Path(flag)
        if not path.is_file():
            raise TitancError(f"--chat-template: {path} is not a file; pass a Jinja template "
                              f"or a {CONFIG_FILE} with a chat_template field")
        if path.suffix == ".json":
            return _from_config(path, required=True)
        return ChatTemplate(_read(path), str(path), *_special_tokens(_config_beside(run)))
    d = Path(run)
    d = d.parent if d.suffix == ".safetensors" else d
    if (d / TEMPLATE_FILE).is_file():
        return ChatTemplate(_read(d / TEMPLATE_FILE), str(d / TEMPLATE_FILE),
                            *_special_tokens(_config_beside(run)))
    if (d / CONFIG_FILE).is_file():
        return _from_config(d / CONFIG_FILE, required=False)
    return None


def _config_beside(run: str | Path) -> dict[str, Any]:
    d = Path(run)
    d = d.parent if d.suffix == ".safetensors" else d
    return _read_json(d / CONFIG_FILE) if (d / CONFIG_FILE).is_file() else {}


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TitancError(f"{path}: cannot read the chat template ({_first_line(exc)})") from None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(_read(path))
    except ValueError as exc:
        raise TitancError(f"{path}: not valid JSON ({_first_line(exc)})") from None
    if not isinstance(data, dict):
        raise TitancError(f"{path}: expected a JSON object with a chat_template field")
    return data


def _from_config(path: Path, required: bool) -> ChatTemplate | None:
    config = _read_json(path)
    text = config.get("chat_template")
    if isinstance(text, list):                   # HF's named templates: the "default" one
        named = {t.get("name"): t.get("template") for t in text if isinstance(t, dict)}
        text = named.get("default")
    if text is None and not required:
        return None
    if not isinstance(text, str) or not text:
        raise TitancError(f"{path}: chat_template must be a non-empty Jinja string (or a list "
                          f"with a 'default' entry)")
    return ChatTemplate(text, str(path), *_special_tokens(config))


def _special_tokens(config: dict[str, Any]) -> tuple[str, str]:
    """bos_token and eos_token of a tokenizer_config.json (a string, or HF's AddedToken
    object with "content"), empty when absent."""
    def one(key: str) -> str:
        v = config.get(key)
        v = v.get("content") if isinstance(v, dict) else v
        return v if isinstance(v, str) else ""
    return one("bos_token"), one("eos_token")


# -- the request ---------------------------------------------------------------------------------

def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param)


def _content(v: Any, i: int) -> str | None:
    """A message's content as text: a string, null, or a list of {"type": "text"} parts."""
    where = f"messages[{i}].content"
    if v is None or isinstance(v, str):
        return v if v is None else body_text(v, "messages")
    if isinstance(v, list) and all(isinstance(p, dict) for p in v):
        if any(p.get("type") != "text" or not isinstance(p.get("text"), str) for p in v):
            raise _bad("messages", f"{where}: only text parts ({{\"type\": \"text\", "
                                   f"\"text\": ...}}) are supported by this model")
        return body_text("".join(p["text"] for p in v), "messages")
    raise _bad("messages", f"{where}: expected a string or a list of text parts")


def parse_messages(v: Any) -> list[dict[str, Any]]:
    """`messages` checked: a non-empty list of {"role", "content"[, "name"]}."""
    if not isinstance(v, list) or not v:
        raise _bad("messages", "is required: a non-empty list of {\"role\", \"content\"}")
    if len(v) > MAX_MESSAGES:
        raise _bad("messages", f"{len(v)} messages; at most {MAX_MESSAGES}")
    out = []
    for i, m in enumerate(v):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            role = m.get("role") if isinstance(m, dict) else m
            raise _bad("messages", f"messages[{i}]: role {str(role)[:40]!r} is not one of "
                                   f"{', '.join(ROLES)}")
        msg: dict[str, Any] = {"role": m["role"], "content": _content(m.get("content"), i)}
        if isinstance(m.get("name"), str):
            msg["name"] = body_text(m["name"], "messages")
        out.append(msg)
    return out


def chat_body(body: Any, limits: Limits) -> tuple[dict[str, Any], list[dict[str, Any]], bool]:
    """A chat body checked and turned into a completion body without its prompt; returns it,
    the messages, and add_generation_prompt."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    for key in sorted(body):
        if key in UNSUPPORTED and body[key] is not None:
            raise _bad(key, "is not supported by this server (a plain text model)")
        if key not in OWN and key not in PASSED and key not in UNSUPPORTED:
            raise _bad(key, "unrecognized request argument")
    comp = {k: body[k] for k in PASSED if k in body}
    mct = body_int(body, "max_completion_tokens", None, 0, limits.max_tokens)
    if mct is not None:
        if body.get("max_tokens") not in (None, mct):
            raise _bad("max_completion_tokens", "differs from max_tokens; give one of them")
        comp["max_tokens"] = mct
    elif body.get("max_tokens") is None:
        comp["max_tokens"] = limits.max_tokens          # chat's default: as long as allowed
    top = body_int(body, "top_logprobs", None, 0, MAX_LOGPROBS)
    if body_bool(body, "logprobs"):
        comp["logprobs"] = top or 0
    elif top is not None:
        raise _bad("top_logprobs", "needs logprobs: true")
    add_prompt = body_bool(body, "add_generation_prompt") if "add_generation_prompt" in body else True
    return comp, parse_messages(body.get("messages")), add_prompt


# -- the response ------------------------------------------------------------------------------

def _token_bytes(token: str) -> list[int]:
    """A completion logprob token's bytes (`bytes:\\xNN` is one byte that is no character)."""
    if token.startswith("bytes:\\x") and len(token) == 10:
        return [int(token[8:], 16)]
    return list(token.encode("utf-8"))


def _entry(token: str, logprob: float | None) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": _token_bytes(token)}


def chat_logprobs(lp: dict[str, Any] | None) -> dict[str, Any] | None:
    """A completion's logprobs (tokens, token_logprobs, top_logprobs) as chat's `content`."""
    if lp is None:
        return None
    content = []
    for tok, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        content.append(dict(_entry(tok, value),
                            top_logprobs=[_entry(t, v) for t, v in (top or {}).items()]))
    return {"content": content}


class ChatShape:
    """How the completion path writes a chat response: a head, final choices, stream deltas."""

    def __init__(self) -> None:
        self.started: set[int] = set()

    def head(self, model_name: str, stream: bool) -> dict[str, Any]:
        return {"id": f"chatcmpl-{uuid.uuid4().hex}",
                "object": "chat.completion.chunk" if stream else "chat.completion",
                "created": int(time.time()), "model": model_name}

    def choice(self, c: Any) -> dict[str, Any]:
        """A finished `responses.Choice` as a chat choice."""
        return {"index": c.index, "message": {"role": "assistant", "content": c.text},
                "logprobs": chat_logprobs(c.logprobs_body()), "finish_reason": c.finish_reason}

    def chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        """A completion stream choice ({text, index, logprobs, finish_reason}) as a delta; the
        first of each choice carries the role."""
        delta: dict[str, Any] = {"content": choice["text"]}
        if choice["index"] not in self.started:
            self.started.add(choice["index"])
            delta = {"role": "assistant", **delta}
        elif not choice["text"] and choice["finish_reason"] is not None:
            delta = {}
        return {"index": choice["index"], "delta": delta,
                "logprobs": chat_logprobs(choice["logprobs"]),
                "finish_reason": choice["finish_reason"]}


Run = Callable[[Any, dict, Any, Any], Awaitable[Any]]


def add_chat_route(app: Any, template: ChatTemplate | None, codec: Any, limits: Limits,
                   read_json: Callable[[Any], Awaitable[Any]], run: Run) -> None:
    """POST /v1/chat/completions: the rendered conversation through `run(request, body,
    params, shape)` (the completion path), or a 404 naming how to set a template."""
    @app.post("/v1/chat/completions")
    async def chat_completions(request: HttpRequest) -> Any:
        if template is None:
            raise ApiError(404, NO_TEMPLATE, code="not_found")
        body = await read_json(request)
        comp, messages, add_prompt = chat_body(body, limits)
        comp["prompt"] = await asyncio.to_thread(template.render, messages, add_prompt)
        if not comp["prompt"]:
            raise _bad("messages", "the chat template rendered this conversation as empty "
                                   "text; the model needs at least one token")
        try:
            params = parse_completion(comp, codec, limits)
        except ApiError as exc:
            if exc.param != "prompt":
                raise
            raise _bad("messages", "the rendered conversation " +
                       exc.message.removeprefix("prompt: ")) from None
        return await run(request, body, params, ChatShape())
